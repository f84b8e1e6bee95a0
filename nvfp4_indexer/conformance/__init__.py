"""Conformance harness of nvfp4_indexer: how a backend earns trust (SPEC 9).

Run ``python -m nvfp4_indexer.conformance --help``. The pieces:

* ``generator`` — seeded, poisoned paged engine states and op inputs (``Case``);
* ``fixtures`` — poisoned storage, cache views, the output poison, the RoPE cos/sin cache;
* ``judges`` — bit-exact bytes, boundary-explained insert / query (SPEC 3), ``tie_aware_check``
  (SPEC 9);
* ``oracles`` — the reference's expected outputs; ``runners`` — one backend op on one case;
* ``ops`` — one record per op (check, backend callables, cases, count, oracle, runner);
  ``run_case`` judges one case; ``caselists`` — the case list of each op;
* ``results`` — ``CaseResult`` / ``Failure``; ``checks`` — the stable import path of the above;
* ``backends`` — the plug-in hook: ``Backend`` (a callable per op), ``load_backend``;
* ``suite`` — ``run_suite``; ``graphs`` — decode wrapper replays (CUDA-graph capture on a GPU);
  ``engine_trace`` — ``Indexer`` over a continuous-batching trace;
* ``golden`` — versioned golden vectors (``write_golden`` / ``verify_golden``);
* ``cases`` — save / replay failing cases; ``report`` — tables, JSON, markdown records.

Importing this package does not import Triton (``--interpret`` must be able to set
``TRITON_INTERPRET=1`` first).
"""

from .backends import DEFAULT_TRITON_BITS, OPS, Backend, load_backend
from .judges import tie_aware_check
from .ops import run_case
from .results import CaseResult, Failure
from .generator import DISTRIBUTIONS, PROFILES, Case

__all__ = ["Backend", "load_backend", "OPS", "DEFAULT_TRITON_BITS", "Case", "CaseResult",
           "Failure", "run_case", "tie_aware_check", "DISTRIBUTIONS", "PROFILES"]
