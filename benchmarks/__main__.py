"""``python -m benchmarks``: run the benchmark suites and write JSON, tables and a plot.

Examples::

    python -m benchmarks                          # every suite on the GPU (< 7 min on an H200)
    python -m benchmarks --quick                  # a representative subset (< 2 min)
    python -m benchmarks --suite decode-lowlat    # one suite
    python -m benchmarks --cpu-smoke              # every code path on CPU, tiny, no timing claims

Outputs (``--out DIR``, default ``out/benchmarks``, ``out/benchmarks-smoke`` with
``--cpu-smoke``): ``bench.json`` (rewritten after every case, so a run stopped early keeps what
it measured), ``tables.md`` and ``roofline.png``. Progress lines carry seconds since start and
are flushed as they happen. The plot needs matplotlib (checked before any work; ``--no-plot``
skips it). ``benchmarks`` is not installed with the package: run ``python -m benchmarks`` from
the repository root (with ``nvfp4_indexer`` installed, e.g. ``pip install -e .``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from . import SCHEMA
from .pool import PagePool
from .report import render_all, write_json
from .context import Context
from .suites import SUITE_FUNCS, SUITE_ORDER, pool_pages_for, run_suite, suite_cases, summarize
from .timing import (GRAPH_CALLS, REPLAYS, WARMUP, L2Flush, copy_ceiling, environment,
                     fp8_matmul_ceiling, l2_bytes, mm16_matmul_ceiling, stream_ceilings)

SMOKE_L2_BYTES = 64 * 1024  # stand-in "L2" so the smoke run exercises slot rotation
DEFAULT_BUDGET_S = {"all": 360.0, "quick": 100.0, "smoke": 120.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="all", choices=("all",) + SUITE_ORDER,
                   help="which suite to run (default: all, in the order "
                        + ", ".join(SUITE_ORDER) + ")")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny inputs on CPU with the reference backend (CI smoke; no timings)")
    p.add_argument("--quick", action="store_true", help="a representative subset (< 2 min)")
    p.add_argument("--smoke-backend", default="reference", choices=("reference", "triton"),
                   help="with --cpu-smoke: the backend of the timed paths; 'triton' runs the "
                        "Triton kernels under TRITON_INTERPRET=1 (slow; checks the calls)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default out/benchmarks, out/benchmarks-smoke)")
    p.add_argument("--json", type=Path, default=None, help="JSON path (default OUT/bench.json)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget; cases that would start later are recorded as "
                        "skipped (default 360 s, 100 s with --quick, 120 s with --cpu-smoke)")
    p.add_argument("--no-reference", action="store_true",
                   help="do not time the PyTorch reference (no speedups)")
    p.add_argument("--graph-calls", type=int, default=None,
                   help=f"calls captured per CUDA graph (default {GRAPH_CALLS})")
    p.add_argument("--replays", type=int, default=REPLAYS, help="timed graph replays")
    p.add_argument("--warmup", type=int, default=WARMUP, help="warm-up graph replays")
    p.add_argument("--seed", type=int, default=0, help="seed of keys, queries and page layout")
    p.add_argument("--allow-fp8-mma", action="store_true",
                   help="decode suites: DecodeIndexerWrapper(allow_fp8_mma=True); prefill and "
                        "engine suites: prefill_indexer / IndexerConfig(allow_fp8_mma=True): "
                        "E4M3 operands on SM90's FP8 tensor cores where faster (inexact: "
                        "SPEC 9 b = 5)")
    p.add_argument("--no-console", action="store_true", help="do not print the final tables")
    p.add_argument("--no-plot", action="store_true",
                   help="do not draw roofline.png (the only use of matplotlib)")
    args = p.parse_args(argv)
    if args.replays < 2 or args.warmup < 0:
        p.error("--replays must be >= 2 and --warmup >= 0")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        p.error("matplotlib is not installed (roofline.png): pip install 'matplotlib>=3.7' "
                "(or pip install 'nvfp4-indexer[demo]'), or pass --no-plot")
    return args


class Log:
    """Timestamped, flushed progress lines."""

    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = Log()
    smoke = args.cpu_smoke
    if smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny tensors: threads only contend (CI has 2 cores)
        if args.smoke_backend == "triton":  # before any nvfp4_indexer.triton import
            os.environ["TRITON_INTERPRET"] = "1"
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("python -m benchmarks: no CUDA device; run with --cpu-smoke for the CPU smoke "
              "test", file=sys.stderr)
        return 2
    out_dir = args.out or Path("out/benchmarks-smoke" if smoke else "out/benchmarks")
    json_path = args.json or out_dir / "bench.json"
    budget = args.budget_s or DEFAULT_BUDGET_S["smoke" if smoke else
                                               "quick" if args.quick else "all"]
    suites = SUITE_ORDER if args.suite == "all" else (args.suite,)
    l2 = SMOKE_L2_BYTES if smoke else l2_bytes(device)
    graph_calls = args.graph_calls or (6 if smoke else GRAPH_CALLS)

    env = environment(device)
    log(f"nvfp4_indexer benchmarks on {env.get('gpu') or 'CPU (smoke)'}: suites "
        f"{', '.join(suites)}{' (quick)' if args.quick else ''}, budget {budget:.0f} s")
    results = {
        "schema": SCHEMA, "mode": "cpu-smoke" if smoke else "gpu", "quick": args.quick,
        "env": env,
        "protocol": {"graph_calls": graph_calls, "warmup_replays": args.warmup,
                     "timed_replays": args.replays, "l2_bytes": l2, "l2_assumed": smoke,
                     "reuse_rule": "a page is re-read only after >= 2x L2 of other traffic",
                     "eager_flush_bytes": None, "budget_s": budget, "seed": args.seed},
        "ceilings": {}, "suites": {},
    }
    ctx = Context(device=device, smoke=smoke,
                  fast_backend=args.smoke_backend if smoke else "triton", l2_bytes=l2,
                  graph_calls=graph_calls, warmup=args.warmup, replays=args.replays,
                  deadline=log.t0 + budget, reference=not args.no_reference, seed=args.seed,
                  allow_fp8_mma=args.allow_fp8_mma, log=log)

    def save():
        write_json(results, json_path)

    def on_case(suite, recs):
        results["suites"][suite] = {
            "cases": recs, "summary": summarize(suite, recs, ctx, len(cases_by_suite[suite]))}
        save()
    ctx.on_case = on_case

    log("ceiling: device-to-device copy ...")
    results["ceilings"]["copy"] = copy_ceiling(device)
    ctx.copy_gbps = results["ceilings"]["copy"]["gbps"]
    log(f"  copy: {ctx.copy_gbps:.0f} GB/s (read + write)")
    log("ceiling: read-only (x.sum()) and write-only (y.fill_) bandwidth ...")
    results["ceilings"]["stream"] = st = stream_ceilings(device)
    ctx.read_gbps, ctx.write_gbps = st["read_gbps"], st["write_gbps"]
    log(f"  read-only: {ctx.read_gbps:.0f} GB/s, write-only: {ctx.write_gbps:.0f} GB/s")
    log("ceiling: FP8 matmul (torch._scaled_mm) ...")
    results["ceilings"]["fp8_matmul"] = mm = fp8_matmul_ceiling(device)
    ctx.matmul_tflops = mm["tflops"]
    log(f"  fp8 matmul: {mm['tflops'] or float('nan'):.1f} TFLOP/s ({mm['best']})"
        + (" [fp32 stand-in]" if mm["stand_in"] else ""))
    log("ceiling: 16-bit matmul (torch.matmul fp16 / bf16) ...")
    results["ceilings"]["mm16_matmul"] = m16 = mm16_matmul_ceiling(device)
    ctx.mm16_tflops = m16["tflops"]
    per_dtype = ", ".join(f"{k} {v['tflops']:.1f}" if "tflops" in v else f"{k} failed"
                          for k, v in m16["variants"].items())
    log(f"  16-bit matmul: {m16['tflops'] or float('nan'):.1f} TFLOP/s ({m16['best']}; "
        f"{per_dtype})" + (" [fp32 stand-in]" if m16["stand_in"] else ""))
    flush_bytes = max(2 * l2, 256 << 20) if device.type == "cuda" else 4 * l2
    ctx.flush = L2Flush(device, flush_bytes)
    results["protocol"]["eager_flush_bytes"] = flush_bytes
    save()

    cases_by_suite = {s: suite_cases(s, quick=args.quick, smoke=smoke) for s in suites}
    pages = pool_pages_for(cases_by_suite, l2, graph_calls)
    if any(s != "insert" for s in suites):
        log(f"page pool: {pages} pages ({pages * 9216 / 1e9:.2f} GB), filling with random "
            "NVFP4 keys through write_index_k ...")
        ctx.pool = PagePool(pages, device, seed=args.seed, log=log)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log(f"  pool ready (write path: {ctx.pool.fill_backend})")
        results["protocol"]["pool_pages"] = pages
        results["protocol"]["pool_fill_backend"] = ctx.pool.fill_backend

    for suite in suites:
        cases = cases_by_suite[suite]
        log(f"suite {suite}: {len(cases)} cases")
        recs = run_suite(ctx, suite, cases, SUITE_FUNCS[suite])
        results["suites"][suite] = {"cases": recs,
                                    "summary": summarize(suite, recs, ctx, len(cases))}
        save()

    results["wall_s"] = round(time.monotonic() - log.t0, 1)
    results["errors"] = ctx.errors
    save()
    files = render_all(results, out_dir, console=not args.no_console, plot=not args.no_plot)
    written = [str(json_path), files["markdown"]] + ([files["roofline"]] if "roofline" in files
                                                     else [])
    log(f"wrote {', '.join(written)}; {ctx.errors} errors, {results['wall_s']:.1f} s")
    if "roofline_error" in files:
        print(f"python -m benchmarks: error: roofline.png not written: "
              f"{files['roofline_error']}", file=sys.stderr)
        return 1
    return 0 if ctx.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
