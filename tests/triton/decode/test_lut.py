"""The table lookup (``triton.decode.lut``, SPEC 1.4): the table and its portable twin bit for bit
over all 16 codes x 256 scale bytes on the CPU; the PTX text of ``LUT_ASM`` / ``LUT_E4M3_ASM``
replayed on the host; on a GPU the inline PTX itself."""

from __future__ import annotations

import pytest
import torch

from kernel_harness import DEV, strict_equal  # importing it sets TRITON_INTERPRET

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import lut_probes as probes  # noqa: E402
from nvfp4_indexer.triton.decode import lut  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def test_lut_table_formula_bit_exact():
    """The table formula (magnitude byte << 7, sign = code sign xor scale sign) gives the
    reference dequant_e4m3 for every (code, scale byte) pair (SPEC 1.4), zero signs included."""
    codes, scales = probes.exhaustive_groups()
    nib = torch.stack([codes.long() & 15, codes.long() >> 4], dim=-1).reshape(-1, 16)
    got = probes.lut_dequant_f16_bits(nib, scales[:, None].expand(-1, 16))
    strict_equal(got, probes.reference_f16_bits(codes, scales))


@triton.jit
def _portable_kernel(codes_ptr, scales_ptr, tbl_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    c = tl.load(codes_ptr + i).to(tl.int32)
    s = tl.load(scales_ptr + i).to(tl.int32)
    v = lut.lut_dequant_portable(c, s, tbl_ptr)
    tl.store(out_ptr + i, v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)


def test_lut_portable_kernel_bit_exact():
    """``lut_dequant_portable`` (the interpreter's twin of the PTX lookup) over all pairs."""
    codes, scales = probes.exhaustive_groups()
    nib = torch.stack([codes.long() & 15, codes.long() >> 4], dim=-1).reshape(-1)
    sc = scales.long().repeat_interleave(16)
    out = torch.full((nib.numel(),), -7, dtype=torch.int32, device=DEV)
    table = lut.lut_table(DEV).view(torch.uint8)
    _portable_kernel[(1,)](nib.to(torch.uint8).to(DEV), sc.to(torch.uint8).to(DEV), table, out,
                           N=nib.numel())
    strict_equal(out.reshape(-1, 16), probes.reference_f16_bits(codes, scales))


def test_ptx_emulate_follows_ptx_semantics():
    """The host replay of ``LUT_ASM``: ``prmt`` (identity, a gather across both sources, the
    sign-replicate mode), ``lop3`` against its truth table, shifts, and a refusal of anything
    it does not model."""
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    regs = probes.ptx_emulate(
        "prmt.b32 p, $1, $2, 0x5140;\nprmt.b32 q, $1, $2, 0x8F07;\n"
        "lop3.b32 r, $1, $2, 0x0000FFFF, 0x28;\nshr.u32 s, $2, 7;\nshl.b32 u, $2, 4;\n"
        "mov.b64 {lo, hi}, $3;",
        {"$1": t(0x44332211), "$2": t(0x88776655), "$3": t(0x0123456789ABCDEF)})
    assert regs["p"].item() == 0x66225511
    assert regs["q"].item() == 0x00FF1188  # bytes 0x88 (sign set), 0x11, then their signs
    assert regs["r"].item() == (0x44332211 ^ 0x88776655) & 0xFFFF  # 0x28: (a ^ b) & c
    assert regs["s"].item() == 0x88776655 >> 7
    assert regs["u"].item() == (0x88776655 << 4) & 0xFFFFFFFF
    assert (regs["lo"].item(), regs["hi"].item()) == (0x89ABCDEF, 0x01234567)
    regs = probes.ptx_emulate(".reg .b32 a; and.b32 a, $1, 0xF0F0F0F0;\nshr.u32 c, $1, 31;",
                           {"$1": t(-1)})  # read modulo 2^32: 0xFFFFFFFF
    assert regs["a"].item() == 0xF0F0F0F0  # a statement after a declaration runs
    assert regs["c"].item() == 1  # logical shift
    for bad in ("add.u32 a, $1, 1;", "mul.hi.u32 a, $1, 2;", "and.b32 a, $1, 3, 5;", "and.b32 a, $2, 1;",
                "lop3.b32 a, 1, $1, 2, 0x28;"):
        with pytest.raises(ValueError, match="ptx_emulate"):
            probes.ptx_emulate(bad, {"$1": t(1)})


def test_lut_asm_text_bit_exact_on_host():
    """``LUT_ASM`` itself (the PTX text the scorers inline), replayed on the host, gives the
    reference dequant_e4m3 for every (code, scale byte) pair in every nibble position
    (SPEC 1.4; the GPU test runs it on the device); a one-digit change of one byte selector
    is caught."""
    codes, scales = probes.exhaustive_groups()
    strict_equal(probes.lut_asm_emulate(codes, scales), probes.reference_f16_bits(codes, scales))
    mutant = lut.LUT_ASM.replace("0x5240", "0x5241", 1)
    regs = probes.ptx_emulate(mutant, {"$8": codes.view(torch.int64).reshape(-1),
                                    "$9": lut.lut_table()[scales.long()],
                                    "$10": scales.long()})
    got = probes.unpack_pairs(torch.stack([regs[f"${i}"] for i in range(8)], dim=1))
    with pytest.raises(AssertionError):
        strict_equal(got, probes.reference_f16_bits(codes, scales))


def test_lut_e4m3_asm_text_bit_exact_on_host():
    """``LUT_E4M3_ASM`` (the E4M3-operand lookup of dot mode "fp8"), replayed on the host,
    gives the reference dequant_e4m3 bytes for every (code, scale byte) pair in every nibble
    position (SPEC 1.4: code 8 as 0x80, negative and NaN scale bytes included); a one-digit
    change of a sign selector or of the lop3 function is caught."""
    codes, scales = probes.exhaustive_groups()
    want = probes.reference_e4m3_bytes(codes, scales)
    nan = (want & 0x7F) == 0x7F
    assert int(nan.sum()) == 2 * 16 * 16  # scale bytes 0x7F and 0xFF: every value NaN

    def check(got):
        assert torch.equal((got & 0x7F) == 0x7F, nan)
        assert torch.equal(got[~nan], want[~nan])
    check(probes.lut_e4m3_asm_emulate(codes, scales))
    for old, new in (("0xD9C8", "0xD9C9"), ("0x78;", "0x6A;")):
        mutant = lut.LUT_E4M3_ASM.replace(old, new, 1)
        regs = probes.ptx_emulate(mutant, {"$4": codes.view(torch.int64).reshape(-1),
                                        "$5": lut.lut_table_e4m3()[scales.long()]})
        with pytest.raises(AssertionError):
            check(probes.unpack_bytes(torch.stack([regs[f"${i}"] for i in range(4)], dim=1)))


def test_lut_table_e4m3_is_signed_lut_table():
    """The "fp8" table is the fp16 one's magnitudes as E4M3 bytes with the scale's sign: row s
    byte m = sign(s) << 7 | (E4M3 magnitude of ``lut_table``'s byte), NaN rows aside."""
    t16, t8 = lut.lut_table(), lut.lut_table_e4m3()
    sh = torch.arange(8, dtype=torch.int64) * 8
    b16 = (t16[:, None] >> sh) & 0xFF  # fp16 bits 7..14 = (exp + 8) << 3 | mantissa
    b8 = (t8[:, None] >> sh) & 0xFF
    s = torch.arange(256)[:, None]
    ok = (s & 0x7F) != 0x7F
    # fp16 bits 7..14 -> E4M3: subtract the exponent bias difference (8) from the exponent
    mag = torch.where(b16 == 0, 0, b16 - (8 << 3))
    sub = b16 < (9 << 3)  # E4M3 subnormals: fp16 exponent field below 1 + 8
    fp16 = (b16 << 7).to(torch.int16).view(torch.float16).float()
    from nvfp4_indexer.reference.formats import encode_e4m3
    mag = torch.where(sub, encode_e4m3(fp16).view(torch.uint8).long(), mag)
    want = mag | ((s >> 7) << 7)
    assert torch.equal(b8[ok.expand(-1, 8)], want[ok.expand(-1, 8)])


@pytest.mark.gpu
@pytest.mark.parametrize("operand", ["f16", "e4m3"])
def test_gpu_lut_asm_bit_exact(operand):
    """The inline-PTX lookups on the device over all pairs: "f16" the registers the wgmma
    scorer feeds its MMA (fp16 bits, NaN by position), "e4m3" the E4M3-operand lookup (dot
    mode "fp8"; bytes equal, NaN by position)."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs SM80+")
    codes, scales = probes.exhaustive_groups()
    if operand == "f16":
        got = probes.lut_asm_dequant(codes.to(DEV), scales.to(DEV))
        strict_equal(got, probes.reference_f16_bits(codes, scales))
        return
    got = probes.lut_e4m3_asm_dequant(codes.to(DEV), scales.to(DEV)).cpu()
    want = probes.reference_e4m3_bytes(codes, scales)
    nan = (want & 0x7F) == 0x7F
    assert torch.equal((got & 0x7F) == 0x7F, nan)
    assert torch.equal(got[~nan], want[~nan])
