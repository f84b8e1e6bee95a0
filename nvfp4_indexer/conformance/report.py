"""Reports: a rich table per run (one line per check), reproducers of failures, ``--json``
documents, progress, and a markdown record of a run for docs/.

JSON schema ``nvfp4-indexer-conformance-report/1`` (see docs/conformance.md)::

    {"schema": ..., "command": "run" | "golden-verify" | "replay", "ok": bool,
     "spec_version": str, "package_version": str, "profile": str | null, "seed": int | null,
     "backend": {"name", "device", "score_error_bits", "exact_insert", "capturable", "ops", ...},
     "environment": {"python", "torch", "triton", "numpy", "platform", "gpu", "commit",
                     "triton_interpret"},
     "started": ISO-8601 UTC, "duration_s": float,
     "checks": [{"check", "cases", "cases_failed", "cases_skipped", "rows", "exact",
                 "tolerance", "needed_bound", "failed", "max_gap", "bound", "explained",
                 "seconds", "skip_reasons": [str]}],
     "failures": [{"check", "case", "seed", "row", "head", "expected", "got", "detail",
                   "case_file"}],
     "cases": [per-case results, only with --json-cases]}
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nvfp4_indexer.provenance import git_state

from .results import CaseResult, Failure, RowCounts

SCHEMA = "nvfp4-indexer-conformance-report/1"


@dataclass
class CheckSummary(RowCounts):
    """Totals of one check over its cases (rows of the cases not skipped: ``RowCounts``)."""

    check: str
    cases: int = 0
    cases_failed: int = 0
    cases_skipped: int = 0
    explained: int = 0
    seconds: float = 0.0
    skip_reasons: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.cases_failed == 0

    def to_json(self) -> dict:
        return {"check": self.check, "cases": self.cases, "cases_failed": self.cases_failed,
                "cases_skipped": self.cases_skipped, "rows": self.rows, "exact": self.exact,
                "tolerance": self.tolerance, "needed_bound": self.needed_bound,
                "failed": self.failed, "max_gap": _num(self.max_gap), "bound": self.bound,
                "explained": self.explained, "seconds": round(self.seconds, 3),
                "skip_reasons": self.skip_reasons}


def _num(x):
    """JSON-safe float (inf / nan as strings)."""
    return x if x is None or x == x and abs(x) != float("inf") else str(x)


def summarize(results: list[CaseResult]) -> list[CheckSummary]:
    """Per-check totals, in first-seen order."""
    out: dict[str, CheckSummary] = {}
    for r in results:
        s = out.setdefault(r.check, CheckSummary(r.check))
        s.cases += 1
        s.seconds += r.seconds
        if r.skipped:
            s.cases_skipped += 1
            if r.skipped not in s.skip_reasons and len(s.skip_reasons) < 5:
                s.skip_reasons.append(r.skipped)
            continue
        s.cases_failed += int(not r.ok)
        s.add_counts(r)
        s.explained += len(r.explained) if r.check == "insert" else 0
        s.failures.extend(r.failures)
    return list(out.values())


def environment() -> dict:
    """Versions, GPU and commit of this run."""
    def ver(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None
    gpu = None
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except Exception:  # pragma: no cover - no torch / driver problems
        pass
    commit, dirty = git_state()
    if commit and dirty:
        commit += "+dirty"
    return {"python": platform.python_version(), "torch": ver("torch"), "triton": ver("triton"),
            "numpy": ver("numpy"), "platform": platform.platform(), "gpu": gpu,
            "commit": commit, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}


def document(command: str, results: list[CaseResult], *, backend: dict, profile=None,
             seed=None, started: float, extra: dict | None = None,
             include_cases: bool = False) -> dict:
    """The ``--json`` document of a run."""
    import nvfp4_indexer
    from nvfp4_indexer.constants import SPEC_VERSION
    sums = summarize(results)
    doc = {"schema": SCHEMA, "command": command,
           "ok": all(s.ok for s in sums),
           "spec_version": SPEC_VERSION, "package_version": nvfp4_indexer.__version__,
           "profile": profile, "seed": seed, "backend": backend, "environment": environment(),
           "started": _dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(
               timespec="seconds"),
           "duration_s": round(time.time() - started, 3),
           "checks": [s.to_json() for s in sums],
           "failures": [f.to_json() for s in sums for f in s.failures]}
    if extra:
        doc.update(extra)
    if include_cases:
        doc["cases"] = [r.to_json() for r in results]
    return doc


def _gap(s: CheckSummary) -> str:
    if s.max_gap is None:
        return "-" if s.bound is None else f"0 (<= {s.bound:.2g})"
    return f"{s.max_gap:.3g} (<= {s.bound:.2g})" if s.bound is not None else f"{s.max_gap:.3g}"


def render(console, results: list[CaseResult], *, title: str, backend: dict,
           show_failures: int = 20, strict: bool = False, rerun: str | None = None) -> bool:
    """Print the table and reproducers; returns overall ok (``strict``: skips fail too)."""
    from rich.table import Table
    sums = summarize(results)
    t = Table(title=title, title_justify="left")
    for col, just in (("check", "left"), ("cases", "right"), ("rows", "right"),
                      ("exact", "right"), ("within tol.", "right"), ("failed", "right"),
                      ("skipped", "right"), ("max gap / M", "right"), ("time s", "right")):
        t.add_column(col, justify=just)
    ok = True
    for s in sums:
        bad = not s.ok or (strict and s.cases_skipped)
        ok &= not bad
        style = "red" if bad else ("yellow" if s.cases_skipped else None)
        t.add_row(s.check, str(s.cases), str(s.rows), str(s.exact), str(s.tolerance),
                  str(s.failed) + (f" ({s.cases_failed} cases)" if s.cases_failed else ""),
                  str(s.cases_skipped), _gap(s), f"{s.seconds:.1f}", style=style)
    console.print(t)
    for s in sums:
        if s.needed_bound:
            console.print(f"{s.check}: {s.needed_bound} row(s) needed the score tolerance; "
                          f"largest normalized gap {s.max_gap:.3g} (allowed 2e/M = "
                          f"{s.bound:.3g})")
        if s.explained:
            console.print(f"{s.check}: boundary-explained differences proved (first: "
                          f"{next(x for r in results if r.check == s.check for x in r.explained)})")
        for why in s.skip_reasons:
            console.print(f"[yellow]{s.check} skipped:[/yellow] {why}", highlight=False)
    fails = [f for s in sums for f in s.failures]
    if fails:
        console.print(f"\n[bold red]{len(fails)} failure(s)[/bold red] (first "
                      f"{min(len(fails), show_failures)}; reproduce with the seed / case / row "
                      "below or replay the case file):")
        for f in fails[:show_failures]:
            console.print(f.reproducer(backend.get("spec") or backend.get("name"), rerun),
                          highlight=False, markup=False, soft_wrap=True)
    console.print(("[bold green]PASS[/bold green]" if ok else "[bold red]FAIL[/bold red]")
                  + f"  backend={backend.get('name')} device={backend.get('device')}")
    return ok


class Progress:
    """Per-case progress on stderr: a rich bar on a terminal, else one line per check (and a
    heartbeat every 30 s)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self._bar = None
        self._task = None
        self._check = None
        self._n = self._total = 0
        self._t0 = self._beat = self._last = time.time()
        if self.tty:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as P,
                                       TextColumn, TimeElapsedColumn)
            self._bar = P(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)

    def __enter__(self):
        if self._bar:
            self._bar.__enter__()
        return self

    def __exit__(self, *a):
        self._finish()
        if self._bar:
            self._bar.__exit__(*a)

    def _finish(self):
        if self._check and self.enabled and not self.tty:
            print(f"  {self._check}: {self._n} case(s) in {time.time() - self._t0:.1f} s",
                  file=sys.stderr, flush=True)
        self._check = None

    def check(self, name: str, total: int, since: float | None = None) -> None:
        self._finish()
        self._check, self._n, self._total = name, 0, total
        self._t0 = self._beat = since or time.time()
        if self._bar:
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task = self._bar.add_task(name, total=total or None)

    def case(self, r: CaseResult) -> None:
        if not self.enabled:
            return
        if self._check != r.check:  # results of a new check arrive: it started at the last one
            self.check(r.check, 0, since=self._last)
        self._last = time.time()
        self._n += 1
        if self._bar:
            self._bar.update(self._task, advance=1, description=f"{self._check}: {r.case}")
        elif time.time() - self._beat > 30:
            self._beat = time.time()
            print(f"  {self._check}: {self._n}/{self._total or '?'} ({r.case})",
                  file=sys.stderr, flush=True)


def record_markdown(path, results: list[CaseResult], *, command: str, backend: dict,
                    profile=None, seed=None, duration: float) -> None:
    """Write a markdown record of a run (date, GPU, commit, versions, the check table)."""
    env = environment()
    sums = summarize(results)
    ok = all(s.ok for s in sums)
    lines = [f"# Conformance: last recorded `{command}` run", "",
             f"- Result: **{'PASS' if ok else 'FAIL'}**",
             f"- Date (UTC): {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
             f"- GPU: {env['gpu'] or 'none (CPU)'}",
             f"- Commit: `{env['commit']}`",
             f"- Backend: `{backend.get('name')}` on `{backend.get('device')}`, score bound bits "
             f"`{backend.get('score_error_bits')}`",
             f"- Profile / seed: `{profile}` / `{seed}`; duration {duration:.1f} s",
             f"- Versions: python {env['python']}, torch {env['torch']}, triton {env['triton']}"
             f", numpy {env['numpy']}; TRITON_INTERPRET={int(env['triton_interpret'])}", "",
             "| check | cases | rows | exact | within tol. | failed | skipped | max gap / M | "
             "time s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sums:
        lines.append(f"| {s.check} | {s.cases} | {s.rows} | {s.exact} | {s.tolerance} | "
                     f"{s.failed} | {s.cases_skipped} | {_gap(s)} | {s.seconds:.1f} |")
    fails = [f for s in sums for f in s.failures]
    if fails:
        lines += ["", "Failures:", "", "```"]
        lines += [f.reproducer(backend.get("spec") or backend.get("name")) for f in fails[:20]]
        lines += ["```"]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
