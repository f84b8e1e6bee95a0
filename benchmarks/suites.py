"""The benchmark suites: build inputs, check the outputs once, time, and record one dict per
case (the JSON schema is documented in docs/performance.md).

Paths timed (GPU):
- decode-full / decode-lowlat / decode-variants / decode-engine-width: the public
  ``DecodeIndexerWrapper`` (``plan()`` outside, ``run()`` captured in CUDA graphs), one
  wrapper per rotation slot; decode-engine-width times block tables 8192 pages wide (an
  engine's ``max_model_len`` of 1M tokens) and the same contexts at their natural width.
- prefill: the Triton entry point the public API dispatches to
  (``nvfp4_indexer.triton.prefill.prefill_indexer``), timed eagerly with an L2 flush before
  each call (it plans on the host from device values, so it cannot be captured); the public
  API call (validation included) is timed too (``api_us``), and the same requests as one
  prefill-only ``Indexer`` step (``plan`` outside, ``forward`` eager after a flush:
  ``indexer_us``; the planned forward replayed from a CUDA graph: ``indexer_kernels_us``).
- gather: the kernel launcher ``nvfp4_indexer.triton.prefill.gather.gather_into`` captured in CUDA
  graphs over rotated block tables, each slot with its own workspace; the public
  ``gather_index_k_fp8`` (which sizes the workspace with a host sync) eagerly (``api_us``).
- insert: ``nvfp4_indexer.triton.insert.insert_index_k`` captured in CUDA graphs over rotated
  inputs (eager + flush if capture fails), plus the public API call (``api_us``).
- the PyTorch reference (``backend="reference"``) on the same GPU and inputs, for cases under
  the reference caps, wall clock with a sync (``ref_us``, ``speedup`` = ref_us / us).
In ``--cpu-smoke`` every fast path is the reference backend on tiny inputs.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback
from typing import Callable

import torch

from . import workloads as wl
from .context import Context
from .decode_suite import decode_case
from .engine_suite import engine_case
from .gather_suite import gather_case, gather_slots
from .insert_suite import insert_case
from .prefill_suite import prefill_case
from .timing import rotation_slots

# Targets, reported next to the measurements (the tool measures; it does not gate).
TARGET_DECODE_WEIGHTED = 0.85
TARGET_DECODE_BIG_CASE = wl.TARGET_DECODE_BIG_CASE
TARGET_LOWLAT_US = 6.0
TARGET_LOWLAT_CASE = "b1_s32000_q8_h4"
TARGET_PREFILL_MATMUL = 0.50
TARGET_COPY_GATHER_INSERT = 0.80
# Engine steps: plan host time of decode-only / mixed steps, mixed forward / kernels
TARGET_ENGINE_DECODE_PLAN_US = 30.0
TARGET_ENGINE_MIXED_PLAN_US = 100.0
TARGET_ENGINE_MIXED_OVER_KERNELS = 1.10
# Engine-width decode: a block table as wide as max_model_len costs at most this over the
# same contexts at their natural width
TARGET_ENGINE_WIDTH_OVER_NATURAL = 1.05

# ---------------------------------------------------------------------------------------------
# Suites

def _case_fields(case) -> dict:
    return {"name": case.name}


def run_suite(ctx: Context, suite: str, cases: list, fn: Callable) -> list[dict]:
    """Run ``fn(ctx, case)`` per case; errors and skips become records, never exceptions."""
    recs: list[dict] = []
    for i, case in enumerate(cases):
        base = {"suite": suite, **_case_fields(case)}
        if ctx.cuda_broken:
            recs.append({**base, "status": "skipped: CUDA context failed earlier"})
            continue
        if ctx.time_left() <= 0:
            recs.append({**base, "status": "skipped: time budget (--budget-s)"})
            continue
        t0 = time.monotonic()
        try:
            rec = {**base, **fn(ctx, case), "status": "ok"}
        except Exception as e:  # noqa: BLE001 - one broken case must not end the run
            ctx.errors += 1
            tb = traceback.format_exc(limit=6)
            rec = {**base, "status": "error", "error": f"{type(e).__name__}: {e}",
                   "traceback": tb}
            ctx.log(f"  ERROR {suite}/{case.name}: {type(e).__name__}: {str(e)[:300]}")
            ctx.check_cuda()
        rec["wall_s"] = round(time.monotonic() - t0, 3)
        recs.append(rec)
        ctx.log(f"  [{i + 1}/{len(cases)}] {suite}/{case.name}: {one_line(rec)}")
        ctx.on_case(suite, recs)
        if ctx.cuda:
            torch.cuda.empty_cache()
    return recs


def _shares(rec: dict, first: tuple[str, str], second: tuple[str, str]) -> str:
    """`` (a% first[, b% second])`` of the record's ratios; empty when ``first`` is absent."""
    shown = [f"{100 * rec[k]:.0f}% {label}" for k, label in (first, second)
             if rec.get(k) is not None]
    return f" ({', '.join(shown)})" if rec.get(first[0]) is not None else ""


def one_line(rec: dict) -> str:
    if rec.get("status") != "ok":
        return rec.get("status", "?")
    s = f"{rec['us']:.2f} us, {rec['gbps']:.0f} GB/s"
    s += _shares(rec, ("copy_ratio", "copy"), ("mix_ratio", "mix"))
    if rec.get("tflops"):
        s += f", {rec['tflops']:.1f} TFLOP/s"
        s += _shares(rec, ("matmul_ratio", "fp8 mm"), ("mm16_ratio", "16-bit mm"))
    if rec.get("speedup"):
        s += f", {rec['speedup']:.1f}x vs reference"
    s += f" [{rec['timing']['method']}, {rec['wall_s']:.1f}s]"
    return s


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(suite: str, recs: list[dict], ctx: Context, expected: int) -> dict:
    """Suite-level numbers: weighted means, flags, target status, reference speedups."""
    ok = [r for r in recs if r.get("status") == "ok"]
    s = {"cases": len(recs), "ok": len(ok), "errors": sum(r.get("status") == "error"
                                                          for r in recs),
         "skipped": sum(str(r.get("status", "")).startswith("skipped") for r in recs),
         "complete": len(ok) == expected and expected > 0,
         "speedup_geomean": _geomean([r.get("speedup") for r in ok])}
    if suite in ("decode-full", "decode-variants"):
        groups = {}
        for r in ok:
            groups.setdefault(f"q{r['query_len']}_h{r['num_heads']}", []).append(r)
        s["groups"] = {}
        for key, rs in groups.items():
            wsum = sum(r["weight"] for r in rs)
            g = {"cases": len(rs), "weight_sum": wsum}
            if wsum:
                g["weighted_mean_gbps"] = sum(r["weight"] * r["gbps"] for r in rs) / wsum
                g["aggregate_gbps"] = (sum(r["weight"] * r["bytes_moved"] for r in rs)
                                       / sum(r["weight"] * r["us"] for r in rs) / 1e3)
                if ctx.copy_gbps:
                    g["weighted_mean_copy_ratio"] = g["weighted_mean_gbps"] / ctx.copy_gbps
                    g["aggregate_copy_ratio"] = g["aggregate_gbps"] / ctx.copy_gbps
            big = [r for r in rs if r["pages_bytes"] >= wl.FLAG_PAGES_BYTES]
            g["big_cases"] = len(big)
            g["big_cases_under_75pct"] = [r["name"] for r in big
                                          if r.get("copy_ratio") is not None
                                          and r["copy_ratio"] < TARGET_DECODE_BIG_CASE]
            g["full_grid"] = len(rs) == len(wl.full_cases()) and wsum == 10_000
            if ctx.copy_gbps and wsum and not ctx.smoke:
                g["target_weighted_085"] = g["weighted_mean_copy_ratio"] >= TARGET_DECODE_WEIGHTED
                g["target_no_big_case_under_075"] = not g["big_cases_under_75pct"]
            s["groups"][key] = g
    elif suite == "decode-lowlat":
        s["us"] = {r["name"]: r["us"] for r in ok}
        tgt = next((r for r in ok if r["name"] == TARGET_LOWLAT_CASE), None)
        if tgt is not None and not ctx.smoke:
            s["target_case"] = TARGET_LOWLAT_CASE
            s["target_case_us"] = tgt["us"]
            s["target_le_6us"] = tgt["us"] <= TARGET_LOWLAT_US
    elif suite == "decode-engine-width":
        over = [r["over_natural"] for r in ok if r.get("over_natural")]
        s["us"] = {r["name"]: r["us"] for r in ok}
        if over:
            worst = max((r for r in ok if r.get("over_natural")),
                        key=lambda r: r["over_natural"])
            s["over_natural_max"], s["worst_case"] = worst["over_natural"], worst["name"]
            s["within_5pct"] = sum(x <= TARGET_ENGINE_WIDTH_OVER_NATURAL for x in over)
            s["cases_compared"] = len(over)
    elif suite == "prefill":
        ratios = [r["matmul_ratio"] for r in ok if r.get("matmul_ratio") is not None]
        if ratios:
            top = max(ok, key=lambda r: r["flops"])
            s["matmul_ratio_max"] = max(ratios)
            s["largest_case"] = top["name"]
            s["largest_case_matmul_ratio"] = top.get("matmul_ratio")
            s["cases_at_or_above_50pct"] = sum(x >= TARGET_PREFILL_MATMUL for x in ratios)
        mm16 = [r["mm16_ratio"] for r in ok if r.get("mm16_ratio") is not None]
        if mm16:  # share of the 16-bit matmul rate (the exact path's fp16 tensor cores)
            s["mm16_ratio_max"] = max(mm16)
            s["largest_case_mm16_ratio"] = max(ok, key=lambda r: r["flops"]).get("mm16_ratio")
    elif suite == "engine":
        dec = [r for r in ok if not r.get("prefills")]
        mixed = [r for r in ok if r.get("prefills")]

        def within(rs, key, limit):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return {"cases": len(vals), "within": sum(x <= limit for x in vals),
                    "max": max(vals) if vals else None,
                    "median": statistics.median(vals) if vals else None}
        s["decode_plan_us"] = within(dec, "plan_us", TARGET_ENGINE_DECODE_PLAN_US)
        s["decode_plan_in_place_us"] = within(dec, "plan_in_place_us",
                                              TARGET_ENGINE_DECODE_PLAN_US)
        s["decode_forward_over_kernels"] = within(dec, "forward_over_kernels", 1.02)  # equal
        s["mixed_plan_us"] = within(mixed, "plan_us", TARGET_ENGINE_MIXED_PLAN_US)
        s["mixed_forward_over_kernels"] = within(mixed, "forward_over_kernels",
                                                 TARGET_ENGINE_MIXED_OVER_KERNELS)
    elif suite in ("gather", "insert"):
        ratios = [r["copy_ratio"] for r in ok if r.get("copy_ratio") is not None]
        if ratios:
            top = max(ok, key=lambda r: r["bytes_moved"])
            s["largest_case"] = top["name"]
            s["largest_case_copy_ratio"] = top.get("copy_ratio")
            s["largest_case_mix_ratio"] = top.get("mix_ratio")  # an extra column, no target
            s["cases_at_or_above_80pct"] = sum(x >= TARGET_COPY_GATHER_INSERT for x in ratios)
    return s


SUITE_ORDER = ("decode-full", "decode-lowlat", "prefill", "gather", "insert", "decode-variants",
               "engine", "decode-engine-width")


SUITE_FUNCS = {"decode-full": decode_case, "decode-lowlat": decode_case,
               "decode-engine-width": decode_case,
               "decode-variants": decode_case, "prefill": prefill_case,
               "gather": gather_case, "insert": insert_case, "engine": engine_case}


def suite_cases(suite: str, *, quick: bool, smoke: bool) -> list:
    """The cases of ``suite`` for this mode (WORKLOADS.md sizes; tiny ones in smoke)."""
    if smoke:
        return wl.smoke_cases()[suite]
    cases = {"decode-full": wl.full_cases, "decode-lowlat": wl.lowlat_cases,
             "decode-variants": wl.variant_cases, "prefill": wl.prefill_cases,
             "gather": wl.prefill_cases, "insert": wl.insert_cases,
             "engine": wl.engine_cases, "decode-engine-width": wl.engine_width_cases}[suite]()
    return wl.quick_filter(cases, suite) if quick else cases


def pool_pages_for(cases_by_suite: dict[str, list], l2: int, graph_calls: int) -> int:
    """Pages the shared pool needs so every case gets its rotation slots (>= 1 page)."""
    need = 1
    for suite, cases in cases_by_suite.items():
        for c in cases:
            if isinstance(c, wl.DecodeCase):
                sl = c.seq_lens()
                tr = wl.decode_traffic(sl, c.query_len, c.num_heads)
                slots = rotation_slots(tr.pages_bytes, l2, graph_calls)
            elif hasattr(c, "pool_pages"):  # engine steps: one block table
                need = max(need, c.pool_pages())
                continue
            elif isinstance(c, wl.PrefillCase):
                sl, slots = c.seq_lens(), 2
                if suite == "gather":
                    slots = gather_slots(c, l2, graph_calls)
            else:
                continue
            need = max(need, slots * sum(wl.pages_needed(s) for s in sl))
    return need
