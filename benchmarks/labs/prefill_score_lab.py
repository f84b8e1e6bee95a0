"""GPU lab (issue 15): the prefill score kernel alone, graph-replayed, against variants.

    python -m benchmarks.labs.prefill_score_lab     # four cases with context, a few minutes
    python -m benchmarks.labs.prefill_score_lab --only "gluon$,gluon splits" \
        --case 1024:131072:1 --splits 2,4,8,16   # one case, the Gluon kernel's split counts

A case's chunk is planned and gathered by ``triton.prefill.prefill_indexer`` (its score launch
is recorded, cases of one chunk only); then that launch is timed alone in CUDA-graph replays
(the workspace stays as gathered, so it is L2-warm as inside a call) with 2 / 3 pipeline
stages, and against the same kernel reading an **fp16 copy of the workspace** (no E4M3 -> fp16
conversion in the page loop: Triton then pipelines each page straight into shared memory as
the MMA's operand) at 2 / 3 / 4 stages and 8 warps, and against the Gluon kernel
(``triton.prefill_wgmma``: warp-specialized, page MMAs overlapped with the epilogues) with 6 /
3 / 4 ring buffers, its speed-of-light variant without top-k inserts (its candidates are
wrong by design), other split counts (timed on their own scratch, not compared), "gluon fp16
ws" (the Gluon kernel on the fp16 copy: its converter only moves bytes), and "gluon direct" /
"gluon direct arith" (``prefill_wgmma_direct_kernel``: pages read from the cache through the
block table, lookup / arithmetic dequantization; no workspace). "gluon splits N" also runs
where the recorded (Triton-rule) launch keeps fewer than 16 candidates, whenever N splits of
the chunk's pages keep 16 (the Gluon kernel's contract): e.g. the 1K-token chunks. Every
other variant's candidate scratch (and output) is compared with the default launch's (lists
as sets), bit for bit. Rates: useful FLOPs over the cuBLAS 16-bit
rate measured in the same run.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

import nvfp4_indexer as ni
from nvfp4_indexer.constants import TOPK
from nvfp4_indexer.triton.decode.lut import lut_table
from nvfp4_indexer.triton import PrefillConfig
from nvfp4_indexer.triton import prefill as tp
from nvfp4_indexer.triton import heuristics as hz
from nvfp4_indexer.triton import prefill_wgmma as pw
from nvfp4_indexer.triton.layout import HEAD, PAGE, scored_pages, split_range
from nvfp4_indexer.triton.operands import load_q_rows
from nvfp4_indexer.triton.scan import block_rows_info, finish_split, out_offsets, scan_pages

from . import knob_lab as kl

log = kl.log


@triton.jit
def _ws16_page_scores(page_src, j, q_ops, DOT: tl.constexpr, TOKENS_N: tl.constexpr):
    ws_page0, = page_src
    q_op, = q_ops
    t = tl.arange(0, PAGE)[:, None]
    k = tl.load(ws_page0 + j.to(tl.int64) * (PAGE * HEAD) + t * HEAD + tl.arange(0, HEAD)[None, :])
    acc = tl.dot(q_op, tl.trans(k), input_precision="ieee", out_dtype=tl.float32)
    return tl.max(acc, 1)


@triton.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "req_base", "num_blocks"])
def _score16_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base,
                    qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                    win_ptr, out_ptr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, DOT: tl.constexpr, WINDOW: tl.constexpr = 1,
                    KEEP: tl.constexpr = 16, TOKENS_N: tl.constexpr = False):
    blk = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                              num_blocks, blk, rows, H)
    n = scored_pages(tl.max(tl.where(row_ok, local, 0), 0))
    start, end = split_range(n, split, NUM_SPLITS)
    q_off = token * q_tok_stride + h * q_head_stride
    q_op = load_q_rows(q_ptr, q_off, row_ok, DOT)
    r = tl.load(blk_ptr + blk)
    ws_page0 = ws_ptr + tl.load(ws_off_ptr + (r - req_base)).to(tl.int64) * (PAGE * HEAD)
    top = scan_pages(start, end, local, (ws_page0,), (q_op,), win_ptr,
                     blk * NUM_SPLITS + split, 0, 1, _ws16_page_scores, DOT, TOKENS_N, BLOCK_M,
                     KEEP, WINDOW)
    finish_split(top, local, out_ptr + out_offsets(token, h, H), row_ok, cand_ptr,
                 (blk * BLOCK_M + rows).to(tl.int64), split, NUM_SPLITS, False)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated prefixes: run only the "
                    "variants whose name starts with one (e.g. 'st3,gluon'); a trailing '$' "
                    "asks for that exact name (e.g. 'gluon$')")
    ap.add_argument("--cases", type=int, default=4, help="the first N of the four cases")
    ap.add_argument("--case", action="append", default=[], metavar="NEW:CONTEXT:REQS",
                    help="time this case instead of the four (repeatable; one chunk)")
    ap.add_argument("--splits", default="1,2,3,4,6",
                    help="split counts of the 'gluon splits N' variants")
    args = ap.parse_args(argv)
    try:
        custom = [tuple(int(v) for v in c.split(":")) for c in args.case]
    except ValueError:
        custom = [()]
    try:
        split_counts = [int(v) for v in args.splits.split(",") if v]
    except ValueError:
        split_counts = [0]
    if any(len(c) != 3 or min(c) < 1 for c in custom):
        ap.error(f"--case: expected NEW:CONTEXT:REQS, positive ints, got {args.case}")
    if any(ns < 1 for ns in split_counts):
        ap.error(f"--splits: expected positive ints, got {args.splits!r}")
    only = [x for x in args.only.split(",") if x]
    from .. import workloads as wl
    from ..pool import random_index_q
    from ..prefill_suite import prefill_inputs
    from ..timing import fp8_matmul_ceiling, mm16_matmul_ceiling
    ctx = kl.make_context(600)
    mm16 = mm16_matmul_ceiling(ctx.device)["tflops"]
    log(f"16-bit mm {mm16:.0f} TFLOP/s")
    mm8 = fp8_matmul_ceiling(ctx.device)["tflops"]
    log(f"FP8 mm {mm8:.0f} TFLOP/s")
    kl.ensure_pool(ctx, 40_000)
    cases = [(16_384, 131_072, 1), (4_096, 131_072, 4), (16_384, 32_768, 1), (4_096, 32_768, 1)]
    cases = cases[:args.cases]
    if args.case:
        cases = custom
    for n, c, r in cases:
        case = wl.PrefillCase(n, c, r)
        tr = wl.prefill_traffic(case)
        _sl, width, tables, seq, cu = prefill_inputs(ctx, case, 1)
        q = random_index_q(case.new_tokens, case.num_heads, ctx.device, ctx.gen(case.name))
        mgp = max(ni.max_gather_pages(width * 128, case.new_tokens), r * width)
        out = torch.full((n, case.num_heads, TOPK), -7, dtype=torch.int32, device=ctx.device)
        orig = tp._prefill_score_kernel
        seen = []

        class Spy:
            def __getitem__(self, grid):
                def launch(*a, **kw):
                    seen.append((grid, a, kw))
                    return orig[grid](*a, **kw)
                return launch
        tp._prefill_score_kernel = Spy()
        try:
            tp.prefill_indexer(q, ctx.pool.cache, tables[0], cu, seq, mgp, out,
                               config=PrefillConfig(kernel="triton"))
        finally:
            tp._prefill_score_kernel = orig
        torch.cuda.synchronize()
        if len(seen) != 1:
            log(f"{case.name}: {len(seen)} chunks, skipped")
            continue
        grid, a, kw = seen[0]
        a = list(a)
        ws8, cand, res = a[3], a[11], a[13]
        ws16 = ws8.view(torch.float8_e4m3fn).to(torch.float16)
        cand0 = cand.clone()
        res0 = res.clone()
        flops = tr.flops
        log(f"{case.name}: grid {grid}, consts { {k: v for k, v in kw.items()} }, "
            f"ws {tuple(ws8.shape)}")

        def base(stages=2, warps=kw.get("num_warps", 4)):
            orig[grid](*a, **{**kw, "num_stages": stages, "num_warps": warps})

        def f16(stages=2, warps=4):
            b = list(a)
            b[3] = ws16
            _score16_kernel[grid](*b, **{**kw, "num_stages": stages, "num_warps": warps})

        def gluon(nb=pw.NUM_BUFFERS, sol=0, ns=None, f16ws=0, fp8=0):
            b, g = a, grid
            if f16ws:  # the fp16 copy of the workspace: no conversion in the converter
                b = list(a)
                b[3] = ws16
            if ns is not None:  # its own scratch and output: not compared
                b = list(a)
                b[11] = torch.empty(grid[0] * kw["BLOCK_M"] * ns * TOPK, dtype=torch.int64,
                                    device=cand.device)
                b[13] = torch.empty_like(res)
                g = (grid[0], ns)
            pw.prefill_wgmma_kernel[g](*b, H=kw["H"], BLOCK_M=kw["BLOCK_M"],
                                       NUM_SPLITS=g[1], NB=nb, SOL=sol, WS16=f16ws,
                                       **pw.launch_options(bool(fp8)))

        tbl = lut_table(ctx.device)

        def direct(conv="lut"):
            # pages straight from the paged cache (no workspace): the same lists expected
            cache, bt = ctx.pool.cache, tables[0][a[5]:]
            assert cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0
            pw.prefill_wgmma_direct_kernel[grid](
                a[0], a[1], a[2], cache, cache.stride(0), cache.shape[0], bt, bt.stride(0),
                tbl, a[5], a[6],
                a[7], a[8], a[9], a[10], a[11], a[13], H=kw["H"], BLOCK_M=kw["BLOCK_M"],
                NUM_SPLITS=grid[1], CONV=conv, **pw.launch_options())

        variants = [("st2", base), ("st3", functools.partial(base, 3)),
                    ("fp16 ws", f16), ("fp16 ws st3", functools.partial(f16, 3)),
                    ("fp16 ws st4", functools.partial(f16, 4)),
                    ("fp16 ws w8", functools.partial(f16, 2, 8))]
        if kw["KEEP"] == TOPK and kw["BLOCK_M"] in hz.PREFILL_WGMMA_BLOCK_M:
            variants += [("gluon", gluon), ("gluon nb3", functools.partial(gluon, 3)),
                         ("gluon nb4", functools.partial(gluon, 4)),
                         ("gluon no-topk (SOL)", functools.partial(gluon, sol=1)),
                         ("gluon fp16 ws", functools.partial(gluon, f16ws=1)),
                         # E4M3 operands (dot "fp8", b = 5): lists may differ (inexact)
                         ("gluon fp8", functools.partial(gluon, fp8=1)),
                         ("gluon fp8 nb8", functools.partial(gluon, 8, fp8=1)),
                         ("gluon fp8 nb12", functools.partial(gluon, 12, fp8=1)),
                         ("gluon direct", direct),
                         ("gluon direct arith", functools.partial(direct, "arith"))]
        if kw["BLOCK_M"] in hz.PREFILL_WGMMA_BLOCK_M:
            # the Gluon kernel at other split counts, on its own scratch, wherever every split
            # keeps 16 (also where the Triton rule's launch keeps fewer: 1K-token chunks)
            # (chunks of short rows only, <= 15 pages, never take a score kernel)
            pages = (int(seq.max()) - 1) // 128
            variants += [(f"gluon splits {ns} (not compared)", functools.partial(gluon, ns=ns))
                         for ns in split_counts
                         if (ns != kw["NUM_SPLITS"] or kw["KEEP"] != TOPK)
                         and pages > hz.SHORT_MAX_LOCAL
                         and hz.keep_for_pages(-(-pages // ns)) == TOPK]
        for name, fn in variants:
            if only and not any(name == x[:-1] if x.endswith("$") else name.startswith(x)
                                for x in only):
                continue
            def run(name=name, fn=fn):
                cand.fill_(-1)
                res.fill_(-7)
                fn()
                torch.cuda.synchronize()
                # lists compared as sets (slot order depends on the insertion order)
                same = bool(torch.equal(cand.view(-1, kw["KEEP"]).sort(-1).values,
                                        cand0.view(-1, kw["KEEP"]).sort(-1).values)) and (
                    kw["NUM_SPLITS"] > 1 or bool(torch.equal(res, res0)))
                if "not compared" in name:  # wrote its own scratch
                    same = None
                note = ""
                if "fp8" in name:  # inexact: the share of rows whose lists hold the same pages
                    def pages(c):  # low 32 bits of a packed candidate: the page id, xor-masked
                        return (c & 0xFFFFFFFF).view(-1, kw["NUM_SPLITS"] * kw["KEEP"]) \
                            .sort(-1).values
                    rows, rows0 = pages(cand), pages(cand0)
                    note = f"lists == fp16 {(rows == rows0).all(-1).float().mean():.3f}, "
                    same = None
                t = ctx.time_capturable([fn])
                tf = flops / (t.us * 1e-6) / 1e12
                kl._record("score", case.name, name, t.us, tf, "TFLOP/s", same,
                           f"{note}{tf / mm16:.1%} of 16-bit mm, {tf / mm8:.1%} of FP8 mm, "
                           f"{t.method}")
            kl._attempt(ctx, f"{case.name} {name}", run)
        ws16 = None  # noqa: F841 (frees the copy)
        torch.cuda.empty_cache()
    kl.print_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
