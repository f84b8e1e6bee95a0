"""``triton.prefill.prefill_wgmma``: the Gluon prefill score kernel (SPEC 4, 5, 7, 10; CUDA
SM90).

Offline (no GPU): an sm_90a compile as the launchers specialize it (12 warps re-balanced by
``setmaxnreg``, no spills in the two consumers' page loops, both pages' MMAs of an iteration
in each, no wgmma serialization), also in its E4M3 form; one ring buffer is refused. GPU
(SM90): the kernel against its Triton twin (``prefill.prefill_score_kernel``) row for row
(poisoned outputs, NaN pages, one and several splits, splits of 1-3 pages and empty ones,
several chunks), and against the exact reference (tie-aware). Its dispatch and launch
plumbing run on the CPU in ``test_dispatch.py`` / ``test_launch.py``.
"""

from __future__ import annotations

import pytest
import torch

from kernel_harness import (DEV, HAS_CUDA, assert_guards, check_selection, local_pages, offline_lines,
                          poisoned_out, prefill_batch, random_q, score_bits)
from nvfp4_indexer import reference as ref
from nvfp4_indexer.triton.config import PrefillConfig
from nvfp4_indexer.triton.prefill import dispatch as D
from nvfp4_indexer.triton.prefill import launch as L

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter
BITS = score_bits()

_COMPILE = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import compile_prefill_wgmma, sass_stats, wgmma_serialized
for ns, fp8 in ((1, 0), (4, 0), (4, 1)):  # the launchers' specialization
    k = compile_prefill_wgmma(num_splits=ns, fp8=bool(fp8))
    st = sass_stats(k)
    steps = 8 if fp8 else 16  # two pages' k-steps (K = 32 / 16 per instruction)
    inner = sorted((n, sp) for (n, hg), sp in zip(st["loops"], st["loop_spills"]) if hg == steps)
    ptx = k.asm["ptx"]
    print(ns, st["registers"], k.metadata.num_warps, len(inner), sum(sp for _, sp in inner[:2]),
          st["spill_ops"], ptx.count("setmaxnreg.dec.sync.aligned.u32 \t104"),
          ptx.count("setmaxnreg.dec.sync.aligned.u32 \t200"), k.metadata.shared,
          sum(sp for (n, hg), sp in zip(st["loops"], st["loop_spills"]) if hg == 0 and n > 100),
          int(wgmma_serialized(k)), fp8,
          ",".join(str(n) for n, hg in st["loops"] if hg == 0 and n > 100))
'''


def test_compiles_offline_for_sm90():
    """sm_90a, no GPU, as the launchers specialize it: 12 warps at 168 registers, re-balanced
    to 200 per consumer thread and 104 per converter thread; each consumer's page loop holds
    two pages' MMAs (2 x 8 wgmma k-steps; 2 x 4 in the E4M3 form) and no spill instruction (a
    few outside the loops with one split: the final selection); six fp16 (E4M3) page buffers
    in shared memory; ptxas keeps the wgmma asynchronous (no C7514 serialization); exactly
    one converter page loop, without spills."""
    assert D.PREFILL_WGMMA_BLOCK_M == (128,)
    lines = offline_lines(_COMPILE)
    assert len(lines) == 3, lines
    for ln in lines:
        *nums, conv_loop = ln.split()
        ns, regs, warps, loops, loop_spills, spills, conv, cons, shared, conv_spills, \
            serialized, fp8 = map(int, nums)
        assert regs == 168 and warps == 12 and loops >= 2 and loop_spills == 0, ln
        assert conv_spills == 0 and conv_loop.isdigit(), ln  # exactly one converter loop
        assert conv >= 1 and cons >= 1 and spills <= 8, ln
        assert shared >= 6 * 128 * 128 * (1 if fp8 else 2), ln
        assert serialized == 0, ln


_COMPILE_NB1 = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import compile_prefill_wgmma
try:
    compile_prefill_wgmma(nb=1)
    print("compiled")
except Exception as e:
    print("refused", "NB >= 2" in str(e))
'''


def test_one_ring_buffer_is_refused():
    """NB (ring buffers) below 2 is refused at compile time: with one buffer a consumer
    releases page k - 1 only after waiting for page k, which the converter writes into that
    same buffer only after the release: a deadlock on the GPU."""
    assert offline_lines(_COMPILE_NB1) == ["refused True"]


def _run_kernels(batch, qsl, q, budget, num_splits, block_m, kernels, dot=None):
    """``prefill_indexer`` outputs per score ``kernel`` of ``kernels`` (poisoned, guards
    checked), asserting that the "wgmma" runs launched the Gluon kernel for every chunk of
    more than 8 pages per split (``dot``: the config's; "fp8": its E4M3 form)."""
    t, heads = q.shape[0], q.shape[1]
    outs = {}
    launch = L.launch_prefill_chunk
    for kernel in kernels:
        seen = []

        def spy(plan, *args):
            seen.append((plan.shape["kernel"], plan.score.kwargs.get("FP8", 0)))
            launch(plan, *args)
        big, out = poisoned_out(t, heads)
        cfg = PrefillConfig(kernel=kernel, num_splits=num_splits, block_m=block_m, dot=dot)
        L.launch_prefill_chunk = spy
        try:
            L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, budget,
                              out, config=cfg)
        finally:
            L.launch_prefill_chunk = launch
        torch.cuda.synchronize()
        assert_guards(big)
        outs[kernel] = out.clone()
        if kernel == "wgmma":
            assert ("wgmma", int(dot == "fp8")) in seen, seen
        else:
            assert all(k == "triton" for k, _ in seen), seen
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and D.prefill_wgmma_ok(torch.device(DEV), "fp16", True)),
                    reason="needs a CUDA SM90 GPU with Gluon")
@pytest.mark.parametrize("specs,budget,num_splits,block_m", [
    ([(1024, 32768 + 1024)], None, 2, None),  # one request, several splits
    ([(2048, 34816), (512, 131072 + 512), (8, 9000)], None, 4, None),
    ([(64, 20000), (16, 40000)], None, 1, 128),  # one split: the kernel writes the output
    ([(4096, 4096), (1024, 33792), (256, 20000)], 300, None, None),  # several chunks
    ([(300, 50000)], None, 3, 128),  # partial last row block
    # blocks of 16 / 17 / 39 pages in 16 splits: 1-, 2-, 3-page and empty splits
    ([(1024, 40000), (64, 2100), (32, 2300), (16, 5000)], None, 16, None),
])
def test_gpu_gluon_matches_triton_twin(specs, budget, num_splits, block_m):
    """The Gluon kernel and its Triton twin select the same pages for every row (the same
    products in the same fp32 wgmma order), the Gluon kernel was taken, and both match the
    exact reference (tie-aware); pages with NaN scales in part or in whole are in the batch.
    (Splits are set where the default would give at most 8 pages per split: those chunks
    take the Triton kernel.)"""
    heads = 4
    batch, qsl = prefill_batch(specs, seed=len(specs) + 5, page_stride=9216)
    for blk, lo, hi in ((1, 8192, 8192 + 8 * 40), (3, 8192, 9216), (7, 8192, 9216)):
        batch.page_bytes(int(batch.block_table[0, blk]))[lo:hi] = 0x7F
    t = int(qsl[-1])
    q = random_q(t, heads, seed=t + 1)
    if budget is None:
        budget = ref.max_gather_pages(batch.width * 128, t)
    outs = _run_kernels(batch, qsl, q, budget, num_splits, block_m, ("triton", "wgmma"))
    assert torch.equal(outs["wgmma"], outs["triton"])
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_selection(outs["wgmma"], exact, mag, local_pages(batch.seq_lens, qsl), BITS)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and D.prefill_wgmma_ok(torch.device(DEV), "fp8", True)),
                    reason="needs a CUDA SM90 GPU with Gluon")
@pytest.mark.parametrize("specs,budget,num_splits", [
    ([(1024, 32768 + 1024)], None, 2),
    ([(2048, 34816), (512, 131072 + 512), (8, 9000)], None, 4),
    ([(64, 20000), (16, 40000)], None, 1),
    ([(4096, 4096), (1024, 33792), (256, 20000)], 300, None),
])
def test_gpu_gluon_fp8(specs, budget, num_splits):
    """Dot "fp8" (E4M3 operands on the FP8 tensor cores): the Gluon kernel is taken and its
    selection is valid against the exact reference within SPEC 9's b = 5, as is the Triton
    kernel's (tokens on M; the two are not bit-twins); the observed worst error is printed."""
    from nvfp4_indexer.triton.decode import SCORE_ERROR_BITS
    heads = 4
    batch, qsl = prefill_batch(specs, seed=len(specs) + 11, page_stride=9216)
    batch.page_bytes(int(batch.block_table[0, 3]))[8192:9216] = 0x7F  # NaN scales
    t = int(qsl[-1])
    q = random_q(t, heads, seed=t + 3)
    if budget is None:
        budget = ref.max_gather_pages(batch.width * 128, t)
    outs = _run_kernels(batch, qsl, q, budget, num_splits, 128, ("triton", "wgmma"), dot="fp8")
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    local = local_pages(batch.seq_lens, qsl)
    for key, out in outs.items():
        differ = check_selection(out, exact, mag, local, SCORE_ERROR_BITS["fp8"])
        print(f"{key}: {differ} long rows of {int((local >= 16).sum()) * heads} differ from "
              "the exact selection (within b = 5)")
