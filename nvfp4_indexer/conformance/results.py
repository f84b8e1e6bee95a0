"""What a check reports: :class:`Failure` (one mismatch, with what a reproducer needs) and
:class:`CaseResult` (the verdict counts of one case); :class:`Skip` marks an op a backend
declares absent (``None``) or not implemented (``NotImplementedError``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .generator import Case


class Skip(Exception):
    """The backend declares an op absent (``None``) or raises ``NotImplementedError``."""


def skip_unimplemented(what: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``; its ``NotImplementedError`` becomes :class:`Skip` naming
    ``what``."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        raise Skip(f"{what}: {e}") from e


def jsonable(x):
    """``x`` as plain JSON data (tensors and arrays as lists, non-finite floats as strings)."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (np.ndarray, np.generic)):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


@dataclass
class Failure:
    """One mismatch, with what a reproducer needs."""

    check: str
    case: str
    seed: int
    row: int | None
    head: int | None
    expected: Any
    got: Any
    detail: str
    case_file: str | None = None

    def reproducer(self, backend: str = "BACKEND", rerun: str | None = None) -> str:
        """Seed, case, row, expected vs got; ``rerun``: a command template with ``{case}``."""
        where = "" if self.row is None else f" row={self.row}" + (
            "" if self.head is None else f" head={self.head}")
        lines = [f"[{self.check}] case={self.case} seed={self.seed}{where}: {self.detail}",
                 f"    expected: {self.expected}", f"    got:      {self.got}"]
        if rerun:
            lines.append("    rerun:    " + rerun.format(case=self.case))
        if self.case_file:
            lines.append(f"    replay:   python -m {__package__} replay {self.case_file} "
                         f"--backend {backend}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"check": self.check, "case": self.case, "seed": self.seed, "row": self.row,
                "head": self.head, "expected": jsonable(self.expected),
                "got": jsonable(self.got), "detail": self.detail, "case_file": self.case_file}


@dataclass(kw_only=True)
class RowCounts:
    """Compared rows by verdict. ``exact``: identical to the expectation. ``tolerance``:
    different but valid (top-k within the SPEC 9 bound, insert differences each explained by
    SPEC 3's band). ``needed_bound``: top-k rows that are only valid because of the bound
    (they fail with e = 0). ``max_gap``: largest normalized gap max(S[w] - S[u]) / M over rows
    that needed the bound; ``bound``: the bound applied."""

    rows: int = 0
    exact: int = 0
    tolerance: int = 0
    needed_bound: int = 0
    failed: int = 0
    max_gap: float | None = None
    bound: float | None = None

    def add_counts(self, other: RowCounts) -> None:
        """Add ``other``'s rows; keep the larger ``max_gap`` and ``other``'s bound if set."""
        self.rows += other.rows
        self.exact += other.exact
        self.tolerance += other.tolerance
        self.needed_bound += other.needed_bound
        self.failed += other.failed
        if other.max_gap is not None:
            mine = self.max_gap
            self.max_gap = other.max_gap if mine is None else max(mine, other.max_gap)
        if other.bound is not None:
            self.bound = other.bound


@dataclass
class CaseResult(RowCounts):
    """Outcome of one case: counts of compared rows by verdict (``RowCounts``)."""

    check: str
    op: str
    case: str
    seed: int
    skipped: str | None = None
    explained: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    case_obj: Case | None = None  # kept for failing cases only (to save a case file)
    expected: dict | None = None

    @property
    def ok(self) -> bool:
        return self.failed == 0 and not self.failures

    def fail(self, max_failures: int, **kw) -> None:
        """Keep a :class:`Failure` (``kw``: its fields) while fewer than ``max_failures`` are
        kept; the caller counts the failed rows."""
        if len(self.failures) < max_failures:
            self.failures.append(Failure(check=self.check, case=self.case, seed=self.seed, **kw))

    def count_failure(self, max_failures: int, **kw) -> None:
        """One more failed row, kept as a :class:`Failure` as :meth:`fail` keeps it."""
        self.failed += 1
        self.fail(max_failures, **kw)

    def raised(self, e: Exception, what: str, max_failures: int, detail: str) -> None:
        """A backend call raised ``e``: ``NotImplementedError`` skips the case (``what``: the
        op or object that does not implement it), any other exception fails it."""
        if isinstance(e, NotImplementedError):
            self.skipped = f"{what}: NotImplementedError: {e}"
        else:
            self.count_failure(max_failures, row=None, head=None, expected="no exception",
                               got=f"{e.__class__.__name__}: {e}", detail=detail)

    def to_json(self) -> dict:
        return {"check": self.check, "op": self.op, "case": self.case, "seed": self.seed,
                "rows": self.rows, "exact": self.exact, "tolerance": self.tolerance,
                "needed_bound": self.needed_bound, "failed": self.failed,
                "max_gap": jsonable(self.max_gap), "bound": self.bound,
                "skipped": self.skipped,
                "explained": self.explained[:5], "seconds": round(self.seconds, 4),
                "failures": [f.to_json() for f in self.failures]}
