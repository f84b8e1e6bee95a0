"""Offline compile for Blackwell (sm_100a, sm_103a, sm_120a), no GPU needed.

Beside the SM90 offline compiles (each kernel module's test in ``tests/triton``, e.g.
``triton/test_encode``, and ``triton/test_ptx``): Triton compiles every launched kernel
configuration below to PTX and, with its bundled ptxas, to a cubin for each Blackwell target,
so a change that breaks Blackwell code generation fails CI.
The configurations are the GPU defaults the launchers pick (PORTABLE=False, dot "fp16", the
inline-PTX dequantization of decode and gather), over the shapes of WORKLOADS.md's suites.

CI compiles a representative subset (the decode / prefill / page-score MMA kernels and the
inline-PTX gather: what differs most between SM90, SM100 and SM120) on all three targets: 12
compiles, ~30 s on 2 shared cores. The full list (22 configurations x 3 targets, ~2 min) runs
only when slow tests are asked for by marker: ``pytest -m slow tests/test_blackwell_compile.py``
(``make test`` selects no marker, so it skips it).
"""

from __future__ import annotations

import pytest

from kernel_harness import offline_stdout

ARCHS = (100, 103, 120)  # sm_100a (B200), sm_103a (B300), sm_120a (RTX 50 / RTX PRO)

_SCRIPT = r'''
import os, sys, time
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.sass_stats import (DECODE_TYPES, GATHER_TYPES, INSERT_TYPES, MERGE_TYPES,
                                   PMERGE_TYPES, PREFILL_TYPES, QUANT_TYPES, QUERY_TYPES,
                                   SCORES_TYPES)
from nvfp4_indexer.triton import (decode, dequantize, encode, heuristics, insert, query,
                                  quantize, scores)
from nvfp4_indexer.triton.prefill import dispatch as prefill_dispatch
from nvfp4_indexer.triton.prefill import gather, prefill


def dec(q, h, ns, window, keep):
    return (decode.split_kernel.decode_score_kernel, DECODE_TYPES,
            dict(Q=q, H=h, BLOCK_M=heuristics.block_rows(q, h), NUM_SPLITS=ns, DOT="fp16",
                 DEQUANT="ptx", WINDOW=window, KEEP=keep, PDL=False, CANDIDATES=False),
            dict(num_warps=4, num_stages=2, maxnreg=decode.dispatch.MAXNREG))


def dmerge(q, h, ns, keep):
    rows, warps = heuristics.merge_config(ns, keep)
    return (decode.split_kernel.decode_merge_kernel, MERGE_TYPES,
            dict(Q=q, H=h, BLOCK_M=heuristics.block_rows(q, h), NUM_SPLITS=ns,
                 SPLITS_PAD=triton.next_power_of_2(ns), ROWS=rows, KEEP=keep, PDL=False),
            dict(num_warps=warps))


def pre(block_m, ns, window, keep):
    return (prefill.prefill_score_kernel, PREFILL_TYPES,
            dict(H=4, BLOCK_M=block_m, NUM_SPLITS=ns, DOT="fp16", WINDOW=window, KEEP=keep,
                 TOKENS_N=True), dict(num_warps=4, num_stages=3))


SUBSET = [
    ("decode score Q8 H4 split 4 window 64", *dec(8, 4, 4, 64, 16)),
    ("prefill score BLOCK_M 128 tokens on N", *pre(128, 2, 32, 16)),
    ("page scores BLOCK_M 64", scores._page_scores_kernel, SCORES_TYPES,
     dict(H=4, BLOCK_M=64, PAGES=scores.PAGES_PER_PROGRAM, DOT="fp16"), dict(num_warps=4)),
    ("gather ptx", gather.gather_kernel, GATHER_TYPES,
     dict(FROM_SEQ_LENS=False, PORTABLE=False, TOK_BLOCK=16, DEQUANT="ptx",
          PAGE_PARTS=prefill_dispatch.GATHER_PAGE_PARTS, STREAM=True,
          PAGES=2), dict(num_warps=1)),
]
REST = [
    ("decode score Q1 H1 unsplit", *dec(1, 1, 1, 1, 16)),
    ("decode score Q1 H1 split 31 window 1", *dec(1, 1, 31, 1, 1)),
    ("decode score Q8 H8 split 8 window 64", *dec(8, 8, 8, 64, 16)),
    ("decode score Q4 H4 split 64 window 32", *dec(4, 4, 64, 32, 16)),
    ("decode merge split 4", *dmerge(8, 4, 4, 16)),
    ("decode merge split 128 keep 4", *dmerge(1, 1, 128, 4)),
    ("prefill score BLOCK_M 16 unsplit", *pre(16, 1, 1, 16)),
    ("prefill merge", prefill.prefill_merge_kernel, PMERGE_TYPES,
     dict(H=4, BLOCK_M=128, NUM_SPLITS=2, SPLITS_PAD=2, ROWS=1, KEEP=16, SORT=0),
     dict(num_warps=1)),
    ("prefill merge sorted, merge_config's rows", prefill.prefill_merge_kernel, PMERGE_TYPES,
     dict(H=4, BLOCK_M=128, NUM_SPLITS=2, SPLITS_PAD=2,
          ROWS=heuristics.merge_config(2, 16, sort=True)[0], KEEP=16, SORT=1),
     dict(num_warps=heuristics.merge_config(2, 16, sort=True)[1])),
    ("encode", encode._encode_e4m3_kernel, dict(x_ptr="*bf16", out_ptr="*u8", n="i32"),
     dict(PORTABLE=False, BLOCK=1024), {}),
    ("quantize paged", quantize._quantize_nvfp4_kernel, QUANT_TYPES,
     dict(PAGED=True, PORTABLE=False, BLOCK_T=8), {}),
    ("quantize", quantize._quantize_nvfp4_kernel, QUANT_TYPES,
     dict(PAGED=False, PORTABLE=False, BLOCK_T=8), {}),
    ("dequantize e4m3", dequantize._dequantize_nvfp4_kernel,
     dict(codes_ptr="*u8", scales_ptr="*u8", out_ptr="*u8", n_rows="i32"),
     dict(PORTABLE=False, OUT_F32=False, BLOCK_T=16), {}),
    ("dequantize f32", dequantize._dequantize_nvfp4_kernel,
     dict(codes_ptr="*u8", scales_ptr="*u8", out_ptr="*fp32", n_rows="i32"),
     dict(PORTABLE=False, OUT_F32=True, BLOCK_T=16), {}),
    ("insert rot 64", insert._insert_index_k_kernel, INSERT_TYPES,
     dict(ROT=64, PORTABLE=False, BLOCK_T=4), dict(num_warps=1)),
    ("insert rot 96", insert._insert_index_k_kernel, INSERT_TYPES,
     dict(ROT=96, PORTABLE=False, BLOCK_T=4), dict(num_warps=1)),
    ("query rot 64", query._prepare_index_q_kernel, QUERY_TYPES,
     dict(ROT=64, PORTABLE=False, BLOCK_R=4), {}),
    ("gather triton", gather.gather_kernel, GATHER_TYPES,
     dict(FROM_SEQ_LENS=True, PORTABLE=False, TOK_BLOCK=16, DEQUANT="triton", PAGE_PARTS=8,
          STREAM=False, PAGES=1), dict(num_warps=1)),
]

which, archs = sys.argv[1], [int(a) for a in sys.argv[2].split(",")]
cases = SUBSET if which == "subset" else SUBSET + REST
t0 = time.time()
for cap in archs:
    for name, fn, types, consts, opts in cases:
        sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                           target=GPUTarget("cuda", cap, 32), options=opts)
        ptx, cubin = k.asm["ptx"], k.asm["cubin"]
        assert f".target sm_{cap}a" in ptx, (cap, name)
        assert len(cubin) > 1000, (cap, name)
        for bad in ("div.full", "div.approx", "rsqrt.approx", "sqrt.approx"):
            assert bad not in ptx, f"sm_{cap}a {name}: {bad} in PTX"
        if consts.get("DEQUANT") == "ptx":  # the inline-PTX dequantization survived
            assert "cvt.rn.satfinite.e4m3x2.f16x2" in ptx, f"sm_{cap}a {name}"
        print("compiled", f"sm_{cap}a", name, flush=True)
print(f"total {len(cases) * len(archs)} in {time.time() - t0:.0f} s")
'''


def _run(which: str) -> str:
    return offline_stdout(_SCRIPT, (which, ",".join(map(str, ARCHS))), gluon=False,
                          timeout=1800)


def test_mma_kernels_compile_offline_for_blackwell():
    """The decode / prefill / page-score kernels and the inline-PTX gather compile to PTX and
    cubin for sm_100a, sm_103a and sm_120a (no approximate division; the gather's and decode's
    f16x2 -> e4m3x2 conversions present)."""
    out = _run("subset")
    assert out.count("compiled ") == 4 * len(ARCHS), out


@pytest.mark.slow
def test_all_launched_configurations_compile_offline_for_blackwell(request):
    """Every configuration of the list (decode score / merge over split and window sizes,
    prefill score / merge, page scores, encode, quantize, dequantize, insert, query, gather)
    for the three Blackwell targets. Runs only under ``-m slow`` (about 2 minutes)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full Blackwell compile list runs with -m slow (CI runs the subset)")
    out = _run("all")
    assert out.count("compiled ") == 22 * len(ARCHS), out
