"""Packed (score, page) candidates and the context-parallel decode steps (SPEC 5, 8.2).

The PyTorch twin of ``nvfp4_indexer.triton.topk``'s packing: one int64 per candidate whose
signed order is SPEC 5's selection order, bit for bit the same keys as the kernels':

- high 32 bits: a monotone int32 key of the fp32 score: larger score -> larger key; -0.0 and
  +0.0 share key 0 (equal scores tie by id); NaN gets INT32_MIN, below every number;
- low 32 bits: ``0xFFFFFFFF - id`` (unsigned), so at equal keys the smaller id is larger.

``EMPTY`` (INT64_MIN) is "no candidate" and sorts below every real one (NaN pages included).

Context parallelism over W ranks (SPEC 8.2): rank r scores logical pages ``j % W == r``
(``subset_candidates``: its best 16 per row), the ranks exchange them, and
``merge_candidates`` selects a row's output from the union. The union holds every page that
beats all but at most 15 others, so the result is ``select_pages`` of the full scores.
"""

from __future__ import annotations

import torch

from ..constants import TOPK
from .decode import decode_query_start_loc
from .paging import history_pages, local_pages
from .scores import dequantize_pages, row_positions, scores_from_keys

EMPTY = -(2 ** 63)  # "no candidate"
KEEP = 16  # candidates a rank contributes per row (>= the 15 history slots)
_INT32_MIN = -(2 ** 31)
_LOW_MASK = 2 ** 32 - 1


def score_key(scores: torch.Tensor) -> torch.Tensor:
    """Monotone int32 key of float32 ``scores`` (any shape): x < y => key(x) < key(y),
    -0.0 and +0.0 share key 0, NaN (any sign or payload) gets INT32_MIN."""
    s = torch.where(scores == 0, torch.zeros_like(scores), scores)
    bits = s.contiguous().view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    return torch.where(torch.isnan(scores), torch.full_like(key, _INT32_MIN), key)


def pack_candidates(scores: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """int64 candidates of float32 ``scores`` and logical ``page_ids >= 0`` (broadcastable)."""
    return (score_key(scores).to(torch.int64) << 32) | (page_ids.to(torch.int64) ^ _LOW_MASK)


def candidate_ids(packed: torch.Tensor) -> torch.Tensor:
    """Logical page ids (int32) of packed candidates (meaningless for ``EMPTY``)."""
    return ((packed & _LOW_MASK) ^ _LOW_MASK).to(torch.int32)


def subset_candidates(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_len: int, page_offset: int,
                      page_step: int) -> torch.Tensor:
    """Best ``KEEP`` candidates per query row among the pages ``j % page_step == page_offset``
    of a uniform decode batch (SPEC 4, 6, 8.2).

    Args:
        index_q: ``float8_e4m3fn [B*Q, H, 128]`` (all ranks' heads). cache, block_table int32
        ``[B, W']``, seq_lens int32 ``[B]``: as ``decode_indexer`` (valid). query_len: Q.
        page_offset / page_step: r and W (0 <= r < W).
    Returns:
        int64 ``[B*Q, H, KEEP]``: the row's largest packed candidates among its history pages
        of the subset, unordered, ``EMPTY`` in unused slots. Rows of requests whose last query
        has at most 15 history pages (every row short, SPEC 5) get no candidates. Only the
        subset's block-table entries below each request's history page count are read.
    """
    t, h, _ = index_q.shape
    out = torch.full((t, h, KEEP), EMPTY, dtype=torch.int64, device=index_q.device)
    b = block_table.shape[0]
    qsl = decode_query_start_loc(b, query_len, index_q.device)
    _, position = row_positions(seq_lens, qsl)
    local = local_pages(position)
    # pages j = r + k*W below a bound n: k < ceil((n - r) / W)
    local_sub = torch.clamp(local - page_offset + page_step - 1, min=0) // page_step
    for req, n in enumerate(history_pages(seq_lens).tolist()):
        if n <= 15:  # every row short: selected by formula
            continue
        lo, hi = req * query_len, (req + 1) * query_len
        n_sub = (n - page_offset + page_step - 1) // page_step
        if n_sub <= 0:
            continue
        pages = page_offset + page_step * torch.arange(n_sub, device=index_q.device)
        keys = dequantize_pages(cache, block_table[req, pages])
        s, _ = scores_from_keys(index_q[lo:hi], keys, local_sub[lo:hi])
        hist = torch.arange(n_sub, device=index_q.device) < local_sub[lo:hi, None, None]
        cand = torch.where(hist, pack_candidates(s, pages), torch.full_like(hist, EMPTY,
                                                                               dtype=torch.int64))
        k = min(KEEP, n_sub)
        out[lo:hi, :, :k] = torch.topk(cand, k, dim=-1).values
    return out


def merge_candidates(candidates: torch.Tensor, seq_lens: torch.Tensor,
                     query_len: int) -> torch.Tensor:
    """SPEC 5 selection of every row from its candidates (the merge after the exchange).

    Args:
        candidates: int64 ``[B*Q, H, C]``: the union of the ranks' candidates per row (``EMPTY``
            where none; a row with L >= 16 must hold its 15 best history pages).
        seq_lens: int32 ``[B]``; query_len: Q.
    Returns:
        int32 ``[B*Q, H, 16]``: the 15 largest candidates' ids by key then L; rows with
        L <= 15 ``[0, ..., L, -1, ...]``; padding rows ``[0, -1, ...]``.
    """
    t, h, c = candidates.shape
    dev = candidates.device
    b = seq_lens.shape[0]
    _, position = row_positions(seq_lens, decode_query_start_loc(b, query_len, dev))
    L = local_pages(position)
    k = TOPK - 1
    best = torch.sort(candidates, dim=-1, descending=True).values[..., :k]
    if best.shape[-1] < k:
        best = torch.cat([best, best.new_full((t, h, k - best.shape[-1]), EMPTY)], dim=-1)
    ranked = torch.cat([candidate_ids(best), L[:, None, None].expand(t, h, 1).to(torch.int32)],
                       dim=-1)
    slot = torch.arange(TOPK, device=dev)
    short = torch.where(slot <= L[:, None], slot, -1)[:, None, :].expand(t, h, TOPK)
    out = torch.where((L > k)[:, None, None], ranked.to(torch.long), short)
    pad_row = torch.where(slot == 0, 0, -1)
    out = torch.where((L < 0)[:, None, None], pad_row, out)
    return out.to(torch.int32)
