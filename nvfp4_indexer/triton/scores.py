"""Triton page scores: page maxima of every query row read from the NVFP4 pages (SPEC 4).

Grid ``(row blocks, page groups)``: a row block is up to ``BLOCK_M`` (token, head) rows of
one request (``prefill.dispatch.plan_row_blocks``); program (k, g) scores the block's pages
``[g * PAGES_PER_PROGRAM, (g + 1) * PAGES_PER_PROGRAM)`` below the block's largest local page
and stores each page maximum where ``j < L`` of the row. Everything else of the
``[T, H, W]`` output is -inf (filled before the launch). Scores carry the dot mode's rounding
error (``decode.SCORE_ERROR_BITS``); the page maximum's NaN rules are exact.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .dot_modes import resolve_dot
from .device import device_guard
from .operands import load_q_pairs_t
from .scan import block_rows_info
from .prefill.dispatch import plan_row_blocks, prefill_block_m
from .scoring import nvfp4_page_scores

PAGES_PER_PROGRAM = 8
SCORES_MAX_BLOCK_M = 64  # (token, head) rows per program


@triton.jit
def _page_scores_kernel(q_ptr, q_tok_stride, q_head_stride, cache_ptr, page_stride, bt_ptr,
                        bt_stride, qsl_ptr, seq_lens_ptr, blk_ptr, num_blocks, out_ptr, width,
                        cache_blocks, H: tl.constexpr, BLOCK_M: tl.constexpr, PAGES: tl.constexpr,
                        DOT: tl.constexpr):
    blk = tl.program_id(0)
    group = tl.program_id(1)
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, seq_lens_ptr, blk_ptr,
                                              num_blocks, blk, tl.arange(0, BLOCK_M), H)
    n = tl.max(tl.where(row_ok, local, 0), 0)
    start = group * PAGES
    end = tl.minimum(tl.minimum(start + PAGES, n), width)  # SPEC 10: inside the row
    q_even, q_odd = load_q_pairs_t(q_ptr, token * q_tok_stride + h * q_head_stride, row_ok, DOT)
    r = tl.load(blk_ptr + blk)
    bt_row = bt_ptr + r.to(tl.int64) * bt_stride
    out_row = out_ptr + (token * H + h) * width
    for j in range(start, end):
        block = tl.minimum(tl.maximum(tl.load(bt_row + j), 0), cache_blocks - 1).to(tl.int64)
        score = nvfp4_page_scores(cache_ptr + block * page_stride, q_even, q_odd, DOT)
        tl.store(out_row + j, score, mask=row_ok & (j < local))


def page_scores(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                dot: str | None = None) -> torch.Tensor:
    """Page scores of every query row against its history pages (SPEC 4).

    Args:
        index_q: ``float8_e4m3fn [T, H, 128]`` (unit last stride). cache: ``uint8 [N, 128, 72]``
        paged cache. block_table: int32 ``[R, W]`` (unit last stride). seq_lens: int32 ``[R]``.
        query_start_loc: int32 ``[R+1]`` row offsets (queries bottom-right aligned; a request
        may have 0 rows; seq_len 0 rows have no history).
        dot: dot mode (``dot_modes.DOT_MODES``; default fp16 on GPU, fp32 under the interpreter).
    Returns:
        float32 ``[T, H, W]``: max over each history page's tokens of the fp32 q . K dot
        product (NaN tokens skipped, NaN when all are), -inf where j >= the row's local page.
    Inputs are assumed validated (``nvfp4_indexer.api.page_scores``). Syncs the host once.
    """
    t, h, _ = index_q.shape
    r, w = block_table.shape
    dev = index_q.device
    out = torch.full((t, h, w), float("-inf"), dtype=torch.float32, device=dev)
    q_lens = np.diff(np.asarray(query_start_loc.tolist(), dtype=np.int64))
    sl = np.asarray(seq_lens.tolist(), dtype=np.int64)
    longest = max(int(q_lens.max()) if r else 0, 1)
    block_m = prefill_block_m(longest, h, SCORES_MAX_BLOCK_M)
    reqs, row0s, pages = plan_row_blocks(q_lens, sl, h, block_m)
    if not len(reqs) or int(pages.max()) == 0:
        return out
    blocks = torch.from_numpy(np.concatenate((reqs, row0s)).astype(np.int32)).to(dev)
    q8 = index_q.view(torch.uint8)
    dot = resolve_dot(dot, dev)
    grid = (len(reqs), triton.cdiv(int(pages.max()), PAGES_PER_PROGRAM))
    with device_guard(dev):
        _page_scores_kernel[grid](
            q8, q8.stride(0), q8.stride(1), cache, cache.stride(0), block_table,
            block_table.stride(0), query_start_loc, seq_lens, blocks, len(reqs), out, w,
            cache.shape[0], H=h, BLOCK_M=block_m, PAGES=PAGES_PER_PROGRAM, DOT=dot, num_warps=4)
    return out
