"""Page selection: the top-k output contract (SPEC 5)."""

from __future__ import annotations

import torch

from ..constants import TOPK


def select_pages(scores: torch.Tensor, local_page: torch.Tensor, topk: int = TOPK) -> torch.Tensor:
    """Select ``topk - 1`` history pages by score plus the local page, per query row (SPEC 5).

    Args:
        scores: float32 ``[N, H, W]`` page scores; only entries ``j < local_page[n]`` are read.
        local_page: int ``[N]``, the row's local page L = position // 128, negative for padding.
        topk: output width K >= 2 (16 for the MiniMax M3 indexer).
    Returns:
        int32 ``[N, H, topk]`` logical page ids:
        L <= K-1: ``[0, 1, ..., L, -1, ...]``; L >= K: the K-1 best history pages (score
        descending, equal scores by smaller id, NaN below every number, NaN pages by smaller id)
        then L; padding rows: ``[0, -1, ...]``.
    """
    n, h, w = scores.shape
    device = scores.device
    L = local_page.to(torch.long)
    ids = torch.arange(w, device=device).expand(n, h, w)
    history = ids < L[:, None, None]
    # Lexicographic order by successive stable sorts, least significant key first:
    # ids ascending (already), then score descending with NaN lowest, then NaN after numbers,
    # then non-history pages after all history pages.
    key = torch.where(torch.isnan(scores), torch.full_like(scores, -torch.inf), scores)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    for secondary in (torch.isnan(scores), ~history):
        flag = torch.gather(secondary, -1, order).to(torch.int8)
        order = torch.gather(order, -1, torch.sort(flag, dim=-1, stable=True).indices)
    k = topk - 1
    if w < k:  # narrow tables: pad so every row has k candidate slots
        order = torch.cat([order, order.new_zeros(n, h, k - w)], dim=-1)
    ranked = torch.cat([order[..., :k], L[:, None, None].expand(n, h, 1)], dim=-1)
    # Rows with L <= K-1 keep every history page in ascending order, the local page at slot L.
    slot = torch.arange(topk, device=device)
    short = torch.where(slot <= L[:, None], slot, -1)[:, None, :].expand(n, h, topk)
    out = torch.where((L > k)[:, None, None], ranked, short)
    # Padding rows (p < 0) read [0, -1, ...].
    pad_row = torch.where(slot == 0, 0, -1)
    out = torch.where((L < 0)[:, None, None], pad_row, out)
    return out.to(torch.int32)
