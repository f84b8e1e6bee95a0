"""Shared device code of the Triton scorers: query and key tiles, one page's scores (SPEC 4).

A page is scored for ``BLOCK_M`` query rows at once as a ``[128 tokens, BLOCK_M rows]`` tile
``K @ q^T`` on tensor cores (tokens as the MMA M dimension, so the 128-token page fills it),
then reduced to the page maximum over tokens per row.

NVFP4 pages (decode, ``page_scores``) are dequantized in registers exactly per SPEC 1.4:
``encode_e4m3(e2m1(code) * scale)``. A code byte holds dims 2i (low nibble) and 2i+1 (high
nibble), so on the GPU a page is scored as two K=64 products,
``K_even @ q_even^T + K_odd @ q_odd^T``, which needs no interleaving of the unpacked nibbles
(the fp32 / interpreter path interleaves and does one K=128 product: fewer interpreted ops).
FP8 workspace pages (prefill) are one K=128 product.

Dot modes (the ``DOT`` constexpr, a string; error bounds in ``decode.SCORE_ERROR_BITS``):

- "fp16" (GPU default) / "bf16": E4M3 operands converted exactly to fp16 / bf16 (every E4M3
  value is both), 16-bit MMA with fp32 accumulation, every product exact. fp16 is the default
  because E4M3 -> fp16 is one hardware conversion per pair on SM89+; the two are equally
  accurate here.
- "fp8": fp8 x fp8 MMA; on SM90 the accumulation keeps ~13 fraction bits (truncating).
- "fp32": the PORTABLE path (interpreter / CPU, or a GPU cross-check): integer-bit decoding
  and E4M3 rounding (``numerics``) to fp32 values and an IEEE fp32 dot (the interpreter's
  16-bit dot and fp8 casts are not trustworthy).

Scores: a token score is the fp32 dot; NaN token scores are skipped by the page max and a page
whose 128 token scores are all NaN scores NaN (SPEC 4). No other values are special: E4M3 has
no infinities and |q . k| <= 128 * 448^2 is finite.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import e4m3_decode, nvfp4_dequant_e4m3, portable_default

PAGE_SIZE = tl.constexpr(128)
CODE_BYTES = tl.constexpr(64)
SCALES_OFFSET = tl.constexpr(8192)


DOT_MODES = ("fp16", "bf16", "fp8", "fp32")
DEFAULT_GPU_DOT = "fp16"


def resolve_dot(dot, device) -> str:
    """The ``DOT`` constexpr of a launch: ``dot`` if given (one of ``DOT_MODES``), else "fp32"
    under the interpreter / off CUDA and ``DEFAULT_GPU_DOT`` on a GPU."""
    if dot is None:
        return "fp32" if portable_default(device) else DEFAULT_GPU_DOT
    if dot not in DOT_MODES:
        raise ValueError(f"dot: expected one of {DOT_MODES}, got {dot!r}")
    if dot != "fp32" and portable_default(device):
        raise ValueError(f"dot: only 'fp32' runs under the interpreter / off CUDA, got {dot!r}")
    return dot


@triton.jit
def e4m3_operand(byte, DOT: tl.constexpr):
    """MMA operand of E4M3 bytes (uint8) for dot mode ``DOT``; every conversion is exact."""
    if DOT == "fp32":
        return e4m3_decode(byte)
    else:
        f8 = byte.to(tl.float8e4nv, bitcast=True)
        if DOT == "fp8":
            return f8
        elif DOT == "bf16":
            return f8.to(tl.bfloat16)
        else:
            return f8.to(tl.float16)


@triton.jit
def load_q_pairs_t(q_ptr, row_off, row_mask, DOT: tl.constexpr):
    """Query operands of ``nvfp4_page_scores`` for rows at byte offsets ``row_off [BLOCK_M]``
    (int64) of E4M3 bytes ``q_ptr`` (uint8); masked rows load zeros.

    GPU modes: the transposed even / odd dims, two ``[64, BLOCK_M]`` operands. "fp32": the whole
    transposed rows ``[128, BLOCK_M]`` (fp32), returned twice (the interpreter path scores a
    page with one K=128 dot: fewer interpreted ops).
    """
    if DOT == "fp32":
        q = load_q_t(q_ptr, row_off, row_mask, DOT)
        return q, q
    else:
        d = tl.arange(0, 64)[:, None]
        base = q_ptr + row_off[None, :] + 2 * d
        qe = tl.load(base, mask=row_mask[None, :], other=0)
        qo = tl.load(base + 1, mask=row_mask[None, :], other=0)
        return e4m3_operand(qe, DOT), e4m3_operand(qo, DOT)


@triton.jit
def load_q_t(q_ptr, row_off, row_mask, DOT: tl.constexpr):
    """Transposed query rows: a ``[128, BLOCK_M]`` MMA operand (see ``load_q_pairs_t``)."""
    d = tl.arange(0, 128)[:, None]
    q = tl.load(q_ptr + row_off[None, :] + d, mask=row_mask[None, :], other=0)
    return e4m3_operand(q, DOT)


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
def e4m3_round_operand(x_f16, DOT: tl.constexpr):
    """encode_e4m3 of exact fp16 products (SPEC 1.1, 1.4) as an MMA operand of ``DOT``
    (fp16 / bf16 / fp8): one native round-to-nearest-even saturating conversion
    (``cvt.rn.satfinite``: beyond +-448 -> +-448, NaN -> 0x7F), exact widening after."""
    k8 = x_f16.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    if DOT == "fp8":
        return k8
    elif DOT == "bf16":
        return k8.to(tl.bfloat16)
    else:
        return k8.to(tl.float16)


# Inline-PTX dequantization (``DEQUANT="ptx"``, SM89+). ``pack=2`` over uint16 code pairs:
# $4 = 4 code bytes [b3 b2 b1 b0] (element 0 = bytes b1 b0, element 1 = b3 b2), $5 = their
# fp16 scales (f16x2). Outputs (f16x2, half i = element i): $0 = low nibbles of b0 / b2,
# $1 = high nibbles of b0 / b2, $2 = low nibbles of b1 / b3, $3 = high nibbles of b1 / b3.
# Each output half depends only on its own element's bytes and scale (any packing order).
# Per f16x2: a sign-replicating byte permute builds halves [S(b) : b] (S = 0xFF if bit 7 of b
# is set); << 5 and the mask 0x8E00 per half move bits 4..6 of b onto fp16 bits 9..11 and
# bit 7 onto the sign: e2m1 * 2^-14 exactly (code 1 is the subnormal 2^-15, code 8 is -0.0).
# Low nibbles take the same steps on w << 4. Then * 2^14 and * scale (both exact, see
# ``nvfp4_page_operands``), one RNE saturating conversion to E4M3 (NaN -> 0x7F, beyond +-448
# -> +-448) and the exact widening back to fp16.
# Shared by both asm families: the permuted sign-replicated bytes in x0..x3 -> e2m1 values.
_PTX_NIBBLES_TO_F16 = """shl.b32 x0, x0, 5;
shl.b32 x1, x1, 5;
shl.b32 x2, x2, 5;
shl.b32 x3, x3, 5;
and.b32 x0, x0, 0x8E008E00;
and.b32 x1, x1, 0x8E008E00;
and.b32 x2, x2, 0x8E008E00;
and.b32 x3, x3, 0x8E008E00;
mul.rn.f16x2 x0, x0, k14;
mul.rn.f16x2 x1, x1, k14;
mul.rn.f16x2 x2, x2, k14;
mul.rn.f16x2 x3, x3, k14;
"""

_PTX_HEAD = """{
.reg .b32 w4, x0, x1, x2, x3, k14;
mov.b32 k14, 0x74007400;
shl.b32 w4, $4, 4;
prmt.b32 x0, w4, w4, 0xA280;
prmt.b32 x1, $4, $4, 0xA280;
prmt.b32 x2, w4, w4, 0xB391;
prmt.b32 x3, $4, $4, 0xB391;
""" + _PTX_NIBBLES_TO_F16 + """mul.rn.f16x2 x0, x0, $5;
mul.rn.f16x2 x1, x1, $5;
mul.rn.f16x2 x2, x2, $5;
mul.rn.f16x2 x3, x3, $5;
"""

# "ptx": native conversions (two F2FP per f16x2: round to E4M3, widen back).
_PTX_CVT_TAIL = """.reg .b16 e0, e1, e2, e3;
cvt.rn.satfinite.e4m3x2.f16x2 e0, x0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, x1;
cvt.rn.satfinite.e4m3x2.f16x2 e2, x2;
cvt.rn.satfinite.e4m3x2.f16x2 e3, x3;
cvt.rn.f16x2.e4m3x2 $0, e0;
cvt.rn.f16x2.e4m3x2 $1, e1;
cvt.rn.f16x2.e4m3x2 $2, e2;
cvt.rn.f16x2.e4m3x2 $3, e3;
}"""

# "ptx_arith": the same E4M3 rounding without conversion instructions (slow on Hopper).
# a = min.NaN(|x|, 448) (saturation; NaN propagates); M = 2^(e+7) for a in [2^e, 2^(e+1)),
# at least 2 (e <= -6: the E4M3 subnormal quantum 2^-9): built on the fp16 bits as
# max_u16((a & 0x7C00) + 0x1C00, 0x4000). Then (a + M) - M: the sum lies in [M, 2M), where
# the fp16 ulp is 2^(e-3) = the E4M3 quantum (2^-9 for M = 2), so the addition rounds a to
# nearest-even on the E4M3 grid and the subtraction is exact; finally x's sign goes back on
# (keeps -0.0). NaN stays NaN through every step.
_PTX_ARITH_ROUND = """abs.f16x2 {a}, {x};
min.NaN.f16x2 {a}, {a}, k448;
and.b32 {m}, {a}, 0x7C007C00;
add.u32 {m}, {m}, 0x1C001C00;
max.u16x2 {m}, {m}, kmin;
add.rn.f16x2 {a}, {a}, {m};
sub.rn.f16x2 {a}, {a}, {m};
lop3.b32 {d}, {a}, {x}, 0x80008000, 0xD8;
"""
_PTX_ARITH_TAIL = (".reg .b32 k448, kmin, a0, a1, a2, a3, m0, m1, m2, m3;\n"
                   "mov.b32 k448, 0x5F005F00;\nmov.b32 kmin, 0x40004000;\n"
                   + "".join(_PTX_ARITH_ROUND.format(a=f"a{i}", m=f"m{i}", x=f"x{i}", d=f"${i}")
                             for i in range(4)) + "}")

_DEQUANT_PTX = tl.constexpr(_PTX_HEAD + _PTX_CVT_TAIL)
_DEQUANT_PTX_ARITH = tl.constexpr(_PTX_HEAD + _PTX_ARITH_TAIL)
DEQUANT_MODES = ("triton", "ptx", "ptx_arith")


@triton.jit
def nvfp4_dequant_ptx(code_pairs, scale_f16, DEQUANT: tl.constexpr = "ptx"):
    """dequant_e4m3 (SPEC 1.4), widened exactly to fp16, of the four nibbles of uint16 code
    pairs ``code_pairs`` (byte 2i + 1 in the high byte, as two code bytes load little-endian)
    with their group scales ``scale_f16`` (fp16 holding E4M3 values, same shape).

    Returns four fp16 tensors of that shape: the low nibble of the first byte, its high
    nibble, the low nibble of the second byte, its high nibble (dims 4i .. 4i + 3 when element
    i holds code bytes 2i, 2i + 1 of a token). Inline PTX: SM89+ GPUs only (no interpreter).
    """
    if DEQUANT == "ptx_arith":
        asm: tl.constexpr = _DEQUANT_PTX_ARITH
    else:
        asm: tl.constexpr = _DEQUANT_PTX
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [code_pairs, scale_f16],
                                     dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                     is_pure=True, pack=2)


# Inline-PTX dequantization straight to E4M3 bytes (the gather, ``DEQUANT="ptx"``, SM89+).
# ``pack=2`` over uint16 code pairs: $2 = 4 code bytes [b3 b2 b1 b0] (element 0 = b1 b0,
# element 1 = b3 b2), $3 = the elements' fp16 scales (f16x2, element 0 in the low half).
# Outputs (32-bit): $0 = the 4 E4M3 bytes of element 0 [hi(b1) lo(b1) hi(b0) lo(b0)] (byte 0 =
# low nibble of b0, i.e. dims 4i .. 4i + 3 in memory order), $1 = the same for element 1.
# Per code byte b one f16x2 holds its two nibbles: ``prmt(w << 4, w, sel)`` builds the halves
# [S(w4.b) : w4.b] (low half: the low nibble moved to bits 4..7) and [S(w.b) : w.b] (high
# half: the high nibble), S = sign-replicated byte (selector nibbles 8..F). Then, exactly as
# ``_PTX_HEAD``: << 5 and the mask 0x8E00 per half give e2m1 * 2^-14, * 2^14 and * the
# element's scale (prmt 0x1010 / 0x3232 duplicates the low / high scale half) are exact,
# one RNE saturating conversion per f16x2 (low half -> low byte). A NaN scale must give 0x7F
# (SPEC 1.1) whatever sign the hardware leaves on a NaN product or keeps through the cvt, so
# every byte whose magnitude is 0x7F (only NaN: satfinite never yields it for a finite value)
# gets its sign bit cleared: (byte & 0x7F) + 1 carries into bit 7 exactly then, with no carry
# across bytes, and LOP3 0x70 computes a & ~(b & c).
_DEQUANT_E4M3_BYTES_PTX = tl.constexpr("""{
.reg .b32 w4, x0, x1, x2, x3, k14, s0, s1, r0, r1, n0, n1;
.reg .b16 e0, e1, e2, e3;
mov.b32 k14, 0x74007400;
shl.b32 w4, $2, 4;
prmt.b32 x0, w4, $2, 0xC480;
prmt.b32 x1, w4, $2, 0xD591;
prmt.b32 x2, w4, $2, 0xE6A2;
prmt.b32 x3, w4, $2, 0xF7B3;
""" + _PTX_NIBBLES_TO_F16 + """prmt.b32 s0, $3, $3, 0x1010;
prmt.b32 s1, $3, $3, 0x3232;
mul.rn.f16x2 x0, x0, s0;
mul.rn.f16x2 x1, x1, s0;
mul.rn.f16x2 x2, x2, s1;
mul.rn.f16x2 x3, x3, s1;
cvt.rn.satfinite.e4m3x2.f16x2 e0, x0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, x1;
cvt.rn.satfinite.e4m3x2.f16x2 e2, x2;
cvt.rn.satfinite.e4m3x2.f16x2 e3, x3;
mov.b32 r0, {e0, e1};
mov.b32 r1, {e2, e3};
and.b32 n0, r0, 0x7F7F7F7F;
and.b32 n1, r1, 0x7F7F7F7F;
add.u32 n0, n0, 0x01010101;
add.u32 n1, n1, 0x01010101;
lop3.b32 $0, r0, n0, 0x80808080, 0x70;
lop3.b32 $1, r1, n1, 0x80808080, 0x70;
}""")


@triton.jit
def nvfp4_dequant_ptx_bytes(code_pairs, scale_f16):
    """dequant_e4m3 bytes (SPEC 1.4) of the four nibbles of uint16 code pairs ``code_pairs``
    (byte 2i + 1 in the high byte, as two code bytes load little-endian) with their group
    scales ``scale_f16`` (fp16 holding E4M3 values, same shape; NaN and negative scales follow
    SPEC 1.4, NaN gives 0x7F).

    Returns a uint32 tensor of that shape: byte j (little-endian) of element i is dim 4i + j
    when element i holds code bytes 2i, 2i + 1 of a token, so storing it through a uint32
    view writes the token-major E4M3 row. Inline PTX: SM89+ GPUs only (no interpreter).
    """
    return tl.inline_asm_elementwise(_DEQUANT_E4M3_BYTES_PTX, "=r,=r,r,r",
                                     [code_pairs, scale_f16], dtype=tl.uint32,
                                     is_pure=True, pack=2)


@triton.jit
def load_q_quads_t(q_ptr, row_off, row_mask):
    """Query operands of ``nvfp4_page_scores_ptx``: fp16 ``[32, BLOCK_M]`` transposed dims
    4i, 4i + 1, 4i + 2, 4i + 3 of the E4M3 rows at byte offsets ``row_off [BLOCK_M]`` (int64)
    of ``q_ptr`` (uint8); masked rows load zeros."""
    d = tl.arange(0, 32)[:, None]
    base = q_ptr + row_off[None, :] + 4 * d
    q0 = tl.load(base, mask=row_mask[None, :], other=0)
    q1 = tl.load(base + 1, mask=row_mask[None, :], other=0)
    q2 = tl.load(base + 2, mask=row_mask[None, :], other=0)
    q3 = tl.load(base + 3, mask=row_mask[None, :], other=0)
    return (e4m3_operand(q0, "fp16"), e4m3_operand(q1, "fp16"), e4m3_operand(q2, "fp16"),
            e4m3_operand(q3, "fp16"))


@triton.jit
def load_nvfp4_page(page_ptr, DEQUANT: tl.constexpr):
    """The raw bytes of one NVFP4 page (``page_ptr``, SPEC 2) in the form its scorer takes:
    ``(codes, scale bytes)``; ``codes`` are uint16 pairs ``[128, 32]`` for the ptx modes and
    bytes ``[128, 64]`` otherwise, scale bytes are ``[128, 8]`` uint8."""
    t = tl.arange(0, PAGE_SIZE)[:, None]
    if DEQUANT != "triton":
        cptr = (page_ptr + t * CODE_BYTES).to(tl.pointer_type(tl.uint16), bitcast=True) \
            + tl.arange(0, 32)[None, :]
    else:
        cptr = page_ptr + t * CODE_BYTES + tl.arange(0, CODE_BYTES)[None, :]
    sptr = page_ptr + SCALES_OFFSET + t * 8 + tl.arange(0, 8)[None, :]
    return tl.load(cptr), tl.load(sptr)


@triton.jit
def nvfp4_page_scores_ptx(page_ptr, q0_t, q1_t, q2_t, q3_t, DEQUANT: tl.constexpr = "ptx"):
    """fp32 ``[BLOCK_M]`` scores of one NVFP4 page (``page_ptr``, SPEC 2) for the rows of
    ``load_q_quads_t``: ``load_nvfp4_page`` then ``nvfp4_scores_ptx``. GPU only (SM89+)."""
    codes, sbytes = load_nvfp4_page(page_ptr, DEQUANT)
    return nvfp4_scores_ptx(codes, sbytes, q0_t, q1_t, q2_t, q3_t, DEQUANT)


@triton.jit
def nvfp4_scores_ptx(codes, sbytes, q0_t, q1_t, q2_t, q3_t, DEQUANT: tl.constexpr = "ptx"):
    """fp32 ``[BLOCK_M]`` scores of one NVFP4 page given as ``load_nvfp4_page`` bytes:
    inline-PTX dequantization (``nvfp4_dequant_ptx``, bit-exact SPEC 1.4) and four K=32 fp16
    MMAs over dims 4i + j (j = 0..3); same products and error bound as dot mode "fp16" (only
    the fp32 accumulation order differs). GPU only (SM89+).

    The code bytes are read as uint16 pairs, so a thread's MMA operand registers (pairs of
    consecutive K) come from one 32-bit shared-memory word: no byte repacking. The page
    maximum is one NaN-ignoring max (``max.f32`` returns the non-NaN operand), NaN when all
    128 token scores are NaN, as SPEC 4 asks.
    """
    s8 = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact
    s = tl.reshape(tl.broadcast_to(s8[:, :, None], (PAGE_SIZE, 8, 4)), (PAGE_SIZE, 32))
    k0, k1, k2, k3 = nvfp4_dequant_ptx(codes, s, DEQUANT)
    acc = tl.dot(k0, q0_t, input_precision="ieee", out_dtype=tl.float32)
    acc = tl.dot(k1, q1_t, acc, input_precision="ieee", out_dtype=tl.float32)
    acc = tl.dot(k2, q2_t, acc, input_precision="ieee", out_dtype=tl.float32)
    acc = tl.dot(k3, q3_t, acc, input_precision="ieee", out_dtype=tl.float32)
    return tl.max(acc, 0)


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
        s = tl.reshape(tl.broadcast_to(s8[:, :, None], (PAGE_SIZE, 8, 16)), (PAGE_SIZE, 128))
        k = nvfp4_dequant_e4m3(c, s)
        return k, k
    else:
        s8 = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact
        s = tl.reshape(tl.broadcast_to(s8[:, :, None], (PAGE_SIZE, 8, 8)),
                       (PAGE_SIZE, CODE_BYTES))
        v_lo, v_hi = e2m1_pair_f16(codes)
        return e4m3_round_operand(v_lo * s, DOT), e4m3_round_operand(v_hi * s, DOT)


@triton.jit
def page_max(token_scores):
    """Page score per row from ``[128 tokens, BLOCK_M]`` fp32 token scores: max over tokens
    skipping NaN; NaN when all 128 are NaN (SPEC 4)."""
    s = tl.where(token_scores == token_scores, token_scores, float("-inf"))
    m = tl.max(s, 0)
    return tl.where(m == float("-inf"), float("nan"), m)


@triton.jit
def nvfp4_page_scores(page_ptr, q_even_t, q_odd_t, DOT: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of one NVFP4 page for the rows of ``q_even_t`` / ``q_odd_t``
    (``load_q_pairs_t``)."""
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
    bytes, token-major, SPEC 2) for the rows of ``q_t`` (``load_q_t``)."""
    t = tl.arange(0, PAGE_SIZE)[:, None]
    kb = tl.load(page_ptr + t * 128 + tl.arange(0, 128)[None, :])
    k = e4m3_operand(kb, DOT)
    acc = tl.dot(k, q_t, input_precision="ieee", out_dtype=tl.float32)
    return page_max(acc)


@triton.jit
def load_q_rows(q_ptr, row_off, row_mask, DOT: tl.constexpr):
    """Query rows ``[BLOCK_M, 128]`` as the A operand of ``fp8_page_scores_n`` (E4M3 bytes at
    byte offsets ``row_off [BLOCK_M]`` (int64) of ``q_ptr``; masked rows load zeros)."""
    q = tl.load(q_ptr + row_off[:, None] + tl.arange(0, 128)[None, :], mask=row_mask[:, None],
                other=0)
    return e4m3_operand(q, DOT)


@triton.jit
def fp8_page_scores_n(page_ptr, q_rows, DOT: tl.constexpr):
    """``fp8_page_scores`` with the tokens on the MMA's N axis: ``[BLOCK_M, 128 tokens]`` =
    ``q_rows`` (``load_q_rows``) x page^T, one K=128 MMA with the converted page as the
    shared-memory operand. The max over tokens then stays inside each thread's columns and
    its quad (2 shuffles), where tokens on M reduce across lanes and warps through shared
    memory: the page loop of the 128-row prefill kernel drops from 1054 to ~330 SASS
    instructions (``benchmarks.sass_stats``). The max is one NaN-ignoring max (``max.f32``
    returns the non-NaN operand), NaN when all 128 are NaN (SPEC 4). GPU dot modes."""
    t = tl.arange(0, PAGE_SIZE)[:, None]
    kb = tl.load(page_ptr + t * 128 + tl.arange(0, 128)[None, :])
    k = e4m3_operand(kb, DOT)
    acc = tl.dot(q_rows, tl.trans(k), input_precision="ieee", out_dtype=tl.float32)
    return tl.max(acc, 1)


@triton.jit
def block_rows_info(qsl_ptr, seq_lens_ptr, blk_ptr, num_blocks, blk, rows,
                    H: tl.constexpr):
    """Rows of row block ``blk`` (see ``heuristics.plan_row_blocks``; ``blk_ptr`` holds int32
    ``[2, num_blocks]``: request, first row), for in-block row indices ``rows [R]``.

    Returns ``(token [R] int64, head [R], local page [R] (0 for p < 0), row mask [R])``.
    """
    r = tl.load(blk_ptr + blk)
    row0 = tl.load(blk_ptr + num_blocks + blk)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    m = row0 + rows
    row_ok = m < q_len * H
    t = m // H
    p = seq_len - q_len + t
    local = tl.where(p >= 0, p // 128, 0)
    return (q_start + t).to(tl.int64), m % H, local, row_ok
