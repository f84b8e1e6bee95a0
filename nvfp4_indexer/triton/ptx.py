"""Inline-PTX NVFP4 dequantization (SPEC 1.4) and the plain-Triton twin of each block.

Three asm blocks, each written out whole below with the meaning of every register on its
line, each behind one ``@triton.jit`` wrapper, its portable twin (plain Triton, any device and
the interpreter, the same outputs bit for bit) named beside it:

- ``DEQUANT_F16_CVT_PTX`` / ``dequant_f16_cvt`` (decode ``DEQUANT="ptx"``, SM89+), twin
  ``dequant_f16_portable``: dequant_e4m3 widened to fp16, native E4M3 conversions.
- ``DEQUANT_F16_ARITH_PTX`` / ``dequant_f16_arith`` (decode ``"ptx_arith"``, SM90+:
  ``max.u16x2``), twin ``dequant_f16_portable``: the same values, the E4M3 rounding done with
  fp16 arithmetic instead of conversion instructions.
- ``DEQUANT_E4M3_BYTES_PTX`` / ``dequant_e4m3_bytes`` (the gather, SM89+), twin
  ``dequant_e4m3_bytes_portable``: the E4M3 bytes themselves, four per uint32 word.

All take ``pack=2`` over uint16 code pairs: one 32-bit input word holds 4 code bytes
[b3 b2 b1 b0], element 0 = bytes b1 b0 (codes of dims 4i .. 4i + 3 when element i holds code
bytes 2i, 2i + 1 of a token), element 1 = b3 b2; the second input holds the two elements'
fp16 group scales (f16x2, element 0 in the low half). Each output depends only on its own
element's bytes and scale.

Shared steps. e2m1 -> fp16: a nibble's magnitude bits placed on fp16 bits 9..11 and its sign
on bit 15 give e2m1 * 2^-14 exactly (code 1 lands on the subnormal 2^-15, code 8 is -0.0);
the byte permute ``prmt`` with sign-replicating selectors (8..F) builds halves [S(b) : b]
(S = 0xFF when bit 7 of b is set), so ``<< 5`` then the mask 0x8E00 per half moves bits 4..6
of b onto bits 9..11 and bit 7 (through S) onto the sign. Low nibbles take the same steps on
``word << 4``. Then ``* 2^14`` and ``* scale`` are exact in fp16 (at most 6 significant bits,
|x| <= 6 * 448 = 2688, nonzero |x| >= 2^-10 stays normal; NaN and negative scales follow
IEEE), so one RNE saturating conversion (beyond +-448 -> +-448) gives dequant_e4m3.

Comments inside the asm use no dollar sign (LLVM would read it as an operand reference);
``in0`` / ``in1`` / ``outN`` in them name the asm operands in constraint order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import nvfp4_dequant_e4m3, nvfp4_dequant_e4m3_bits

DEQUANT_MODES = ("triton", "ptx", "ptx_arith")  # decode: Triton ops or one of the asm blocks

def _asm(instr: str, comment: str = "") -> str:
    """One PTX line, its comment (if any) from column 36 (or two spaces after the operands)."""
    return f"{instr:<34}  // {comment}" if comment else instr


def _each_x(instr: str, *comments: str) -> list[str]:
    """``instr`` for registers 0..3 (``{i}`` the index, ``{h}`` = i // 2), ``comments`` on the
    first lines."""
    return [_asm(instr.format(i=i, h=i // 2), comments[i] if i < len(comments) else "")
            for i in range(4)]


def _asm_block(*lines: str) -> str:
    return "{\n" + "\n".join(lines) + "\n}"


_K14 = _asm("mov.b32 k14, 0x74007400;", "k14 = f16x2 (2^14, 2^14)")


def _w4(in0: str) -> str:
    return _asm(f"shl.b32 w4, {in0}, 4;", "w4 = in0 << 4: each low nibble in bits 4..7 of its byte")


# x0..x3 holding sign-extended nibbles in bits 4..7 of each half -> their e2m1 values (f16x2)
_E2M1_F16 = (_each_x("shl.b32 x{i}, x{i}, 5;", "x0..x3: nibble magnitude bits 4..6 -> 9..11,",
                     "  sign copy (bit 10 of the half) -> bit 15")
             + _each_x("and.b32 x{i}, x{i}, 0x8E008E00;",
                       "x0..x3 = e2m1 * 2^-14 per half (sign, bits 9..11 kept)")
             + _each_x("mul.rn.f16x2 x{i}, x{i}, k14;", "x0..x3 = e2m1 values (exact)"))

# Operands: out0..out3 = $0..$3 (f16x2), in0 = $4 (4 code bytes), in1 = $5 (f16x2 scales).
# out0 = low nibbles of b0 / b2, out1 = high nibbles of b0 / b2, out2 = low nibbles of
# b1 / b3, out3 = high nibbles of b1 / b3 (half i = element i). Both f16 variants share these
# steps up to the scale products.
_F16_SCALED = [
    ".reg .b32 w4, x0, x1, x2, x3, k14;", _K14, _w4("$4"),
    _asm("prmt.b32 x0, w4, w4, 0xA280;", 
         "x0 = [S(w4.b2) : w4.b2, S(w4.b0) : w4.b0]: lo(b2), lo(b0)"),
    _asm("prmt.b32 x1, $4, $4, 0xA280;", "x1 = [S(b2) : b2, S(b0) : b0]: hi(b2), hi(b0)"),
    _asm("prmt.b32 x2, w4, w4, 0xB391;", 
         "x2 = [S(w4.b3) : w4.b3, S(w4.b1) : w4.b1]: lo(b3), lo(b1)"),
    _asm("prmt.b32 x3, $4, $4, 0xB391;", "x3 = [S(b3) : b3, S(b1) : b1]: hi(b3), hi(b1)"),
    *_E2M1_F16,
    *_each_x("mul.rn.f16x2 x{i}, x{i}, $5;",
             "x0..x3 = e2m1 * scale of each half's element (exact)"),
]

DEQUANT_F16_CVT_PTX = tl.constexpr(_asm_block(
    *_F16_SCALED,
    ".reg .b16 e0, e1, e2, e3;",
    *_each_x("cvt.rn.satfinite.e4m3x2.f16x2 e{i}, x{i};",
             "e0..e3 = E4M3 byte pairs: RNE, +-448 saturation,", "  NaN -> 0x7F"),
    *_each_x("cvt.rn.f16x2.e4m3x2 ${i}, e{i};",
             "out0..out3 = the E4M3 values widened to fp16 (exact)")))

# Operands as ``DEQUANT_F16_CVT_PTX``; the same steps up to the scale products, then E4M3
# rounding by arithmetic: a = min.NaN(|x|, 448) (saturation; NaN propagates); M = 2^(e+7)
# for a in [2^e, 2^(e+1)), at least 2 (e <= -6: the E4M3 subnormal quantum 2^-9), built on
# the fp16 bits as max_u16((a & 0x7C00) + 0x1C00, 0x4000). (a + M) - M: the sum lies in
# [M, 2M), where the fp16 ulp 2^(e-3) is the E4M3 quantum, so the addition rounds a to
# nearest-even on the E4M3 grid and the subtraction is exact; x's sign goes back on last
# (keeps -0.0). NaN stays NaN through every step.
_ROUND_E4M3_STEPS = (  # (instruction, its comment for x0)
    ("abs.f16x2 a{i}, x{i};", "a0 = |x0|"),
    ("min.NaN.f16x2 a{i}, a{i}, k448;", "a0 = min(|x0|, 448), NaN kept"),
    ("and.b32 m{i}, a{i}, 0x7C007C00;", "m0 = exponent bits of a0"),
    ("add.u32 m{i}, m{i}, 0x1C001C00;", "m0 = 2^(e + 7) (exponent + 7)"),
    ("max.u16x2 m{i}, m{i}, kmin;", "m0 = M = max(2^(e + 7), 2)"),
    ("add.rn.f16x2 a{i}, a{i}, m{i};", "a0 = a + M, rounded on the E4M3 grid (RNE)"),
    ("sub.rn.f16x2 a{i}, a{i}, m{i};", "a0 = the rounded magnitude (exact)"),
    ("lop3.b32 ${i}, a{i}, x{i}, 0x80008000, 0xD8;", "out0 = a0 with the sign bits of x0"),
)


def _round_e4m3(i: int) -> list[str]:
    """``_ROUND_E4M3_STEPS`` for x{i} -> out{i} (x0: every step commented)."""
    steps = [(instr.format(i=i), comment if i == 0 else "")
             for instr, comment in _ROUND_E4M3_STEPS]
    if i:
        steps[0] = (steps[0][0], f"a{i}, m{i} -> out{i}: the same steps for x{i}")
    return [_asm(instr, comment) for instr, comment in steps]


DEQUANT_F16_ARITH_PTX = tl.constexpr(_asm_block(
    *_F16_SCALED,
    ".reg .b32 k448, kmin, a0, a1, a2, a3, m0, m1, m2, m3;",
    _asm("mov.b32 k448, 0x5F005F00;", "k448 = f16x2 (448, 448)"),
    _asm("mov.b32 kmin, 0x40004000;", "kmin = f16x2 (2, 2): the smallest M"),
    *(line for i in range(4) for line in _round_e4m3(i))))

# Operands: out0 = $0, out1 = $1 (uint32: the 4 E4M3 bytes of element 0 / 1 in dim order,
# byte 0 = lo(b0), 1 = hi(b0), 2 = lo(b1), 3 = hi(b1) for element 0), in0 = $2 (4 code bytes),
# in1 = $3 (f16x2 scales). Per code byte b one f16x2 holds its two nibbles:
# ``prmt(w << 4, w, sel)`` builds [S(w.b) : w.b] (high half: the high nibble) and
# [S(w4.b) : w4.b] (low half: the low nibble moved to bits 4..7). A NaN scale must give 0x7F
# (SPEC 1.1) whatever sign the hardware leaves on a NaN product or keeps through the cvt, so
# every byte whose magnitude is 0x7F (only NaN: satfinite never yields it for a finite value)
# gets its sign bit cleared: (byte & 0x7F) + 1 carries into bit 7 exactly then, with no carry
# across bytes, and LOP3 0x70 computes a & ~(b & c).
DEQUANT_E4M3_BYTES_PTX = tl.constexpr(_asm_block(
    ".reg .b32 w4, x0, x1, x2, x3, k14, s0, s1, r0, r1, n0, n1;",
    ".reg .b16 e0, e1, e2, e3;",
    _K14, _w4("$2"),
    *(_asm(f"prmt.b32 x{i}, w4, $2, 0x{12 + i:X}{4 + i}{8 + i:X}{i};",
           f"x{i} = [S(b{i}) : b{i}, S(w4.b{i}) : w4.b{i}]: hi(b{i}), lo(b{i})")
      for i in range(4)),
    *_E2M1_F16,
    _asm("prmt.b32 s0, $3, $3, 0x1010;", "s0 = (scale 0, scale 0): element 0 (bytes b0, b1)"),
    _asm("prmt.b32 s1, $3, $3, 0x3232;", "s1 = (scale 1, scale 1): element 1 (bytes b2, b3)"),
    *_each_x("mul.rn.f16x2 x{i}, x{i}, s{h};", "x0..x3 = e2m1 * the element's scale (exact)"),
    *_each_x("cvt.rn.satfinite.e4m3x2.f16x2 e{i}, x{i};",
             "e0..e3 = E4M3 byte pairs [hi, lo] of b0..b3:",
             "  RNE, +-448 saturation, NaN -> 0x7F or 0xFF"),
    _asm("mov.b32 r0, {e0, e1};", "r0 = element 0's bytes [hi(b1) lo(b1) hi(b0) lo(b0)]"),
    _asm("mov.b32 r1, {e2, e3};", "r1 = element 1's bytes [hi(b3) lo(b3) hi(b2) lo(b2)]"),
    _asm("and.b32 n0, r0, 0x7F7F7F7F;", "n0, n1 = byte magnitudes"),
    "and.b32 n1, r1, 0x7F7F7F7F;",
    _asm("add.u32 n0, n0, 0x01010101;", "n0, n1: bit 7 of a byte set exactly for magnitude 0x7F"),
    "add.u32 n1, n1, 0x01010101;",
    _asm("lop3.b32 $0, r0, n0, 0x80808080, 0x70;", "out0 = r0, NaN bytes' sign cleared (-> 0x7F)"),
    _asm("lop3.b32 $1, r1, n1, 0x80808080, 0x70;", "out1 = r1, likewise")))

@triton.jit
def _dequant_f16_asm(code_pairs, scale_f16, ASM: tl.constexpr):
    """The f16 dequantization asm block ``ASM`` (operands as ``DEQUANT_F16_CVT_PTX``)."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r,r", [code_pairs, scale_f16],
                                     dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                     is_pure=True, pack=2)


@triton.jit
def dequant_f16_cvt(code_pairs, scale_f16):
    """``DEQUANT_F16_CVT_PTX``: dequant_e4m3 (SPEC 1.4) widened exactly to fp16 of the four
    nibbles of uint16 code pairs ``code_pairs`` (byte 2i + 1 in the high byte, as two code
    bytes load little-endian) with their group scales ``scale_f16`` (fp16 holding E4M3
    values, same shape). Returns four fp16 tensors of that shape: the low nibble of the first
    byte, its high nibble, the low nibble of the second byte, its high nibble. SM89+ GPUs
    only (no interpreter); twin: ``dequant_f16_portable``."""
    return _dequant_f16_asm(code_pairs, scale_f16, DEQUANT_F16_CVT_PTX)


@triton.jit
def dequant_f16_arith(code_pairs, scale_f16):
    """``DEQUANT_F16_ARITH_PTX``: ``dequant_f16_cvt``'s outputs without conversion
    instructions. SM90+ GPUs only (``max.u16x2``); twin: ``dequant_f16_portable``."""
    return _dequant_f16_asm(code_pairs, scale_f16, DEQUANT_F16_ARITH_PTX)


@triton.jit
def dequant_f16_portable(code_pairs, scale_f16):
    """Plain-Triton twin of ``dequant_f16_cvt`` / ``dequant_f16_arith`` (same arguments, the
    same four fp16 results bit for bit; NaN as fp16 NaN): integer-bit E4M3 rounding
    (``numerics``), any device and the interpreter."""
    c = code_pairs.to(tl.int32)
    s = scale_f16.to(tl.float32)  # exact
    return (nvfp4_dequant_e4m3(c & 15, s).to(tl.float16),
            nvfp4_dequant_e4m3((c >> 4) & 15, s).to(tl.float16),
            nvfp4_dequant_e4m3((c >> 8) & 15, s).to(tl.float16),
            nvfp4_dequant_e4m3((c >> 12) & 15, s).to(tl.float16))


@triton.jit
def nvfp4_dequant_ptx(code_pairs, scale_f16, DEQUANT: tl.constexpr = "ptx"):
    """The decode dequantization of ``DEQUANT`` ("ptx": ``dequant_f16_cvt``, "ptx_arith":
    ``dequant_f16_arith``); arguments and results as ``dequant_f16_cvt``."""
    if DEQUANT == "ptx_arith":
        return dequant_f16_arith(code_pairs, scale_f16)
    else:
        return dequant_f16_cvt(code_pairs, scale_f16)


@triton.jit
def dequant_e4m3_bytes(code_pairs, scale_f16):
    """``DEQUANT_E4M3_BYTES_PTX``: dequant_e4m3 bytes (SPEC 1.4) of the four nibbles of
    uint16 code pairs ``code_pairs`` (as ``dequant_f16_cvt``) with their group scales
    ``scale_f16`` (fp16 holding E4M3 values, same shape; NaN and negative scales follow
    SPEC 1.4, NaN gives 0x7F). Returns a uint32 tensor of that shape: byte j (little-endian)
    of element i is dim 4i + j when element i holds code bytes 2i, 2i + 1 of a token, so
    storing it through a uint32 view writes the token-major E4M3 row. SM89+ GPUs only (no
    interpreter); twin: ``dequant_e4m3_bytes_portable``."""
    return tl.inline_asm_elementwise(DEQUANT_E4M3_BYTES_PTX, "=r,=r,r,r",
                                     [code_pairs, scale_f16], dtype=tl.uint32,
                                     is_pure=True, pack=2)


@triton.jit
def dequant_e4m3_bytes_portable(code_pairs, scale_f16):
    """Plain-Triton twin of ``dequant_e4m3_bytes`` (same arguments, the same uint32 words):
    integer-bit E4M3 encoding (``numerics``), any device and the interpreter."""
    c = code_pairs.to(tl.uint32)
    s = scale_f16.to(tl.float32)  # exact
    b0 = nvfp4_dequant_e4m3_bits(c & 15, s, True).to(tl.uint32)
    b1 = nvfp4_dequant_e4m3_bits((c >> 4) & 15, s, True).to(tl.uint32)
    b2 = nvfp4_dequant_e4m3_bits((c >> 8) & 15, s, True).to(tl.uint32)
    b3 = nvfp4_dequant_e4m3_bits((c >> 12) & 15, s, True).to(tl.uint32)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
