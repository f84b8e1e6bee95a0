"""The one-launch decode kernel (``triton.decode.split_kernel``): on a GPU its ptx modes and
top-k windows select what the default path selects (tie-aware)."""

from __future__ import annotations

import pytest
import torch

import kernel_harness  # noqa: F401  (importing it sets TRITON_INTERPRET)

from nvfp4_indexer.conformance.fixtures import selection_out  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("mode,window", [("ptx", 64), ("ptx", 4), ("ptx_arith", 32),
                                         ("triton", 16)])
def test_gpu_decode_modes_match_triton(mode, window):
    """Decode with the ptx modes / top-k windows selects the same pages as the default path
    (identical operands; fp32 accumulation order may differ: rows may differ only by exact
    ties within SPEC 9's tolerance)."""
    from benchmarks.pool import PagePool, random_index_q
    from nvfp4_indexer import reference as ref
    from nvfp4_indexer.triton import decode
    from nvfp4_indexer.triton.config import DecodeConfig
    b, q_len, heads, max_len = 8, 8, 4, 40000
    dev = torch.device("cuda")
    pool = PagePool(b * (max_len // 128 + 1) + 8, dev, seed=5)
    lens = [max_len, 0, 129, 2050, 30000, 12345, 999, 40000]
    bt = pool.block_tables(lens, 1)[0]
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = random_index_q(b * q_len, heads, dev, torch.Generator(device=dev).manual_seed(3))
    outs = {}
    for name, kw in (("base", {}), ("new", {"dequant": mode, "window": window})):
        out = selection_out(b * q_len, heads, device=dev)
        decode.DecodeRunner(heads, b, bt.shape[1], q_len, dev,
                            config=DecodeConfig(**kw)).run(q, pool.cache, bt, sl, out)
        outs[name] = out
    torch.cuda.synchronize()
    if not torch.equal(outs["base"], outs["new"]):  # only exact-tie reorderings are allowed
        qsl = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=dev)
        exact = ref.page_scores(q, pool.cache, bt, sl, qsl)
        diff = (outs["base"] != outs["new"]).any(-1)
        for r, h in diff.nonzero().tolist():
            a, n = outs["base"][r, h, :15].long(), outs["new"][r, h, :15].long()
            sa, sn = exact[r, h, a.clamp(min=0)], exact[r, h, n.clamp(min=0)]
            tol = 2.0 ** -decode.SCORE_ERROR_BITS["fp16"] * sa.abs().max()
            assert torch.all((sa - sn).abs() <= 2 * tol), (r, h, a.tolist(), n.tolist())
