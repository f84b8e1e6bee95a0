"""The Gluon prefill score kernel (``triton.prefill_wgmma``, SPEC 4, 5, 7, 10) and its dispatch.

CPU: which chunks take it (``heuristics.prefill_launch``'s ``kernel``: splits that keep 16
candidates, BLOCK_M 128, on SM90 with dot fp16 and tokens on N), ``PrefillConfig.kernel``
checks, and an offline sm_90a compile (spills bounded, both pages' MMAs of an iteration in
the page loop). Its semantics run on the CPU through the Triton twin
(``prefill._prefill_score_kernel``, ``tests/test_triton_scoring.py``).
GPU (SM90): the Gluon kernel against the Triton twin row for row (poisoned outputs, NaN
pages, one and several splits, several chunks), and against the exact
reference (tie-aware, b = 15).
"""

from __future__ import annotations

import pytest
import torch

from test_triton_decode_wgmma import _offline
from test_triton_scoring import (  # noqa: F401  (sets TRITON_INTERPRET before the kernels)
    BITS,
    DEV,
    HAS_CUDA,
    HZ,
    PREFILL,
    assert_guards,
    check_selection,
    local_pages,
    poisoned_out,
    prefill_batch,
    random_q,
)

from conformance.fixtures import OUT_POISON  # noqa: E402
from nvfp4_indexer import reference as ref  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def test_dispatch_rule():
    """The Gluon kernel takes exactly the chunks whose splits keep 16 candidates (> 8 pages)
    at BLOCK_M 128, when allowed; it inserts per page: window 1, no window scratch."""
    big = HZ.prefill_launch(512, 1023, 128, 132, wgmma=True)
    assert big["kernel"] == "wgmma" and big["win"] == 1 and big["win_elems"] == 0
    assert big["scratch"] == 2 * big["cand"]
    tri = HZ.prefill_launch(512, 1023, 128, 132)
    assert tri["kernel"] == "triton" and tri["win"] == 32 and tri["ns"] == big["ns"]
    assert HZ.prefill_launch(512, 1023, 64, 132, wgmma=True)["kernel"] == "triton"
    assert HZ.prefill_launch(512, 1023, 32, 132, wgmma=True)["kernel"] == "triton"
    assert HZ.prefill_launch(4, 9, 128, 132, num_splits=1, wgmma=True)["kernel"] == "wgmma"
    assert HZ.prefill_launch(4, 8, 128, 132, num_splits=1, wgmma=True)["kernel"] == "triton"
    assert HZ.prefill_launch(4, 0, 128, 132, wgmma=True)["kernel"] == "triton"  # all short
    assert HZ.prefill_launch(512, 1023, 128, 132, window=8, wgmma=True)["win"] == 1
    cpu = torch.device("cpu")
    assert not HZ.prefill_wgmma_ok(cpu, "fp16", True)
    if HAS_CUDA and torch.cuda.get_device_capability() == (9, 0):
        assert HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True)
        assert not HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", False)
        assert not HZ.prefill_wgmma_ok(torch.device(DEV), "bf16", True)


def test_kernel_knob_checked():
    """``PrefillConfig.kernel`` takes None / "triton" / "wgmma"; "wgmma" where it cannot run is
    refused before anything is written."""
    for bad in ("gluon", 1, True):
        with pytest.raises(ValueError, match="kernel"):
            PREFILL.PrefillConfig(kernel=bad)
    if HAS_CUDA and HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True):
        cfgs = [PREFILL.PrefillConfig(kernel="wgmma", tokens_on_n=False),
                PREFILL.PrefillConfig(kernel="wgmma", dot="bf16")]
    else:
        cfgs = [PREFILL.PrefillConfig(kernel="wgmma")]
    batch, qsl = prefill_batch([(4, 2200)], seed=3)
    q = random_q(4, 1, seed=3)
    for cfg in cfgs:
        big, out = poisoned_out(4, 1)
        with pytest.raises(ValueError, match="kernel"):
            PREFILL.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 64,
                                    out, config=cfg)
        assert_guards(big)
        assert (out == OUT_POISON).all()


_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import compile_prefill_wgmma, sass_stats
for bm in (64, 128):
    for ns in (1, 4):
        k = compile_prefill_wgmma(block_m=bm, num_splits=ns)  # the launchers' specialization
        st = sass_stats(k)
        mma = [m for _, m in st["loops"] if m]
        print(bm, ns, st["registers"], st["mma_loop_spill_ops"], len(mma), max(mma),
              k.metadata.shared)
'''


def test_compiles_offline_for_sm90():
    """sm_90a, no GPU, as the launchers specialize it (query in registers): one page loop
    holding two pages' MMAs (2 x 8 wgmma k-steps per warpgroup), the query and three page
    buffers in shared memory (the module doc's buffer argument needs three); at BLOCK_M 128
    (the dispatched one) no spill instruction inside the page loop (3-9 outside it) -- at 64
    rows the loop spills, which is why the launchers take 128 only."""
    assert HZ.PREFILL_WGMMA_BLOCK_M == (128,)
    lines = _offline(_COMPILE)
    assert len(lines) == 4, lines
    for ln in lines:
        bm, _, regs, spills, loops, mma, shared = map(int, ln.split())
        assert regs <= 255 and loops == 1 and mma == 16, ln
        assert shared >= 3 * 128 * 128 * 2 + bm * 128 * 2, ln
        if bm == 128:
            assert spills == 0, ln


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HZ.prefill_wgmma_ok(torch.device(DEV), "fp16", True)),
                    reason="needs a CUDA SM90 GPU with Gluon")
@pytest.mark.parametrize("specs,budget,num_splits,block_m", [
    ([(1024, 32768 + 1024)], None, 2, None),  # one request, several splits
    ([(2048, 34816), (512, 131072 + 512), (8, 9000)], None, 4, None),
    ([(64, 20000), (16, 40000)], None, 1, 128),  # one split: the kernel writes the output
    ([(4096, 4096), (1024, 33792), (256, 20000)], 300, None, None),  # several chunks
    ([(300, 50000)], None, 3, 128),  # partial last row block
])
def test_gpu_gluon_matches_triton_twin(specs, budget, num_splits, block_m):
    """The Gluon kernel and its Triton twin select the same pages for every row (the same
    products in the same fp32 wgmma order), the Gluon path was taken, and both match the
    exact reference (tie-aware); pages with NaN scales in part or in whole are in the batch.
    (Splits are set where the default would give at most 8 pages per split: those chunks take
    the Triton kernel.)"""
    from nvfp4_indexer.triton import prefill_wgmma as PW
    heads = 4
    batch, qsl = prefill_batch(specs, seed=len(specs) + 5, page_stride=9216)
    for blk, lo, hi in ((1, 8192, 8192 + 8 * 40), (3, 8192, 9216), (7, 8192, 9216)):
        batch.page_bytes(int(batch.block_table[0, blk]))[lo:hi] = 0x7F
    t = int(qsl[-1])
    q = random_q(t, heads, seed=t + 1)
    if budget is None:
        budget = ref.max_gather_pages(batch.width * 128, t)
    outs, calls = {}, []
    orig = PW.prefill_wgmma_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return orig[grid]
    for kernel in ("triton", "wgmma"):
        big, out = poisoned_out(t, heads)
        cfg = PREFILL.PrefillConfig(kernel=kernel, num_splits=num_splits, block_m=block_m)
        PW.prefill_wgmma_kernel = Spy()
        try:
            PREFILL.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens,
                                    budget, out, config=cfg)
        finally:
            PW.prefill_wgmma_kernel = orig
        torch.cuda.synchronize()
        assert_guards(big)
        outs[kernel] = out.clone()
        assert bool(calls) == (kernel == "wgmma"), (kernel, calls)
    assert torch.equal(outs["wgmma"], outs["triton"])
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_selection(outs["wgmma"], exact, mag, local_pages(batch.seq_lens, qsl), BITS)
