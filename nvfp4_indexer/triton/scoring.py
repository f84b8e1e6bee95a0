"""Page scorers of the Triton backend: one page's scores for ``BLOCK_M`` query rows (SPEC 4).

NVFP4 pages (decode, ``scores``) are dequantized in registers exactly per SPEC 1.4
(``operands``, or the inline PTX of ``ptx``), FP8 workspace pages (prefill) are one K=128
product; dot modes and their operands: ``dot_modes``.

Scores: a token score is the fp32 dot; NaN token scores are skipped by the page max and a page
whose 128 token scores are all NaN scores NaN (SPEC 4). No other values are special: E4M3 has
no infinities and |q . k| <= 128 * 448^2 is finite.

``prefill.dispatch.plan_row_blocks`` (host) plans the row blocks of the prefill scorer and
``page_scores``; their kernels read a block's rows with ``scan.block_rows_info``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dot_modes import e4m3_operand
from .layout import CODE_PAIRS, GROUPS, HEAD, PAGE
from .operands import load_nvfp4_page, nvfp4_operands
from .ptx import nvfp4_dequant_ptx


@triton.jit
def page_max(token_scores):
    """Page score per row from ``[128 tokens, BLOCK_M]`` fp32 token scores: max over tokens
    skipping NaN; NaN when all 128 are NaN (SPEC 4)."""
    s = tl.where(token_scores == token_scores, token_scores, float("-inf"))
    m = tl.max(s, 0)
    return tl.where(m == float("-inf"), float("nan"), m)


@triton.jit
def nvfp4_page_scores_ptx(page_ptr, q0_t, q1_t, q2_t, q3_t, DEQUANT: tl.constexpr = "ptx"):
    """fp32 ``[BLOCK_M]`` scores of one NVFP4 page (``page_ptr``, SPEC 2) for the rows of
    ``operands.load_q_quads_t``: ``load_nvfp4_page`` then ``nvfp4_scores_ptx``. GPU only (SM89+)."""
    codes, sbytes = load_nvfp4_page(page_ptr, DEQUANT)
    return nvfp4_scores_ptx(codes, sbytes, q0_t, q1_t, q2_t, q3_t, DEQUANT)


@triton.jit
def nvfp4_scores_ptx(codes, sbytes, q0_t, q1_t, q2_t, q3_t, DEQUANT: tl.constexpr = "ptx"):
    """fp32 ``[BLOCK_M]`` scores of one NVFP4 page given as ``load_nvfp4_page`` bytes:
    inline-PTX dequantization (``ptx.nvfp4_dequant_ptx``, bit-exact SPEC 1.4) and four K=32 fp16
    MMAs over dims 4i + j (j = 0..3); same products and error bound as dot mode "fp16" (only
    the fp32 accumulation order differs). GPU only (SM89+).

    The code bytes are read as uint16 pairs, so a thread's MMA operand registers (pairs of
    consecutive K) come from one 32-bit shared-memory word: no byte repacking. The page
    maximum is one NaN-ignoring max (``max.f32`` returns the non-NaN operand), NaN when all
    128 token scores are NaN, as SPEC 4 asks.
    """
    s8 = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact
    s = tl.reshape(tl.broadcast_to(s8[:, :, None], (PAGE, GROUPS, CODE_PAIRS // GROUPS)),
                   (PAGE, CODE_PAIRS))
    k0, k1, k2, k3 = nvfp4_dequant_ptx(codes, s, DEQUANT)
    acc = tl.dot(k0, q0_t, input_precision="ieee", out_dtype=tl.float32)
    acc = tl.dot(k1, q1_t, acc, input_precision="ieee", out_dtype=tl.float32)
    acc = tl.dot(k2, q2_t, acc, input_precision="ieee", out_dtype=tl.float32)
    acc = tl.dot(k3, q3_t, acc, input_precision="ieee", out_dtype=tl.float32)
    return tl.max(acc, 0)


@triton.jit
def nvfp4_page_scores(page_ptr, q_even_t, q_odd_t, DOT: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of one NVFP4 page for the rows of ``q_even_t`` / ``q_odd_t``
    (``operands.load_q_pairs_t``)."""
    codes, sbytes = load_nvfp4_page(page_ptr, "triton")
    return nvfp4_scores(codes, sbytes, q_even_t, q_odd_t, DOT)


@triton.jit
def nvfp4_scores(codes, sbytes, q_even_t, q_odd_t, DOT: tl.constexpr):
    """``nvfp4_page_scores`` of a page given as ``load_nvfp4_page(..., "triton")`` bytes."""
    k_lo, k_hi = nvfp4_operands(codes, sbytes, DOT)
    if DOT == "fp32":  # one K=128 fp32 dot (operands in dim order)
        acc = tl.dot(k_lo, q_even_t, input_precision="ieee", out_dtype=tl.float32)
    else:
        acc = tl.dot(k_lo, q_even_t, input_precision="ieee", out_dtype=tl.float32)
        acc = tl.dot(k_hi, q_odd_t, acc, input_precision="ieee", out_dtype=tl.float32)
    return page_max(acc)


@triton.jit
def fp8_page_scores(page_ptr, q_t, DOT: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of one FP8 workspace page (``[128 tokens, 128 dims]`` E4M3
    bytes, token-major, SPEC 2) for the rows of ``q_t`` (``operands.load_q_t``)."""
    t = tl.arange(0, PAGE)[:, None]
    return fp8_tile_scores(tl.load(page_ptr + t * HEAD + tl.arange(0, HEAD)[None, :]), q_t, DOT)


@triton.jit
def fp8_tile_scores(kb, q_t, DOT: tl.constexpr):
    """``fp8_page_scores`` of a page already in registers: E4M3 bytes ``kb [128, 128]``."""
    k = e4m3_operand(kb, DOT)
    acc = tl.dot(k, q_t, input_precision="ieee", out_dtype=tl.float32)
    return page_max(acc)


@triton.jit
def fp8_page_scores_n(page_ptr, q_rows, DOT: tl.constexpr):
    """``fp8_page_scores`` with the tokens on the MMA's N axis: ``[BLOCK_M, 128 tokens]`` =
    ``q_rows`` (``operands.load_q_rows``) x page^T, one K=128 MMA with the converted page as the
    shared-memory operand. The max over tokens then stays inside each thread's columns and
    its quad (2 shuffles), where tokens on M reduce across lanes and warps through shared
    memory (a much shorter page loop: ``benchmarks.sass_stats``). The max
    is one NaN-ignoring max (``max.f32`` returns the non-NaN operand), NaN when all 128 are
    NaN (SPEC 4). GPU dot modes."""
    t = tl.arange(0, PAGE)[:, None]
    return fp8_tile_scores_n(tl.load(page_ptr + t * HEAD + tl.arange(0, HEAD)[None, :]),
                             q_rows, DOT)


@triton.jit
def fp8_tile_scores_n(kb, q_rows, DOT: tl.constexpr):
    """``fp8_page_scores_n`` of a page already in registers: E4M3 bytes ``kb [128, 128]``."""
    k = e4m3_operand(kb, DOT)
    acc = tl.dot(q_rows, tl.trans(k), input_precision="ieee", out_dtype=tl.float32)
    return tl.max(acc, 1)


