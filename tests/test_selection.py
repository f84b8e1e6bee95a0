"""SPEC 5 page selection: ``nvfp4_indexer.reference.selection.select_pages`` directly (given
scores) and through ``ni.decode_indexer`` (scores from a cache built so that their order is
known), against the brute-force sort of tests/bruteforce.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bruteforce as bf
import nvfp4_indexer as ni
from nvfp4_indexer.reference.selection import select_pages

REF = {"backend": "reference"}


def run_select(scores: np.ndarray, local: list[int], topk: int = 16) -> np.ndarray:
    s = torch.from_numpy(np.ascontiguousarray(scores, dtype=np.float32))
    out = select_pages(s, torch.tensor(local, dtype=torch.int64), topk)
    assert out.dtype == torch.int32 and out.shape == (len(local), scores.shape[1], topk)
    return out.numpy()


def oracle(scores: np.ndarray, local: list[int], topk: int = 16) -> np.ndarray:
    return np.array([[bf.select_row(scores[n, h], local[n], topk) for h in range(scores.shape[1])]
                     for n in range(len(local))], dtype=np.int32)


def check_structure(out: np.ndarray, local: list[int], topk: int) -> None:
    """SPEC 9 structural rules, independent of scores."""
    for n, L in enumerate(local):
        for row in out[n]:
            row = row.tolist()
            if L < 0:
                assert row == [0] + [-1] * (topk - 1)
            elif L <= topk - 1:
                assert row == list(range(L + 1)) + [-1] * (topk - 1 - L)
            else:
                assert row[-1] == L
                hist = row[:-1]
                assert len(set(hist)) == topk - 1 and all(0 <= j < L for j in hist)


@pytest.mark.parametrize("L", [0, 1, 14, 15, 16, 17, 100, 8191])
def test_lengths(L):
    rng = np.random.default_rng(L)
    w = max(L + 1, 1)
    scores = rng.standard_normal((2, 3, w)).astype(np.float32)
    scores[:, :, L:] = np.nan  # past the history: never read
    out = run_select(scores, [L, L])
    assert np.array_equal(out, oracle(scores, [L, L]))
    check_structure(out, [L, L], 16)
    if L >= 16:  # the best 15 in score order, explicitly
        for h in range(3):
            best = np.argsort(-scores[0, h, :L], kind="stable")[:15]
            assert out[0, h, :15].tolist() == best.tolist()


def test_short_rows_ignore_scores():
    scores = np.full((4, 1, 20), np.nan, dtype=np.float32)
    local = [0, 3, 15, -1]
    out = run_select(scores, local)
    assert out[0, 0].tolist() == [0] + [-1] * 15
    assert out[1, 0].tolist() == [0, 1, 2, 3] + [-1] * 12
    assert out[2, 0].tolist() == list(range(16))
    assert out[3, 0].tolist() == [0] + [-1] * 15


def test_all_equal_scores_pick_lowest_ids():
    for value in (0.0, -3.5, 1e30, -np.inf):
        scores = np.full((1, 2, 40), value, dtype=np.float32)
        out = run_select(scores, [40])
        assert out[0, 0].tolist() == list(range(15)) + [40]
        assert out[0, 1].tolist() == list(range(15)) + [40]


def test_ties_3_3_2_2():
    # Pages: score 3 at ids 20, 5; score 2 at 30, 1; everything else lower.
    scores = np.full((1, 1, 41), -1.0, dtype=np.float32)
    scores[0, 0, [20, 5]] = 3.0
    scores[0, 0, [30, 1]] = 2.0
    scores[0, 0, 10:20] = np.arange(10, dtype=np.float32) / 100  # 0.00 .. 0.09
    out = run_select(scores, [40])[0, 0].tolist()
    assert out[:4] == [5, 20, 1, 30]
    assert out[4:14] == list(range(19, 9, -1))
    assert out[14] == 0 and out[15] == 40  # -1.0 tie among the rest: smallest id


def test_nan_scores_rank_last_by_id():
    scores = np.full((1, 1, 30), np.nan, dtype=np.float32)
    scores[0, 0, [7, 3, 25]] = [1.0, -np.inf, 2.0]
    out = run_select(scores, [30])[0, 0].tolist()
    assert out == [25, 7, 3] + [0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13] + [30]
    # All NaN: smallest ids.
    scores = np.full((1, 1, 30), np.nan, dtype=np.float32)
    assert run_select(scores, [29])[0, 0].tolist() == list(range(15)) + [29]


def test_inf_scores_and_signed_zero():
    scores = np.zeros((1, 1, 20), dtype=np.float32)
    scores[0, 0, 4] = np.inf
    scores[0, 0, 6] = -np.inf
    scores[0, 0, 2] = -0.0  # equal to +0.0: ordered by id
    scores[0, 0, 9] = 1e-45
    out = run_select(scores, [20])[0, 0].tolist()
    assert out[:2] == [4, 9]
    assert out[2:15] == [0, 1, 2, 3, 5, 7, 8, 10, 11, 12, 13, 14, 15]
    assert out[15] == 20


def test_padding_rows():
    scores = np.random.default_rng(0).standard_normal((3, 2, 20)).astype(np.float32)
    out = run_select(scores, [-1, -128, -7])
    assert np.all(out[..., 0] == 0) and np.all(out[..., 1:] == -1)


def test_narrow_score_table():
    # W below K-1 is legal for short rows and padding (e.g. a 1-column block table).
    scores = np.zeros((3, 1, 1), dtype=np.float32)
    out = run_select(scores, [0, -1, 0])
    assert np.array_equal(out, oracle(scores, [0, -1, 0]))
    out = run_select(np.zeros((2, 1, 0), dtype=np.float32), [-1, -5])
    assert np.all(out[..., 0] == 0) and np.all(out[..., 1:] == -1)


@pytest.mark.parametrize("topk", [2, 3, 8, 32])
def test_other_topk(topk):
    rng = np.random.default_rng(topk)
    local = [-1, 0, 1, topk - 2, topk - 1, topk, topk + 1, 3 * topk, 200]
    w = 201
    scores = rng.integers(-4, 4, (len(local), 2, w)).astype(np.float32)  # many ties
    scores[1::3, 0, ::5] = np.nan
    out = run_select(scores, local, topk)
    assert np.array_equal(out, oracle(scores, local, topk))
    check_structure(out, local, topk)


def test_heads_rank_independently():
    scores = np.zeros((1, 4, 32), dtype=np.float32)
    for h in range(4):
        scores[0, h, np.arange(32)] = ((np.arange(32) * (h + 3)) % 32).astype(np.float32)
    out = run_select(scores, [32])
    assert np.array_equal(out, oracle(scores, [32]))
    assert len({tuple(r) for r in out[0].tolist()}) == 4


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_property_selection_invariants(data):
    n = data.draw(st.integers(1, 4))
    w = data.draw(st.integers(1, 48))
    topk = data.draw(st.sampled_from([2, 4, 16, 17]))
    local = data.draw(st.lists(st.integers(-3, w - 1), min_size=n, max_size=n))
    pool = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, math.inf, -math.inf, math.nan, 1e-40])
    values = data.draw(st.lists(st.one_of(pool, st.floats(-1e6, 1e6, width=32)),
                                min_size=n * 2 * w, max_size=n * 2 * w))
    scores = np.array(values, dtype=np.float32).reshape(n, 2, w)
    out = run_select(scores, local, topk)
    check_structure(out, local, topk)
    assert np.array_equal(out, oracle(scores, local, topk))
    # Ranked rows: scores never increase along slots 0..K-2, and no unselected page beats the
    # last selected one.
    for i, L in enumerate(local):
        if L <= topk - 1:
            continue
        for h in range(2):
            key = [(-math.inf if math.isnan(x) else x) for x in scores[i, h, :L].tolist()]
            sel = out[i, h, :-1].tolist()
            ranked = [key[j] for j in sel]
            assert ranked == sorted(ranked, reverse=True)
            rest = [key[j] for j in range(L) if j not in sel]
            assert not rest or max(rest) <= ranked[-1]


# ----------------------------------------------------------------------------- through decode

def one_hot_page_cache(values: list[float]):
    """A cache of ``len(values) + 1`` pages (reversed physical order) where page j's token 0
    has key e_0 * values[j] and every other token the zero key, so q = e_0 scores page j at
    values[j] * q_0 (max with 0 from the zero tokens)."""
    n = len(values)
    cache = ni.new_index_cache(n + 1)
    block_table = torch.tensor([list(range(n, -1, -1))], dtype=torch.int32)
    k = torch.zeros(n, 128)
    k[:, 0] = torch.tensor(values)
    slots = block_table[0, :n].long() * 128
    ni.write_index_k(cache, k, slots, **REF)
    return cache, block_table


def test_decode_ties_and_order_through_cache():
    # Exact E2M1 * E4M3 values: 3, 3, 2, 2 then small ones; zero tokens make every score >= 0.
    values = [0.0] * 40
    values[20], values[5], values[30], values[1] = 3.0, 3.0, 2.0, 2.0
    for j in range(10, 20):
        values[j] = 0.5 * (j - 9) / 8
    cache, bt = one_hot_page_cache(values)
    q = torch.zeros(1, 1, 128)
    q[0, 0, 0] = 1.0
    seq = torch.tensor([40 * 128 + 1], dtype=torch.int32)
    out = ni.decode_indexer(ni.encode_e4m3(q, **REF), cache, bt, seq, 1, **REF)
    scores = ni.page_scores(ni.encode_e4m3(q, **REF), cache, bt, seq,
                            torch.tensor([0, 1], dtype=torch.int32), **REF)
    assert out[0, 0].tolist() == bf.select_row(scores[0, 0].numpy(), 40)
    assert out[0, 0, :4].tolist() == [5, 20, 1, 30]
    assert out[0, 0, 15] == 40


@pytest.mark.parametrize("topk", [2, 8, 32])
def test_decode_other_topk(topk):
    rng = np.random.default_rng(topk)
    values = (rng.integers(0, 6, 50) * 0.5).tolist()
    cache, bt = one_hot_page_cache(values)
    q = torch.zeros(3, 1, 128)
    q[:, 0, 0] = 1.0
    qf = ni.encode_e4m3(q, **REF)
    seq = torch.tensor([50 * 128 + 2], dtype=torch.int32)
    out = ni.decode_indexer(qf, cache, bt, seq, 3, topk=topk, **REF)
    assert out.shape == (3, 1, topk)
    want = bf.decode(qf, cache, bt, seq, 3, topk)
    assert np.array_equal(out.numpy(), want)
    check_structure(out.numpy(), [49, 50, 50], topk)
