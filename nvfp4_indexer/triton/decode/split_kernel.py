"""The one-launch decode kernel: NVFP4 pages scored in place, split-K over pages, fused top-k,
and the Triton merge of its split candidates (SPEC 4-6).

Score kernel (``decode_score_kernel``), grid ``(B, NUM_SPLITS)``. Program (b, s) loads request
b's ``Q*H`` query rows (row m = i*H + h, padded to ``BLOCK_M`` = 16 or 32 or 64) once, then
walks its share of the request's history pages ``j < n = (seq_len - 1) // 128`` (the last
query's L; n = 0 when n <= 15: every row is then a short row, SPEC 5 gives it by formula):
split s takes pages ``[s*c, min((s+1)*c, n))`` with ``c = ceil(n / NUM_SPLITS)``. Per page (one
iteration = 128 tokens): the block id from the block table, the page's 8192 code bytes and
1024 scale bytes from ``cache + block * page_stride`` (read in place; Triton's pipeliner turns
the loads into ``cp.async`` copies), dequantization in registers (SPEC 1.4), ``[128 tokens,
BLOCK_M]`` token scores on tensor cores, and the NaN-skipping max over tokens. The page's
candidate (score, j) counts only for rows with j < their local page L_i = (seq_len - Q + i)
// 128. Each program keeps a running top-KEEP per row, KEEP = min(16, next power of two >= its
page count) (``dispatch.keep_per_split``: a split never needs more), updated either per page
(``topk_insert``, WINDOW = 1) or, for splits of >= ``MIN_WINDOW_PAGES`` pages, once per window
of WINDOW pages whose scores were buffered in a per-program scratch (``topk_merge``: only as
many rounds as candidates beat the kept entries). Each program then writes its lists to the
candidate scratch ``int64 [B, BLOCK_M, NUM_SPLITS, KEEP]``; with ``NUM_SPLITS == 1`` it writes
the output itself (no merge launch, no candidate scratch). Page-subset mode (``page_offset``,
``page_step``: pages ``j = page_offset + k * page_step``) is context parallelism's (SPEC 8.2).

Dequantization (the ``DEQUANT`` constexpr): "triton" is ``scoring.nvfp4_page_scores`` (two
K=64 MMAs; one K=128 fp32 dot in the interpreter); "ptx" / "ptx_arith" (GPU, dot "fp16") are
``scoring.nvfp4_page_scores_ptx``: code bytes read as uint16 pairs, inline-PTX dequantization
(bit-exact SPEC 1.4, "ptx_arith" without conversion instructions) and four K=32 fp16 MMAs over
dims 4i + j.

Merge kernel (``decode_merge_kernel``, grid ``(B, cdiv(Q*H, ROWS))``): loads each row's
``NUM_SPLITS * KEEP`` candidates and writes the final SPEC 5 output (15 rounds of
max-and-remove, skipped when the row is short; slot 15 = L; padding rows by formula). On a
CUDA GPU the dispatch takes the Gluon ``redux.redux_merge_kernel`` instead where it applies.

Nothing depends on host values of ``seq_lens`` / ``block_table``: the grid and all constexprs
are a function of (B, W, Q, H, SM count), every program writes all of its outputs every run
(no state carried between runs; the window scratch is rewritten before it is read), so a
CUDA-graph replay after in-place changes of the buffers computes fresh results. Block-table
entries at or past a request's history page count are never read.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..layout import num_history_pages, scored_pages, split_range
from ..operands import load_q_pairs_t, load_q_quads_t
from ..scan import (clamped_seq_len, decode_rows, finish_split, merge_splits, out_offsets,
                    scan_pages)
from ..scoring import nvfp4_page_scores, nvfp4_page_scores_ptx


@triton.jit(do_not_specialize=["q_row_stride", "q_head_stride", "bt_stride", "width",
                               "num_blocks"],
            do_not_specialize_on_alignment=["q_ptr", "bt_ptr", "seq_lens_ptr", "cand_ptr",
                                            "win_ptr", "out_ptr"])
def decode_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride,
                        bt_ptr, bt_stride, seq_lens_ptr, cand_ptr, win_ptr, out_ptr,
                        width, num_blocks, page_offset, page_step,
                        Q: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, DOT: tl.constexpr,
                        DEQUANT: tl.constexpr = "triton", WINDOW: tl.constexpr = 64,
                        KEEP: tl.constexpr = 16, PDL: tl.constexpr = False,
                        CANDIDATES: tl.constexpr = False):
    # Page subset (context parallelism, SPEC 8.2): the program walks pages
    # j = page_offset + k * page_step (0 and 1 for a single device), splits over k.
    # CANDIDATES: always write the candidate scratch, even with one split.
    b = tl.program_id(0)
    split = tl.program_id(1)
    # SPEC 10: pages clamped to the block-table width, block ids into the cache
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)
    n_pages = scored_pages(num_history_pages(seq_len))  # history of the last query
    n_sub = tl.maximum(n_pages - page_offset + page_step - 1, 0) // page_step
    start, end = split_range(n_sub, split, NUM_SPLITS)

    m = tl.arange(0, BLOCK_M)
    h, row_ok, local, row = decode_rows(b, m, seq_len, Q, H)
    q_off = row * q_row_stride + h * q_head_stride
    if DEQUANT != "triton":
        q_ops = load_q_quads_t(q_ptr, q_off, row_ok)
    else:
        q_ops = load_q_pairs_t(q_ptr, q_off, row_ok, DOT)
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride
    top = scan_pages(start, end, local, (cache_ptr, page_stride, bt_row, num_blocks), q_ops,
                     win_ptr, b * NUM_SPLITS + split, page_offset, page_step,
                     _cache_page_scores, DOT, DEQUANT, BLOCK_M, KEEP, WINDOW)

    if PDL:  # pages done: the merge grid may launch (it waits for this grid to finish)
        gdc_launch_dependents()
    finish_split(top, local, out_ptr + out_offsets(row, h, H), row_ok, cand_ptr,
                 (b * BLOCK_M + m).to(tl.int64), split, NUM_SPLITS, CANDIDATES)


@triton.jit
def _cache_page_scores(page_src, j, q_ops, DOT: tl.constexpr, DEQUANT: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of logical page j read in place from the paged cache
    (``page_src = (cache_ptr, page_stride, block-table row, num_blocks)``; the block id is
    clamped into the cache, SPEC 10) with the query operands ``q_ops`` of ``DEQUANT``."""
    cache_ptr, page_stride, bt_row, num_blocks = page_src
    block = tl.minimum(tl.maximum(tl.load(bt_row + j), 0), num_blocks - 1).to(tl.int64)
    page_ptr = cache_ptr + block * page_stride
    if DEQUANT != "triton":
        q0, q1, q2, q3 = q_ops
        return nvfp4_page_scores_ptx(page_ptr, q0, q1, q2, q3, DEQUANT)
    else:
        q_even, q_odd = q_ops
        return nvfp4_page_scores(page_ptr, q_even, q_odd, DOT)


@triton.jit(do_not_specialize=["width"],
            do_not_specialize_on_alignment=["seq_lens_ptr", "cand_ptr", "out_ptr"])
def decode_merge_kernel(cand_ptr, seq_lens_ptr, out_ptr, width, Q: tl.constexpr,
                        H: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        SPLITS_PAD: tl.constexpr, ROWS: tl.constexpr, KEEP: tl.constexpr,
                        PDL: tl.constexpr = False):
    if PDL:  # launched early (programmatic dependent launch): wait for the score grid
        gdc_wait()
    b = tl.program_id(0)
    m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)  # as the score kernel
    h, row_ok, local, row = decode_rows(b, m, seq_len, Q, H)
    merge_splits(cand_ptr, (b * BLOCK_M + m).to(tl.int64), row_ok, local,
                 out_ptr + out_offsets(row, h, H), NUM_SPLITS, SPLITS_PAD, KEEP)
