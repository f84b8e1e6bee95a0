"""The stable import path of the harness's checks (SPEC 9), kept for callers of
``conformance.checks``. The code lives by concept:

* ``conformance.results`` — :class:`Failure`, :class:`CaseResult`, :class:`Skip`;
* ``conformance.judges`` — bit-exact bytes, the SPEC 3 band (``explain_keys`` /
  ``explain_queries``), SPEC 5 / 9 ``tie_aware_check``;
* ``conformance.oracles`` — the reference's expected outputs of each op;
* ``conformance.runners`` — call one backend op on one case and judge it;
* ``conformance.ops`` — one record per op; ``run_case`` and ``oracle`` dispatch through it.
"""

from __future__ import annotations

from .judges import (BAND_BITS, TieAwareResult, compare_bytes, explain_keys, explain_queries,
                     explain_row, record_selection, round_e4m3_f64, tie_aware_check)
from .ops import oracle, run_case
from .results import CaseResult, Failure, Skip
from .runners import call_op

__all__ = ["BAND_BITS", "CaseResult", "Failure", "Skip", "TieAwareResult", "call_op",
           "compare_bytes", "explain_keys", "explain_queries", "explain_row", "oracle",
           "record_selection", "round_e4m3_f64", "run_case", "tie_aware_check"]
