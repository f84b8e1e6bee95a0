"""CPU model (issue 15, eleventh step): how the order of a prefill score grid's programs
shapes its tail, by greedy list scheduling.

    python -m benchmarks.labs.wave_model                     # the prediction in docs/benchmarks.md
    python -m benchmarks.labs.wave_model --case 8192:32768 --splits 1,2

A chunk of one request (``new`` tokens after ``context`` cached, H = 4, BLOCK_M 128) is cut
into row blocks as the library plans them (``heuristics.plan_row_blocks``); block b scores
its pages in ``splits`` ranges of ``ceil(pages / splits)`` (``layout.split_range``). Programs
run one per SM (the Gluon kernel's one CTA per SM) and each takes ``pages + fixed`` time
units; the next program in launch order goes to the SM that frees first (CUDA hands out
programs in grid order, axis 0 fastest). Printed: the makespan over the ideal (total work /
SMs) for row blocks in ascending order (before c9d514e) and descending order
(``scan.score_row_block``). A model: real programs differ in fixed costs, memory contention
and the merge, which it leaves out.
"""

from __future__ import annotations

import argparse
import heapq

from nvfp4_indexer.triton.heuristics import SHORT_MAX_LOCAL, plan_row_blocks

DEFAULT_CASES = [(4096, 32768), (16384, 32768), (16384, 0), (4096, 131072), (16384, 131072)]


def program_pages(new: int, context: int, splits: int, heads: int = 4,
                  block_m: int = 128) -> list[list[int]]:
    """Pages of each program, ``[split][row block]`` in ascending row-block order."""
    _r, _row0, last = plan_row_blocks([0, new], [context + new], heads, block_m, [0])
    pages = [n if n > SHORT_MAX_LOCAL else 0 for n in last]  # layout.scored_pages
    out = []
    for s in range(splits):
        row = []
        for n in pages:
            per = -(-n // splits)
            row.append(max(0, min(per * (s + 1), n) - per * s))
        out.append(row)
    return out


def makespan(jobs: list[int], sms: int, fixed: float) -> float:
    """Greedy list scheduling of ``jobs`` (in launch order) on ``sms`` machines."""
    free = [0.0] * sms
    for j in jobs:
        heapq.heappush(free, heapq.heappop(free) + j + fixed)
    return max(free)


def model(new: int, context: int, splits: int, sms: int = 132, fixed: float = 2.0) -> dict:
    """``{"ideal", "ascending", "descending"}``: makespans (page-time units)."""
    grid = program_pages(new, context, splits)
    asc = [p for row in grid for p in row]
    desc = [p for row in grid for p in reversed(row)]
    ideal = (sum(asc) + fixed * len(asc)) / sms
    return {"ideal": ideal, "ascending": makespan(asc, sms, fixed),
            "descending": makespan(desc, sms, fixed)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=[], metavar="NEW:CONTEXT")
    ap.add_argument("--splits", default="2", help="comma-separated split counts")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--fixed", type=float, default=2.0,
                    help="fixed cost per program, in pages (default 2)")
    args = ap.parse_args(argv)
    cases = [tuple(int(x) for x in c.split(":")) for c in args.case] or DEFAULT_CASES
    for new, context in cases:
        for ns in (int(x) for x in args.splits.split(",")):
            m = model(new, context, ns, args.sms, args.fixed)
            print(f"{new} new x {context} cached, {ns} split(s): makespan / ideal "
                  f"ascending {m['ascending'] / m['ideal']:.3f}, "
                  f"descending {m['descending'] / m['ideal']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
