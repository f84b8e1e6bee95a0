"""``python -m benchmarks.compare BASE.json NEW.json``: per-case A/B of two ``bench.json`` files.

A regression gate for a change: run ``python -m benchmarks --quick --out DIR`` on the base tree
and on the changed tree on the same machine (interleave two runs of each to see the noise),
then compare. Prints one row per case both files timed (suite, case, base us, new us,
new / base), then the geometric mean of the ratios and the cases slower than ``--tolerance``.
Exit status 1 when such a case exists (2 for unusable input), so scripts can gate on it.
Timings of different GPUs are not comparable: the GPU names of both files are printed and a
mismatch is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def case_times(record: dict) -> dict[tuple[str, str], float]:
    """``{(suite, case name): us}`` of every case a ``bench.json`` record timed."""
    return {(suite, case["name"]): float(case["us"])
            for suite, body in record.get("suites", {}).items()
            for case in body.get("cases", []) if case.get("us")}


def gpu_name(record: dict) -> str:
    """The GPU a record was measured on ("" when it does not say)."""
    env = record.get("env", {})
    return str(env.get("gpu") or "")


def compare(base: dict, new: dict) -> list[tuple[str, str, float, float, float]]:
    """Rows ``(suite, case, base us, new us, new / base)`` of the cases both records timed,
    in suite and case order."""
    a, b = case_times(base), case_times(new)
    return [(s, c, a[s, c], b[s, c], b[s, c] / a[s, c]) for s, c in sorted(set(a) & set(b))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, help="bench.json of the base tree")
    ap.add_argument("new", type=Path, help="bench.json of the changed tree")
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="a case counts as slower above new / base = 1 + TOLERANCE "
                         "(default 0.03: the quick suite's run-to-run spread on an H200)")
    args = ap.parse_args(argv)
    if args.tolerance < 0:
        ap.error(f"--tolerance: expected a number >= 0, got {args.tolerance}")
    try:
        base, new = (json.loads(p.read_text()) for p in (args.base, args.new))
    except (OSError, ValueError) as e:
        print(f"benchmarks.compare: cannot read a record: {e}", file=sys.stderr)
        return 2
    ga, gb = gpu_name(base), gpu_name(new)
    if ga and gb and ga != gb:
        print(f"benchmarks.compare: base ran on {ga!r}, new on {gb!r}: timings of different "
              "GPUs are not comparable", file=sys.stderr)
        return 2
    rows = compare(base, new)
    if not rows:
        print("benchmarks.compare: no case is timed in both records", file=sys.stderr)
        return 2
    print(f"GPU: {ga or gb or 'not recorded'}")
    print(f"{'suite':15s} {'case':36s} {'base us':>10s} {'new us':>10s} {'new/base':>9s}")
    for suite, case, ta, tb, r in rows:
        print(f"{suite:15s} {case:36s} {ta:10.2f} {tb:10.2f} {r:9.3f}")
    geo = math.exp(sum(math.log(r) for *_, r in rows) / len(rows))
    slower = [row for row in rows if row[4] > 1 + args.tolerance]
    print(f"{len(rows)} cases, geometric mean new/base {geo:.3f}; "
          f"{len(slower)} slower than {1 + args.tolerance:.2f}x"
          + "".join(f"\n  slower: {s} {c} {r:.3f}" for s, c, _, _, r in slower))
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
