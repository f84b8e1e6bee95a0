"""Host rules that pick the Triton launches' shapes (pure functions of static shapes and the
device; never of device values, so CUDA-graph replays stay valid).

The shape rules decode and prefill share: the split rule, BLOCK_M, the top-k window, the
candidates a split keeps, the merge program shape and the scratch sizes; and the insert launch
shape. Which kernel runs where is decided by ``decode.dispatch`` and ``prefill.dispatch``.
"""

from __future__ import annotations

from ..constants import TOPK

# -- shared by decode, context parallelism and prefill ----------------------------------------
MIN_PAGES_PER_SPLIT = 4  # at full block-table width, at least this many pages per split
MAX_SPLITS = 256
MIN_BLOCK_M = 16  # smallest BLOCK_M of a row-block scorer (tl.dot's smallest M)
WINDOW = 64  # pages whose scores are buffered before one top-k merge
MIN_WINDOW_PAGES = 32  # splits shorter than this insert each page's candidate directly
MAX_WINDOW_ELEMS = 4096  # window * BLOCK_M bound of the window scratch

# -- merge ----------------------------------------------------------------------------------
# keys per one-warp program of the sorting merge (``merge_config``: 8 rows of 2 splits x 16, 4
# of 4 x 16). One row per program was launch-bound (~124 one-warp programs per SM at 4K new
# tokens): H200 merge alone 128x2 splits 11.6 -> 5.2 us, 512x2 41.2 -> 15.1, 32x4 4.3 -> 3.9,
# bit-equal; 512 keys (8 rows of 4 splits) 5.4 us
MERGE_SORT_KEYS_PER_WARP = 256
# the merge sorts only rows of at most this many candidate columns (``merge_sorts``; a build
# without the limit had no fewer SASS instructions at 16 splits x 16)
MERGE_SORT_MAX_COLUMNS = 64

# -- insert ----------------------------------------------------------------------------------
INSERT_BLOCK_T = 4  # tokens per program on a GPU


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (plain Python: ``triton.cdiv``'s wrapper costs host time)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_rows(query_len: int, num_heads: int) -> int:
    """Decode BLOCK_M: the request's Q*H query rows padded to a power of two >= 16."""
    return max(MIN_BLOCK_M, next_pow2(query_len * num_heads))


def split_rule(programs: int, target: int, cap: int) -> int:
    """The shared split rule: about ``target`` score programs over ``programs`` programs per
    split, at most ``cap`` (pages) and ``MAX_SPLITS``, at least 1."""
    return max(min(cdiv(target, max(programs, 1)), cap, MAX_SPLITS), 1)


def keep_for_pages(pages_per_split: int) -> int:
    """Candidates a split keeps per row: min(16, next power of two >= its page count)."""
    return min(TOPK, next_pow2(pages_per_split))


def choose_window(pages_per_split: int, rows: int, window: int = WINDOW,
                  min_pages: int = MIN_WINDOW_PAGES) -> int:
    """Top-k window of a scorer: 1 (a direct insert per page) below ``min_pages`` pages per
    split, else ``window`` capped by the split's pages and by ``window * rows <= 4096``."""
    if pages_per_split < min_pages:
        return 1
    return min(window, next_pow2(pages_per_split), MAX_WINDOW_ELEMS // rows)


def merge_sorts(columns: int, sort: bool) -> bool:
    """Whether a merge launched with ``SORT = sort`` over ``columns`` candidate columns per row
    (``keep * next_pow2(num_splits)``) takes the bitonic top-16: the host twin of
    ``scan.merge_splits``' test (16 to ``MERGE_SORT_MAX_COLUMNS`` columns)."""
    return bool(sort) and TOPK <= columns <= MERGE_SORT_MAX_COLUMNS


def merge_config(num_splits: int, keep: int = TOPK, sort: bool = False) -> tuple[int, int]:
    """``(rows, num_warps)`` of a merge program over ``keep * next_pow2(num_splits)`` candidate
    columns per row. ``sort`` (the prefill merge's ``SORT``, always on: H200 merge alone 1.4-1.6x
    faster than 15 rounds, bit-equal): where
    the merge takes the bitonic top-16 (``merge_sorts``), 1 warp holds
    ``MERGE_SORT_KEYS_PER_WARP`` keys (``MERGE_SORT_KEYS_PER_WARP // cols`` rows). Otherwise
    one row per program (each of the 15 selection rounds stays in-thread compares and a few
    shuffles), on 1 warp (<= 512 columns), 2 (<= 1024) or 4 (more; at most 32 per thread at
    the largest decode split count)."""
    cols = keep * next_pow2(num_splits)
    if merge_sorts(cols, sort):
        return MERGE_SORT_KEYS_PER_WARP // cols, 1
    return 1, (1 if cols <= 512 else 2 if cols <= 1024 else 4)


def candidate_elems(num_reqs: int, num_splits: int, rows: int, keep: int) -> int:
    """int64 candidate scratch elements: [B, BLOCK_M, NUM_SPLITS, KEEP], none when unsplit."""
    return 0 if num_splits == 1 else num_reqs * rows * num_splits * keep


def window_elems(num_reqs: int, num_splits: int, rows: int, window: int) -> int:
    """fp32 window-buffer elements: [B * NUM_SPLITS, 2, WINDOW, BLOCK_M] (none for WINDOW 1)."""
    return 0 if window == 1 else num_reqs * num_splits * 2 * window * rows


def insert_launch_shape(rotary_dim: int, n: int, block_t: int | None,
                        num_warps: int | None) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of an insert launch of ``n`` tokens. ROT 64 / 128 (the fast
    path) map two threads to a token; the interpreter takes larger tiles
    (``device.rows_per_program``)."""
    from .device import interpreting, rows_per_program
    fast = rotary_dim in (64, 128)
    if block_t is None:
        block_t = rows_per_program(n) if interpreting() else INSERT_BLOCK_T
    if num_warps is None:  # fast path: 2 * BLOCK_T threads, at least one warp
        num_warps = min(8, max(1, 2 * block_t // 32)) if fast else 1
    return block_t, num_warps
