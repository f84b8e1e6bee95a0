"""Prefill: gather history pages into an FP8 workspace, chunked by a page budget, then score
the workspace ("Q8KV8") and select (SPEC 7)."""

from __future__ import annotations

import bisect
import itertools
import math

import torch

from ..constants import PAGE_SIZE, TOPK
from .paging import history_pages, local_pages
from .scores import dequantize_pages, row_positions, scores_from_keys
from .selection import select_pages


def max_gather_pages(max_model_len: int, max_num_batched_tokens: int) -> int:
    """FP8 workspace pages one prefill chunk may gather (SPEC 7):
    ``ceil(max(max_model_len, 4 * max_num_batched_tokens) / 128)``; always fits one request."""
    return math.ceil(max(max_model_len, 4 * max_num_batched_tokens) / PAGE_SIZE)


def plan_chunks(pages: list[int], budget: int) -> list[tuple[int, int]]:
    """Split requests (their history page counts, in order) into ``[start, end)`` chunks whose
    pages fit ``budget``, greedily: each chunk takes requests while their sum fits; each holds
    at least one request (SPEC 7). Host ints only (prefix sums and a bisection per chunk).

    Raises:
        ValueError: a single request needs more than ``budget`` pages.
    """
    for r, n in enumerate(pages):
        if n > budget:
            raise ValueError(f"max_gather_pages={budget} is smaller than request {r}'s "
                             f"{n} history pages; expected max_gather_pages >= {max(pages)}")
    n = len(pages)
    if n <= 1:
        return [(0, n)] if n else []
    cs = list(itertools.accumulate(pages, initial=0))
    if cs[n] <= budget:
        return [(0, n)]
    chunks, start = [], 0
    while start < n:
        end = max(bisect.bisect_right(cs, cs[start] + budget) - 1, start + 1)
        chunks.append((start, end))
        start = end
    return chunks


def gather_index_k_fp8(cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize every request's history pages into a compact FP8 workspace (SPEC 7).

    Returns ``workspace float8_e4m3fn [P, 128, 128]`` (P = sum of (seq_len - 1) // 128) and
    ``page_offsets int32 [R+1]``; request r's logical page j is workspace page
    ``page_offsets[r] + j``.
    """
    pages = history_pages(seq_lens)
    offsets = torch.zeros(len(pages) + 1, dtype=torch.int32, device=block_table.device)
    offsets[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    blocks = block_table[cols[None, :] < pages.to(block_table.device)[:, None]]  # request-major
    return dequantize_pages(cache, blocks), offsets


def prefill_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    max_gather_pages: int, topk: int = TOPK) -> torch.Tensor:
    """Selected pages ``int32 [Tp, H, topk]`` of prefill requests (SPEC 5, 7).

    Requests are grouped into chunks of at most ``max_gather_pages`` history pages; each chunk
    is gathered into an FP8 workspace and scored from it. Inputs are assumed valid.
    """
    t, h, _ = index_q.shape
    out = torch.empty((t, h, topk), dtype=torch.int32, device=index_q.device)
    _, position = row_positions(seq_lens, cu_seqlens_q)
    local = local_pages(position)
    qsl = cu_seqlens_q.tolist()
    for start, end in plan_chunks(history_pages(seq_lens).tolist(), max_gather_pages):
        workspace, offsets = gather_index_k_fp8(cache, block_table[start:end], seq_lens[start:end])
        offsets = offsets.tolist()
        for r in range(start, end):
            lo, hi = qsl[r], qsl[r + 1]
            keys = workspace[offsets[r - start]:offsets[r - start + 1]]
            scores, _ = scores_from_keys(index_q[lo:hi], keys, local[lo:hi])
            out[lo:hi] = select_pages(scores, local[lo:hi], topk)
    return out
