"""One record per op under test: its report check, the backend callables it calls, its case
list and case count, its oracle and its runner. Everything else (the check list, case lists,
progress totals, ``oracle``, ``run_case``) is derived from ``OPS``.

Two records are sessions instead of independent cases: ``decode_wrapper`` (plan/run replays
after in-place buffer changes, ``conformance.graphs``) and ``engine`` (``Indexer`` plan /
forward over a continuous-batching trace, ``conformance.engine_trace``).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from . import caselists as C
from . import oracles as O
from . import runners as R
from .backends import OPS as BACKEND_OPS
from .backends import Backend
from .engine_trace import engine_results, engine_steps
from .generator import NUM_CONTRACT_CASES, Case, Profile
from .graphs import wrapper_results, wrapper_sessions
from .results import CaseResult, Skip


@dataclass(frozen=True)
class OpRecord:
    """An op under test.

    Attributes:
        name: ``Case.op`` of its cases (the op a session's results carry is ``result_op``).
        check: the report check (row of the results table) it belongs to.
        backend: the :class:`~conformance.backends.Backend` callables it calls.
        count: ``count(profile)``: how many results it yields (progress totals).
        cases: ``cases(profile, seed, device)``: its case list (None for a session).
        oracle: ``oracle(inputs) -> expected dict`` from the reference (None for a session).
        run: ``run(case, backend, expected, result, max_failures)`` (None for a session).
        session: ``session(backend, profile, seed, *, max_failures, case_glob)`` returning
            its :class:`~conformance.results.CaseResult` list (None for case ops).
    """

    name: str
    check: str
    backend: tuple[str, ...]
    count: Callable[[Profile], int]
    cases: Callable[..., Iterable[Case]] | None = None
    oracle: Callable[[dict], dict] | None = None
    run: Callable | None = None
    session: Callable[..., list[CaseResult]] | None = None


def _fixed(n: int) -> Callable[[Profile], int]:
    return lambda profile: n


OPS: tuple[OpRecord, ...] = (
    OpRecord("encode_e4m3", "codec", ("encode_e4m3",), _fixed(6), C.encode_cases,
             O.encode_oracle, R.run_encode),
    OpRecord("dequantize_nvfp4", "codec", ("dequantize_nvfp4",), _fixed(4),
             C.dequantize_cases, O.dequantize_oracle, R.run_dequantize),
    OpRecord("quantize_nvfp4", "codec", ("quantize_nvfp4",),
             _fixed(1 + 2 * len(C.QUANT_DISTRIBUTIONS)), C.quantize_cases, O.quantize_oracle,
             R.run_quantize),
    OpRecord("write_index_k", "write", ("write_index_k",), lambda p: p.write_cases,
             C.write_cases, O.write_oracle, R.run_write),
    OpRecord("insert_index_k", "insert", ("insert_index_k",),
             lambda p: p.insert_cases + C.NAN_CASES, C.insert_cases, O.insert_oracle,
             R.run_insert),
    OpRecord("prepare_index_q", "insert", ("prepare_index_q",),
             lambda p: p.insert_cases + C.NAN_CASES, C.query_cases, O.query_oracle,
             R.run_query),
    OpRecord("gather_index_k_fp8", "gather", ("gather_index_k_fp8",), lambda p: p.gather_cases,
             C.gather_cases, O.gather_oracle, R.run_gather),
    OpRecord("page_scores", "scores", ("page_scores",), C.num_scores_cases, C.scores_cases,
             O.scores_oracle, R.run_scores),
    OpRecord("decode", "decode", ("decode_indexer",),
             lambda p: p.decode_cases + NUM_CONTRACT_CASES, C.decode_cases, O.decode_oracle,
             R.run_decode),
    OpRecord("prefill", "prefill", ("prefill_indexer",), lambda p: p.prefill_cases,
             C.prefill_cases, O.prefill_oracle, R.run_prefill),
    OpRecord("mixed", "mixed", ("decode_indexer", "prefill_indexer"), lambda p: p.mixed_cases,
             C.mixed_cases, O.mixed_oracle, R.run_mixed),
    OpRecord("decode_wrapper", "wrapper", ("make_decode_wrapper",),
             lambda p: len(wrapper_sessions(p)) * (p.wrapper_replays + 1),
             session=wrapper_results),
    OpRecord("engine", "engine", ("make_indexer",), engine_steps, session=engine_results),
)

#: Checks in run order (each a row of the report).
CHECKS: tuple[str, ...] = tuple(dict.fromkeys(r.check for r in OPS))
CHECK_DOCS = {
    "codec": "E4M3 encode (all fp16/bf16 patterns, every rounding boundary, random fp32), "
             "NVFP4 quantize (edge groups, every distribution, fp32/bf16/fp16), dequantize "
             "(16 x 256 table, both dtypes): bit-exact (SPEC 1)",
    "write": "write_index_k into a poisoned cache with scattered / skipped slots and padded "
             "page strides: token bytes bit-exact, nothing else touched (SPEC 1.3, 2)",
    "insert": "fused norm + RoPE + quantize + write, and query prepare: bit-exact or every "
              "difference proved inside SPEC 3's band",
    "gather": "FP8 workspace and page offsets, bit-exact (SPEC 7)",
    "scores": "page_scores (when the backend has it): exact, or within e (SPEC 4, 9)",
    "decode": "decode_indexer on random engine states and designed contract cases: output "
              "structure exact, ranking tie-aware (SPEC 5, 6, 9)",
    "prefill": "prefill_indexer with cached context and small gather budgets (SPEC 5, 7, 9)",
    "mixed": "decode-first batch into one shared output, each op only its rows (SPEC 8)",
    "wrapper": "DecodeIndexerWrapper: plan/run (CUDA-graph capture + replay on a GPU) after "
               "in-place changes of q, seq lens, block tables and padding rows (SPEC 6)",
    "engine": "Indexer plan/forward over a seeded continuous-batching trace (arrivals, chunked "
              "prefill with cached context, decode Q 1..8 padded to CUDA-graph sizes, "
              "finishes, block reuse); decode-only steps replay captured graphs on a GPU "
              "(SPEC 8.1)",
}
_OF_NAME = {r.name: r for r in OPS if r.session is None}

assert set(CHECK_DOCS) == set(CHECKS), "every check needs its doc line"
assert all(set(r.backend) <= set(BACKEND_OPS) for r in OPS), "unknown backend callable"


def op_record(op: str) -> OpRecord:
    """The record of case op ``op``.

    Raises:
        ValueError: ``op`` is not a case op of ``OPS``.
    """
    try:
        return _OF_NAME[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(_OF_NAME)}") from None


def records_of(check: str) -> tuple[OpRecord, ...]:
    """The records of ``check``, in run order.

    Raises:
        ValueError: unknown ``check``.
    """
    recs = tuple(r for r in OPS if r.check == check)
    if not recs:
        raise ValueError(f"unknown check {check!r}; expected one of {', '.join(CHECKS)}")
    return recs


def build_cases(check: str, profile: Profile, seed: int, device=None) -> Iterator[Case]:
    """The cases of ``check`` for ``(profile, seed)`` (a session check has none: see
    ``OpRecord.session``).

    Raises:
        ValueError: unknown ``check``.
    """
    for r in records_of(check):
        if r.cases is not None:
            yield from r.cases(profile, seed, device)


def case_counts(profile: Profile) -> dict[str, int]:
    """Number of results each check yields for ``profile`` (progress totals)."""
    counts = dict.fromkeys(CHECKS, 0)
    for r in OPS:
        counts[r.check] += r.count(profile)
    return counts


def oracle(case: Case) -> dict[str, torch.Tensor]:
    """Expected outputs of ``case`` computed by the reference on the inputs' device.

    Raises:
        ValueError: unknown ``case.op``.
    """
    return op_record(case.op).oracle(case.inputs)


def run_case(case: Case, backend: Backend, *, max_failures: int = 5,
             check: str | None = None) -> CaseResult:
    """Run one case on ``backend`` and judge it (expected outputs from ``case.expected`` or the
    reference oracle). Exceptions from the backend become failures; an op the backend declares
    absent (``None``) or not implemented (``NotImplementedError``) makes the case skipped."""
    rec = op_record(case.op)
    res = CaseResult(check=check or rec.check, op=case.op, case=case.name,
                     seed=case.seed, case_obj=case)
    t0 = time.perf_counter()
    exp = None
    try:
        exp = case.expected if case.expected is not None else rec.oracle(case.inputs)
        rec.run(case, backend, exp, res, max_failures)
    except Skip as e:
        res.skipped = str(e)
    except Exception as e:  # the backend (or, with exp None, the oracle) raised
        res.failed += 1
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        who = case.op if exp is not None else "the reference oracle"
        res.fail(max_failures, row=None, head=None, expected="no exception",
                 got=f"{e.__class__.__name__}: {e}", detail=f"{who} raised{where}")
    if not res.ok:
        res.expected = exp
    if torch.device(backend.device).type == "cuda":
        torch.cuda.synchronize()
    if res.ok:
        res.case_obj = None  # free the inputs of passing cases
    res.seconds = time.perf_counter() - t0
    return res
