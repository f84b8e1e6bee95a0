"""MMA operands of the Triton scorers: query tiles, the raw bytes of an NVFP4 page and its
dequantized keys (SPEC 1.4, 2, 4).

A page is scored for ``BLOCK_M`` query rows at once as a ``[128 tokens, BLOCK_M rows]`` tile
``K @ q^T`` (tokens as the MMA M dimension, so the 128-token page fills it), or with the
tokens on N (``load_q_rows``). A code byte holds dims 2i (low nibble) and 2i+1 (high nibble),
so on the GPU an NVFP4 page is two K=64 operands ``K_even`` / ``K_odd`` (no interleaving of
the unpacked nibbles; the fp32 / interpreter path interleaves and does one K=128 product:
fewer interpreted ops), or, read as uint16 code pairs for the inline-PTX dequantization
(``ptx``), four K=32 operands over dims 4i + j.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dot_modes import e4m3_operand, e4m3_round_operand
from .layout import CODE_BYTES, CODE_PAIRS, GROUPS, HEAD, PAGE, SCALES_OFFSET
from .numerics import e4m3_decode, nvfp4_dequant_e4m3


@triton.jit
def load_q_t(q_ptr, row_off, row_mask, DOT: tl.constexpr):
    """Transposed query rows: a ``[128, BLOCK_M]`` MMA operand of the E4M3 rows at byte
    offsets ``row_off [BLOCK_M]`` (int64) of ``q_ptr`` (uint8); masked rows load zeros."""
    d = tl.arange(0, HEAD)[:, None]
    q = tl.load(q_ptr + row_off[None, :] + d, mask=row_mask[None, :], other=0)
    return e4m3_operand(q, DOT)


@triton.jit
def load_q_pairs_t(q_ptr, row_off, row_mask, DOT: tl.constexpr):
    """Query operands of ``scoring.nvfp4_page_scores`` for rows at byte offsets
    ``row_off [BLOCK_M]`` (int64) of E4M3 bytes ``q_ptr`` (uint8); masked rows load zeros.

    GPU modes: the transposed even / odd dims, two ``[64, BLOCK_M]`` operands. "fp32": the whole
    transposed rows ``[128, BLOCK_M]`` (fp32), returned twice (the interpreter path scores a
    page with one K=128 dot: fewer interpreted ops).
    """
    if DOT == "fp32":
        q = load_q_t(q_ptr, row_off, row_mask, DOT)
        return q, q
    else:  # dim pair d = code byte d
        return (_q_dims_t(q_ptr, row_off, row_mask, 2, CODE_BYTES, 0, DOT),
                _q_dims_t(q_ptr, row_off, row_mask, 2, CODE_BYTES, 1, DOT))


@triton.jit
def load_q_quads_t(q_ptr, row_off, row_mask):
    """Query operands of ``scoring.nvfp4_page_scores_ptx``: fp16 ``[32, BLOCK_M]`` transposed
    dims 4i, 4i + 1, 4i + 2, 4i + 3 of the E4M3 rows at byte offsets ``row_off [BLOCK_M]``
    (int64) of ``q_ptr`` (uint8); masked rows load zeros."""
    # dim quad d = code pair d
    return (_q_dims_t(q_ptr, row_off, row_mask, 4, CODE_PAIRS, 0, "fp16"),
            _q_dims_t(q_ptr, row_off, row_mask, 4, CODE_PAIRS, 1, "fp16"),
            _q_dims_t(q_ptr, row_off, row_mask, 4, CODE_PAIRS, 2, "fp16"),
            _q_dims_t(q_ptr, row_off, row_mask, 4, CODE_PAIRS, 3, "fp16"))


@triton.jit
def _q_dims_t(q_ptr, row_off, row_mask, STEP: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              DOT: tl.constexpr):
    """``DOT`` operand ``[N, BLOCK_M]``: dims ``STEP * d + K`` (d < N) of the E4M3 rows at byte
    offsets ``row_off [BLOCK_M]`` of ``q_ptr``, transposed; masked rows load zeros."""
    d = tl.arange(0, N)[:, None]
    base = q_ptr + row_off[None, :] + STEP * d
    qb = tl.load(base + K, mask=row_mask[None, :], other=0)
    return e4m3_operand(qb, DOT)


@triton.jit
def load_q_rows(q_ptr, row_off, row_mask, DOT: tl.constexpr):
    """Query rows ``[BLOCK_M, 128]`` as the A operand of ``scoring.fp8_page_scores_n`` (E4M3
    bytes at byte offsets ``row_off [BLOCK_M]`` (int64) of ``q_ptr``; masked rows load
    zeros)."""
    q = tl.load(q_ptr + row_off[:, None] + tl.arange(0, HEAD)[None, :], mask=row_mask[:, None],
                other=0)
    return e4m3_operand(q, DOT)


@triton.jit
def load_nvfp4_page(page_ptr, DEQUANT: tl.constexpr):
    """The raw bytes of one NVFP4 page (``page_ptr``, SPEC 2) in the form its scorer takes:
    ``(codes, scale bytes)``; ``codes`` are uint16 pairs ``[128, 32]`` for the ptx modes and
    bytes ``[128, 64]`` otherwise, scale bytes are ``[128, 8]`` uint8."""
    t = tl.arange(0, PAGE)[:, None]
    if DEQUANT != "triton":
        cptr = (page_ptr + t * CODE_BYTES).to(tl.pointer_type(tl.uint16), bitcast=True) \
            + tl.arange(0, CODE_PAIRS)[None, :]
    else:
        cptr = page_ptr + t * CODE_BYTES + tl.arange(0, CODE_BYTES)[None, :]
    sptr = page_ptr + SCALES_OFFSET + t * GROUPS + tl.arange(0, GROUPS)[None, :]
    return tl.load(cptr), tl.load(sptr)


@triton.jit
def e2m1_pair_f16(code_bytes):
    """fp16 values (exact, SPEC 1.2) of the low and high E2M1 nibbles of code bytes (uint8).

    A nibble's magnitude bits placed at fp16 bits 9..11 give e2m1 * 2^-14 (code 1 lands on the
    subnormal 2^-15), its sign at bit 15; one exact multiply by 2^14 restores the value
    (code 8 gives -0.0). Masks take the nibbles straight from the byte (no unpacking shift).
    """
    u = code_bytes.to(tl.uint16)
    lo = ((u & 0x07) << 9) | ((u & 0x08) << 12)
    hi = ((u & 0x70) << 5) | ((u & 0x80) << 8)
    return (lo.to(tl.float16, bitcast=True) * 16384.0,
            hi.to(tl.float16, bitcast=True) * 16384.0)


@triton.jit
def nvfp4_page_operands(page_ptr, DOT: tl.constexpr):
    """Dequantized keys of one NVFP4 page (SPEC 1.4, 2).

    ``page_ptr`` points at the page's 9216 bytes (uint8): codes of token t at t*64 .. t*64+63,
    its 8 group scales at 8192 + 8t; code byte i of a token holds dims 2i (low nibble) and
    2i+1 (high nibble), both in group i // 8.

    GPU modes: two ``[128 tokens, 64]`` operands, dims 0, 2, .., 126 and dims 1, 3, .., 127:
    ``e2m1 * scale`` is exact in fp16 (at most 6 significant bits, |x| <= 6 * 448 = 2688,
    nonzero |x| >= 2^-10 stays normal; NaN and negative scales follow IEEE), so one native
    conversion to E4M3 gives exactly dequant_e4m3. "fp32": one ``[128, 128]`` fp32 tile in
    dim order (returned twice) from the integer-bit E4M3 rounding of ``numerics``.
    """
    codes, sbytes = load_nvfp4_page(page_ptr, "triton")
    return nvfp4_operands(codes, sbytes, DOT)


@triton.jit
def nvfp4_operands(codes, sbytes, DOT: tl.constexpr):
    """``nvfp4_page_operands`` of a page given as ``load_nvfp4_page(..., "triton")`` bytes."""
    if DOT == "fp32":
        s8 = e4m3_decode(sbytes)  # [128, 8] fp32 scale values
        c = tl.interleave(codes & 15, codes >> 4)  # [128, 128] codes in dim order
        s = tl.reshape(tl.broadcast_to(s8[:, :, None], (PAGE, GROUPS, HEAD // GROUPS)),
                       (PAGE, HEAD))
        k = nvfp4_dequant_e4m3(c, s)
        return k, k
    else:
        s8 = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact
        s = tl.reshape(tl.broadcast_to(s8[:, :, None], (PAGE, GROUPS, CODE_BYTES // GROUPS)),
                       (PAGE, CODE_BYTES))
        v_lo, v_hi = e2m1_pair_f16(codes)
        return e4m3_round_operand(v_lo * s, DOT), e4m3_round_operand(v_hi * s, DOT)
