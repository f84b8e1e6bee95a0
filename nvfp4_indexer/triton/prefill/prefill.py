"""Triton "Q8KV8" prefill kernels: score the gathered FP8 workspace, select top-k (SPEC 4, 5,
7). The chunk plan and launches: ``prefill.launch``; the rules: ``prefill.dispatch``.

Score kernel (``prefill_score_kernel``), grid ``(row blocks, NUM_SPLITS)``: a row block is
``BLOCK_M`` (token, head) rows of one request (``dispatch.plan_row_blocks``); its pages are those
below the local page of its last row (rows are bottom-right aligned, so that is the block's
largest L), 0 when that is <= 15. Split s takes the s-th of NUM_SPLITS equal ranges of those
pages; per page: a ``[128 tokens, 128 dims]`` E4M3 tile from the workspace, the token scores in
one K=128 MMA (16-bit dot modes: ``[BLOCK_M, 128 tokens]``, the page as the shared-memory
operand, so the max over tokens stays in registers; "fp8" / "fp32": ``[128 tokens,
BLOCK_M]``), the NaN-skipping max, and the page's candidate for rows with j < L, kept in each
row's running top-KEEP list (KEEP = min(16, next power of two >= pages per split); updated per
page, or once per window of buffered page scores for splits of >= 32 pages, as in ``decode``).
No ``[tokens, heads, pages]`` score tensor exists: each program writes its lists to the
candidate scratch ``int64 [blocks * BLOCK_M, NUM_SPLITS, KEEP]``; the merge kernel
(``prefill_merge_kernel``, grid ``(blocks, BLOCK_M / rows)``, ``heuristics.merge_config``'s
rows per program) selects the final 15 and writes SPEC 5's output. With one split the score
kernel writes the output itself. On CUDA SM90 the Gluon twin
``prefill_wgmma.prefill_wgmma_kernel`` takes the chunks ``dispatch.prefill_launch`` gives it.

Both kernels read request r's seq len as ``max(min(seq_lens[r], caps[r]), 0)``
(``scan.block_rows_info``): ``caps`` are the seq lens the host planned with (the engine's
staged copies of ``seq_lens_cpu``, SPEC 8.1), so no row scores past a planned page and no
clamp op runs before the launch; ``prefill_indexer`` planned from the device values
themselves and passes ``seq_lens`` twice. Dot modes and their error bounds are those of
``decode`` (``SCORE_ERROR_BITS``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..layout import WS_PAGE, scored_pages, split_range, ws_page_offset
from ..operands import load_q_rows, load_q_t
from ..scan import (block_rows_info, finish_split, merge_splits, out_offsets, scan_pages,
                    score_row_block)
from ..scoring import fp8_page_scores, fp8_page_scores_n


# seq_lens_ptr is a view at the step's first prefill request (Indexer): its alignment varies
# with the decode count, and its loads are scalar, so it takes no alignment specialization
# (no second compile mid-serving); nor does caps_ptr.
_SEQ_PTRS = ["seq_lens_ptr", "caps_ptr"]


@triton.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "req_base", "num_blocks"],
            do_not_specialize_on_alignment=_SEQ_PTRS)
def prefill_score_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base,
                         qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                         win_ptr, out_ptr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, DOT: tl.constexpr, WINDOW: tl.constexpr = 1,
                         KEEP: tl.constexpr = 16, TOKENS_N: tl.constexpr = False):
    """Prefill score program ``(x, split)`` of grid ``(num_blocks, NUM_SPLITS)``: row block
    ``num_blocks - 1 - x`` (``scan.score_row_block``; SPEC 4, 5, 7).

    ``q_ptr`` E4M3 query bytes (uint8) with token / head strides in bytes; ``ws_ptr`` the FP8
    workspace ``[P, 128, 128]`` (bytes) and ``ws_off_ptr`` int32 each request's first
    workspace page (indexed by request - ``req_base``); ``qsl_ptr`` int32 cu_seqlens_q,
    ``seq_lens_ptr`` / ``caps_ptr`` int32 device / planned seq lens; ``blk_ptr`` int32
    ``[2, num_blocks]`` (request, first row); ``cand_ptr`` int64 candidates
    ``[num_blocks * BLOCK_M, NUM_SPLITS, KEEP]`` (NUM_SPLITS > 1); ``win_ptr`` fp32 window
    scratch ``[num_blocks * NUM_SPLITS, 2, WINDOW, BLOCK_M]`` (WINDOW > 1); ``out_ptr`` int32
    ``[Tp, H, 16]`` (written when NUM_SPLITS == 1). ``TOKENS_N``: page tokens on the MMA's N
    axis (16-bit dot modes)."""
    blk = score_row_block()
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                              num_blocks, blk, rows, H)
    n = scored_pages(tl.max(tl.where(row_ok, local, 0), 0))  # the block's largest L
    start, end = split_range(n, split, NUM_SPLITS)
    q_off = token * q_tok_stride + h * q_head_stride
    if TOKENS_N:
        q_op = load_q_rows(q_ptr, q_off, row_ok, DOT)
    else:
        q_op = load_q_t(q_ptr, q_off, row_ok, DOT)
    r = tl.load(blk_ptr + blk)
    ws_page0 = ws_ptr + tl.load(ws_off_ptr + (r - req_base)).to(tl.int64) * WS_PAGE
    top = scan_pages(start, end, local, (ws_page0,), (q_op,), win_ptr,
                     blk * NUM_SPLITS + split, 0, 1, _ws_page_scores, DOT, TOKENS_N, BLOCK_M,
                     KEEP, WINDOW)
    finish_split(top, local, out_ptr + out_offsets(token, h, H), row_ok, cand_ptr,
                 (blk * BLOCK_M + rows).to(tl.int64), split, NUM_SPLITS, False)


@triton.jit
def _ws_page_scores(page_src, j, q_ops, DOT: tl.constexpr, TOKENS_N: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of workspace page j (``page_src = (request's first
    workspace page,)``), tokens on the MMA's N or M axis."""
    ws_page0, = page_src
    q_op, = q_ops
    if TOKENS_N:
        return fp8_page_scores_n(ws_page0 + ws_page_offset(j), q_op, DOT)
    else:
        return fp8_page_scores(ws_page0 + ws_page_offset(j), q_op, DOT)


@triton.jit(do_not_specialize=["num_blocks"], do_not_specialize_on_alignment=_SEQ_PTRS)
def prefill_merge_kernel(cand_ptr, qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks,
                         out_ptr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, ROWS: tl.constexpr,
                         KEEP: tl.constexpr = 16, SORT: tl.constexpr = 0):
    """Merge program ``(block, row group)`` of grid ``(num_blocks, BLOCK_M / ROWS)``: the
    final 15 of each row's ``NUM_SPLITS`` candidate lists (``scan.merge_splits``; ``SORT``:
    one bitonic top-16 where a row has 16-64 candidate columns, else 15 rounds of
    max-and-remove, the same output) and SPEC 5's output row; arguments as
    ``prefill_score_kernel``'s."""
    blk = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                              num_blocks, blk, rows, H)
    row_ok = row_ok & (rows < BLOCK_M)
    merge_splits(cand_ptr, (blk * BLOCK_M + rows).to(tl.int64), row_ok, local,
                 out_ptr + out_offsets(token, h, H), NUM_SPLITS, SPLITS_PAD, KEEP, SORT)
