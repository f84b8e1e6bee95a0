"""Decode (SPEC 6), prefill (SPEC 7), page scores (SPEC 4) and the FP8 gather (SPEC 7) of the
reference backend against the dense brute force of tests/bruteforce.py, on paged batches with
scattered physical blocks, garbage in unused block-table entries and poisoned unused pages."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import bruteforce as bf
import nvfp4_indexer as ni
from nvfp4_indexer.conformance.fixtures import selection_out

REF = {"backend": "reference"}
GARBAGE_IDS = (-1, 10**9, 2**31 - 1, -(2**31), 123456)


class Batch:
    """A paged batch: cache, block table, seq lens, built through ``ni.write_index_k``.

    Every token of every request is written at a random physical slot; then every block that
    is not a history page of some request (the local/last pages, spare blocks, pages dropped by
    ``alias``) is poisoned with 0xAB codes and 0x7F (NaN) scales, so a read of it shows.
    Block-table entries past a request's page count hold garbage ids.
    """

    def __init__(self, seq_lens, seed: int, spare: int = 6, alias=(), width_extra: int = 2):
        rng = np.random.default_rng(seed)
        self.seq_lens_list = [int(s) for s in seq_lens]
        need = [math.ceil(s / 128) for s in self.seq_lens_list]
        total = sum(need) + spare
        width = max(need + [0]) + width_extra
        phys = rng.permutation(total)
        # Garbage past each request's pages: fixed bad ids and random big ones.
        bt = rng.choice(GARBAGE_IDS, size=(len(need), width)).astype(np.int32)
        big = rng.integers(total, 2**31 - 1, size=bt.shape, dtype=np.int64).astype(np.int32)
        bt = np.where(rng.random(bt.shape) < 0.5, bt, big)
        at = 0
        for r, n in enumerate(need):
            bt[r, :n] = phys[at:at + n]
            at += n
        self.cache = ni.new_index_cache(total)
        bf.storage_view(self.cache).fill_(0x5C)
        ks, slots = [], []
        for r, s in enumerate(self.seq_lens_list):
            if s == 0:
                continue
            pos = np.arange(s)
            # Per-token magnitudes over many binades; a few pages get a common large outlier.
            mag = np.exp(rng.standard_normal((s, 1)) * 1.5)
            k = rng.standard_normal((s, 128)) * mag
            k[pos % 311 == 7, rng.integers(0, 128)] = 50.0
            ks.append(k.astype(np.float32))
            slots.append(bt[r, pos // 128].astype(np.int64) * 128 + pos % 128)
        if ks:
            ni.write_index_k(self.cache, torch.from_numpy(np.concatenate(ks)),
                             torch.from_numpy(np.concatenate(slots)), **REF)
        # alias: (request, j_from, j_to): logical page j_to reuses j_from's physical block,
        # so both score exactly the same (an exact tie decided by the smaller id).
        for r, j_from, j_to in alias:
            bt[r, j_to] = bt[r, j_from]
        history = {int(bt[r, j]) for r, s in enumerate(self.seq_lens_list)
                   for j in range(max(s - 1, 0) // 128)}
        self.poisoned = [b for b in range(total) if b not in history]
        for b in self.poisoned:
            page = bf.storage_view(self.cache)[b * 9216:(b + 1) * 9216]
            page[:8192] = 0xAB
            page[8192:] = 0x7F
        self.block_table = torch.from_numpy(bt)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32)

    def snapshot(self):
        return (bf.storage_view(self.cache).clone(), self.block_table.clone(),
                self.seq_lens.clone())

    def assert_unchanged(self, snap):
        assert torch.equal(bf.storage_view(self.cache), snap[0])
        assert torch.equal(self.block_table, snap[1]) and torch.equal(self.seq_lens, snap[2])


def random_q(rows: int, heads: int, seed: int, zero_head: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 128, generator=g) * torch.exp(torch.randn(rows, heads, 1,
                                                                           generator=g))
    if zero_head and heads > 1:
        q[:, -1] = 0.0  # every page scores 0: the 15 lowest ids
    return ni.encode_e4m3(q, **REF)


def decode_seq_lens(q_len: int) -> list[int]:
    """0 (padding), Q, 127, 128, 129 and lengths whose last query sits at L = 16, 17 and 32."""
    return [0, q_len, 127, 128, 129, 2048 + q_len, 2177 + q_len, 4200]


@functools.lru_cache(maxsize=None)
def decode_batch(q_len: int) -> Batch:
    """One batch per Q, shared by tests that do not modify it (they assert so)."""
    return Batch(decode_seq_lens(q_len), 100 * q_len, alias=[(6, 3, 9), (7, 0, 31)])


# Every Q in 1..8, H cycling through 1, 2, 4, plus every H at Q = 1 and Q = 8.
DECODE_CASES = sorted({(q, (1, 2, 4)[q % 3]) for q in range(1, 9)}
                      | {(q, h) for q in (1, 8) for h in (1, 2, 4)})


@pytest.mark.parametrize("q_len,heads", DECODE_CASES)
def test_decode_against_bruteforce(q_len, heads):
    seed = 100 * q_len + heads
    batch = decode_batch(q_len)
    q = random_q(8 * q_len, heads, seed, zero_head=True)
    snap = batch.snapshot()
    out = ni.decode_indexer(q, batch.cache, batch.block_table, batch.seq_lens, q_len, **REF)
    assert out.dtype == torch.int32 and out.shape == (8 * q_len, heads, 16)
    want = bf.decode(q, batch.cache, batch.block_table, batch.seq_lens, q_len)
    np.testing.assert_array_equal(out.numpy(), want)
    batch.assert_unchanged(snap)
    # Rows of the padding request (seq_len 0) and the ranked rows, spelled out.
    assert np.all(out[:q_len, :, 0].numpy() == 0) and np.all(out[:q_len, :, 1:].numpy() == -1)
    last = 8 * q_len - 1
    assert np.all(out[last, :, 15].numpy() == (4200 - 1) // 128)
    if heads > 1:  # the zero head: all scores tie at 0 -> lowest ids
        assert out[last, -1, :15].tolist() == list(range(15))
    # The aliased pages tie exactly: never j_to without j_from before it.
    for row in out[7 * q_len:].reshape(-1, 16).tolist():
        if 31 in row[:15]:
            assert 0 in row[:row.index(31)]


@pytest.mark.parametrize("q_len,heads", [(1, 4), (8, 2)])
def test_decode_out_buffer_poisoned(q_len, heads):
    batch = decode_batch(q_len)
    q = random_q(8 * q_len, heads, seed=8)
    out = selection_out(8 * q_len, heads)
    res = ni.decode_indexer(q, batch.cache, batch.block_table, batch.seq_lens, q_len, out=out,
                            **REF)
    assert res is out
    want = bf.decode(q, batch.cache, batch.block_table, batch.seq_lens, q_len)
    np.testing.assert_array_equal(out.numpy(), want)
    # A topk-32 out buffer through the same path.
    out32 = torch.full((8 * q_len, heads, 32), 0x5A5A, dtype=torch.int32)
    ni.decode_indexer(q, batch.cache, batch.block_table, batch.seq_lens, q_len, out=out32,
                      topk=32, **REF)
    want32 = bf.decode(q, batch.cache, batch.block_table, batch.seq_lens, q_len, topk=32)
    np.testing.assert_array_equal(out32.numpy(), want32)


def test_decode_all_padding_and_empty_batch():
    batch = Batch([0, 0, 0], seed=1, spare=1)
    q = random_q(6, 2, 1)
    out = ni.decode_indexer(q, batch.cache, batch.block_table, batch.seq_lens, 2, **REF)
    assert np.all(out[..., 0].numpy() == 0) and np.all(out[..., 1:].numpy() == -1)
    empty = ni.decode_indexer(random_q(0, 2, 1), batch.cache, batch.block_table[:0],
                              batch.seq_lens[:0], 2, **REF)
    assert empty.shape == (0, 2, 16)


def test_decode_block_table_column_view():
    # The engine passes block_table[:, :W'] of a wider persistent table (SPEC 6).
    batch = Batch([2300, 129, 0, 4200], seed=3, width_extra=5)
    wide = torch.full((4, batch.block_table.shape[1] + 20), -1, dtype=torch.int32)
    wide[:, :batch.block_table.shape[1]] = batch.block_table
    view = wide[:, :batch.block_table.shape[1]]
    assert not view.is_contiguous()
    q = random_q(4 * 2, 4, 3)
    got = ni.decode_indexer(q, batch.cache, view, batch.seq_lens, 2, **REF)
    want = bf.decode(q, batch.cache, batch.block_table, batch.seq_lens, 2)
    np.testing.assert_array_equal(got.numpy(), want)


def test_decode_corrupted_cache_and_nan_query():
    # NaN scale bytes in some history tokens (their token scores are skipped), one history
    # page entirely NaN (scores NaN, ranks last), negative scale bytes, and a query row whose
    # head has a NaN byte (all its pages NaN: lowest ids).
    batch = Batch([2500, 3000], seed=11)
    bt = batch.block_table
    pages = bf.storage_view(batch.cache)
    blk = lambda r, j: int(bt[r, j]) * 9216  # noqa: E731
    pages[blk(0, 3) + 8192 + 8 * 5:blk(0, 3) + 8192 + 8 * 5 + 3] = 0x7F  # token 5: 3 groups
    pages[blk(0, 4) + 8192:blk(0, 4) + 9216] = 0xFF  # page 4: all NaN
    pages[blk(1, 2) + 8192:blk(1, 2) + 8192 + 8 * 64] = 0xB8  # scale -1.0 on 64 tokens
    pages[blk(1, 6) + 8192 + 8 * 127 + 7] = 0xFF
    q = random_q(4, 2, 12)
    q.view(torch.uint8)[3, 1, 17] = 0x7F
    got = ni.decode_indexer(q, batch.cache, bt, batch.seq_lens, 2, **REF)
    want = bf.decode(q, batch.cache, bt, batch.seq_lens, 2)
    np.testing.assert_array_equal(got.numpy(), want)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    s = ni.page_scores(q, batch.cache, bt, batch.seq_lens, qsl, **REF).numpy()
    np.testing.assert_array_equal(s, bf.scores(q, batch.cache, bt, batch.seq_lens, qsl))
    assert np.all(np.isnan(s[:2, :, 4])) and not np.any(np.isnan(s[:2, :, 3]))
    assert np.all(np.isnan(s[3, 1, :(3000 - 1) // 128]))
    assert got[3, 1, :15].tolist() == list(range(15))


# ----------------------------------------------------------------------------- page scores

def test_page_scores_decode_and_prefill_layouts():
    batch = Batch([129, 2100, 0, 4200, 5, 300], seed=21, alias=[(3, 2, 20)])
    # query_start_loc with an empty request (q_len 0) and bottom-right aligned rows.
    q_lens = [1, 7, 0, 3, 5, 0]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    rows = int(qsl[-1])
    for heads in (1, 4):
        q = random_q(rows, heads, 22 + heads)
        snap = batch.snapshot()
        got = ni.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl, **REF)
        assert got.dtype == torch.float32
        assert got.shape == (rows, heads, batch.block_table.shape[1])
        want = bf.scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl)
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))  # bitwise
        batch.assert_unchanged(snap)
        # -inf exactly outside each row's history; finite inside (no NaN in this cache).
        pos = bf.positions(batch.seq_lens, qsl)
        cols = np.arange(got.shape[2])
        for row, p in enumerate(pos):
            hist = cols < p // 128
            assert np.all(np.isneginf(got[row, :, ~hist].numpy()))
            assert np.all(np.isfinite(got[row, :, hist].numpy()))
        assert torch.equal(got[8:11, :, 2], got[8:11, :, 20])  # request 3's aliased pages


def test_page_scores_round_once_to_fp32():
    # One token whose exact score is B + 16 * 6 * 2^-9 with B = 16 * 448 * 448 (fp32 ulp 0.25):
    # each small term is below half an ulp, so fp32 accumulation gives B, while the exact sum
    # B + 0.1875 rounds once to B + 0.25 (SPEC 4).
    cache = ni.new_index_cache(2)
    k = torch.zeros(1, 128)
    k[0, :16] = 2688.0  # scale 448, code 7: dequant_e4m3 saturates 6 * 448 to 448
    k[0, 16:32] = 6.0  # scale 1, code 7
    ni.write_index_k(cache, k, torch.tensor([5]), **REF)
    q = torch.zeros(1, 1, 128)
    q[0, 0, :16] = 448.0
    q[0, 0, 16:32] = 2.0 ** -9
    qf = ni.encode_e4m3(q, **REF)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    seq = torch.tensor([129], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    got = ni.page_scores(qf, cache, bt, seq, qsl, **REF)
    assert got[0, 0, 0].item() == 16 * 448 * 448 + 0.25
    assert np.isneginf(got[0, 0, 1].item())
    assert np.array_equal(got.numpy(), bf.scores(qf, cache, bt, seq, qsl))


# ----------------------------------------------------------------------------- prefill

PREFILL = [  # (q_len, seq_len): fresh prefills, cached context, page-crossing chunks
    (1, 1), (5, 5), (128, 128), (3, 129), (40, 2100), (1, 4200), (130, 2300), (200, 200),
]


def prefill_batch(seed: int, reqs=PREFILL, alias=((4, 1, 15),)):
    batch = Batch([s for _, s in reqs], seed, alias=alias)
    q_lens = [q for q, _ in reqs]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    return batch, cu


@pytest.mark.parametrize("heads", [1, 4])
def test_prefill_against_bruteforce_and_chunking(heads):
    batch, cu = prefill_batch(31 + heads)
    rows = int(cu[-1])
    q = random_q(rows, heads, 32 + heads, zero_head=True)
    snap = batch.snapshot()
    want = bf.prefill(q, batch.cache, batch.block_table, cu, batch.seq_lens)
    hist = [max(s - 1, 0) // 128 for _, s in PREFILL]
    # Default budget, the tightest legal budget (each large request alone), one more page,
    # and a budget holding everything in one chunk (split over the two head counts).
    budgets = (None, max(hist)) if heads == 4 else (max(hist) + 1, sum(hist))
    for budget in budgets:
        got = ni.prefill_indexer(q, batch.cache, batch.block_table, cu, batch.seq_lens,
                                 max_gather_pages=budget, **REF)
        assert got.dtype == torch.int32 and got.shape == (rows, heads, 16)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"budget {budget}")
    batch.assert_unchanged(snap)
    # Ranked rows exist (L >= 16) and the local slot is right.
    pos = bf.positions(batch.seq_lens, cu)
    assert max(pos) // 128 >= 32
    assert np.array_equal(want[:, 0, 15][np.array(pos) // 128 >= 16],
                          (np.array(pos) // 128)[np.array(pos) // 128 >= 16])


def test_prefill_chunks_are_planned_as_spec():
    from nvfp4_indexer.reference.prefill import plan_chunks
    hist = [max(s - 1, 0) // 128 for _, s in PREFILL]  # [0, 0, 0, 1, 16, 32, 17, 1]
    assert plan_chunks(hist, 32) == [(0, 5), (5, 6), (6, 8)]
    assert plan_chunks(hist, 67) == [(0, 8)]
    assert plan_chunks([0, 0], 0) == [(0, 2)]
    with pytest.raises(ValueError, match="max_gather_pages"):
        plan_chunks(hist, 31)


def test_prefill_out_buffer_poisoned_and_topk():
    batch, cu = prefill_batch(41)
    rows = int(cu[-1])
    q = random_q(rows, 2, 42)
    out = selection_out(rows, 2)
    res = ni.prefill_indexer(q, batch.cache, batch.block_table, cu, batch.seq_lens, out=out,
                             max_gather_pages=32, **REF)
    assert res is out
    np.testing.assert_array_equal(out.numpy(),
                                  bf.prefill(q, batch.cache, batch.block_table, cu,
                                             batch.seq_lens))
    out8 = torch.full((rows, 2, 8), 0x5A5A5A5A, dtype=torch.int32)
    ni.prefill_indexer(q, batch.cache, batch.block_table, cu, batch.seq_lens, out=out8, topk=8,
                       **REF)
    np.testing.assert_array_equal(out8.numpy(),
                                  bf.prefill(q, batch.cache, batch.block_table, cu,
                                             batch.seq_lens, topk=8))


def test_prefill_without_history():
    batch, cu = prefill_batch(51, reqs=[(1, 1), (128, 128), (7, 100)], alias=())
    q = random_q(int(cu[-1]), 1, 52)
    got = ni.prefill_indexer(q, batch.cache, batch.block_table, cu, batch.seq_lens,
                             max_gather_pages=0, **REF)
    np.testing.assert_array_equal(got.numpy(),
                                  bf.prefill(q, batch.cache, batch.block_table, cu,
                                             batch.seq_lens))


def test_prefill_matches_decode_on_decode_shaped_batch():
    # A uniform batch read as prefill (cu_seqlens_q = b*Q) selects what decode selects.
    batch = Batch([2049 + 3, 130, 4000], seed=61)
    q = random_q(9, 2, 62)
    cu = torch.arange(4, dtype=torch.int32) * 3
    a = ni.prefill_indexer(q, batch.cache, batch.block_table, cu, batch.seq_lens, **REF)
    b = ni.decode_indexer(q, batch.cache, batch.block_table, batch.seq_lens, 3, **REF)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- gather

def test_gather_index_k_fp8_against_bruteforce():
    batch = Batch([0, 129, 2100, 128, 4200, 257], seed=71, alias=[(4, 0, 7)])
    snap = batch.snapshot()
    ws, offsets = ni.gather_index_k_fp8(batch.cache, batch.block_table, batch.seq_lens, **REF)
    want_ws, want_off = bf.gather(batch.cache, batch.block_table, batch.seq_lens)
    assert ws.dtype == torch.float8_e4m3fn and ws.shape == want_ws.shape
    assert offsets.dtype == torch.int32 and offsets.tolist() == want_off
    assert want_off == [0, 0, 1, 17, 17, 49, 51]
    assert np.array_equal(ws.view(torch.uint8).numpy(), want_ws)
    batch.assert_unchanged(snap)
    # Workspace page of (request 4, logical page 7) equals its aliased page 0.
    assert torch.equal(ws[want_off[4] + 7].view(torch.uint8), ws[want_off[4]].view(torch.uint8))


def test_gather_empty():
    batch = Batch([0, 1, 128], seed=81)
    ws, offsets = ni.gather_index_k_fp8(batch.cache, batch.block_table, batch.seq_lens, **REF)
    assert ws.shape == (0, 128, 128) and offsets.tolist() == [0, 0, 0, 0]
