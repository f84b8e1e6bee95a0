"""Which source tree produced a record: the git commit of the project checkout, if any.

Used by the conformance recorder and the benchmark environment block. A source tree that is
not a git checkout of its own (e.g. a ``git archive`` snapshot unpacked inside another
repository) reports no commit, rather than the enclosing repository's HEAD.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _git(root: Path, args: list[str]) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state(root: Path | str = PROJECT_ROOT) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout rooted exactly at ``root``.

    Returns ``(None, None)`` when git is missing or ``root`` is not the top of a checkout;
    ``dirty`` is True when tracked files differ from the commit. Never raises.
    """
    top = _git(Path(root), ["rev-parse", "--show-toplevel"])
    if not top or os.path.realpath(top) != os.path.realpath(root):
        return None, None
    commit = _git(Path(root), ["rev-parse", "HEAD"])
    status = _git(Path(root), ["status", "--porcelain", "--untracked-files=no"])
    return commit, (None if status is None else bool(status))
