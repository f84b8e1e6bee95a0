"""Gather of requests' history pages into a compact FP8 workspace (SPEC 7).

Workspace page ``page_offsets[r] + j`` holds request r's logical page j, token-major
``[128 tokens, 128 dims]``, as dequant_e4m3 bytes (SPEC 1.4), bit-exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import HEAD_DIM, PAGE_SIZE
from ..reference.paging import history_pages
from .dequantize import dequant_code_tile
from .numerics import device_guard, interpreting, portable_default


@triton.jit
def _gather_kernel(cache_ptr, page_stride, bt_ptr, bt_row_stride, len_ptr, off_ptr, ws_ptr,
                   ws_pages, FROM_SEQ_LENS: tl.constexpr, PORTABLE: tl.constexpr,
                   TOK_BLOCK: tl.constexpr):
    """Program (r, j): request r's logical page j, if j < its page count, into workspace page
    ``off_ptr[r] + j`` (skipped when that lies outside ``[0, ws_pages)``)."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    length = tl.load(len_ptr + r).to(tl.int64)
    if FROM_SEQ_LENS:
        num_pages = tl.maximum(length - 1, 0) // 128  # history pages (SPEC 4, 7)
    else:
        num_pages = length
    dst = tl.load(off_ptr + r).to(tl.int64) + j
    if (j < num_pages) & (dst >= 0) & (dst < ws_pages):
        block = tl.load(bt_ptr + r.to(tl.int64) * bt_row_stride + j).to(tl.int64)
        page = cache_ptr + block * page_stride
        out_page = ws_ptr + dst * (128 * 128)
        i = tl.arange(0, 64)[None, :]
        d = tl.arange(0, 128)[None, :]
        for t0 in tl.static_range(0, 128, TOK_BLOCK):
            tok = (t0 + tl.arange(0, TOK_BLOCK))[:, None]
            code_bytes = tl.load(page + tok * 64 + i)
            scale_bytes = tl.load(page + 8192 + tok * 8 + i // 8)
            out = dequant_code_tile(code_bytes, scale_bytes, PORTABLE, False)
            tl.store(out_page + tok * 128 + d, out)


def gather_into(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                page_offsets: torch.Tensor, workspace: torch.Tensor, max_pages: int, *,
                lengths_are_seq_lens: bool = True, portable: bool | None = None) -> None:
    """Launch the gather without host syncs (SPEC 7): request r's logical pages
    j < n_r go to ``workspace[page_offsets[r] + j]``.

    Args:
        cache: ``uint8 [num_blocks, 128, 72]`` with strides ``(S, 72, 1)``.
        block_table: int32 ``[R, W]``, unit stride in the last dim; entries [r, j] for
            j < n_r must be valid block ids (others are never read).
        lengths: int32/int64 ``[R]`` on the device: seq_lens (n_r = (seq_len - 1) // 128, 0 for
            empty requests) when ``lengths_are_seq_lens``, else the page counts n_r themselves.
        page_offsets: int32/int64 ``[>= R]`` destination page of each request's page 0.
        workspace: ``float8_e4m3fn`` (or uint8) ``[P, 128, 128]``, contiguous; pages outside
            ``[0, P)`` are skipped, pages not gathered are left untouched.
        max_pages: host int >= every n_r (the grid is ``(R, max_pages)``; pages past n_r exit).
        portable: force the PORTABLE constexpr (tests).
    """
    r = block_table.shape[0]
    if r == 0 or max_pages <= 0 or workspace.shape[0] == 0:
        return
    assert workspace.is_contiguous() and tuple(workspace.shape[1:]) == (PAGE_SIZE, HEAD_DIM)
    assert block_table.stride(-1) == 1
    ws = workspace.view(torch.uint8)
    portable = portable_default(cache.device) if portable is None else portable
    tok_block = 128 if interpreting() else 32
    with device_guard(cache.device):
        _gather_kernel[(r, max_pages)](
            cache, cache.stride(0), block_table, block_table.stride(0), lengths.contiguous(),
            page_offsets.contiguous(), ws, ws.shape[0], FROM_SEQ_LENS=lengths_are_seq_lens,
            PORTABLE=portable, TOK_BLOCK=tok_block)


def gather_index_k_fp8(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       *, portable: bool | None = None):
    """Dequantize every request's history pages into a compact FP8 workspace (SPEC 7).

    Args:
        cache: the paged cache. block_table: int32 ``[R, W]`` (unit stride in the last dim).
        seq_lens: int32 ``[R]``; request r contributes (seq_len - 1) // 128 pages.
        portable: force the PORTABLE constexpr (tests).
    Returns:
        ``(workspace float8_e4m3fn [P, 128, 128], page_offsets int32 [R+1])``, P = total pages.
    One host sync (to size the workspace). Inputs are validated by ``nvfp4_indexer.api``.
    """
    dev = block_table.device
    r = block_table.shape[0]
    pages = history_pages(seq_lens)  # int64 [R], on the device
    page_offsets = torch.zeros(r + 1, dtype=torch.int32, device=dev)
    if r:
        page_offsets[1:] = torch.cumsum(pages, 0)
        total, max_pages = torch.stack((page_offsets[-1].to(torch.int64), pages.max())).tolist()
    else:
        total = max_pages = 0
    workspace = torch.empty((total, PAGE_SIZE, HEAD_DIM), dtype=torch.float8_e4m3fn, device=dev)
    gather_into(cache, block_table, pages, page_offsets, workspace, max_pages,
                lengths_are_seq_lens=False, portable=portable)
    return workspace, page_offsets
