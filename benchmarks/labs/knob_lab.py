"""GPU lab for the launch knobs of the prefill, gather and insert kernels.

Run (one H200, a few minutes)::

    python -m benchmarks.labs.knob_lab                   # every part
    python -m benchmarks.labs.knob_lab --part prefill    # or gather / insert

Each part times variants of one Triton launcher against its current default on WORKLOADS.md
cases, with the protocol of ``python -m benchmarks`` (``benchmarks.timing``: cold-cache page
sets from one pool far larger than L2, CUDA-graph replays where the launcher is capturable,
eager calls after an L2 flush where it syncs the host) and checks every variant's output
against the default's, byte for byte (prefill: the selected pages, row for row):

- prefill: ``triton.prefill.prefill_indexer`` with ``kernel`` (the Triton score kernel where
  the default is the Gluon one), ``block_m`` (rows per score program), ``tokens_on_n``,
  ``dot``, ``num_warps`` and ``num_stages`` (Triton kernel knobs: the Gluon one ignores
  them); eager (it plans on the host).
- gather: ``triton.prefill.gather.gather_into`` with ``dequant``, ``tok_block``,
  ``num_warps``, ``page_parts``, ``streaming`` (cache hints) and ``pages_per_program``;
  graph replays, every slot with its own workspace.
- insert: ``triton.insert.insert_index_k`` with ``block_t`` and ``num_warps``; graph replays
  over rotated key / slot sets.

A variant that fails (compile error, launch error, different output) is reported and the lab
goes on. ``--variant NAME:KEY=VALUE,...`` adds a variant with any launcher keywords, so a row
of an older lab log can be re-measured on the current code (the log names each run's commit). Results are printed as they come and as one table at the end.
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback

import torch

from .profile_case import config_of, knob_value
from .cli import gpu_args, lab_parser, print_markdown

START = time.monotonic()

PREFILL_VARIANTS = {
    "base": {},
    "tokens m": {"tokens_on_n": False},
    "m64": {"block_m": 64},
    "m64 tokens m": {"block_m": 64, "tokens_on_n": False},
    "triton": {"kernel": "triton"},  # SM90: the default takes the Gluon scorer (no stages)
    "st3": {"kernel": "triton", "num_stages": 3},
    "w8": {"kernel": "triton", "num_warps": 8},
    "m256 w8": {"block_m": 256, "num_warps": 8},
    "gather no stream": {"gather_streaming": False},
    "fp8 dot": {"dot": "fp8"},  # on SM90: the Gluon kernel's E4M3 form where it runs
    "fp8 dot triton": {"dot": "fp8", "kernel": "triton"},  # the Triton kernel's fp8 everywhere
}
PREFILL_CASES = [(16_384, 131_072, 1), (4_096, 131_072, 4), (16_384, 32_768, 1),
                 (1_024, 131_072, 1), (16_384, 0, 1)]  # (new tokens, context, requests)

GATHER_VARIANTS = {
    "base": {},
    "pages1": {"pages_per_program": 1},
    "parts2": {"page_parts": 2},
    "parts4": {"page_parts": 4},
    "parts8": {"page_parts": 8},
    "parts2 w2": {"page_parts": 2, "num_warps": 2},
    "parts4 w2": {"page_parts": 4, "num_warps": 2},
    "parts8 w1": {"page_parts": 8, "num_warps": 1},
    "tb32": {"tok_block": 32},
    "no stream": {"streaming": False},
}
GATHER_CASES = [(16_384, 131_072, 4), (1_024, 131_072, 4), (4_096, 131_072, 1),
                (16_384, 32_768, 4), (1_024, 32_768, 1)]

INSERT_VARIANTS = {
    "base": {},
    "bt8 w1": {"block_t": 8, "num_warps": 1},
    "bt32": {"block_t": 32},
    "bt16 w2": {"block_t": 16, "num_warps": 2},
    "bt64": {"block_t": 64},
    "bt16 w1": {"block_t": 16, "num_warps": 1},
}

ROWS: list[tuple] = []


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


def _record(part, case, variant, us, unit_value, unit, same, note=""):
    ROWS.append((part, case, variant, us, unit_value, unit, same, note))
    log(f"{part:8s} {case:22s} {variant:14s} {us:10.2f} us  {unit_value:8.1f} {unit}"
        f"  same={same} {note}")


def _record_gbps(ctx, part, case, variant, t, bytes_moved, same, slots) -> None:
    """``_record`` of a bandwidth row: ``bytes_moved`` over the ``Timing`` ``t``, rated
    against the copy ceiling."""
    gbps = bytes_moved / (t.us * 1e-6) / 1e9
    _record(part, case, variant, t.us, gbps, "GB/s", same,
            f"{gbps / ctx.copy_gbps:.1%} of copy, slots {slots}, {t.method}")


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,...`` -> ``(NAME, {KEY: VALUE})``; values as
    ``profile_case.knob_value`` reads them (true / false -> bool, integers -> int)."""
    name, _, knobs = text.partition(":")
    kw = {}
    for item in filter(None, knobs.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"expected NAME:KEY=VALUE,..., got {text!r}")
        kw[key.strip()] = knob_value(value)
    return name, kw


def print_table() -> None:
    """Every recorded row (``_record``) as one Markdown table."""
    print_markdown(["part", "case", "variant", "us", "rate", "same as base", "note"],
                   [[part, case, variant, f"{us:.2f}", f"{val:.1f} {unit}", str(same), note]
                    for part, case, variant, us, val, unit, same, note in ROWS])


def _attempt(ctx, label: str, fn) -> bool:
    """Run one variant; report a failure and go on. False once the CUDA context is broken."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        log(f"{label}: FAILED {type(e).__name__}: {e}")
        traceback.print_exc()
        ctx.check_cuda()
    return not ctx.cuda_broken


def _attempt_all(ctx, label: str, run, variants: dict) -> bool:
    """``_attempt`` of ``run(name, kw)`` for each variant in turn, labelled ``label name``;
    stops (False) once the CUDA context is broken."""
    return all(_attempt(ctx, f"{label} {name}", functools.partial(run, name, kw))
               for name, kw in variants.items())


def make_context(budget_s: float = 3600.0):
    """A ``benchmarks.context.Context`` on the current GPU with both ceilings measured."""
    from ..context import Context
    from ..timing import (
        GRAPH_CALLS,
        REPLAYS,
        WARMUP,
        L2Flush,
        copy_ceiling,
        fp8_matmul_ceiling,
        l2_bytes,
    )
    dev = torch.device("cuda", torch.cuda.current_device())
    l2 = l2_bytes(dev)
    ctx = Context(device=dev, smoke=False, fast_backend="triton", l2_bytes=l2,
                         graph_calls=GRAPH_CALLS, warmup=WARMUP, replays=REPLAYS,
                         deadline=time.monotonic() + budget_s, reference=False, log=log)
    ctx.copy_gbps = copy_ceiling(dev)["gbps"]
    ctx.matmul_tflops = fp8_matmul_ceiling(dev)["tflops"]
    ctx.flush = L2Flush(dev, max(2 * l2, 256 << 20))
    log(f"copy {ctx.copy_gbps:.0f} GB/s, fp8 matmul {ctx.matmul_tflops:.0f} TFLOP/s, "
        f"L2 {l2 / 1e6:.0f} MB")
    return ctx


def ensure_pool(ctx, pages: int) -> None:
    from ..pool import PagePool
    if ctx.pool is None or ctx.pool.cache.shape[0] < pages:
        ctx.pool = None
        torch.cuda.empty_cache()
        ctx.pool = PagePool(pages, ctx.device, seed=0, log=log)
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------- prefill

def prefill_part(ctx, variants: dict, cases=None) -> None:
    from .. import workloads as wl
    for n, c, r in cases or PREFILL_CASES:
        if not _prefill_case(ctx, wl.PrefillCase(n, c, r), variants):
            return


def _prefill_case(ctx, case, variants: dict) -> bool:
    import nvfp4_indexer as ni
    from nvfp4_indexer.constants import TOPK
    from nvfp4_indexer.triton import prefill as tp

    from .. import workloads as wl
    from ..pool import random_index_q
    from ..prefill_suite import prefill_inputs
    tr = wl.prefill_traffic(case)
    _sl, width, tables, seq, cu = prefill_inputs(ctx, case, 2)
    q = random_index_q(case.new_tokens, case.num_heads, ctx.device, ctx.gen(case.name))
    mgp = ni.max_gather_pages(width * 128, case.new_tokens)
    base = {}

    def run(name, kw):
        cfg = config_of("prefill", kw)
        out = torch.full((case.new_tokens, case.num_heads, TOPK), -7, dtype=torch.int32,
                         device=ctx.device)
        tp.prefill_indexer(q, ctx.pool.cache, tables[0], cu, seq, mgp, out, config=cfg)
        torch.cuda.synchronize()
        base.setdefault("out", out.clone())
        same = float((out == base["out"]).all(-1).float().mean())
        t = ctx.time_uncapturable([functools.partial(
            tp.prefill_indexer, q, ctx.pool.cache, bt, cu, seq, mgp, out, config=cfg)
            for bt in tables])
        tflops = tr.flops / (t.us * 1e-6) / 1e12
        _record("prefill", case.name, name, t.us, tflops, "TFLOP/s", f"{same:.4f}",
                f"{tflops / ctx.matmul_tflops:.1%} of fp8 mm")

    return _attempt_all(ctx, f"prefill {case.name}", run, variants)


# -------------------------------------------------------------------------------- gather

def gather_part(ctx, variants: dict) -> None:
    from .. import workloads as wl
    for n, c, r in GATHER_CASES:
        if not _gather_case(ctx, wl.PrefillCase(n, c, r), variants):
            return


def gather_inputs(ctx, case) -> tuple:
    """A gather case's rotation slots and inputs from the pool, as the gather suite draws
    them: ``(traffic, slots, width, block tables (one per slot), seq lens, page offsets
    int32 [R + 1], max pages)``."""
    from nvfp4_indexer.reference.paging import history_pages

    from .. import workloads as wl
    from ..gather_suite import gather_slots
    from ..prefill_suite import prefill_inputs
    tr = wl.gather_traffic(case)
    slots = max(2, gather_slots(case, ctx.l2_bytes, ctx.graph_calls))
    sl, width, tables, seq, _cu = prefill_inputs(ctx, case, slots)
    counts = history_pages(seq)
    offsets = torch.zeros(len(sl) + 1, dtype=torch.int32, device=ctx.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return tr, slots, width, tables, seq, offsets, int(counts.max())


def _gather_case(ctx, case, variants: dict) -> bool:
    from nvfp4_indexer.triton.prefill import gather as tg
    tr, slots, _width, tables, seq, offsets, max_pages = gather_inputs(ctx, case)
    wss = [torch.full((tr.history_pages, 128, 128), 0x5A, dtype=torch.uint8,
                      device=ctx.device) for _ in range(slots)]
    base = {}

    def run(name, kw):
        cfg = config_of("gather", kw)
        ws0 = wss[0]
        ws0.fill_(0x5A)
        tg.gather_into(ctx.pool.cache, tables[0], seq, offsets, ws0, max_pages, config=cfg)
        torch.cuda.synchronize()
        base.setdefault("ws", ws0.clone())
        same = bool(torch.equal(ws0, base["ws"]))
        t = ctx.time_capturable([functools.partial(
            tg.gather_into, ctx.pool.cache, tables[i], seq, offsets, wss[i],
            max_pages, config=cfg) for i in range(slots)])
        _record_gbps(ctx, "gather", case.name, name, t, tr.bytes_moved, same, slots)

    return _attempt_all(ctx, f"gather {case.name}", run, variants)


# -------------------------------------------------------------------------------- insert

def insert_part(ctx, variants: dict) -> None:
    from nvfp4_indexer.triton import insert as ti

    from .. import workloads as wl
    from ..insert_suite import insert_inputs
    case = wl.InsertCase()
    tr, slots, pool, weight, cos_sin, inputs = insert_inputs(ctx, case)
    base = {}
    start = pool.cache.clone()

    def run(name, kw):
        cfg = config_of("insert", kw)
        pool.cache.copy_(start)
        ti.insert_index_k(pool.cache, *inputs[0], weight, cos_sin, case.rotary_dim, 1e-6,
                          config=cfg)
        torch.cuda.synchronize()
        base.setdefault("cache", pool.cache.clone())
        same = bool(torch.equal(pool.cache, base["cache"]))
        t = ctx.time_capturable([functools.partial(
            ti.insert_index_k, pool.cache, *x, weight, cos_sin, case.rotary_dim, 1e-6,
            config=cfg)
            for x in inputs])
        _record_gbps(ctx, "insert", case.name, name, t, tr.bytes_moved, same, slots)

    _attempt_all(ctx, "insert", run, variants)


def main(argv=None) -> int:
    ap = lab_parser(__doc__)
    ap.add_argument("--part", choices=("all", "prefill", "gather", "insert"), default="all")
    ap.add_argument("--all-cases", action="store_true",
                    help="prefill: every WORKLOADS.md prefill case, not the five default ones")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant,
                    metavar="NAME:KEY=VALUE,...",
                    help="an extra variant of the part's launcher, e.g. 'm64:block_m=64' or "
                         "'tb32:tok_block=32,page_parts=1,num_warps=4' (repeatable)")
    args = gpu_args(ap, argv, "knob_lab")
    from ..timing import environment
    env = environment(torch.device("cuda"))
    log(f"{env.get('gpu')} driver {env.get('driver')} torch {env.get('torch')} "
        f"triton {env.get('triton')} commit {env.get('git_commit')}")
    ctx = make_context()
    parts = ("insert", "gather", "prefill") if args.part == "all" else (args.part,)
    if "gather" in parts or "prefill" in parts:
        ensure_pool(ctx, 40_000)  # 369 MB: >= 6x L2, every case's slots disjoint
    for part in parts:
        log(f"part {part}")
        variants = {"prefill": PREFILL_VARIANTS, "gather": GATHER_VARIANTS,
                    "insert": INSERT_VARIANTS}[part]
        if args.variants:
            variants = {k: variants[k] for k in args.variants.split(",")}
        variants = {**variants, **dict(args.variant)}
        if part == "prefill":
            from ..workloads import prefill_cases
            cases = ([(c.new_tokens, c.context, c.num_reqs) for c in prefill_cases()]
                     if args.all_cases else None)
            prefill_part(ctx, variants, cases)
        elif part == "gather":
            gather_part(ctx, variants)
        else:
            insert_part(ctx, variants)
    print_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
