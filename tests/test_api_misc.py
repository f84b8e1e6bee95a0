"""Public API surface (SPEC 11) on CPU: constants, ``max_gather_pages``, backend dispatch
("auto" is the reference on CPU), the ``DecodeIndexerWrapper`` with the reference backend, and
inputs that are legal but unusual (views, narrow tables, head slices)."""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np
import pytest
import torch

import bruteforce as bf
import nvfp4_indexer as ni
from nvfp4_indexer.conformance.fixtures import OUT_POISON

REF = {"backend": "reference"}

SPEC_PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "spec" / "SPEC.md"


def spec_11_names() -> list:
    """The names in the first column of SPEC 11's table (the contract, not the package)."""
    text = SPEC_PATH.read_text()
    rows = [line.split("|")[1] for line in text[text.index("## 11."):].splitlines()
            if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`(\w+)`", row)]


def test_public_names_and_constants():
    names = spec_11_names()
    assert len(names) == 18 and "max_gather_pages" in names, names
    for name in names:
        assert hasattr(ni, name), name
        assert name in ni.__all__
    assert (ni.PAGE_SIZE, ni.HEAD_DIM, ni.TOPK, ni.PAGE_BYTES) == (128, 128, 16, 9216)


@pytest.mark.parametrize("model_len,tokens", [(1, 1), (128, 32), (129, 1), (1000, 300),
                                              (131072, 8192), (163840, 65536), (4096, 1024)])
def test_max_gather_pages(model_len, tokens):
    want = -(-max(model_len, 4 * tokens) // 128)  # integer ceil
    assert ni.max_gather_pages(model_len, tokens) == want
    assert want == math.ceil(max(model_len, 4 * tokens) / 128)
    assert want * 128 >= model_len  # one request of max_model_len always fits


def small_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    seq = [2300, 0, 130, 2700]
    need = [math.ceil(s / 128) for s in seq]
    width = max(need) + 3
    cache = ni.new_index_cache(sum(need) + 2)
    phys = rng.permutation(sum(need))
    bt = np.full((len(seq), width), -1, dtype=np.int32)
    at = 0
    ks, slots = [], []
    for r, (s, n) in enumerate(zip(seq, need)):
        bt[r, :n] = phys[at:at + n]
        at += n
        pos = np.arange(s)
        ks.append(rng.standard_normal((s, 128)).astype(np.float32))
        slots.append(bt[r, pos // 128].astype(np.int64) * 128 + pos % 128)
    ni.write_index_k(cache, torch.from_numpy(np.concatenate(ks)),
                     torch.from_numpy(np.concatenate(slots)), **REF)
    return cache, torch.from_numpy(bt), torch.tensor(seq, dtype=torch.int32)


def q_for(rows: int, heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return ni.encode_e4m3(torch.randn(rows, heads, 128, generator=g), **REF)


def test_auto_backend_is_reference_on_cpu():
    cache, bt, seq = small_problem()
    q = q_for(8, 2, 1)
    x = torch.randn(5, 128) * 7
    pairs = [
        (ni.encode_e4m3(x), ni.encode_e4m3(x, **REF)),
        (ni.quantize_nvfp4(x)[0], ni.quantize_nvfp4(x, **REF)[0]),
        (ni.decode_indexer(q, cache, bt, seq, 2),
         ni.decode_indexer(q, cache, bt, seq, 2, **REF)),
        (ni.gather_index_k_fp8(cache, bt, seq)[0].view(torch.uint8),
         ni.gather_index_k_fp8(cache, bt, seq, **REF)[0].view(torch.uint8)),
    ]
    for auto, ref in pairs:
        assert auto.device.type == "cpu"
        assert torch.equal(auto, ref)


def test_decode_head_slice_and_narrow_table_view():
    cache, bt, seq = small_problem(2)
    q4 = q_for(8, 4, 3)
    q2 = q4[:, 1:3]  # non-contiguous head slice, unit stride in the last dim
    assert not q2.is_contiguous()
    got = ni.decode_indexer(q2, cache, bt, seq, 2, **REF)
    assert torch.equal(got, ni.decode_indexer(q4, cache, bt, seq, 2, **REF)[:, 1:3])
    np.testing.assert_array_equal(got.numpy(), bf.decode(q2.contiguous(), cache, bt, seq, 2))
    # The narrowest table the requests allow (a column view of the wider one) gives the same.
    narrow = bt[:, :math.ceil(2700 / 128)]
    assert torch.equal(ni.decode_indexer(q2, cache, narrow, seq, 2, **REF), got)


def test_wrapper_reference_plan_run_and_replay():
    cache, bt, seq = small_problem(4)
    q = q_for(8, 2, 5)
    width = bt.shape[1] + 4
    bt_buf = torch.full((4, width), -1, dtype=torch.int32)
    sl_buf = torch.zeros(4, dtype=torch.int32)
    wr = ni.DecodeIndexerWrapper(2, block_table_buffer=bt_buf, seq_lens_buffer=sl_buf,
                                 use_cuda_graph=False, backend="reference")
    wr.plan(bt, seq, 2, num_blocks=cache.shape[0])
    assert torch.equal(bt_buf[:, :bt.shape[1]], bt) and torch.equal(sl_buf, seq)
    out = torch.full((8, 2, 16), OUT_POISON, dtype=torch.int32)
    assert wr.run(q, cache, out) is out
    want = ni.decode_indexer(q, cache, bt, seq, 2, **REF)
    assert torch.equal(out, want)
    # In-place change of the planned buffers (the engine's persistent tensors) then run again
    # without a new plan: fresh results (SPEC 6).
    sl_buf[0] = 2000
    sl_buf[2] = 0  # now a padding request
    out.fill_(OUT_POISON)
    wr.run(q, cache, out)
    seq2 = seq.clone()
    seq2[0], seq2[2] = 2000, 0
    assert torch.equal(out, ni.decode_indexer(q, cache, bt, seq2, 2, **REF))
    np.testing.assert_array_equal(out.numpy(), bf.decode(q, cache, bt, seq2, 2))
    # Planning the buffers themselves (in place) is allowed and copies nothing.
    wr.plan(bt_buf, sl_buf, 2, num_blocks=cache.shape[0])
    out2 = wr.run(q, cache, torch.empty_like(out))
    assert torch.equal(out2, out)


def test_wrapper_auto_backend_on_cpu_is_reference():
    bt_buf = torch.zeros(1, 2, dtype=torch.int32)
    wr = ni.DecodeIndexerWrapper(1, block_table_buffer=bt_buf,
                                 seq_lens_buffer=torch.zeros(1, dtype=torch.int32))
    assert wr.backend == "reference"


def test_prefill_default_budget_equals_one_chunk():
    cache, bt, seq = small_problem(6)
    seq = seq.clone()
    seq[1] = 1  # a fresh one-token request instead of the empty one
    cu = torch.tensor([0, 3, 4, 9, 10], dtype=torch.int32)
    q = q_for(10, 1, 7)
    a = ni.prefill_indexer(q, cache, bt, cu, seq, **REF)
    b = ni.prefill_indexer(q, cache, bt, cu, seq, max_gather_pages=10**6, **REF)
    assert torch.equal(a, b)


def test_read_index_k_matches_gather():
    cache, bt, seq = small_problem(8)
    ws, off = ni.gather_index_k_fp8(cache, bt, seq, **REF)
    j = 5
    codes, scales = ni.read_index_k(cache, int(bt[0, j]))
    deq = ni.dequantize_nvfp4(codes, scales, **REF)
    assert torch.equal(deq.view(torch.uint8), ws[int(off[0]) + j].view(torch.uint8))


def test_empty_batches():
    cache = ni.new_index_cache(2)
    bt0 = torch.zeros(0, 3, dtype=torch.int32)
    s0 = torch.zeros(0, dtype=torch.int32)
    q0 = torch.zeros(0, 2, 128, dtype=torch.float8_e4m3fn)
    ws, off = ni.gather_index_k_fp8(cache, bt0, s0, **REF)
    assert ws.shape == (0, 128, 128) and off.tolist() == [0]
    assert ni.prefill_indexer(q0, cache, bt0, torch.zeros(1, dtype=torch.int32), s0,
                              **REF).shape == (0, 2, 16)
    assert ni.page_scores(q0, cache, torch.zeros(1, 3, dtype=torch.int32),
                          torch.tensor([5], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                          **REF).shape == (0, 2, 3)
    # All-padding decode on an empty cache with a zero-width block table.
    out = ni.decode_indexer(torch.zeros(4, 1, 128, dtype=torch.float8_e4m3fn),
                            ni.new_index_cache(0), torch.zeros(2, 0, dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int32), 2, **REF)
    assert out.shape == (4, 1, 16)
    assert torch.all(out[..., 0] == 0) and torch.all(out[..., 1:] == -1)



def test_prefill_allow_fp8_mma_validated_and_exact_off_cuda():
    """``prefill_indexer(allow_fp8_mma=...)`` must be a bool (SPEC 10), checked before
    anything is written; off CUDA (and on the reference backend) it changes nothing: no
    Triton config, the output equals the exact reference's."""
    from nvfp4_indexer.api import _prefill_config
    gen = torch.Generator().manual_seed(3)
    cache = ni.new_index_cache(24)
    ni.write_index_k(cache, torch.randn(24 * 128, 128, generator=gen), torch.arange(24 * 128),
                     backend="reference")
    table = torch.randperm(24, generator=gen).view(1, 24).to(torch.int32)
    seq = torch.tensor([24 * 128 - 7], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = ni.encode_e4m3(torch.randn(3, 2, 128, generator=gen))
    out = torch.full((3, 2, 16), -99, dtype=torch.int32)
    with pytest.raises(ValueError, match="allow_fp8_mma"):
        ni.prefill_indexer(q, cache, table, cu, seq, out=out, backend="reference",
                           allow_fp8_mma="yes")
    assert torch.all(out == -99)
    assert _prefill_config(True, torch.device("cpu")) is None
    assert _prefill_config(False, torch.device("cpu")) is None
    exact = ni.prefill_indexer(q, cache, table, cu, seq, backend="reference")
    for backend in ("reference", "auto", "triton"):  # triton: the interpreter's fp32 dots
        got = ni.prefill_indexer(q, cache, table, cu, seq, backend=backend, allow_fp8_mma=True)
        assert torch.equal(got, exact), backend


def test_wrapper_allow_fp8_mma_validated_and_exact_off_cuda():
    """``allow_fp8_mma`` must be a bool (SPEC 10); off CUDA it changes nothing: the wrapper's
    runner config stays the default and its output equals the exact reference."""
    from nvfp4_indexer.reference.paging import new_index_cache
    bt = torch.zeros((2, 20), dtype=torch.int32)
    sl = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="allow_fp8_mma"):
        ni.DecodeIndexerWrapper(2, block_table_buffer=bt, seq_lens_buffer=sl, allow_fp8_mma=1)
    scratch = torch.empty(1 << 16, dtype=torch.float32)
    for backend in ("reference", "auto"):
        w = ni.DecodeIndexerWrapper(2, block_table_buffer=bt, seq_lens_buffer=sl,
                                    backend=backend, allow_fp8_mma=True, score_buffer=scratch)
        assert w.runner_config() is None
    gen = torch.Generator().manual_seed(2)
    cache = new_index_cache(40)
    ni.write_index_k(cache, torch.randn(40 * 128, 128, generator=gen), torch.arange(40 * 128),
                     backend="reference")
    table = torch.randperm(40, generator=gen)[:40].view(2, 20).to(torch.int32)
    lens = torch.tensor([20 * 128, 17 * 128 + 3], dtype=torch.int32)
    q = ni.encode_e4m3(torch.randn(2, 2, 128, generator=gen))
    w = ni.DecodeIndexerWrapper(2, block_table_buffer=bt, seq_lens_buffer=sl,
                                backend="reference", allow_fp8_mma=True)
    w.plan(table, lens, 1)
    out = w.run(q, cache, torch.empty((2, 2, 16), dtype=torch.int32))
    assert torch.equal(out, ni.decode_indexer(q, cache, table, lens, 1, backend="reference"))
