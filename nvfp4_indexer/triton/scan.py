"""The page scan and the split merge shared by the decode and prefill scorers (SPEC 4, 5), and
the row bookkeeping of their kernels.

A score program holds ``BLOCK_M`` query rows of one request and scans the logical pages
``j = page_offset + k * page_step`` for k in its split's ``[start, end)`` (``scan_pages``;
offset 0 / step 1 except for a context-parallel rank's page subset, SPEC 8.2). Each page's
``[BLOCK_M]`` scores come from the caller's ``PAGE_SCORES`` function; the page is a candidate
of the rows whose local page lies past it, kept in a running top-KEEP list per row
(``topk``): inserted per page (WINDOW == 1) or merged once per window of WINDOW pages whose
scores wait in the program's slice of the window scratch. ``finish_split`` then writes the
final selection (one split) or the split's candidates; ``merge_splits`` is the merge kernels'
body (every split's candidates of a row -> SPEC 5 output).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .heuristics import MERGE_SORT_MAX_COLUMNS
from .layout import PAGE, TOPK, local_page
from .topk import (empty_topk, insert_page, load_candidates, merge_window_strided,
                   store_candidates, window_buffer, write_selection)

_SORT_MAX_COLUMNS = tl.constexpr(MERGE_SORT_MAX_COLUMNS)  # as a kernel may read it


@triton.jit
def scan_pages(start, end, local, page_src, q_ops, win_ptr, prog, page_offset, page_step,
               PAGE_SCORES: tl.constexpr, DOT: tl.constexpr, MODE: tl.constexpr,
               BLOCK_M: tl.constexpr, KEEP: tl.constexpr, WINDOW: tl.constexpr):
    """Running top-KEEP lists ``int64 [BLOCK_M, KEEP]`` of logical pages
    ``j = page_offset + k * page_step``, k in ``[start, end)``, for rows with local pages
    ``local [BLOCK_M]``.

    ``PAGE_SCORES(page_src, j, q_ops, DOT, MODE)`` returns page j's fp32 ``[BLOCK_M]`` scores
    (``page_src`` / ``q_ops``: tuples the caller's function unpacks). WINDOW > 1: scores go to
    program ``prog``'s window scratch ``win_ptr`` (fp32 ``[2, WINDOW, BLOCK_M]`` per program,
    ``topk.window_buffer``) and are merged once per window (``topk.merge_window_strided``);
    the loads are left to Triton's pipeliner (cp.async into shared memory).
    """
    top = empty_topk(BLOCK_M, KEEP)
    if WINDOW == 1:
        for k in range(start, end):
            j = page_offset + k * page_step
            score = PAGE_SCORES(page_src, j, q_ops, DOT, MODE)
            top = insert_page(top, score, j, local)
    else:
        rows = tl.arange(0, BLOCK_M)
        for w0 in range(start, end, WINDOW):
            w_end = tl.minimum(w0 + WINDOW, end)
            buf = window_buffer(win_ptr, prog, (w0 - start) // WINDOW, BLOCK_M, WINDOW)
            for k in range(w0, w_end):
                score = PAGE_SCORES(page_src, page_offset + k * page_step, q_ops, DOT, MODE)
                tl.store(buf + (k - w0) * BLOCK_M + rows, score)
            top = merge_window_strided(top, buf, w0, w_end, local, WINDOW, page_offset,
                                       page_step)
    return top


@triton.jit
def finish_split(top, local, out_row_ptr, row_ok, cand_ptr, cand_rows, split,
                 NUM_SPLITS: tl.constexpr, TO_CANDIDATES: tl.constexpr):
    """A score program's output: the SPEC 5 selection of its rows at ``out_row_ptr [R]``
    when it is the only split (``NUM_SPLITS == 1`` and not ``TO_CANDIDATES``), else its lists
    ``top`` as split ``split``'s slice of candidate scratch rows ``cand_rows [R]`` (int64)."""
    if NUM_SPLITS == 1 and not TO_CANDIDATES:
        write_selection(top, local, out_row_ptr, row_ok)
    else:
        store_candidates(cand_ptr, cand_rows, top, split, NUM_SPLITS)


@triton.jit
def merge_splits(cand_ptr, cand_rows, row_ok, local, out_row_ptr, NUM_SPLITS: tl.constexpr,
                 SPLITS_PAD: tl.constexpr, KEEP: tl.constexpr, SORT: tl.constexpr = 0):
    """Merge kernel body: every split's candidates of scratch rows ``cand_rows [R]`` (int64)
    -> the SPEC 5 output at ``out_row_ptr [R]`` of the rows ``row_ok`` with local pages
    ``local``. ``SORT``: select by one bitonic top-16 (``write_selection``'s ``SORT``) where
    a row has 16 to ``MERGE_SORT_MAX_COLUMNS`` (64) candidate columns (host twin:
    ``heuristics.merge_sorts``; offline SM90 at one row per program, ``sass_stats --merge``:
    224 against 624 SASS instructions at 2 x 16, 408 against 752 at 4 x
    16), else by 15 rounds of max-and-remove (the same output)."""
    keys = load_candidates(cand_ptr, cand_rows, row_ok, NUM_SPLITS, SPLITS_PAD, KEEP)
    write_selection(keys, local, out_row_ptr, row_ok, SORT and SPLITS_PAD * KEEP >= TOPK
                    and SPLITS_PAD * KEEP <= _SORT_MAX_COLUMNS)


@triton.jit
def clamped_seq_len(seq_lens_ptr, b, width):
    """Request b's seq_len clamped to ``[0, width * 128]`` (SPEC 10: a negative device value,
    INT32_MIN included, is a padding request; positions derived from it cannot wrap)."""
    return tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), width * PAGE)


@triton.jit
def decode_rows(b, m, seq_len, Q: tl.constexpr, H: tl.constexpr):
    """Decode rows ``m = i * H + h`` of request b (uniform query length Q, bottom-right
    aligned): ``(head h, row mask m < Q*H, local page, query row b*Q + i (int64))``."""
    i = m // H
    h = m % H
    row_ok = m < Q * H
    local = local_page(seq_len - Q + i)
    return h, row_ok, local, (b * Q + i).to(tl.int64)


@triton.jit
def out_offsets(row, h, H: tl.constexpr):
    """Element offsets of the 16 output slots of (query row, head) rows in ``[*, H, 16]``."""
    return (row * H + h) * TOPK


@triton.jit
def score_row_block():
    """Row block of this prefill score program, grid ``(row blocks, splits)``: axis 0 in
    descending order. Within a request the last row blocks have the most (causal) pages, so
    each request's longest programs start first and a wave's tail holds its shortest ones
    (in a chunk of several requests the last request's blocks go first, whatever their
    length); any order gives the same output."""
    return tl.num_programs(0) - 1 - tl.program_id(0)


@triton.jit
def block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, blk, rows,
                    H: tl.constexpr):
    """Rows of row block ``blk`` (see ``prefill.dispatch.plan_row_blocks``; ``blk_ptr`` holds
    int32 ``[2, num_blocks]``: request, first row), for in-block row indices ``rows [R]``.

    Request r's seq len is ``max(min(seq_lens[r], caps[r]), 0)``: ``caps`` are the seq lens
    the host planned with (SPEC 8.1: the device values are the truth, the host copies an upper
    bound, so no row reads past a planned page), and no position wraps around (SPEC 10). A
    caller without separate caps passes ``seq_lens_ptr`` twice.

    Returns ``(token [R] int64, head [R], local page [R] (0 for p < 0), row mask [R])``.
    """
    r = tl.load(blk_ptr + blk)
    row0 = tl.load(blk_ptr + num_blocks + blk)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    seq_len = tl.maximum(tl.minimum(tl.load(seq_lens_ptr + r), tl.load(caps_ptr + r)), 0)
    m = row0 + rows
    row_ok = m < q_len * H
    t = m // H
    p = seq_len - q_len + t
    local = local_page(p)
    return (q_start + t).to(tl.int64), m % H, local, row_ok
