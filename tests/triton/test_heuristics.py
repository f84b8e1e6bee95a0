"""``triton.heuristics``: the launch-shape rules decode and prefill share (pure host functions)."""

from __future__ import annotations

import pytest

from nvfp4_indexer.triton import heuristics as hz


@pytest.mark.parametrize("a,b,want", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (-5, 4, -1)])
def test_cdiv(a, b, want):
    assert hz.cdiv(a, b) == want


@pytest.mark.parametrize("n,want", [(-3, 1), (0, 1), (1, 1), (2, 2), (3, 4), (16, 16), (17, 32)])
def test_next_pow2(n, want):
    assert hz.next_pow2(n) == want


def test_block_rows_are_a_power_of_two_of_at_least_16():
    assert hz.block_rows(1, 1) == hz.MIN_BLOCK_M == 16
    assert hz.block_rows(8, 4) == 32 and hz.block_rows(5, 4) == 32 and hz.block_rows(8, 8) == 64


def test_split_rule():
    """About ``target`` programs over ``programs`` per split, capped by pages and
    ``MAX_SPLITS``, at least 1."""
    assert hz.split_rule(4, 100, 1000) == 25
    assert hz.split_rule(4, 100, 10) == 10  # page cap
    assert hz.split_rule(1, 10**6, 10**6) == hz.MAX_SPLITS
    assert hz.split_rule(0, 5, 3) == 3  # no programs counts as one
    assert hz.split_rule(1000, 100, 50) == 1


def test_keep_and_window():
    """A split keeps min(16, next power of two >= its pages); the window is 1 below
    ``MIN_WINDOW_PAGES`` pages per split, else ``WINDOW`` capped by the split's pages and by
    ``window * rows <= MAX_WINDOW_ELEMS``."""
    assert [hz.keep_for_pages(p) for p in (1, 2, 3, 9, 16, 17, 500)] == [1, 2, 4, 16, 16, 16, 16]
    assert hz.choose_window(hz.MIN_WINDOW_PAGES - 1, 16) == 1
    assert hz.choose_window(hz.MIN_WINDOW_PAGES, 16) == 32
    assert hz.choose_window(1000, 16) == hz.WINDOW
    assert hz.choose_window(1000, 128) == hz.MAX_WINDOW_ELEMS // 128


def test_scratch_elements():
    assert hz.candidate_elems(3, 1, 32, 16) == 0  # unsplit: no candidate scratch
    assert hz.candidate_elems(3, 4, 32, 16) == 3 * 32 * 4 * 16
    assert hz.window_elems(3, 4, 32, 1) == 0
    assert hz.window_elems(3, 4, 32, 8) == 3 * 4 * 2 * 8 * 32


def test_merge_config_rows_per_program():
    """``merge_config``: where the merge sorts (``merge_sorts``: 16-64 columns) one warp holds
    ``MERGE_SORT_KEYS_PER_WARP`` keys; the rounds keep one row per program, on 1, 2 or 4 warps
    by the candidate columns. (The kernel at these rows: the prefill merge tests.)"""
    assert hz.merge_config(2, 16, sort=True) == (8, 1)
    assert hz.merge_config(3, 16, sort=True) == (4, 1)  # 4 x 16 columns
    assert hz.merge_config(2, 8, sort=True) == (16, 1)
    assert hz.merge_config(8, 16, sort=True) == (1, 1)  # 128 columns: the rounds
    assert hz.merge_config(2, 4, sort=True) == (1, 1)  # 8 columns: the rounds
    assert hz.merge_config(2, 16) == (1, 1)
    assert hz.merge_config(64, 16) == (1, 2) and hz.merge_config(128, 16) == (1, 4)
    assert not hz.merge_sorts(hz.MERGE_SORT_MAX_COLUMNS * 2, True)
