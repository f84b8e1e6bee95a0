"""Layout numbers of the index cache and the selection as ``tl.constexpr`` (SPEC 2, 5, 7), and
the small SPEC formulas every kernel shares.

The values come from ``nvfp4_indexer.constants`` (the one place they are defined, free of
torch / triton); kernels read these twins (``@triton.jit`` code may only read constexpr
globals) instead of literal 128 / 64 / 8192 / 16 / 15.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import constants as C

PAGE = tl.constexpr(C.PAGE_SIZE)  # tokens per page
HEAD = tl.constexpr(C.HEAD_DIM)  # dims per token
GROUPS = tl.constexpr(C.NUM_GROUPS)  # E4M3 group scales per token
CODE_BYTES = tl.constexpr(C.CODE_BYTES)  # packed E2M1 code bytes per token
CODE_PAIRS = tl.constexpr(C.CODE_BYTES // 2)  # the same read as uint16 code pairs
SCALES_OFFSET = tl.constexpr(C.SCALES_OFFSET)  # byte offset of a page's scales (after codes)
WS_PAGE = tl.constexpr(C.PAGE_SIZE * C.HEAD_DIM)  # bytes of an FP8 workspace page (SPEC 7)
TOPK = tl.constexpr(C.TOPK)  # output slots per query row
HISTORY = tl.constexpr(C.TOPK - 1)  # history slots per row: rows with L <= 15 are short


@triton.jit
def num_history_pages(seq_len):
    """History pages of a request's last query, ``(seq_len - 1) // 128`` (0 for seq_len <= 0,
    INT32_MIN included: no wrap-around) (SPEC 4, 7)."""
    return (tl.maximum(seq_len, 1) - 1) // PAGE


@triton.jit
def local_page(pos):
    """Local page L = p // 128 of query positions ``pos``; 0 for padding rows (p < 0), which
    then select like L = 0 (SPEC 5)."""
    return tl.where(pos >= 0, pos // PAGE, 0)


@triton.jit
def scored_pages(n_pages):
    """Pages a scorer scans: ``n_pages``, or 0 when it is at most 15 (every row is short:
    SPEC 5 gives the output by formula)."""
    return tl.where(n_pages > HISTORY, n_pages, 0)


@triton.jit
def ws_page_offset(j):
    """int64 byte offset of page ``j`` of a request's FP8 workspace pages (SPEC 7): in int32,
    ``j * 16384`` wraps from page 131072 on (a 16M-token history), and the scorer would read
    before its workspace (SPEC 10)."""
    return tl.cast(j, tl.int64) * WS_PAGE  # j may be a Python int under the interpreter


@triton.jit
def split_range(n_pages, split, NUM_SPLITS: tl.constexpr):
    """``[start, end)`` of split ``split``: the s-th of NUM_SPLITS ranges of
    ``ceil(n_pages / NUM_SPLITS)`` pages (the last ones may be short or empty)."""
    per = tl.cdiv(n_pages, NUM_SPLITS)
    start = split * per
    return start, tl.minimum(start + per, n_pages)
