"""Host emulations and GPU probes of the table lookup (``nvfp4_indexer.triton.decode.lut``) for
the tests (not a test module).

- ``lut_dequant_f16_bits``: the table formula on the host.
- ``ptx_emulate``: a replay of inline-PTX blocks of ``LUT_ASM``'s integer instruction set
  (``lut_asm_emulate`` / ``lut_e4m3_asm_emulate``: the lookup's PTX text itself, so an edit of
  the asm is caught without a GPU).
- ``lut_asm_dequant`` / ``lut_e4m3_asm_dequant``: the PTX on a CUDA GPU (probe kernels).
- ``exhaustive_groups``, ``reference_f16_bits``, ``reference_e4m3_bytes``: every (code, scale
  byte) pair and the reference's answers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nvfp4_indexer.constants import GROUP_SIZE
from nvfp4_indexer.triton.decode.lut import (LUT_ASM, LUT_CONSTRAINTS, LUT_E4M3_ASM,
                                             LUT_E4M3_CONSTRAINTS, PAIR_NIBBLES, lut_table,
                                             lut_table_e4m3)


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
    ``prefill_wgmma``'s converter PTX); one statement per ``;``, operands are registers,
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
    return unpack_pairs(words)


def unpack_pairs(words: torch.Tensor) -> torch.Tensor:
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
    return unpack_pairs(out)


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
    from nvfp4_indexer.reference.formats import decode_e4m3, e2m1_value, encode_e4m3
    c = codes.cpu().to(torch.int64)
    nib = torch.stack([c & 15, c >> 4], dim=-1).reshape(c.shape[0], GROUP_SIZE)
    s = decode_e4m3(scale_bytes.cpu())[:, None]
    k = encode_e4m3(e2m1_value(nib) * s).to(torch.float16)
    bits = k.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(torch.isnan(k), 0x7E00, bits)



def unpack_bytes(words: torch.Tensor) -> torch.Tensor:
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
    return unpack_bytes(torch.stack([regs[f"${i}"] for i in range(4)], dim=1))



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
    return unpack_bytes(out)


def reference_e4m3_bytes(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (int32) of the reference ``dequant_e4m3`` (SPEC 1.4) of groups given as in
    ``exhaustive_groups``: ``[N, 16]`` (NaN results as the encoder gives them: compare NaN
    positions only)."""
    from nvfp4_indexer.reference.formats import decode_e4m3, e2m1_value, encode_e4m3
    c = codes.cpu().to(torch.int64)
    nib = torch.stack([c & 15, c >> 4], dim=-1).reshape(c.shape[0], GROUP_SIZE)
    s = decode_e4m3(scale_bytes.cpu())[:, None]
    return encode_e4m3(e2m1_value(nib) * s).view(torch.uint8).to(torch.int32)
