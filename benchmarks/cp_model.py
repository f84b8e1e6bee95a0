"""Cost model of decode context parallelism (SPEC 8.2, docs/context-parallel.md): per decode
step and rank, the exchange (bytes, time) against the page scan it saves, for the WORKLOADS.md
decode cases, from a recorded single-GPU benchmark and stated NVLink / NCCL assumptions.

    python -m benchmarks.cp_model                                 # the docs' tables
    python -m benchmarks.cp_model --nvlink-gbps 360 --latency-us 2:10,4:14,8:20
    python -m benchmarks.cp_model --exchange all_to_all --suite decode-variants

Model, per rank of W (every rank holds H_r heads and the same pages):
- single GPU: the measured time t1 of the case (CUDA-graph replay, the results JSON).
- context parallel: scan time ``floor + (t_rows - floor) / W``, where t_rows is the measured
  time of the same (batch, seq len) with the rank's gathered rows Q * W * H_r (the suites hold
  4 (q1h4), 8 (q8h1), 16 (q8h2) and 32 (q8h4) rows; 64 rows extrapolate the 16 -> 32 ratio
  once more) and floor is the smallest measured call (launch latency). The "bandwidth" column
  is the plain model: the saved page bytes at the case's own measured GB/s.
- exchange: two collectives (queries, candidates), each ``latency(W)`` plus its received
  bytes (``nvfp4_indexer.context_parallel.exchange_bytes``) over ``--nvlink-gbps``; plus
  ``--extra-us`` for the extra launches (query transpose, candidate reduce).
Rows above 64 per request (Q * W * H_r) are past the Triton kernel's tile: marked "n/a".
"""

from __future__ import annotations

import argparse
import json
import pathlib

from nvfp4_indexer.context_parallel import exchange_bytes

DEFAULT_RESULTS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "results" / \
    "bench-h200-7335455.json"
MAX_ROWS = 64


def parse_latency(text: str) -> dict[int, float]:
    try:
        pairs = [p.split(":") for p in text.split(",") if p]
        return {int(w): float(us) for w, us in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W:us pairs like 2:8,4:10, got {text!r}")


def latency_for(table: dict[int, float], world: int) -> float:
    """Latency of one collective at ``world`` ranks: the table's entry, else the nearest
    larger one (else the largest)."""
    bigger = [w for w in sorted(table) if w >= world]
    return table[bigger[0]] if bigger else table[max(table)]


def load_cases(path: pathlib.Path):
    data = json.loads(path.read_text())
    by_rows = {}  # (batch, nominal, rows) -> us
    cases = {}
    for suite in ("decode-full", "decode-lowlat", "decode-variants"):
        for c in data["suites"].get(suite, {}).get("cases", []):
            rows = c["query_len"] * c["num_heads"]
            by_rows.setdefault((c["batch"], c["nominal"], rows), c["us"])
            cases.setdefault(suite, []).append(c)
    floor = min(c["us"] for cs in cases.values() for c in cs)
    return data, cases, by_rows, floor


def scan_us(by_rows, batch, nominal, rows, floor):
    """Measured (or extrapolated) single-GPU time with ``rows`` query rows per request."""
    if (batch, nominal, rows) in by_rows:
        return by_rows[(batch, nominal, rows)]
    if rows == 64 and (batch, nominal, 32) in by_rows and (batch, nominal, 16) in by_rows:
        t32, t16 = by_rows[(batch, nominal, 32)], by_rows[(batch, nominal, 16)]
        return t32 * t32 / t16
    if rows < 8 and (batch, nominal, 8) in by_rows:
        return by_rows[(batch, nominal, 8)]
    return None


def step_model(c, world, args, by_rows, floor):
    b, q, h = c["batch"], c["query_len"], c["num_heads"]
    ex = exchange_bytes(b, q, h, world, args.exchange)
    lat = latency_for(args.latency_us, world)
    exch_us = 2 * lat + ex["total_recv"] / (args.nvlink_gbps * 1e3) + args.extra_us
    saved_bytes = c["pages_bytes"] * (1 - 1 / world)
    bw_saved_us = saved_bytes / (c["gbps"] * 1e3)  # at the case's measured GB/s
    rows = q * h * world
    t_rows = scan_us(by_rows, b, c["nominal"], rows, floor) if rows <= MAX_ROWS else None
    cp_us = None if t_rows is None else floor + (t_rows - floor) / world + exch_us
    return {"recv_kb": ex["total_recv"] / 1e3, "saved_mb": saved_bytes / 1e6,
            "exch_us": exch_us, "bw_saved_us": bw_saved_us, "cp_us": cp_us}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=pathlib.Path, default=DEFAULT_RESULTS,
                   help="benchmark JSON with the decode suites (default: %(default)s)")
    p.add_argument("--suite", default="decode-full",
                   choices=("decode-full", "decode-lowlat", "decode-variants"))
    p.add_argument("--nvlink-gbps", type=float, default=450.0,
                   help="NVLink bandwidth per direction per GPU, GB/s (H200 NVLink 4: 900 GB/s "
                        "total bidirectional; default %(default)s)")
    p.add_argument("--latency-us", type=parse_latency, default=parse_latency("2:8,4:10,8:15"),
                   help="latency floor of one small all-gather in a CUDA graph, per group size "
                        "(assumption; default 2:8,4:10,8:15)")
    p.add_argument("--extra-us", type=float, default=3.0,
                   help="extra kernel launches per step (query transpose, candidate reduce)")
    p.add_argument("--exchange", default="all_gather", choices=("all_gather", "all_to_all"))
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--cases", default="", help="only cases whose name contains this text")
    args = p.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds: expected comma-separated ints, got {args.worlds!r}")
    if any(w < 2 for w in worlds) or args.nvlink_gbps <= 0:
        p.error("--worlds: every W >= 2; --nvlink-gbps > 0")
    data, cases, by_rows, floor = load_cases(args.results)
    env = data.get("env", {})
    print(f"# {args.suite}, exchange {args.exchange}, NVLink {args.nvlink_gbps:g} GB/s/direction, "
          f"latency {args.latency_us} us/collective (x2), extra {args.extra_us:g} us; single-GPU "
          f"times: {args.results.name} (commit {env.get('git_commit', '?')}), floor {floor:.2f} us")
    head = ["case", "weight", "pages MB", "t1 us"]
    for w in worlds:
        head += [f"W{w} recv KB", f"W{w} saved us (bw)", f"W{w} exch us", f"W{w} cp us",
                 f"W{w} speedup"]
    head.append("best W")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    tot = {w: [0.0, 0.0] for w in worlds}  # weighted t1, weighted cp (cases where defined)
    wins_bw = {w: 0 for w in worlds}
    rows_out = []
    for c in cases.get(args.suite, []):
        if args.cases not in c["name"]:
            continue
        cells = [c["name"], str(c.get("weight", "-")), f"{c['pages_bytes'] / 1e6:.1f}",
                 f"{c['us']:.1f}"]
        best = (c["us"], 1)
        for w in worlds:
            m = step_model(c, w, args, by_rows, floor)
            wins_bw[w] += m["bw_saved_us"] > m["exch_us"]
            if m["cp_us"] is None:
                cp, sp = "n/a", "n/a"
            else:
                cp, sp = f"{m['cp_us']:.1f}", f"{c['us'] / m['cp_us']:.2f}x"
                best = min(best, (m["cp_us"], w))
                wt = c.get("weight") or 1
                tot[w][0] += wt * c["us"]
                tot[w][1] += wt * m["cp_us"]
            cells += [f"{m['recv_kb']:.0f}", f"{m['bw_saved_us']:.1f}", f"{m['exch_us']:.1f}",
                      cp, sp]
        cells.append(str(best[1]))
        rows_out.append(cells)
        print("| " + " | ".join(cells) + " |")
    n = len(rows_out)
    for w in worlds:
        t1, tcp = tot[w]
        mix = f"{t1 / tcp:.2f}x" if tcp else "n/a (no case within the kernel's 64 rows)"
        print(f"- W={w}: the bandwidth model saves more than the exchange costs in "
              f"{wins_bw[w]}/{n} cases; row-aware weighted speedup of the mix: {mix}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
