"""Table-lookup NVFP4 dequantization to MMA operands (SPEC 1.4), for the page-score decode scorers.

A dequantized key depends only on (code, scale byte): ``dequant_e4m3(c, s) =
encode_e4m3(e2m1(c) * s)``. Its sign is sign(c) xor sign(s) (rounding is symmetric) and its
magnitude is one of 8 values per scale byte. Every E4M3 value is an fp16 whose low 7 bits are
zero, so fp16 bits 7..14 (5 exponent + 3 mantissa bits) hold the whole magnitude: one byte.

``lut_table`` is the 256-row table of those bytes: row s, byte m (m = 0..7) =
``fp16_bits(dequant_e4m3(m, s & 0x7F)) >> 7`` (2 KB, built by the reference encoder, so every
case -- subnormal results, saturation at 448, NaN scales -- is exact by construction). A
value's fp16 bits are then ``(T[s][c & 7] << 7) | ((c >> 3) ^ (s >> 7)) << 15``.

Two implementations of that formula:

- ``LUT_ASM`` (GPU): one group of 16 codes (an int64: dims 16G .. 16G+15, two 32-bit words)
  and its table entry -> eight f16x2 registers, 16 integer instructions per word of 8 codes
  (4 of them shifts the compiler puts on the FMA pipe), plus 1 per group (the scale's sign
  spread to a mask): two byte permutes (``prmt``) look up 4 magnitudes each in the table row,
  the code sign bits are gathered one per byte with the scale's sign xor-ed in (a shift and a
  ``lop3`` per 4 signs), two more per output pair place a magnitude byte and its sign bit, a
  shift moves them onto fp16 bits 7..15. Output pair p of a word holds its nibbles
  ``PAIR_NIBBLES[p]``.
- ``lut_dequant_portable`` (any backend, the interpreter included): the same formula with
  Triton gathers and integer ops (the "lut" scorer's).

The tests check both against the reference for all 16 codes x 256 scale bytes (the PTX text
also on the CPU, replayed instruction by instruction). ``device_table`` keeps one table per
device alive for the kernels (CUDA graphs capture its address).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


# Nibbles (within a 32-bit word of 8 codes) of output pair p's low and high fp16 half.
PAIR_NIBBLES = ((0, 2), (1, 3), (4, 6), (5, 7))
NAN_MAGNITUDE_BYTE = 0xFC  # fp16 0x7E00 >> 7: a quiet NaN


def lut_table(device=None) -> torch.Tensor:
    """The dequantization table (see module doc): int64 ``[256]``, byte m of entry s (little
    endian) = fp16 bits 7..14 of ``dequant_e4m3(m, s & 0x7F)``; NaN results give 0xFC."""
    from ...reference.formats import E2M1_MAGNITUDES, decode_e4m3, encode_e4m3
    s = decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8) & 0x7F)  # |scale|
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    k = encode_e4m3(mag[None, :] * s[:, None])  # [256, 8], exact product, one rounding
    f16 = k.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    byte = torch.where(torch.isnan(k.to(torch.float32)), NAN_MAGNITUDE_BYTE, (f16 >> 7) & 0xFF)
    shifts = torch.arange(8, dtype=torch.int64) * 8
    table = (byte << shifts).sum(dim=1)  # disjoint bytes: the sum is an OR
    return table.to(device) if device is not None else table


@functools.lru_cache(maxsize=None)
def device_table(device: torch.device, fp8: bool = False) -> torch.Tensor:
    """``lut_table`` (``fp8``: ``lut_table_e4m3``) on ``device``, allocated once per device and
    kept alive (CUDA graphs capture its address)."""
    return lut_table_e4m3(device) if fp8 else lut_table(device)


@triton.jit
def lut_dequant_portable(codes, sbytes, tbl_ptr):
    """fp16 dequantized keys (SPEC 1.4) of E2M1 ``codes`` (int32, 0..15) with E4M3 scale bytes
    ``sbytes`` (int32, 0..255, same shape) through the table at ``tbl_ptr`` (uint8 view of
    ``lut_table``): the module's formula with a gather and integer ops (runs everywhere)."""
    mag = tl.load(tbl_ptr + sbytes * 8 + (codes & 7)).to(tl.int32)
    sign = ((codes >> 3) ^ (sbytes >> 7)) & 1
    bits = (mag << 7) | (sign << 15)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


def _lut_pair_asm(out: str, lo: int) -> str:
    """PTX of output pair (nibbles ``lo``, ``lo + 2``; ``PAIR_NIBBLES``) -> register ``out``:
    ``prmt`` places the two magnitude bytes (from rl / rh) and their sign bytes (from se /
    so: byte k = sign of value 2k / 2k + 1), the shift moves them onto fp16 bits 7..15."""
    hi = lo + 2
    mags, signs = ("rl" if lo < 4 else "rh"), ("so" if lo % 2 else "se")
    # selector digit k: source byte of result byte k (0..3: mags, 4..7: signs)
    sel = f"0x{4 + hi // 2}{hi % 4}{4 + lo // 2}{lo % 4}"
    prmt, shl = f"prmt.b32 p, {mags}, {signs}, {sel};", f"shl.b32 {out}, p, 7;"
    return (f"{prmt:<36} // [T(n{lo}) s{lo} T(n{hi}) s{hi}]\n"
            f"{shl:<35} // -> f16x2 (n{lo}, n{hi})\n")

def _lut_word_asm(word: str, first_out: int) -> str:
    """PTX of one 32-bit code word -> output registers ``$first_out .. $first_out + 3``."""
    return f"""and.b32 x, {word}, 0x77777777;    // 3-bit magnitude index of each nibble
shr.u32 xh, x, 16;                   // indices of nibbles 4..7 in the low half
prmt.b32 rl, tl, th, x;              // rl = [T(n0) T(n1) T(n2) T(n3)]
prmt.b32 rh, tl, th, xh;             // rh = [T(n4) T(n5) T(n6) T(n7)]
shr.u32 so, {word}, 7;
lop3.b32 so, so, sm, 0x01010101, 0x28;  // (so ^ sm) & 0x0101..: byte k = sign of value 2k+1
shr.u32 se, {word}, 3;
lop3.b32 se, se, sm, 0x01010101, 0x28;  // byte k = sign of value 2k
""" + "".join(_lut_pair_asm(f"${first_out + p}", lo) for p, (lo, _) in enumerate(PAIR_NIBBLES))

# Inputs: $8 = int64, 16 codes of one group (low word: dims 16G..16G+7, nibble k = dim
# 16G + k); $9 = the table entry of the group's scale byte (int64, loaded by the caller so
# that the compiler can issue the table loads early); $10 = the scale byte (int32).
# Outputs $0..$3 from the low word, $4..$7 from the high word.
LUT_ASM = ("{\n.reg .b32 wl, wh, x, xh, rl, rh, so, se, p, tl, th, sm;\n"
           "mov.b64 {wl, wh}, $8;\n"
           "mov.b64 {tl, th}, $9;               // the scale's 8 magnitude bytes\n"
           "prmt.b32 sm, $10, 0, 0x8888;        // all ones for a negative scale byte, else 0\n"
           + _lut_word_asm("wl", 0) + _lut_word_asm("wh", 4) + "}")
LUT_CONSTRAINTS = "=r,=r,=r,=r,=r,=r,=r,=r,l,l,r"


# --------------------------------------------------------------------------------------------
# E4M3 operands (dot mode "fp8"): the lookup emits the dequantized E4M3 bytes themselves
# --------------------------------------------------------------------------------------------
# A SPEC 1.4 key *is* an E4M3 byte, and rounding is sign-symmetric, so with the scale's sign
# folded into the table (row s, byte m = the E4M3 byte of dequant_e4m3(m, s)) a code c gives
# ``T[s][c & 7] ^ ((c >> 3) << 7)`` (code 8 with a valid scale: 0x00 ^ 0x80 = 0x80, SPEC 1.4).
# Per word of 8 codes: two ``prmt`` look up 4 bytes each (nibbles 0..3, 4..7: the natural
# order), two more spread the code signs to full-byte masks (the odd nibbles' sign is bit 7 of
# their byte, the even nibbles' bit 7 of the word shifted by 4; ``prmt``'s replicate mode),
# one ``lop3`` per output word applies bit 7: 9 integer instructions per 8 values, none per
# group (LUT_ASM: 16 + 1).

def lut_table_e4m3(device=None) -> torch.Tensor:
    """The signed E4M3 table of dot mode "fp8": int64 ``[256]``, byte m of entry s (little
    endian) = the E4M3 byte of ``dequant_e4m3(m, s)`` (SPEC 1.4, the scale's sign included;
    NaN results as the reference encoder gives them)."""
    from ...reference.formats import E2M1_MAGNITUDES, decode_e4m3, encode_e4m3
    s = decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    byte = encode_e4m3(mag[None, :] * s[:, None]).view(torch.uint8).to(torch.int64)  # [256, 8]
    table = (byte << (torch.arange(8, dtype=torch.int64) * 8)).sum(dim=1)  # disjoint bytes
    return table.to(device) if device is not None else table


def _lut_e4m3_word_asm(word: str, lo: str, hi: str) -> str:
    """PTX of one 32-bit code word -> ``lo`` (E4M3 bytes of nibbles 0..3) and ``hi`` (4..7)."""
    return f"""and.b32 x, {word}, 0x77777777;    // 3-bit magnitude index of each nibble
shr.u32 xh, x, 16;
prmt.b32 rl, tl, th, x;              // [T(n0) T(n1) T(n2) T(n3)] (signed by the scale)
prmt.b32 rh, tl, th, xh;             // [T(n4) T(n5) T(n6) T(n7)]
shl.b32 w4, {word}, 4;               // even nibbles' sign bits onto bit 7 of their byte
prmt.b32 sl, w4, {word}, 0xD9C8;     // byte k: 0xFF where nibble k's code is negative
prmt.b32 sh, w4, {word}, 0xFBEA;     // the same for nibbles 4..7
lop3.b32 {lo}, rl, sl, 0x80808080, 0x78;  // rl ^ (sl & 0x80808080)
lop3.b32 {hi}, rh, sh, 0x80808080, 0x78;
"""


# Inputs: $4 = int64, 16 codes of one group (low word: dims 16G..16G+7, nibble k = dim 16G + k);
# $5 = the group's ``lut_table_e4m3`` entry (int64, loaded by the caller). Outputs: $0 / $1
# the E4M3 bytes of nibbles 0..3 / 4..7 of the low word, $2 / $3 of the high word.
LUT_E4M3_ASM = ("{\n.reg .b32 wl, wh, x, xh, rl, rh, w4, sl, sh, tl, th;\n"
                "mov.b64 {wl, wh}, $4;\n"
                "mov.b64 {tl, th}, $5;               // the scale's 8 signed E4M3 bytes\n"
                + _lut_e4m3_word_asm("wl", "$0", "$1") + _lut_e4m3_word_asm("wh", "$2", "$3")
                + "}")
LUT_E4M3_CONSTRAINTS = "=r,=r,=r,=r,l,l"
