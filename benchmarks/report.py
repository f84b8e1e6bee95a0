"""Reports: a rich table per suite on the terminal, the same tables as Markdown (for
docs/performance.md), the JSON record, and a roofline plot (PNG).

Every function takes the results dict that ``python -m benchmarks`` builds (and writes as
JSON), so a saved JSON can be re-rendered: ``python -m benchmarks.report bench.json OUTDIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable

# ---------------------------------------------------------------------------------------------
# Columns: (header, function of a case record -> str)


def _f(x, fmt="{:.1f}", none="-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return fmt.format(x)


def _pct(x) -> str:
    return _f(None if x is None else 100 * x, "{:.0f}%")


def _ref_ms(r) -> str:
    return _f(r["ref_us"] / 1e3, "{:.2f}") if r.get("ref_us") else "-"


def _eq(r) -> str:
    for key in ("rows_equal_reference", "tokens_equal_reference"):
        if key in r:
            return _pct(r[key]) if r[key] < 1 else "100%"
    if "equal_reference" in r:
        return "yes" if r["equal_reference"] else "NO"
    return "-"


def _decode_note(r) -> str:
    notes = []
    if r.get("flag_big_under_75"):
        notes.append("FLAG <75%")
    if r.get("out_fully_written") is False:
        notes.append("UNWRITTEN")
    if r.get("graph_replay_equals_eager") is False:
        notes.append("REPLAY!=EAGER")
    if r.get("reuse_over_l2") is not None and r["reuse_over_l2"] < 2:
        notes.append("warm<2xL2")
    if r.get("timing", {}).get("note"):
        notes.append("eager")
    return " ".join(notes)


def _plain(*header_keys: tuple[str, str]) -> list[tuple[str, Callable]]:
    """Columns ``(header, record key)`` that print the record's value as it is."""
    return [(h, lambda r, k=k: str(r[k])) for h, k in header_keys]


# columns several suites share
CASE_COL = ("case", lambda r: r["name"])
PAGES_MB_COL = ("pages MB", lambda r: _f(r["pages_bytes"] / 1e6))
US_COL = ("us/call", lambda r: _f(r["us"], "{:.1f}"))
GBPS_COL = ("GB/s", lambda r: _f(r["gbps"], "{:.0f}"))
COPY_COL = ("% copy", lambda r: _pct(r.get("copy_ratio")))
BANDWIDTH_COLS = [GBPS_COL, COPY_COL, ("% mix", lambda r: _pct(r.get("mix_ratio")))]
API_COL = ("api us", lambda r: _f(r.get("api_us"), "{:.1f}"))
REF_COLS = [("ref ms", _ref_ms), ("speedup", lambda r: _f(r.get("speedup"), "{:.0f}x")),
            ("= ref", _eq)]

DECODE_COLS: list[tuple[str, Callable]] = [
    CASE_COL,
    *_plain(("B", "batch"), ("S", "nominal"), ("Q", "query_len"), ("H", "num_heads"),
            ("weight", "weight")),
    PAGES_MB_COL,
    *_plain(("slots", "slots")),
    ("reuse/L2", lambda r: _f(r.get("reuse_over_l2"))),
    ("us/call", lambda r: _f(r["us"], "{:.2f}")),
    GBPS_COL, COPY_COL,
    ("TFLOP/s", lambda r: _f(r.get("tflops"))),
    *REF_COLS,
    ("note", _decode_note),
]
ENGINE_WIDTH_COLS: list[tuple[str, Callable]] = [
    CASE_COL,
    *_plain(("B", "batch"), ("S", "nominal"), ("W", "width"), ("natural W", "natural_width")),
    PAGES_MB_COL,
    ("us/call", lambda r: _f(r["us"], "{:.2f}")),
    ("natural us", lambda r: _f(r.get("natural_us"), "{:.2f}")),
    ("wide/natural", lambda r: _f(r.get("over_natural"), "{:.2f}")),
    COPY_COL,
    ("same output", lambda r: "-" if r.get("natural_equal") is None
     else str(r["natural_equal"])),
    *REF_COLS,
]
PREFILL_COLS = [
    CASE_COL,
    *_plain(("new", "new_tokens"), ("ctx", "context"), ("R", "num_reqs")),
    PAGES_MB_COL,
    ("GFLOP", lambda r: _f(r["flops"] / 1e9)),
    US_COL,
    ("TFLOP/s", lambda r: _f(r.get("tflops"))),
    ("% fp8 mm", lambda r: _pct(r.get("matmul_ratio"))),
    ("% 16-bit mm", lambda r: _pct(r.get("mm16_ratio"))),
    GBPS_COL,
    API_COL,
    ("Indexer us", lambda r: _f(r.get("indexer_us"), "{:.1f}")),
    ("% 16-bit (Indexer)", lambda r: _pct(r.get("indexer_mm16_ratio"))),
    ("graph us", lambda r: _f(r.get("indexer_kernels_us"), "{:.1f}")),
    ("% 16-bit (graph)", lambda r: _pct(r.get("indexer_kernels_mm16_ratio"))),
    *REF_COLS,
]
GATHER_COLS = [
    CASE_COL,
    *_plain(("pages", "history_pages")),
    ("MB moved", lambda r: _f(r["bytes_moved"] / 1e6)),
    US_COL,
    *BANDWIDTH_COLS,
    API_COL,
    *REF_COLS,
]
INSERT_COLS = [
    CASE_COL,
    *_plain(("tokens", "tokens")),
    ("MB moved", lambda r: _f(r["bytes_moved"] / 1e6, "{:.2f}")),
    *_plain(("slots", "slots")),
    US_COL,
    *BANDWIDTH_COLS,
    ("method", lambda r: r["timing"]["method"]),
    API_COL,
    *REF_COLS,
]
ENGINE_COLS = [
    CASE_COL,
    ("rows", lambda r: str(r["rows"])),
    ("chunks", lambda r: str(r.get("prefill_chunks", 0))),
    ("plan us", lambda r: f"{r['plan_us']:.1f}"),
    ("in place", lambda r: f"{r['plan_in_place_us']:.1f}" if "plan_in_place_us" in r else "-"),
    ("forward us", lambda r: f"{r['us']:.1f}"),
    ("kernels us", lambda r: f"{r['kernels_us']:.1f}"),
    ("warm us", lambda r: f"{r['kernels_warm_us']:.1f}" if "kernels_warm_us" in r else "-"),
    ("fwd/kern", lambda r: "-" if r.get("forward_over_kernels") is None
     else f"{r['forward_over_kernels']:.2f}"),
    ("step us", lambda r: f"{r['step_us']:.1f}"),
    ("method", lambda r: r["timing"]["method"]),
    ("= ref", lambda r: "-" if r.get("rows_equal_reference") is None
     else f"{100 * r['rows_equal_reference']:.0f}%"),
]


SUITE_COLS = {"decode-full": DECODE_COLS, "decode-lowlat": DECODE_COLS,
              "decode-variants": DECODE_COLS, "prefill": PREFILL_COLS,
              "gather": GATHER_COLS, "insert": INSERT_COLS, "engine": ENGINE_COLS,
              "decode-engine-width": ENGINE_WIDTH_COLS}
TITLES = {
    "decode-full": "Decode, full suite (Q8KV4 + fused top-k; 28 weighted cases)",
    "decode-lowlat": "Decode, low-latency suite (graph-replay latency per call)",
    "decode-variants": "Decode variants (Q = 1 with H = 4; H = 1, 2 with Q = 8)",
    "prefill": "Prefill scoring + top-k (Q8KV8)",
    "gather": "Gather: NVFP4 pages -> FP8 workspace",
    "insert": "Insert: fused norm + RoPE + NVFP4 quantize + paged write",
    "engine": "Engine steps: Indexer.plan host time + forward device time (SPEC 8.1)",
    "decode-engine-width": "Decode with engine-width block tables (max_model_len 1M = 8192 "
                           "pages) against the same contexts at their natural width",
}


def rows(suite: str, recs: list[dict]) -> tuple[list[str], list[list[str]], list[str]]:
    """Headers, table rows of the ok cases, and one line per error/skip."""
    cols = SUITE_COLS[suite]
    body, other = [], []
    for r in recs:
        if r.get("status") == "ok":
            body.append([fn(r) for _, fn in cols])
        else:
            other.append(f"{r.get('name')}: {r.get('status')}"
                         + (f" ({r['error'][:200]})" if r.get("error") else ""))
    return [h for h, _ in cols], body, other


def summary_lines(suite: str, summary: dict, results: dict) -> list[str]:
    """Plain-language summary of a suite with its targets next to the numbers."""
    out = [f"{summary.get('ok', 0)}/{summary.get('cases', 0)} cases ok"
           + (f", {summary['errors']} errors" if summary.get("errors") else "")
           + (f", {summary['skipped']} skipped" if summary.get("skipped") else "")]
    copy = (results.get("ceilings", {}).get("copy") or {}).get("gbps")
    for key, g in (summary.get("groups") or {}).items():
        line = f"{key}: {g['cases']} cases, weight {g['weight_sum']}"
        if "weighted_mean_gbps" in g:
            line += (f"; weighted mean {g['weighted_mean_gbps']:.0f} GB/s"
                     + (f" = {100 * g['weighted_mean_copy_ratio']:.1f}% of copy {copy:.0f} GB/s"
                        if copy else "")
                     + f"; aggregate (sum w*bytes / sum w*time) {g['aggregate_gbps']:.0f} GB/s")
        if "target_weighted_085" in g:
            full = "" if g.get("full_grid") else " [subset: not the full-suite metric]"
            line += (f"; target >= 85%: {'met' if g['target_weighted_085'] else 'NOT met'}"
                     f"; cases >= 256 MB under 75%: "
                     f"{', '.join(g['big_cases_under_75pct']) or 'none'}{full}")
        out.append(line)
    if "target_case_us" in summary:
        out.append(f"{summary['target_case']}: {summary['target_case_us']:.2f} us/call "
                   f"(target <= 6 us: {'met' if summary['target_le_6us'] else 'NOT met'})")
    if "largest_case_matmul_ratio" in summary:
        mm16 = "mm16_ratio_max" in summary  # absent from runs before the 16-bit ceiling
        out.append(f"largest case {summary['largest_case']}: "
                   f"{_pct(summary['largest_case_matmul_ratio'])} of the FP8 matmul rate"
                   + (f" ({_pct(summary['largest_case_mm16_ratio'])} of the 16-bit matmul "
                      "rate)" if mm16 else "")
                   + f"; best {_pct(summary['matmul_ratio_max'])}"
                   + (f" ({_pct(summary['mm16_ratio_max'])} of 16-bit)" if mm16 else "")
                   + f"; cases >= 50%: {summary['cases_at_or_above_50pct']}")
    if "largest_case_copy_ratio" in summary:
        mix = summary.get("largest_case_mix_ratio")
        out.append(f"largest case {summary['largest_case']}: "
                   f"{_pct(summary['largest_case_copy_ratio'])} of copy bandwidth"
                   + (f" ({_pct(mix)} of the read/write mix ceiling)" if mix is not None
                      else "")
                   + f"; cases >= 80%: {summary['cases_at_or_above_80pct']}")
    if summary.get("speedup_geomean"):
        out.append(f"speedup vs the PyTorch reference (geometric mean over timed cases): "
                   f"{summary['speedup_geomean']:.0f}x")
    return out


def env_lines(results: dict) -> list[str]:
    env = results.get("env", {})
    c = results.get("ceilings", {})
    copy = (c.get("copy") or {}).get("gbps")
    mm = c.get("fp8_matmul") or {}
    st = c.get("stream") or {}
    m16 = c.get("mm16_matmul") or {}
    m16_dtypes = ", ".join(f"{k} {_f(v.get('tflops'), '{:.0f}')}"
                           for k, v in (m16.get("variants") or {}).items())
    lines = [
        f"mode: {results.get('mode')}{' (quick subset)' if results.get('quick') else ''}",
        f"device: {env.get('gpu') or env.get('cpu')} "
        f"(cc {env.get('gpu_capability', '-')}, {env.get('gpu_sms', '-')} SMs, "
        f"L2 {_f((env.get('gpu_l2_bytes') or 0) / 1e6, '{:.0f}')} MB), "
        f"driver {env.get('driver', '-')}",
        f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, "
        f"python {env.get('python')}",
        f"commit {env.get('git_commit') or 'unknown'}"
        f"{' (dirty)' if env.get('git_dirty') else ''}, sources sha256 "
        f"{env.get('source_sha256_16')}, date {env.get('date_utc')}",
        f"ceilings: device-to-device copy {_f(copy, '{:.0f}')} GB/s (read + write)"
        # the read / write and 16-bit ceilings are absent from runs recorded before them
        + (f", read-only {_f(st.get('read_gbps'), '{:.0f}')} GB/s, "
           f"write-only {_f(st.get('write_gbps'), '{:.0f}')} GB/s" if st else "")
        + f"; FP8 matmul ({mm.get('best')}) {_f(mm.get('tflops'), '{:.0f}')} TFLOP/s"
        + (" [fp32 stand-in]" if mm.get("stand_in") else "")
        + (f"; 16-bit matmul ({m16.get('best')}) {_f(m16.get('tflops'), '{:.0f}')} TFLOP/s "
           f"({m16_dtypes})" if m16 else "")
        + (" [fp32 stand-in]" if m16.get("stand_in") else ""),
    ]
    if results.get("mode") == "cpu-smoke":
        lines.insert(0, "CPU SMOKE RUN: tiny inputs, reference backend - NOT a measurement")
    return lines


# ---------------------------------------------------------------------------------------------
# Renderers

def print_tables(results: dict, file=None) -> None:
    """One rich table per suite, with the environment and summaries (plain text fallback)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is in the test extra and on the GPU image
        print(markdown(results), file=file or sys.stdout)
        return
    con = Console(file=file, width=200)
    for line in env_lines(results):
        con.print(line, highlight=False)
    for suite, data in results.get("suites", {}).items():
        headers, body, other = rows(suite, data.get("cases", []))
        t = Table(title=TITLES.get(suite, suite), title_justify="left")
        for h in headers:
            t.add_column(h, justify="left" if h in ("case", "note", "method") else "right")
        for row in body:
            t.add_row(*row)
        con.print(t)
        for line in other:
            con.print(f"  {line}", highlight=False)
        for line in summary_lines(suite, data.get("summary", {}), results):
            con.print(f"  {line}", highlight=False)


def markdown(results: dict) -> str:
    """The same tables as Markdown, with the environment block (for docs/performance.md)."""
    out = ["```"] + env_lines(results) + ["```", ""]
    for suite, data in results.get("suites", {}).items():
        headers, body, other = rows(suite, data.get("cases", []))
        out.append(f"### {TITLES.get(suite, suite)}")
        out.append("")
        out.append("| " + " | ".join(headers) + " |")
        out.append("|" + "|".join("---" for _ in headers) + "|")
        out.extend("| " + " | ".join(r) + " |" for r in body)
        out.append("")
        out.extend(f"- {line}" for line in other + summary_lines(
            suite, data.get("summary", {}), results))
        out.append("")
    return "\n".join(out)


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(path)


_STYLE = {"decode-full": ("o", "tab:blue"), "decode-lowlat": ("v", "tab:cyan"),
          "decode-variants": ("D", "tab:purple"), "prefill": ("s", "tab:red"),
          "gather": ("^", "tab:green"), "insert": ("P", "tab:orange"),
          "decode-engine-width": ("x", "tab:gray")}


def roofline(results: dict, path: Path) -> Path:
    """Two panels: (left) roofline - achieved TFLOP/s against arithmetic intensity with the
    measured copy-bandwidth slope and the FP8 (solid) and 16-bit (dashed) matmul roofs;
    (right) achieved GB/s against bytes moved per call with the copy ceiling and the 85 / 80 /
    75 % lines. Saved as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = results.get("ceilings", {})
    copy = (c.get("copy") or {}).get("gbps")
    mm = (c.get("fp8_matmul") or {}).get("tflops")
    mm16 = (c.get("mm16_matmul") or {}).get("tflops")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    xs_all = []
    for suite, data in results.get("suites", {}).items():
        ok = [r for r in data.get("cases", []) if r.get("status") == "ok"]
        marker, color = _STYLE.get(suite, ("x", "k"))
        pts = [(r["intensity_flop_per_byte"], r["tflops"]) for r in ok if r.get("flops")]
        if pts:
            xs_all += [p[0] for p in pts]
            ax1.scatter(*zip(*pts), marker=marker, color=color, label=suite, alpha=0.8)
        pts2 = [(r["bytes_moved"], r["gbps"]) for r in ok if suite != "prefill"]
        if pts2:
            ax2.scatter(*zip(*pts2), marker=marker, color=color, label=suite, alpha=0.8)
    lo = min(xs_all + [1.0]) / 2
    hi = max(xs_all + [1e4]) * 2
    if copy and mm:
        import numpy as np
        x = np.geomspace(lo, hi, 200)
        ax1.plot(x, np.minimum(mm, copy * x / 1e3), "k-", lw=1.2,
                 label=f"roof: copy {copy:.4g} GB/s, FP8 matmul {mm:.4g} TFLOP/s")
        if mm16:
            ax1.plot(x, np.minimum(mm16, copy * x / 1e3), "k--", lw=1,
                     label=f"roof: copy, 16-bit matmul {mm16:.4g} TFLOP/s")
    ax1.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / necessary byte)",
            ylabel="achieved TFLOP/s (2*128*rows*tokens scored / time)", title="Roofline")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    if copy:
        for frac, style in ((1.0, "k-"), (0.85, "k--"), (0.80, "k-."), (0.75, "k:")):
            ax2.axhline(copy * frac, color="k", ls=style[1:], lw=1,
                        label=f"{int(frac * 100)}% of copy ({copy * frac:.0f} GB/s)")
    ax2.set(xscale="log", xlabel="necessary bytes per call", ylabel="achieved GB/s",
            title="Bandwidth (memory-bound ops) against the measured copy")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    env = results.get("env", {})
    title = (f"nvfp4_indexer benchmarks - {env.get('gpu') or env.get('cpu')}, "
             f"torch {env.get('torch')}, triton {env.get('triton')}, "
             f"commit {(env.get('git_commit') or 'unknown')[:12]}, {env.get('date_utc')}")
    if results.get("mode") == "cpu-smoke":
        title = "CPU SMOKE (not a measurement) - " + title
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_all(results: dict, out_dir: Path, *, console: bool = True,
               plot: bool = True) -> dict:
    """Write tables.md and (``plot``) roofline.png under ``out_dir`` (and print the tables).
    Returns the paths written (``markdown``, ``roofline``); a plot failure is returned as
    ``roofline_error`` (the tables are kept) for the caller to report and fail on."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "tables.md"
    md.write_text(markdown(results) + "\n")
    files = {"markdown": str(md)}
    if plot:
        try:
            files["roofline"] = str(roofline(results, out_dir / "roofline.png"))
        except Exception as e:  # noqa: BLE001 - a plot failure must not lose the tables
            files["roofline_error"] = f"{type(e).__name__}: {e}"
    if console:
        print_tables(results)
    return files


def main(argv=None) -> int:
    """``python -m benchmarks.report BENCH_JSON OUT_DIR``: re-render a saved run (tables,
    Markdown, JSON, roofline plot). Exit status 1 when the plot failed, 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                 description="Re-render a saved benchmark run.")
    ap.add_argument("bench_json", type=Path, help="the JSON record python -m benchmarks wrote")
    ap.add_argument("out_dir", type=Path, help="folder for the tables and the plot")
    args = ap.parse_args(argv)
    data = json.loads(args.bench_json.read_text())
    written = render_all(data, args.out_dir)
    print(written)
    return 1 if "roofline_error" in written else 0


if __name__ == "__main__":
    sys.exit(main())
