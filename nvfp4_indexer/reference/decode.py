"""Decode: uniform batches of Q queries per request scored on the NVFP4 pages (SPEC 6)."""

from __future__ import annotations

import torch

from ..constants import TOPK
from .paging import local_pages
from .scores import page_scores, row_positions
from .selection import select_pages


def decode_query_start_loc(num_reqs: int, query_len: int, device=None) -> torch.Tensor:
    """``int32 [B+1]`` row offsets of a uniform decode batch (row = b * Q + i)."""
    return torch.arange(num_reqs + 1, dtype=torch.int32, device=device) * query_len


def decode_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, query_len: int, topk: int = TOPK) -> torch.Tensor:
    """Selected pages ``int32 [B*Q, H, topk]`` of a uniform decode batch (SPEC 5, 6).

    Query i of request b sits at p = seq_lens[b] - Q + i; requests with seq_len 0 are padding
    and get ``[0, -1, ...]``. Inputs are assumed valid (the API validates them).
    """
    qsl = decode_query_start_loc(block_table.shape[0], query_len, index_q.device)
    scores = page_scores(index_q, cache, block_table, seq_lens, qsl)
    _, position = row_positions(seq_lens, qsl)
    local = local_pages(position)
    return select_pages(scores, local, topk)
