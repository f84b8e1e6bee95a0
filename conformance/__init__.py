"""Conformance harness of nvfp4_indexer: how a backend earns trust (SPEC 9).

Run ``python -m conformance --help``. The pieces:

* ``generator`` — seeded, poisoned paged engine states and op inputs (``Case``);
* ``checks`` — bit-exact comparisons, ``tie_aware_check`` (SPEC 9), boundary-explained insert
  (SPEC 3); ``run_case`` judges one case;
* ``backends`` — the plug-in hook: ``Backend`` (a callable per op), ``load_backend``;
* ``graphs`` — decode wrapper replays (CUDA-graph capture on a GPU);
* ``golden`` — versioned golden vectors (``write_golden`` / ``verify_golden``);
* ``cases`` — save / replay failing cases; ``report`` — tables, JSON, markdown records.

Importing this package does not import Triton (``--interpret`` must be able to set
``TRITON_INTERPRET=1`` first).
"""

from .backends import DEFAULT_TRITON_BITS, OPS, Backend, load_backend
from .checks import CaseResult, Failure, run_case, tie_aware_check
from .generator import DISTRIBUTIONS, PROFILES, Case

__all__ = ["Backend", "load_backend", "OPS", "DEFAULT_TRITON_BITS", "Case", "CaseResult",
           "Failure", "run_case", "tie_aware_check", "DISTRIBUTIONS", "PROFILES"]
