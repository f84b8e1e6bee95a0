"""One decode case for a profiler: ``python -m benchmarks.labs.profile_decode B NOMINAL [k=v ...]``
is ``python -m benchmarks.labs.profile_case decode B NOMINAL [k=v ...]`` (kept for the commands
quoted in docs/benchmarks.md; see ``benchmarks.labs.profile_case``)."""

from __future__ import annotations

import sys

from benchmarks.labs.profile_case import main as _main


def main(argv=None) -> int:
    return _main(["decode", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
