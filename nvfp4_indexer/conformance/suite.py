"""The loop that runs checks on a backend: every record of ``conformance.ops.OPS`` of each
requested check, its cases generated lazily on the backend's device (or its session run).

``CHECKS``, ``CHECK_DOCS``, ``build_cases`` and ``case_counts`` live in ``conformance.ops``
(one record per op) and are importable from here too.
"""

from __future__ import annotations

import fnmatch
from typing import Callable

import torch

from . import generator as G
from .backends import Backend
from .caselists import dequant_table_inputs
from .ops import CHECK_DOCS, CHECKS, build_cases, case_counts, records_of, run_case
from .results import CaseResult

__all__ = ["CHECKS", "CHECK_DOCS", "build_cases", "case_counts", "dequant_table_inputs",
           "run_suite"]


def run_suite(backend: Backend, profile: G.Profile, seed: int, checks=CHECKS, *,
              case_glob: str | None = None, max_failures: int = 5,
              on_result: Callable[[CaseResult], None] | None = None,
              on_check: Callable[[str, int], None] | None = None) -> list[CaseResult]:
    """Run ``checks`` on ``backend``; cases are generated lazily on the backend's device.

    ``case_glob`` keeps only cases whose name matches (fnmatch). ``on_check(check, n)`` is
    called before each check with its case count, ``on_result`` after each case.

    Raises:
        ValueError: an unknown check.
    """
    results: list[CaseResult] = []
    dev = backend.device if torch.device(backend.device).type == "cuda" else None
    counts = case_counts(profile)
    for check in checks:
        records = records_of(check)
        if on_check:
            on_check(check, counts[check])
        for rec in records:
            if rec.session is not None:
                found = rec.session(backend, profile, seed, max_failures=max_failures,
                                    case_glob=case_glob)
            else:
                found = (run_case(case, backend, max_failures=max_failures, check=check)
                         for case in rec.cases(profile, seed, dev)
                         if not case_glob or fnmatch.fnmatch(case.name, case_glob))
            for r in found:
                results.append(r)
                if on_result:
                    on_result(r)
    return results
