"""Offline SM90 compile of the Triton decode / prefill score kernels: registers and loop sizes.

No GPU needed: Triton compiles for a named target with its bundled ``ptxas`` and
``nvdisasm``. Prints, per configuration, the registers per thread, local-memory bytes, the
SASS instruction count of every loop body (the page loop is the one holding the ``HGMMA``
instructions) and the ``F2FP`` conversion count::

    python -m benchmarks.sass_stats                       # the decode/prefill defaults
    python -m benchmarks.sass_stats --window 1 --maxnreg 128
    python -m benchmarks.sass_stats --elementwise          # gather and insert kernels
    python -m benchmarks.sass_stats --wgmma                # the Gluon wgmma decode scorer
    python -m benchmarks.sass_stats --mma [--arch 89|100]  # the Gluon mma decode scorer
    python -m benchmarks.sass_stats --wgflat               # the Gluon page-per-warp scorer
    python -m benchmarks.sass_stats --prefill-wgmma        # the Gluon prefill score kernel
    python -m benchmarks.sass_stats --redux-select [--arch 100]  # the Gluon select kernel
    python -m benchmarks.sass_stats --merge                # prefill merge: rounds vs top-16

The per-page instruction counts of the performance docs come from these loop bodies (on the
named commit's sources). Must not run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

DECODE_TYPES = dict(q_ptr="*u8", q_row_stride="i32", q_head_stride="i32", cache_ptr="*u8",
                    page_stride="i32", bt_ptr="*i32", bt_stride="i32", seq_lens_ptr="*i32",
                    cand_ptr="*i64", win_ptr="*fp32", out_ptr="*i32", width="i32",
                    num_blocks="i32", page_offset="i32", page_step="i32")
PREFILL_TYPES = dict(q_ptr="*u8", q_tok_stride="i32", q_head_stride="i32", ws_ptr="*u8",
                     ws_off_ptr="*i32", req_base="i32", qsl_ptr="*i32", seq_lens_ptr="*i32",
                     caps_ptr="*i32", blk_ptr="*i32", num_blocks="i32", cand_ptr="*i64",
                     win_ptr="*fp32", out_ptr="*i32")


def _compile(fn, types: dict, consts: dict, aligned: tuple, num_warps: int,
             num_stages: int | None, maxnreg: int | None, arch: int = 90, gluon: bool = False):
    """``triton.compile`` of a Triton (or ``gluon``) kernel for ``sm_<arch>``: ``consts`` as
    constexprs, the other arguments typed by ``types``, ``aligned`` arguments specialized as
    the launcher sees them at run time (16-byte aligned pointers, ints divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    opts = {"num_warps": num_warps}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    return triton.compile(Source(fn, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=opts)


def compile_decode(*, q_len=8, heads=4, block_m=32, num_splits=4, dot="fp16", dequant="ptx",
                   window=64, keep=16, num_warps=4, num_stages=2, maxnreg=None, pdl=False):
    """The decode score kernel for SM90 (a ``triton.compile`` result)."""
    from nvfp4_indexer.triton.decode.split_kernel import decode_score_kernel
    consts = dict(Q=q_len, H=heads, BLOCK_M=block_m, NUM_SPLITS=num_splits, DOT=dot,
                  DEQUANT=dequant, WINDOW=window, KEEP=keep, PDL=pdl, CANDIDATES=False)
    return _compile(decode_score_kernel, DECODE_TYPES, consts,
                    ("q_ptr", "cache_ptr", "page_stride"), num_warps, num_stages, maxnreg)


def compile_prefill(*, heads=4, block_m=128, num_splits=2, dot="fp16", window=32, keep=16,
                    num_warps=4, num_stages=2, maxnreg=None, tokens_on_n=True):
    """The prefill score kernel for SM90 (a ``triton.compile`` result)."""
    from nvfp4_indexer.triton.prefill.prefill import prefill_score_kernel
    consts = dict(H=heads, BLOCK_M=block_m, NUM_SPLITS=num_splits, DOT=dot, WINDOW=window,
                  KEEP=keep, TOKENS_N=tokens_on_n)
    return _compile(prefill_score_kernel, PREFILL_TYPES, consts, ("q_ptr", "ws_ptr"),
                    num_warps, num_stages, maxnreg)


GATHER_TYPES = dict(cache_ptr="*u8", page_stride="i32", bt_ptr="*i32", bt_row_stride="i32",
                    len_ptr="*i32", off_ptr="*i32", ws_ptr="*u8", ws_pages="i32", width="i32",
                    num_blocks="i32")
INSERT_TYPES = dict(x_ptr="*bf16", x_row_stride="i32", n_rows="i32", pos_ptr="*i64",
                    w_ptr="*fp32", cs_ptr="*bf16", cs_stride0="i32", cs_stride1="i32",
                    eps="fp32", cache_ptr="*u8", slot_ptr="*i64", page_stride="i32")
SCORES_TYPES = dict(q_ptr="*u8", q_tok_stride="i32", q_head_stride="i32", cache_ptr="*u8",
                    page_stride="i32", bt_ptr="*i32", bt_stride="i32", qsl_ptr="*i32",
                    seq_lens_ptr="*i32", blk_ptr="*i32", num_blocks="i32", out_ptr="*fp32",
                    width="i32", cache_blocks="i32")
QUANT_TYPES = dict(x_ptr="*fp32", x_row_stride="i32", n_rows="i32", codes_ptr="*u8",
                   scales_ptr="*u8", slot_ptr="*i64", page_stride="i32")
QUERY_TYPES = dict(q_ptr="*bf16", q_stride_t="i32", q_stride_h="i32", num_heads="i32",
                   n_rows="i32", pos_ptr="*i64", w_ptr="*bf16", cs_ptr="*fp32",
                   cs_stride0="i32", cs_stride1="i32", eps="fp32", out_ptr="*u8")


def compile_gather(*, dequant="ptx", tok_block=16, page_parts=8, num_warps=1, streaming=True,
                   pages=1):
    """The gather kernel for SM90 with the given launch options (``pages``: PAGES, pages
    per program)."""
    from nvfp4_indexer.triton.prefill.gather import gather_kernel
    consts = dict(FROM_SEQ_LENS=False, PORTABLE=False, TOK_BLOCK=tok_block, DEQUANT=dequant,
                  PAGE_PARTS=page_parts, STREAM=streaming, PAGES=pages)
    return _compile(gather_kernel, GATHER_TYPES, consts,
                    ("cache_ptr", "page_stride", "ws_ptr"), num_warps, 1, None)


def compile_insert(*, rotary_dim=64, block_t=4, num_warps=1):
    """The fused insert kernel for SM90, specialized as a launch with contiguous bf16 keys
    and cos/sin cache gets it (16-divisible strides, aligned pointers)."""
    from nvfp4_indexer.triton.insert import _insert_index_k_kernel
    consts = dict(ROT=rotary_dim, PORTABLE=False, BLOCK_T=block_t, cs_stride1=1)
    return _compile(_insert_index_k_kernel, INSERT_TYPES, consts,
                    ("x_ptr", "x_row_stride", "pos_ptr", "w_ptr", "cs_ptr", "cs_stride0",
                     "cache_ptr", "slot_ptr", "page_stride"), num_warps, 1, None)


WGMMA_TYPES = dict(q_ptr="*u8", q_row_stride="i64", q_head_stride="i64", cache_ptr="*u8",
                   page_stride16="i64", num_blocks="i32", bt_ptr="*i32", bt_stride="i64",
                   width="i32", seq_lens_ptr="*i32", tbl_ptr="*i64", scores_ptr="*fp32",
                   num_reqs="i32", num_programs="i32")
WGMMA_ALIGNED = ("q_ptr", "cache_ptr", "bt_ptr", "seq_lens_ptr", "tbl_ptr", "scores_ptr")


def compile_wgmma(*, q_len=8, heads=4, num_splits=8):
    """The Gluon wgmma decode score kernel (``triton.decode.wgmma``) for SM90, specialized as
    a launch on an aligned cache with the default page stride gets it."""
    from nvfp4_indexer.triton.decode.wgmma import layouts, wgmma_score_kernel
    from nvfp4_indexer.triton.heuristics import block_rows
    rows = block_rows(q_len, heads)
    cl, mma, ql, b_sl = layouts(rows)
    consts = dict(Q=q_len, H=heads, N=rows, NUM_SPLITS=num_splits, CL=cl, MMA=mma, QL=ql,
                  B_SL=b_sl)
    return _compile(wgmma_score_kernel, WGMMA_TYPES, consts, WGMMA_ALIGNED, 4, None, None,
                    gluon=True)


def compile_mma(*, q_len=8, heads=4, num_reqs=128, maxnreg=None, arch=90):
    """The Gluon warp-per-split decode score kernel (``triton.decode.mma``, one warp) for
    ``sm_<arch>`` (a ``triton.compile`` result), at the launcher's register cap unless
    ``maxnreg`` is given, specialized as a launch on a 16-byte aligned cache gets it (the
    page stride is never specialized: 16-byte code copies at any stride)."""
    import triton

    from nvfp4_indexer.triton.decode.dispatch import MMA_MAXNREG, MMA_STAGES
    from nvfp4_indexer.triton.decode.mma import layouts, mma_score_kernel
    from nvfp4_indexer.triton.heuristics import block_rows
    rows = block_rows(q_len, heads)
    cl, mma, ql, scl = layouts(rows)
    consts = dict(Q=q_len, H=heads, N=rows, BB=max(32, triton.next_power_of_2(num_reqs)),
                  CL=cl, MMA=mma, QL=ql, SCL=scl, STAGES=MMA_STAGES)
    return _compile(mma_score_kernel, WGMMA_TYPES, consts, WGMMA_ALIGNED, 1, None,
                    MMA_MAXNREG if maxnreg is None else maxnreg, arch, gluon=True)


def compile_wgflat(*, q_len=8, heads=4, num_reqs=128, maxnreg=None, stages=None, fp8=False):
    """The Gluon page-per-warp wgmma decode score kernel (``triton.decode.wgflat``) for SM90,
    with the launcher's constexprs (``WGFLAT_STAGES`` ring slots unless ``stages`` is given:
    ``DecodeConfig.ring_stages``), specialized as a launch on a 16-byte aligned cache gets it."""
    import triton

    from nvfp4_indexer.triton.decode.dispatch import WGFLAT_STAGES
    from nvfp4_indexer.triton.decode.wgflat import layouts, wgflat_score_kernel
    from nvfp4_indexer.triton.heuristics import block_rows
    rows = block_rows(q_len, heads)
    cl, mma, ql, scl, b_sl = layouts(rows, fp8)
    consts = dict(Q=q_len, H=heads, N=rows, BB=max(32, triton.next_power_of_2(num_reqs)),
                  CL=cl, MMA=mma, QL=ql, SCL=scl, B_SL=b_sl,
                  STAGES=WGFLAT_STAGES if stages is None else stages, FP8=int(fp8))
    return _compile(wgflat_score_kernel, WGMMA_TYPES, consts, WGMMA_ALIGNED, 4, None, maxnreg,
                    gluon=True)


def compile_prefill_wgmma(*, heads=4, num_splits=4, nb=None, fp8=False):
    """The Gluon prefill score kernel (``triton.prefill.prefill_wgmma``) for SM90, specialized
    as ``prefill_indexer`` launches it (aligned query and workspace, BLOCK_M 128); ``nb``: its
    ring buffers (default ``NUM_BUFFERS``); ``fp8``: its E4M3-operand form (dot "fp8")."""
    from nvfp4_indexer.triton.prefill.prefill_wgmma import (NUM_BUFFERS, launch_options,
                                                            prefill_wgmma_kernel)
    fn = prefill_wgmma_kernel
    opts = dict(launch_options(fp8))
    num_warps = opts.pop("num_warps")
    consts = dict(H=heads, BLOCK_M=128, NUM_SPLITS=num_splits,
                  NB=NUM_BUFFERS if nb is None else nb, **opts)
    consts.setdefault("FP8", 0)
    return _compile(fn, PREFILL_TYPES, consts, ("q_ptr", "ws_ptr"), num_warps, None, None,
                    gluon=True)


def prefill_wgmma_report() -> list[str]:
    """Registers (the launch's per-thread count; the partitions re-balance them with
    ``setmaxnreg``), spills and the consumers' page loop (two pages per iteration) of the Gluon
    prefill score kernel, per variant."""
    lines = []
    for ns, nb, fp8 in ((4, None, False), (1, None, False), (4, 3, False), (4, None, True)):
        k = compile_prefill_wgmma(num_splits=ns, nb=nb, fp8=fp8)
        st = sass_stats(k)
        steps = 8 if fp8 else 16  # two pages' wgmma k-steps (K = 32 / 16 per instruction)
        inner = [(n, sp) for (n, hg), sp in zip(st["loops"], st["loop_spills"]) if hg == steps]
        inner = sorted(inner)[:2]  # the two consumers' page loops (the workers' loop holds one)
        page = [n for n, _ in inner]
        conv = [n for n, hg in st["loops"] if hg == 0 and n > 100]  # the converter's page loop
        ptx = k.asm["ptx"]
        regs = sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                   ptx)})
        lines.append(f"prefill_wgmma NUM_SPLITS {ns} NB {nb or 'default'}"
                     f"{' FP8' if fp8 else ''}: "
                     f"{'wgmma SERIALIZED (C7514), ' if wgmma_serialized(k) else ''}"
                     f"{st['registers']} registers at launch "
                     f"(setmaxnreg {regs}), {st['spill_ops']} LDL/STL "
                     f"({sum(sp for _, sp in inner)} in the page loops), consumer page loop "
                     f"bodies (2 pages) {page} SASS instructions, converter page loop "
                     f"{conv}, {k.metadata.num_warps} warps, "
                     f"{k.metadata.shared} B shared")
    return lines


def _scorer_head(name: str, q_len: int, heads: int, st: dict) -> str:
    """The start of a decode scorer's report line: shape, registers, local bytes."""
    return (f"{name} Q{q_len} H{heads} N {'%2d' % max(16, q_len * heads)}: "
            f"{st['registers']} registers, {st['local_bytes']} B local, ")


def _cp_async_shared(k) -> str:
    ptx = k.asm["ptx"]
    return (f"{ptx.count('cp.async.ca') + ptx.count('cp.async.cg')} cp.async, "
            f"{k.metadata.shared} B shared")


def mma_report(arch: int = 90) -> list[str]:
    """One line per (Q, H) of the Gluon mma decode scorer compiled for ``sm_<arch>``:
    registers, local bytes, LDL/STL (spill) instructions, the page loop's SASS instructions,
    and the PTX's mma.sync and cp.async counts and shared-memory bytes."""
    lines = []
    for q_len, heads in ((8, 4), (4, 4), (1, 4), (8, 8)):
        k = compile_mma(q_len=q_len, heads=heads, arch=arch)
        st = sass_stats(k)
        # the page loop is the innermost big loop: the request loop around it is larger
        page_n, page_spills = min((n, sp) for (n, _), sp in zip(st["loops"], st["loop_spills"])
                                  if n >= 256)
        lines.append(_scorer_head(f"mma sm_{arch}", q_len, heads, st)
                     + f"{st['spill_ops']} LDL/STL ({page_spills} in the page loop), page loop "
                     f"body {page_n} SASS instructions, "
                     f"{k.asm['ptx'].count('mma.sync.aligned')} mma.sync, "
                     + _cp_async_shared(k))
    return lines


def wgflat_report() -> list[str]:
    """One line per (Q, H) of the Gluon page-per-warp decode scorer (sm_90a): registers,
    LDL/STL, the group loop's SASS instructions (four pages, one per warp) and HGMMAs, the
    PTX's wgmma and cp.async counts and the shared-memory bytes."""
    lines = []
    for q_len, heads in ((8, 4), (4, 4), (1, 4)):
        k = compile_wgflat(q_len=q_len, heads=heads)
        st = sass_stats(k)
        group_n, hg, group_spills = min((n, hg, sp) for (n, hg), sp
                                        in zip(st["loops"], st["loop_spills"]) if hg)
        lines.append(_scorer_head("wgflat ", q_len, heads, st)
                     + f"{st['spill_ops']} LDL/STL ({group_spills} in the group loop), group "
                     f"loop body {group_n} SASS instructions with {hg} HGMMA, "
                     f"{k.asm['ptx'].count('wgmma.mma_async')} wgmma, "
                     + _cp_async_shared(k))
    return lines


def _compile_gluon(fn, types: dict, consts: dict, num_warps: int, arch: int):
    """A Gluon kernel for ``sm_<arch>`` with no value or alignment specialization."""
    return _compile(fn, types, consts, (), num_warps, None, None, arch, gluon=True)


SELECT_TYPES = dict(scores_ptr="*fp32", seq_lens_ptr="*i32", width="i32", out_ptr="*i32")
MERGE_TYPES = dict(cand_ptr="*i64", seq_lens_ptr="*i32", out_ptr="*i32", width="i32")


def compile_redux_select(*, q_len=8, heads=4, k=4, rows=4, arch=90):
    """The Gluon select kernel (``triton.decode.redux``) for ``sm_<arch>``."""
    from nvfp4_indexer.triton.decode.redux import redux_select_kernel
    n = max(16, 1 << (q_len * heads - 1).bit_length())
    return _compile_gluon(redux_select_kernel, SELECT_TYPES,
                          dict(Q=q_len, H=heads, N=n, K=k, ROWS=rows), rows, arch)


def redux_select_report(arch: int = 90) -> list[str]:
    """One line per K (keys per lane: W <= 32 K) of the Gluon select at Q8 H4, 4 rows per
    program: registers, LDL/STL, SASS instructions, REDUX count; the Gluon merge of the
    one-launch kernel's split candidates at C = 64 and 512 candidates per row; the split
    select at K 8 / S 4 (W <= 1024), K 16 / S 4 (W <= 2048: the library's shape there),
    K 16 / S 8 (W <= 4096) and K 32 / S 8 (W <= 8192); then, for
    comparison, the plain-Triton wide select at W = 128 and merge of 10 splits x 4 candidates
    (one warp per row; SHFL count)."""
    from nvfp4_indexer.triton.decode.redux import redux_merge_kernel, redux_select_split_kernel
    from nvfp4_indexer.triton.decode.select import select_wide_kernel
    from nvfp4_indexer.triton.decode.split_kernel import decode_merge_kernel
    kernels = [(f"redux_select sm_{arch} K {k:2d}", compile_redux_select(k=k, arch=arch))
               for k in (1, 4, 8, 16, 32)]
    kernels += [(f"redux_merge sm_{arch} C {c:3d}",
                 _compile_gluon(redux_merge_kernel, MERGE_TYPES,
                                dict(Q=8, H=4, BLOCK_M=32, C=c, K=c // 32, ROWS=4), 4, arch))
                for c in (64, 512)]
    kernels += [(f"redux_select_split sm_{arch} K {k:2d} S {s}",
                 _compile_gluon(redux_select_split_kernel, SELECT_TYPES,
                                dict(Q=8, H=4, N=32, K=k, S=s, ROWS=1), s, arch))
                for k, s in ((8, 4), (16, 4), (16, 8), (32, 8))]  # W <= 1024 .. 8192
    lines = [_count_line(label, ker, r"\bC?REDUX\b", "REDUX")  # sm_100: CREDUX
             for label, ker in kernels]
    wide = _compile(select_wide_kernel, SELECT_TYPES, dict(Q=8, H=4, N=32, CHUNK=128), (), 1,
                    1, None, arch)
    lines.append(_count_line(f"wide select sm_{arch} W 128 (1 warp)", wide, "SHFL", "SHFL",
                             spills=False))
    merge = _compile(decode_merge_kernel, MERGE_TYPES,
                     dict(Q=8, H=4, BLOCK_M=32, NUM_SPLITS=10, SPLITS_PAD=16, ROWS=1, KEEP=4,
                          PDL=False), (), 1, 1, None, arch)
    lines.append(_count_line(f"triton merge sm_{arch} 10 x 4 (64 padded candidates, 1 warp)",
                             merge, "SHFL", "SHFL", spills=False))
    return lines


def _count_line(label: str, kernel, pattern: str, name: str, spills: bool = True) -> str:
    """``label: R registers[, S LDL/STL], I SASS instructions, N name`` (N: SASS lines
    matching ``pattern``)."""
    st = sass_stats(kernel)
    n = len(re.findall(pattern, sass_text(kernel)))
    return (f"{label}: {st['registers']} registers, "
            + (f"{st['spill_ops']} LDL/STL, " if spills else "")
            + f"{st['instructions']} SASS instructions, {n} {name}")


def wgmma_report() -> list[str]:
    """Registers and per-page SASS instructions of the Gluon wgmma decode scorer, by rows."""
    lines = []
    for q_len, heads in ((8, 4), (4, 4), (1, 4), (8, 8)):
        k = compile_wgmma(q_len=q_len, heads=heads)
        st = sass_stats(k)
        page = [n for n, hg in st["loops"] if hg]
        ptx = k.asm["ptx"]
        lines.append(_scorer_head("wgmma  ", q_len, heads, st)
                     + f"{st['spill_ops']} LDL/STL, page loop "
                     f"body {page} SASS instructions, {ptx.count('wgmma.mma_async')} wgmma, "
                     f"{ptx.count('prmt.b32')} prmt in the PTX")
    return lines


PMERGE_TYPES = dict(cand_ptr="*i64", qsl_ptr="*i32", seq_lens_ptr="*i32", caps_ptr="*i32",
                    blk_ptr="*i32", num_blocks="i32", out_ptr="*i32")


def merge_report() -> list[str]:
    """Static SASS of the prefill merge kernel (no loops; ``merge_config``'s rows per program:
    one for the 15 rounds of max-and-remove (SORT 0), several for the bitonic top-16 (SORT
    1)), per split count."""
    from nvfp4_indexer.triton import heuristics as hz
    from nvfp4_indexer.triton.prefill.prefill import prefill_merge_kernel
    lines = []
    for ns, keep in ((2, 16), (4, 16), (16, 16), (33, 16), (2, 8)):
        for sort in (0, 1):
            rows, warps = hz.merge_config(ns, keep, sort=bool(sort))
            k = _compile(prefill_merge_kernel, PMERGE_TYPES,
                         dict(H=4, BLOCK_M=128, NUM_SPLITS=ns, SPLITS_PAD=hz.next_pow2(ns),
                              ROWS=rows, KEEP=keep, SORT=sort), ("cand_ptr", "out_ptr"),
                         warps, 1, None)
            st, txt = sass_stats(k), sass_text(k)
            lines.append(f"merge splits {ns:2d} keep {keep:2d} rows {rows:2d} warps {warps} "
                         f"SORT {sort}: "
                         f"{st['registers']} registers, {st['local_bytes']} B local, "
                         f"{st['instructions']} SASS instructions, {txt.count('SHFL')} SHFL, "
                         f"{txt.count('BAR')} BAR")
    return lines


def elementwise_report() -> list[str]:
    """Static SASS sizes of the gather and insert kernels (no loops: every instruction runs
    once per program, except the rarely taken slow paths of IEEE division / sqrt)."""
    lines = []
    for dequant, tb, parts, nw, pages in (("ptx", 16, 8, 1, 1), ("ptx", 16, 8, 1, 2),
                                          ("triton", 16, 8, 1, 1), ("ptx", 32, 1, 4, 1),
                                          ("triton", 32, 1, 4, 1)):
        st = sass_stats(compile_gather(dequant=dequant, tok_block=tb, page_parts=parts,
                                       num_warps=nw, pages=pages))
        per_thread_values = pages * 128 * 128 // parts // (32 * nw)
        lines.append(f"gather  dequant {dequant:6s} tok_block {tb} page_parts {parts} warps {nw} "
                     f"pages {pages}: "
                     f"{st['registers']} registers, {st['instructions']} SASS instructions per "
                     f"program = {8 * st['instructions'] / per_thread_values:.1f} per 8 values "
                     f"per thread")
    for rot, bt, nw in ((64, 4, 1), (64, 16, 1), (128, 4, 1), (96, 4, 1)):
        st = sass_stats(compile_insert(rotary_dim=rot, block_t=bt, num_warps=nw))
        per_value = st["instructions"] * 32 * nw / (bt * 128)
        lines.append(f"insert  rotary_dim {rot:3d} block_t {bt:2d} warps {nw}: "
                     f"{st['registers']} registers, {st['local_bytes']} B local, "
                     f"{st['instructions']} SASS instructions per program = {per_value:.1f} "
                     f"thread-instructions per value")
    return lines


def _tool(name: str) -> str:
    import triton
    hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                  "bin", name))
    if not hits:
        raise FileNotFoundError(f"Triton's bundled {name} was not found")
    return hits[0]


def _on_cubin(kernel, tool: str, *args: str) -> str:
    """stdout of Triton's bundled ``tool`` run on the kernel's cubin (a temporary file)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([_tool(tool), *args, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_text(kernel) -> str:
    """The SASS of a compiled kernel (``nvdisasm`` of its cubin)."""
    return _on_cubin(kernel, "nvdisasm", "-c")


def wgmma_serialized(kernel) -> bool:
    """Whether ptxas serializes the kernel's ``wgmma.mma_async`` (its C7514 warning, e.g. for
    a non-wgmma instruction reading an in-flight accumulator): ``ptxas -v`` of its PTX."""
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        arch = re.search(r"\.target\s+(sm_\w+)", kernel.asm["ptx"]).group(1)
        r = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-v", ptx, "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True)
        return "C7514" in r.stderr


def sass_stats(kernel) -> dict:
    """Registers, local bytes, loop bodies ``[(instructions, HGMMAs / QGMMAs), ...]`` and the
    LDL/STL in each (``loop_spills``), F2FP count and
    local-memory (spill) instructions of a compiled kernel's SASS (``spill_ops``; those inside
    loops that hold HGMMA: ``mma_loop_spill_ops``). ``local_bytes`` is the resource usage's
    ``LOCAL``, which stays 0 when ptxas spills (spills go to ``STACK``): ``spill_ops`` is the
    spill check."""
    sass = sass_text(kernel)
    usage = _on_cubin(kernel, "cuobjdump", "--dump-resource-usage")
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines)
              if (m := re.match(r"^(\.L_x_\d+):", ln))}
    is_ins = [bool(re.search(r"/\*[0-9a-f]{4,}\*/", ln)) for ln in lines]
    loops, loop_spills = [], []
    spill = [bool(re.search(r"\b(?:LDL|STL)\b", ln)) for ln in lines]
    mma_loop_spills = 0
    for i, ln in enumerate(lines):  # a backward branch closes a loop body
        # "@P0 BRA `(.L_x_3)" or, on sm_100, "BRA.U UP0, `(.L_x_0)" (uniform predicate)
        m = re.search(r"BRA(?:\.\w+)*\s+(?:!?U?P\w+,\s*)?`\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i:
            body = range(labels[m.group(1)], i + 1)
            loops.append((sum(is_ins[k] for k in body),
                          sum(bool(re.search(r"\b[HQ]GMMA", lines[k])) for k in body)))
            loop_spills.append(sum(spill[k] for k in body))
            if loops[-1][1]:
                mma_loop_spills += sum(spill[k] for k in body)
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "local_bytes": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "instructions": sum(is_ins), "loops": loops, "loop_spills": loop_spills,
            "f2fp": sass.count("F2FP"),
            "spill_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "mma_loop_spill_ops": mma_loop_spills}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=None, help="WINDOW (default: 64 and 1)")
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--dequant", default="ptx", help="decode DEQUANT constexpr")
    # flag -> (help, report(arch)); the first flag given (in this order) picks the report
    reports = {
        "merge": ("the prefill merge kernel: 15 rounds against the bitonic top-16",
                  lambda arch: merge_report()),
        "redux-select": ("the Gluon select kernel of the page-score paths (decode.redux)",
                         redux_select_report),
        "wgflat": ("the Gluon page-per-warp wgmma decode scorer (dequant 'wgflat')",
                   lambda arch: wgflat_report()),
        "wgmma": ("the Gluon wgmma decode scorer (decode dequant 'wgmma')",
                  lambda arch: wgmma_report()),
        "prefill-wgmma": ("the Gluon prefill score kernel (prefill_wgmma)",
                          lambda arch: prefill_wgmma_report()),
        "mma": ("the Gluon warp-per-split decode scorer (decode dequant 'mma')", mma_report),
        "elementwise": ("the gather and insert kernels instead of the score kernels",
                        lambda arch: elementwise_report()),
    }
    for flag, (text, _) in reports.items():
        ap.add_argument(f"--{flag}", action="store_true", help=text)
    ap.add_argument("--arch", type=int, default=90,
                    help="--mma / --redux-select target (89, 90, 100)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sass_stats: unset TRITON_INTERPRET (it compiles for a real target)")
        return 2
    chosen = next((r for flag, (_, r) in reports.items()
                   if getattr(args, flag.replace("-", "_"))), None)
    if chosen is not None:
        for line in chosen(args.arch):
            print(line, flush=True)
        return 0
    windows = (args.window,) if args.window else (64, 1)
    for w in windows:
        for name, k in (
                (f"decode  Q8 H4 BLOCK_M 32 dequant {args.dequant} window {w}",
                 compile_decode(window=w, dequant=args.dequant, maxnreg=args.maxnreg)),
                (f"prefill H4 BLOCK_M 128 window {min(w, 32)}",
                 compile_prefill(window=min(w, 32), maxnreg=args.maxnreg))):
            st = sass_stats(k)
            page = [n for n, hg in st["loops"] if hg]
            print(f"{name}: {st['registers']} registers, {st['local_bytes']} B local, "
                  f"{st['instructions']} SASS instructions, page loop body {page}, "
                  f"all loop bodies {[n for n, _ in st['loops']]}, F2FP {st['f2fp']}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
