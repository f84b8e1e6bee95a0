"""``nvfp4_indexer.provenance.git_state``: the commit of the checkout rooted exactly at a
folder, never that of an enclosing repository."""

from __future__ import annotations

import subprocess

import pytest

from nvfp4_indexer.provenance import git_state

GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]


@pytest.fixture
def outer_repo(tmp_path):
    """A one-commit repository ``outer`` with an untracked folder ``outer/snapshot``."""
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git not installed")
    outer = tmp_path / "outer"
    (outer / "snapshot").mkdir(parents=True)
    subprocess.run(GIT + ["init", "-q", str(outer)], check=True)
    (outer / "f").write_text("x")
    subprocess.run(GIT + ["-C", str(outer), "add", "f"], check=True)
    subprocess.run(GIT + ["-C", str(outer), "commit", "-qm", "c"], check=True)
    return outer


def test_a_tree_inside_another_repository_has_no_commit(outer_repo):
    """A source tree unpacked inside another repository (a ``git archive`` snapshot)."""
    assert git_state(outer_repo / "snapshot") == (None, None)


def test_commit_and_dirty_of_a_checkout(outer_repo):
    commit, dirty = git_state(outer_repo)
    head = subprocess.run(["git", "-C", str(outer_repo), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert commit == head and len(commit) == 40 and dirty is False
    (outer_repo / "f").write_text("changed")
    assert git_state(outer_repo) == (head, True)


def test_no_checkout_at_all(tmp_path):
    assert git_state(tmp_path / "nowhere") == (None, None)
