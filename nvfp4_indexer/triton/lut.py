"""Table-lookup NVFP4 dequantization to fp16 operands (SPEC 1.4), for the wgmma decode scorer.

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
  Triton gathers and integer ops; the CPU tests check it against the reference for all 16
  codes x 256 scale bytes, and the GPU tests check ``LUT_ASM`` the same way. On the CPU,
  ``lut_asm_emulate`` also replays the PTX text of ``LUT_ASM`` itself (``ptx_emulate``: the
  handful of integer instructions it uses), so an edit of the asm is caught without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import GROUP_SIZE

# Nibbles (within a 32-bit word of 8 codes) of output pair p's low and high fp16 half.
PAIR_NIBBLES = ((0, 2), (1, 3), (4, 6), (5, 7))
NAN_MAGNITUDE_BYTE = 0xFC  # fp16 0x7E00 >> 7: a quiet NaN


def lut_table(device=None) -> torch.Tensor:
    """The dequantization table (see module doc): int64 ``[256]``, byte m of entry s (little
    endian) = fp16 bits 7..14 of ``dequant_e4m3(m, s & 0x7F)``; NaN results give 0xFC."""
    from ..reference.formats import E2M1_MAGNITUDES, decode_e4m3, encode_e4m3
    s = decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8) & 0x7F)  # |scale|
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    k = encode_e4m3(mag[None, :] * s[:, None])  # [256, 8], exact product, one rounding
    f16 = k.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    byte = torch.where(torch.isnan(k.to(torch.float32)), NAN_MAGNITUDE_BYTE, (f16 >> 7) & 0xFF)
    shifts = torch.arange(8, dtype=torch.int64) * 8
    table = (byte << shifts).sum(dim=1)  # disjoint bytes: the sum is an OR
    return table.to(device) if device is not None else table


def lut_dequant_f16_bits(codes: torch.Tensor, scale_bytes: torch.Tensor,
                         table: torch.Tensor | None = None) -> torch.Tensor:
    """Host emulation of the table formula: fp16 bit patterns (int32, 0..0xFFFF) of
    ``dequant_e4m3(codes, scale_bytes)`` for int tensors of codes (0..15) and scale bytes
    (0..255) of one shape. For tests and documentation; the reference is ``reference.formats``."""
    table = lut_table() if table is None else table.cpu()
    c = codes.to(torch.int64)
    s = scale_bytes.to(torch.int64)
    mag = (table[s] >> ((c & 7) * 8)) & 0xFF
    sign = ((c >> 3) ^ (s >> 7)) & 1
    return ((mag << 7) | (sign << 15)).to(torch.int32)


@triton.jit
def lut_dequant_portable(codes, sbytes, tbl_ptr):
    """fp16 dequantized keys (SPEC 1.4) of E2M1 ``codes`` (int32, 0..15) with E4M3 scale bytes
    ``sbytes`` (int32, 0..255, same shape) through the table at ``tbl_ptr`` (uint8 view of
    ``lut_table``): the module's formula with a gather and integer ops (runs everywhere)."""
    mag = tl.load(tbl_ptr + sbytes * 8 + (codes & 7)).to(tl.int32)
    sign = ((codes >> 3) ^ (sbytes >> 7)) & 1
    bits = (mag << 7) | (sign << 15)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


def _lut_word_asm(word: str, first_out: int) -> str:
    """PTX of one 32-bit code word -> output registers ``$first_out .. $first_out + 3``."""
    a, b, c, d = (f"${first_out + i}" for i in range(4))
    return f"""and.b32 x, {word}, 0x77777777;    // 3-bit magnitude index of each nibble
shr.u32 xh, x, 16;                   // indices of nibbles 4..7 in the low half
prmt.b32 rl, tl, th, x;              // rl = [T(n0) T(n1) T(n2) T(n3)]
prmt.b32 rh, tl, th, xh;             // rh = [T(n4) T(n5) T(n6) T(n7)]
shr.u32 so, {word}, 7;
lop3.b32 so, so, sm, 0x01010101, 0x28;  // (so ^ sm) & 0x0101..: byte k = sign of value 2k+1
shr.u32 se, {word}, 3;
lop3.b32 se, se, sm, 0x01010101, 0x28;  // byte k = sign of value 2k
prmt.b32 p, rl, se, 0x5240;          // [T(n0) s0 T(n2) s2]
shl.b32 {a}, p, 7;                   // -> f16x2 (n0, n2)
prmt.b32 p, rl, so, 0x5341;          // [T(n1) s1 T(n3) s3]
shl.b32 {b}, p, 7;                   // -> f16x2 (n1, n3)
prmt.b32 p, rh, se, 0x7260;          // [T(n4) s4 T(n6) s6]
shl.b32 {c}, p, 7;                   // -> f16x2 (n4, n6)
prmt.b32 p, rh, so, 0x7361;          // [T(n5) s5 T(n7) s7]
shl.b32 {d}, p, 7;                   // -> f16x2 (n5, n7)
"""


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


def _lop3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, imm: int) -> torch.Tensor:
    """PTX ``lop3.b32``: bit i of the result is bit ``(a_i << 2 | b_i << 1 | c_i)`` of imm."""
    out = torch.zeros_like(a)
    for k in range(8):
        if imm >> k & 1:
            out |= ((a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c))
    return out & 0xFFFFFFFF


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """PTX ``prmt.b32`` (default mode): output byte k = byte ``sel >> 4k & 7`` of (a, b), or
    that byte's bit 7 replicated when ``sel >> 4k & 8``."""
    src = a | (b << 32)
    out = torch.zeros_like(a)
    for k in range(4):
        nib = (sel >> (4 * k)) & 0xF
        byte = (src >> ((nib & 7) * 8)) & 0xFF
        out |= torch.where((nib & 8) != 0, (byte >> 7) * 0xFF, byte) << (8 * k)
    return out


_PTX_OPERANDS = {"and.b32": 3, "xor.b32": 3, "shr.u32": 3, "shl.b32": 3, "prmt.b32": 4,
                 "lop3.b32": 5, "mov.b32": 2}


def ptx_emulate(asm: str, inputs: dict) -> dict:
    """Replay an inline-PTX block of ``LUT_ASM``'s instruction set on the host (tests): 32-bit
    ``and`` / ``xor`` / ``shr.u32`` / ``shl`` / ``prmt`` / ``lop3`` / ``mov`` and
    ``mov.b64`` splits (also the direct prefill converter's
    ``prefill_wgmma._F16X2_LUT_PTX``); one statement per ``;``, operands are registers,
    ``$n`` and integer literals.
    ``inputs``: ``{"$8": int64 tensor [N], ...}``, one element per thread (a 64-bit operand is
    split little-endian by ``mov.b64``; 32-bit ones are read modulo 2^32). Returns every
    register, ``$n`` outputs included, as int64 ``[N]`` tensors of 32-bit patterns.

    Raises:
        ValueError: an instruction outside that set, a wrong operand count, an unset register
            or any statement it cannot evaluate (the emulation must not guess)."""
    m32 = 0xFFFFFFFF
    regs = dict(inputs)
    for line in asm.splitlines():
        for stmt in line.split("//")[0].split(";"):
            stmt = stmt.strip()
            if stmt in ("", "{", "}") or stmt.startswith(".reg "):  # declarations
                continue
            try:
                if stmt.startswith("mov.b64"):  # mov.b64 {lo, hi}, $n
                    lo, hi, src = (t.strip(" {}") for t in stmt[len("mov.b64"):].split(","))
                    regs[lo], regs[hi] = regs[src] & m32, (regs[src] >> 32) & m32
                    continue
                op, rest = stmt.split(None, 1)
                if op not in _PTX_OPERANDS:
                    raise ValueError("unsupported instruction")
                d, *args = (t.strip() for t in rest.split(","))
                if 1 + len(args) != _PTX_OPERANDS[op]:
                    raise ValueError(f"{op} takes {_PTX_OPERANDS[op]} operands")
                v = [regs[t] & m32 if not t[0].isdigit() else int(t, 0) & m32 for t in args]
                if op == "and.b32":
                    r = v[0] & v[1]
                elif op == "xor.b32":
                    r = v[0] ^ v[1]
                elif op == "mov.b32":
                    r = v[0]
                elif op == "shr.u32":
                    r = v[0] >> v[1]
                elif op == "shl.b32":
                    r = (v[0] << v[1]) & m32
                elif op == "prmt.b32":
                    r = _prmt(v[0], v[1], torch.as_tensor(v[2]))
                else:  # lop3.b32
                    r = _lop3(v[0], torch.as_tensor(v[1]) + torch.zeros_like(v[0]),
                              torch.as_tensor(v[2]) + torch.zeros_like(v[0]), v[3])
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise ValueError(f"ptx_emulate: cannot evaluate {stmt!r}: {e}") from None
            regs[d] = r if isinstance(r, torch.Tensor) else torch.as_tensor(r)
    return regs


def lut_asm_emulate(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """``LUT_ASM`` replayed on the host by ``ptx_emulate`` (CPU tests of the PTX text itself):
    arguments and result as ``lut_asm_dequant``."""
    n = codes.shape[0]
    c = codes.contiguous().view(torch.int64).reshape(n)
    s = scale_bytes.to(torch.int64)
    regs = ptx_emulate(LUT_ASM, {"$8": c, "$9": lut_table()[s], "$10": s})
    words = torch.stack([regs[f"${i}"] for i in range(8)], dim=1)
    return _unpack_pairs(words)


def _unpack_pairs(words: torch.Tensor) -> torch.Tensor:
    """Eight f16x2 words per group (``LUT_ASM``'s outputs $0..$7) -> int32 ``[N, 16]``: the
    fp16 bits of dims 0..15 (pairs placed by ``PAIR_NIBBLES``)."""
    words = words.to(torch.int64) & 0xFFFFFFFF
    res = torch.empty((words.shape[0], GROUP_SIZE), dtype=torch.int32, device=words.device)
    for w in range(2):
        for p, (lo, hi) in enumerate(PAIR_NIBBLES):
            reg = words[:, 4 * w + p]
            res[:, 8 * w + lo] = (reg & 0xFFFF).to(torch.int32)
            res[:, 8 * w + hi] = (reg >> 16).to(torch.int32)
    return res


_ASM_C = tl.constexpr(LUT_ASM)
_CONSTRAINTS_C = tl.constexpr(LUT_CONSTRAINTS)


@triton.jit
def _lut_asm_probe_kernel(codes_ptr, sbytes_ptr, tbl_ptr, out_ptr, N: tl.constexpr):
    """GPU test kernel: ``LUT_ASM`` on N groups (int64 codes, uint8 scale bytes) -> int32
    ``[N, 8]`` f16x2 words (exactly the registers the scorer feeds its MMA)."""
    i = tl.arange(0, N)
    codes = tl.load(codes_ptr + i)
    s = tl.load(sbytes_ptr + i).to(tl.int32)
    row = tl.load(tbl_ptr + s)
    o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
        _ASM_C, _CONSTRAINTS_C, [codes, row, s],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True, pack=1)
    base = out_ptr + i * 8
    tl.store(base + 0, o0)
    tl.store(base + 1, o1)
    tl.store(base + 2, o2)
    tl.store(base + 3, o3)
    tl.store(base + 4, o4)
    tl.store(base + 5, o5)
    tl.store(base + 6, o6)
    tl.store(base + 7, o7)


def lut_asm_dequant(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Run ``LUT_ASM`` on a CUDA GPU (tests): ``codes`` uint8 ``[N, 8]`` (one group of 16 codes
    per row, SPEC 2 byte order), ``scale_bytes`` uint8 ``[N]``; N a power of two.
    Returns int32 ``[N, 16]``: the fp16 bits of dims 0..15 of each group (pairs unpacked with
    ``PAIR_NIBBLES``)."""
    n = codes.shape[0]
    table = lut_table(codes.device)
    out = torch.empty((n, 8), dtype=torch.int32, device=codes.device)
    _lut_asm_probe_kernel[(1,)](codes.contiguous().view(torch.int64).reshape(n), scale_bytes,
                                table, out, N=n)
    return _unpack_pairs(out)


def exhaustive_groups() -> tuple[torch.Tensor, torch.Tensor]:
    """Every (code, scale byte) pair in every nibble position (tests, labs): 4096 groups,
    ``(codes uint8 [4096, 8], scale bytes uint8 [4096])``; group 16s + r holds codes
    ``(k + r) % 16`` at dims k = 0..15 with scale byte s."""
    r = torch.arange(16)
    nib = (torch.arange(16)[None, :] + r[:, None]) % 16  # [16 r, 16 dims]
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)  # dim 2i low, 2i+1 high
    codes = packed.repeat(256, 1)
    scales = torch.arange(256).repeat_interleave(16).to(torch.uint8)
    return codes, scales


def reference_f16_bits(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp16 bits (int32) of the reference ``dequant_e4m3`` (SPEC 1.4) of groups given as in
    ``exhaustive_groups``: ``[N, 16]``; NaN results as 0x7E00 (compare NaN positions only)."""
    from ..reference.formats import decode_e4m3, e2m1_value, encode_e4m3
    c = codes.cpu().to(torch.int64)
    nib = torch.stack([c & 15, c >> 4], dim=-1).reshape(c.shape[0], GROUP_SIZE)
    s = decode_e4m3(scale_bytes.cpu())[:, None]
    k = encode_e4m3(e2m1_value(nib) * s).to(torch.float16)
    bits = k.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(torch.isnan(k), 0x7E00, bits)


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
    from ..reference.formats import E2M1_MAGNITUDES, decode_e4m3, encode_e4m3
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


def _unpack_bytes(words: torch.Tensor) -> torch.Tensor:
    """Four E4M3x4 words per group (``LUT_E4M3_ASM``'s outputs $0..$3) -> int32 ``[N, 16]``:
    the E4M3 byte of dims 0..15 (word k holds nibbles 4k .. 4k+3, byte i = nibble 4k + i)."""
    words = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(4, dtype=torch.int64, device=words.device) * 8
    return ((words[:, :, None] >> shifts) & 0xFF).reshape(words.shape[0], GROUP_SIZE) \
        .to(torch.int32)


def lut_e4m3_asm_emulate(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """``LUT_E4M3_ASM`` replayed on the host by ``ptx_emulate`` (CPU tests of the PTX text):
    ``codes`` uint8 ``[N, 8]`` (one group per row, SPEC 2 byte order), ``scale_bytes`` uint8
    ``[N]``; returns int32 ``[N, 16]``, the E4M3 byte of each dim."""
    n = codes.shape[0]
    c = codes.contiguous().view(torch.int64).reshape(n)
    regs = ptx_emulate(LUT_E4M3_ASM, {"$4": c, "$5": lut_table_e4m3()[scale_bytes.long()]})
    return _unpack_bytes(torch.stack([regs[f"${i}"] for i in range(4)], dim=1))


_E4M3_ASM_C = tl.constexpr(LUT_E4M3_ASM)
_E4M3_CONSTRAINTS_C = tl.constexpr(LUT_E4M3_CONSTRAINTS)


@triton.jit
def _lut_e4m3_asm_probe_kernel(codes_ptr, sbytes_ptr, tbl_ptr, out_ptr, N: tl.constexpr):
    """GPU test kernel: ``LUT_E4M3_ASM`` on N groups -> int32 ``[N, 4]`` E4M3x4 words."""
    i = tl.arange(0, N)
    codes = tl.load(codes_ptr + i)
    row = tl.load(tbl_ptr + tl.load(sbytes_ptr + i).to(tl.int32))
    o0, o1, o2, o3 = tl.inline_asm_elementwise(
        _E4M3_ASM_C, _E4M3_CONSTRAINTS_C, [codes, row],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    base = out_ptr + i * 4
    tl.store(base + 0, o0)
    tl.store(base + 1, o1)
    tl.store(base + 2, o2)
    tl.store(base + 3, o3)


def lut_e4m3_asm_dequant(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Run ``LUT_E4M3_ASM`` on a CUDA GPU (tests): arguments and result as
    ``lut_e4m3_asm_emulate``; N a power of two."""
    n = codes.shape[0]
    out = torch.empty((n, 4), dtype=torch.int32, device=codes.device)
    _lut_e4m3_asm_probe_kernel[(1,)](codes.contiguous().view(torch.int64).reshape(n),
                                     scale_bytes, lut_table_e4m3(codes.device), out, N=n)
    return _unpack_bytes(out)


def reference_e4m3_bytes(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (int32) of the reference ``dequant_e4m3`` (SPEC 1.4) of groups given as in
    ``exhaustive_groups``: ``[N, 16]`` (NaN results as the encoder gives them: compare NaN
    positions only)."""
    from ..reference.formats import decode_e4m3, e2m1_value, encode_e4m3
    c = codes.cpu().to(torch.int64)
    nib = torch.stack([c & 15, c >> 4], dim=-1).reshape(c.shape[0], GROUP_SIZE)
    s = decode_e4m3(scale_bytes.cpu())[:, None]
    return encode_e4m3(e2m1_value(nib) * s).view(torch.uint8).to(torch.int32)
