"""GPU lab: scheduling variants of the Gluon wgmma decode scorer (issue 13; docs/benchmarks.md,
"Issue 13, second step"). Run on an SM90 GPU::

    python -m benchmarks.labs.wgmma_variants                     # all variants, 6 large cases
    python -m benchmarks.labs.wgmma_variants 128:100000 "nw8 async pps16"

Variants of ``triton.wgmma_scorer.wgmma_score_kernel`` (same page loop, constexpr flags):
NW warps per CTA (4: one warpgroup on a page's 128 tokens; 8: two warpgroups of 64 tokens),
ASYNC (the lo half's wgmma runs while the hi half is looked up), the split target per SM, and
the select kernel's chunk (0: score kernel only). Each variant's page scores are compared bit
for bit with the first variant's and its selected rows with the library's; timing as the
decode suite (cold page pool, rotated block tables, CUDA-graph replays). ``LAB_ONCE=1``: one
launch per variant, for ``ncu``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)
from nvfp4_indexer.triton.wgmma_scorer import _dequant_half, _load_page, _load_q


def layouts(rows, nw):
    """(CL, MMA, QL, B_SL) of ``decode_wgmma.gluon_layouts`` for ``nw`` = 4 or 8 warps (8: the
    page's token bases 16, 32, 64 on warps, two warpgroups along M)."""
    cl_warps = [[16, 0, 0], [32, 0, 0]] + ([[64, 0, 0]] if nw == 8 else [])
    cl_regs = [[0, 0, 1], [8, 0, 0]] + ([[64, 0, 0]] if nw == 4 else [])
    cl = gl.DistributedLinearLayout(
        reg_bases=cl_regs,
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=cl_warps, block_bases=[], shape=[128, 4, 2])
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                    instr_shape=[16, rows, 16])
    ql = gl.BlockedLayout([4, 1], [32, 1], [1, nw], [0, 1])
    b_sl = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * rows), element_bitwidth=16,
                                rank=2)
    return cl, mma, ql, b_sl


@gluon.jit
def wgv_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride8, num_blocks,
               bt_ptr, bt_stride, width, seq_lens_ptr, tbl_ptr, scores_ptr,
               Q: gl.constexpr, H: gl.constexpr, N: gl.constexpr,
               NUM_SPLITS: gl.constexpr, CL: gl.constexpr, MMA: gl.constexpr,
               QL: gl.constexpr, B_SL: gl.constexpr, ASYNC: gl.constexpr):
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    b = gl.program_id(0)
    split = gl.program_id(1)
    seq_len = gl.minimum(gl.load(seq_lens_ptr + b), width * 128)
    n_pages = gl.maximum(seq_len - 1, 0) // 128
    n_pages = gl.where(n_pages > 15, n_pages, 0)
    per = gl.cdiv(n_pages, NUM_SPLITS)
    start = split * per
    end = gl.minimum(start + per, n_pages)
    if start < end:
        q_lo = gl.allocate_shared_memory(gl.float16, [64, N], B_SL, _load_q(
            q_ptr, b, q_row_stride, q_head_stride, 0, Q, H, N, QL))
        q_hi = gl.allocate_shared_memory(gl.float16, [64, N], B_SL, _load_q(
            q_ptr, b, q_row_stride, q_head_stride, 64, Q, H, N, QL))
        fence_async_shared()
        m = gl.arange(0, 128, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
        jj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
        gp = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
        m3 = gl.expand_dims(gl.expand_dims(m, 1), 2)
        grp = gl.expand_dims(gl.expand_dims(jj, 0), 2) * 2 \
            + gl.expand_dims(gl.expand_dims(gp, 0), 1)
        off64 = m3 * 8 + grp
        sc_off = 8192 + m3 * 8 + grp
        cache64 = cache_ptr.to(gl.pointer_type(gl.int64), bitcast=True)
        bt_row = bt_ptr + b.to(gl.int64) * bt_stride
        zero = gl.zeros([128, N], gl.float32, layout=MMA)
        out_base = scores_ptr + b.to(gl.int64) * N * width
        out_off = gl.arange(0, N, layout=gl.SliceLayout(0, MMA)) * width
        codes_n, sb_n = _load_page(cache64, cache_ptr, bt_row, start, num_blocks, page_stride8,
                                   off64, sc_off)
        for j in range(start, end):
            codes = codes_n
            sb = sb_n
            codes_n, sb_n = _load_page(cache64, cache_ptr, bt_row, gl.minimum(j + 1, end - 1),
                                       num_blocks, page_stride8, off64, sc_off)
            c_lo, c_hi = gl.split(codes)
            s_lo, s_hi = gl.split(sb)
            s_lo = s_lo.to(gl.int32)
            s_hi = s_hi.to(gl.int32)
            r_lo = gl.load(tbl_ptr + s_lo)
            r_hi = gl.load(tbl_ptr + s_hi)
            a_lo = _dequant_half(c_lo, s_lo, r_lo, A_L)
            if ASYNC:
                acc = warpgroup_mma(a_lo, q_lo, zero, use_acc=False, is_async=True)
                a_hi = _dequant_half(c_hi, s_hi, r_hi, A_L)
                acc = warpgroup_mma(a_hi, q_hi, acc, is_async=True)
                acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a_lo, a_hi])
            else:
                acc = warpgroup_mma(a_lo, q_lo, zero, use_acc=False)
                a_hi = _dequant_half(c_hi, s_hi, r_hi, A_L)
                acc = warpgroup_mma(a_hi, q_hi, acc)
            gl.store(out_base + j + out_off, gl.max(acc, axis=0))


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------

T0 = time.monotonic()
Q, H = 8, 4
VARIANTS = {  # name: (warps, async, programs per SM, select chunk)
    "lib": None,
    "nw4 sync pps32": (4, 0, 32, 1024),
    "nw4 async pps32": (4, 1, 32, 1024),
    "nw8 sync pps32": (8, 0, 32, 1024),
    "nw8 sync pps16": (8, 0, 16, 1024),
    "nw8 async pps16": (8, 1, 16, 1024),
    "score only": (4, 0, 32, 0),
    "sync c128": (4, 0, 32, 128),
}
CASES = [(128, 100000), (64, 100000), (32, 200000), (128, 50000), (64, 50000), (32, 100000)]


def log(m):
    print(f"[{time.monotonic() - T0:6.1f}s] {m}", flush=True)


def make_launch(dev, nw, asyn, pps, sel_chunk, b, width, rows):
    from nvfp4_indexer.triton import decode_wgmma as DW
    from nvfp4_indexer.triton import heuristics as hz
    splits = hz.choose_num_splits(b, width, hz.num_sms(dev), pps)
    cl, mma, ql, b_sl = layouts(rows, nw)
    table = DW._device_table(dev)
    chunk = min(sel_chunk, triton.next_power_of_2(max(width, 16))) if sel_chunk else 0

    def run(q, cache, bt, seq, out, scores):
        q8 = q.view(torch.uint8)
        wgv_kernel[(b, splits)](q8, q8.stride(0), q8.stride(1), cache, cache.stride(0) // 8,
                                cache.shape[0], bt, bt.stride(0), width, seq, table, scores,
                                Q=Q, H=H, N=rows, NUM_SPLITS=splits, CL=cl, MMA=mma, QL=ql,
                                B_SL=b_sl, ASYNC=asyn, num_warps=nw)
        if chunk:
            DW._select_kernel[(b, Q * H)](scores, seq, width, out, Q=Q, H=H, N=rows,
                                          CHUNK=chunk, num_warps=DW.SELECT_WARPS)
    return run, splits


def _cases(text: str):
    """argparse type: "all" (None: ``CASES``) or BATCH:NOMINAL,..."""
    if text == "all":
        return None
    try:
        return [(int(b), int(n)) for b, n in (c.split(":") for c in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or BATCH:NOMINAL,..., got {text!r}")


def _variants(text: str):
    """argparse type: comma-separated names of ``VARIANTS``."""
    names = text.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown}; "
                                         f"known: {', '.join(VARIANTS)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.labs.wgmma_variants",
        description="GPU lab: scheduling variants of the Gluon wgmma decode scorer (issue 13). "
                    "Needs an SM90 GPU.")
    p.add_argument("cases", nargs="?", type=_cases, default=None,
                   help="'all' (default: the 6 large cases) or BATCH:NOMINAL,...")
    p.add_argument("variants", nargs="?", type=_variants, default=None,
                   help="comma-separated variants (default all; 'lib' always runs): "
                        + ", ".join(VARIANTS))
    return p.parse_args(argv)


def main(argv=None) -> int:
    from benchmarks import workloads as wl
    from benchmarks.pool import PagePool, random_index_q
    from benchmarks.timing import copy_ceiling, l2_bytes, rotation_slots, time_graph
    from nvfp4_indexer.triton import decode_wgmma as DW
    from nvfp4_indexer.triton.decode import DecodeRunner
    from nvfp4_indexer.triton.heuristics import block_rows
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("wgmma_variants: needs an SM90 GPU", flush=True)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    cases = args.cases or CASES
    variants = {k: v for k, v in VARIANTS.items()
                if k == "lib" or args.variants is None or k in args.variants}
    log(f"{torch.cuda.get_device_name(dev)} torch {torch.__version__} triton {triton.__version__}")
    copy = copy_ceiling(dev)["gbps"]
    l2 = l2_bytes(dev)
    plans, total = [], 0
    for b, nom in cases:
        sl = wl.make_seq_lens(b, nom, Q)
        tr = wl.decode_traffic(sl, Q, H)
        need = sum(wl.pages_needed(s) for s in sl)
        slots = rotation_slots(tr.pages_bytes, l2, 24)
        plans.append((b, nom, sl, tr, slots))
        total = max(total, need * slots)
    pool = PagePool(total, dev, seed=11, log=log)
    rows = block_rows(Q, H)
    res = []
    for b, nom, sl, tr, slots in plans:
        width = max(wl.pages_needed(s) for s in sl)
        tables = pool.block_tables(sl, slots, width)
        seq = torch.tensor(sl, dtype=torch.int32, device=dev)
        q = random_index_q(b * Q, H, dev, torch.Generator(device=dev).manual_seed(b))
        base_out = base_sc = None
        for name, v in variants.items():
            try:
                scores = torch.full((DW.scratch_elems(b, width, rows),), float("nan"), device=dev)
                if v is None:
                    r = DecodeRunner(H, b, width, Q, dev)
                    fn, splits = (lambda q, c, bt, s, o, sc, r=r: r.run(q, c, bt, s, o)), r.num_splits
                else:
                    fn, splits = make_launch(dev, *v, b, width, rows)
                out = torch.full((b * Q, H, 16), -7, dtype=torch.int32, device=dev)
                fn(q, pool.cache, tables[0], seq, out, scores)
                torch.cuda.synchronize(dev)
                note = ""
                if v is None:
                    base_out = out.clone()
                else:
                    if v[3]:
                        note = f"rows_eq {float((out == base_out).all(-1).float().mean()):.4f}"
                    if base_sc is None:
                        base_sc = scores.clone()
                    else:
                        same = torch.equal(scores.nan_to_num(-1e30), base_sc.nan_to_num(-1e30))
                        note += f" scores_eq {same}"
                if os.environ.get("LAB_ONCE"):
                    log(f"{name}: ran once {note}")
                    continue
                outs = [torch.empty_like(out) for _ in range(2)]
                calls = [lambda bt=bt, o=outs[i % 2]: fn(q, pool.cache, bt, seq, o, scores)
                         for i, bt in enumerate(tables)]
                t = time_graph(calls, dev, graph_calls=24, warmup=2, replays=10)
                gbps = tr.bytes_moved / (t.us * 1e-6) / 1e9
                res.append((f"b{b}_s{nom}", name, splits, t.us, gbps, 100 * gbps / copy, note))
                log(f"b{b}_s{nom} {name}: {t.us:.1f} us {100 * gbps / copy:.1f} % {note}")
            except Exception as e:  # noqa: BLE001 (a failing variant is reported, the lab goes on)
                torch.cuda.synchronize(dev)
                log(f"b{b}_s{nom} {name}: FAIL {type(e).__name__}: {str(e)[:300]}")
    print(f"\n== summary (copy {copy:.0f} GB/s) ==")
    for r in res:
        print(f"{r[0]:14s} {r[1]:18s} splits {r[2]:4d} {r[3]:8.1f} us {r[4]:6.0f} GB/s "
              f"{r[5]:5.1f} %  {r[6]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
