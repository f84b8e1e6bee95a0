"""Paged index-K cache layout: page bytes, slot mapping and block tables (SPEC 2).

A page is 9216 bytes: the 128 tokens' packed E2M1 codes (64 bytes each, token-major) in
bytes [0, 8192), then their E4M3 scales (8 bytes each) in [8192, 9216). The cache tensor is a
``uint8 [num_blocks, 128, 72]`` view of those bytes; its rows are NOT tokens.
"""

from __future__ import annotations

import torch

from ..constants import (CODE_BYTES, NUM_GROUPS, PAGE_BYTES, PAGE_SIZE, SCALES_OFFSET,
                         TOKEN_BYTES)

_CODE_COLS = torch.arange(CODE_BYTES)
_SCALE_COLS = torch.arange(NUM_GROUPS)


def new_index_cache(num_blocks: int, device=None, page_stride: int = PAGE_BYTES) -> torch.Tensor:
    """Allocate a zeroed cache of ``num_blocks`` pages as a ``uint8 [num_blocks, 128, 72]`` view.

    ``page_stride`` (bytes between pages, a multiple of 16 and >= 9216) lets pages sit inside
    larger per-block allocations; the padding is never read or written (SPEC 2).
    """
    storage = torch.zeros(num_blocks * page_stride, dtype=torch.uint8, device=device)
    return storage.as_strided((num_blocks, PAGE_SIZE, TOKEN_BYTES), (page_stride, TOKEN_BYTES, 1))


def page_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache's pages as a ``uint8 [num_blocks, 9216]`` view (same storage, any page stride)."""
    return cache.as_strided((cache.shape[0], PAGE_BYTES), (cache.stride(0), 1))


def code_byte_index(offset: torch.Tensor) -> torch.Tensor:
    """Byte offsets inside a page of the 64 code bytes of tokens at ``offset [T]`` -> ``[T, 64]``."""
    return offset[:, None] * CODE_BYTES + _CODE_COLS.to(offset.device)


def scale_byte_index(offset: torch.Tensor) -> torch.Tensor:
    """Byte offsets inside a page of the 8 scale bytes of tokens at ``offset [T]`` -> ``[T, 8]``."""
    return SCALES_OFFSET + offset[:, None] * NUM_GROUPS + _SCALE_COLS.to(offset.device)


def write_tokens(cache: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write quantized tokens at their slots; negative slots are skipped (SPEC 2).

    ``codes uint8 [T, 64]``, ``scales float8_e4m3fn [T, 8]``, ``slot_mapping int [T]``
    (= physical_block * 128 + offset). Touches exactly 72 bytes per written token.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.long)
    block, offset = slots // PAGE_SIZE, slots % PAGE_SIZE
    pages = page_bytes(cache)
    pages[block[:, None], code_byte_index(offset)] = codes[keep]
    pages[block[:, None], scale_byte_index(offset)] = scales[keep].view(torch.uint8)


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``uint8 [..., 128, 64]`` and scales ``float8_e4m3fn [..., 128, 8]`` of physical
    ``blocks [...]`` (any int tensor of valid block ids) (SPEC 2)."""
    pages = page_bytes(cache)[blocks.to(torch.long)]
    codes = pages[..., :SCALES_OFFSET].unflatten(-1, (PAGE_SIZE, CODE_BYTES))
    scales = pages[..., SCALES_OFFSET:].unflatten(-1, (PAGE_SIZE, NUM_GROUPS))
    return codes, scales.view(torch.float8_e4m3fn)


def history_pages(seq_lens: torch.Tensor) -> torch.Tensor:
    """History pages of a request's last token: ``(seq_len - 1) // 128``, 0 for empty requests."""
    return torch.clamp(seq_lens.to(torch.long) - 1, min=0) // PAGE_SIZE


def history_page_count(seq_len: int) -> int:
    """``history_pages`` of one host int: ``(seq_len - 1) // 128``, 0 for an empty request."""
    return max(seq_len - 1, 0) // PAGE_SIZE


def local_pages(position: torch.Tensor) -> torch.Tensor:
    """Local page L = floor(position / 128) of query rows at ``position`` (int tensor; negative
    for SPEC 5's padding rows, p < 0) (SPEC 5)."""
    return torch.div(position, PAGE_SIZE, rounding_mode="floor")


def pages_needed(seq_lens: torch.Tensor) -> torch.Tensor:
    """Block-table entries a request of ``seq_lens`` tokens uses: ceil(seq_len / 128)."""
    return (seq_lens.to(torch.long) + PAGE_SIZE - 1) // PAGE_SIZE
