"""Inline-PTX NVFP4 dequantization of the Triton decode kernel (``DEQUANT="ptx"`` /
``"ptx_arith"``, ``ptx.dequant_f16_cvt`` / ``ptx.dequant_f16_arith``) against SPEC 1.4.

- CPU: a small PTX interpreter (numpy, the PTX ISA semantics of each instruction used) runs
  the exact asm strings the kernel embeds on all 16 x 256 (code, scale byte) pairs in every
  nibble position, with different scales in the two packed elements: every output half must
  equal dequant_e4m3 (``reference.dequant_table``) widened to fp16, bit for bit (NaN where
  the reference byte is NaN). This checks the bit tricks, permute selectors, LOP3 tables and
  the rounding arithmetic; it cannot check Triton's packing order or the hardware itself.
- CPU: the same for the gather's asm (``ptx.DEQUANT_E4M3_BYTES_PTX``, E4M3 bytes packed
  in uint32 words), byte for byte against the table, under every model of the hardware's NaN
  results (sign and payload of NaN products, sign kept or dropped by the E4M3 cvt), so a NaN
  scale gives 0x7F whatever the GPU does; wrong variants of the asm must fail.
- CPU (interpreter): the plain-Triton twins of the asm blocks (``ptx.dequant_f16_portable``,
  ``ptx.dequant_e4m3_bytes_portable``) against the same table on all 16 x 256 pairs.
- CPU: the decode kernel compiles offline for SM90 with each dequant mode (Triton's bundled
  ptxas; no GPU) with wgmma MMAs, no conversion instructions in "ptx_arith", and the
  interpreter path ("fp32", DEQUANT "triton") still matches the reference.
- GPU (skipped without CUDA): the page operands of the ptx modes equal the portable path's
  bit for bit on all 16 x 256 pairs, and decode selections are identical to DEQUANT="triton".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nvfp4_indexer.triton import ptx  # noqa: E402
from conformance.fixtures import selection_out

HAS_CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------- PTX interpreter

def _f16(bits):
    return np.asarray(bits, dtype=np.uint16).view(np.float16)


def _bits16(vals):
    return np.asarray(vals, dtype=np.float16).view(np.uint16).astype(np.uint32)


def _halves(x):
    return x & 0xFFFF, x >> 16


def _join(lo, hi):
    return (lo.astype(np.uint32) & 0xFFFF) | ((hi.astype(np.uint32) & 0xFFFF) << 16)


# NaN results of f16x2 arithmetic: IEEE 754 leaves their sign and payload open, so the
# interpreter can model three behaviours (``run_ptx(nan_f16=...)``): "propagate" (the first
# NaN operand, quieted: x86's rule), "canonical" (0x7FFF, positive) and "xor" (the sign of
# the operands' signs XORed, payload 0x7E00). Code that must be exact on NaN inputs is
# run under every model.
NAN_F16_MODELS = ("propagate", "canonical", "xor")
# NaN into cvt.rn.satfinite.e4m3x2: "drop" gives 0x7F, "keep" gives 0x7F | sign << 7 (the
# rule of cuda_fp8.hpp's host emulation).
CVT_NAN_MODELS = ("drop", "keep")


def _f16x2(op, a, b, nan_f16="propagate"):
    out = []
    for ha, hb in zip(_halves(a), _halves(b)):
        fa, fb = _f16(ha), _f16(hb)
        with np.errstate(all="ignore"):  # fp16 ops are correctly rounded via exact fp32
            r = op(fa.astype(np.float32), fb.astype(np.float32)).astype(np.float16)
        bits = _bits16(r)
        nan_a, nan_b = np.isnan(fa), np.isnan(fb)
        if nan_f16 == "propagate":
            # invalid operations (0 * inf) give x86's default NaN 0xFE00
            nan_bits = np.where(nan_a, ha | 0x0200, np.where(nan_b, hb | 0x0200, 0xFE00))
        elif nan_f16 == "canonical":
            nan_bits = np.full_like(bits, 0x7FFF)
        elif nan_f16 == "xor":
            nan_bits = 0x7E00 | ((ha ^ hb) & 0x8000)
        else:
            raise ValueError(nan_f16)
        out.append(np.where(np.isnan(r), nan_bits, bits))
    return _join(*out)


def _min_nan(a, b):
    r = np.minimum(a, b)  # propagates NaN
    return np.where(np.isnan(a) | np.isnan(b), np.float32(np.nan), r)


def _prmt(a, b, c):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    src = np.stack(src)
    d = np.zeros_like(a)
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = np.take_along_axis(src, (sel & 7)[None], 0)[0] if np.ndim(sel) else src[sel & 7]
        if np.ndim(sel) == 0 and sel & 8:
            byte = np.where(byte & 0x80, 0xFF, 0x00).astype(np.uint32)
        d |= byte << (8 * i)
    return d


def _lop3(a, b, c, lut):
    d = np.zeros_like(a)
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        d |= ((lut >> idx) & 1) << bit
    return d


def _cvt_e4m3x2(a, cvt_nan="drop"):
    out = []
    for h in _halves(a):
        v = _f16(h).astype(np.float32)
        nan = np.isnan(v)
        v = np.clip(np.where(nan, 0, v), -448, 448)  # satfinite
        byte = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint32)
        nan_byte = 0x7F | ((h >> 8) & 0x80) if cvt_nan == "keep" else 0x7F
        out.append(np.where(nan, nan_byte, byte))
    return out[0] | (out[1] << 8)


def _cvt_f16x2_from_e4m3x2(a):
    halves = []
    for i in range(2):
        byte = ((a >> (8 * i)) & 0xFF).astype(np.uint8)
        halves.append(_bits16(byte.view(ml_dtypes.float8_e4m3fn).astype(np.float16)))
    return _join(*halves)


def run_ptx(asm: str, operands: dict[str, np.ndarray], *, nan_f16: str = "propagate",
            cvt_nan: str = "drop") -> dict[str, np.ndarray]:
    """Interpret the straight-line PTX ``asm`` on uint32 numpy arrays (``$n`` operands in
    ``operands``); returns every register (16-bit registers hold their value in the low
    bits). ``nan_f16`` / ``cvt_nan``: the NaN models (``NAN_F16_MODELS``,
    ``CVT_NAN_MODELS``). Raises on an instruction it does not know."""
    regs = {k: np.asarray(v, dtype=np.uint32) for k, v in operands.items()}

    def val(tok):
        tok = tok.strip()
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return np.uint32(int(tok, 0))
        return regs[tok]

    for line in asm.splitlines():
        line = line.split("//")[0].strip().rstrip(";")  # the blocks comment every line
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        pack = re.fullmatch(r"([$\w]+),\s*\{\s*([$\w]+),\s*([$\w]+)\s*\}", rest.strip())
        if op == "mov.b32" and pack:  # mov.b32 d, {lo16, hi16}: pack two 16-bit registers
            d, lo, hi = pack.groups()
            regs[d] = np.asarray(_join(val(lo), val(hi)), dtype=np.uint32)
            continue
        args = [t.strip() for t in rest.split(",")]
        dst, src = args[0], [val(t) for t in args[1:]]
        if op == "mov.b32":
            r = src[0] + np.zeros_like(next(iter(regs.values())))
        elif op == "shl.b32":
            r = (src[0].astype(np.uint64) << np.uint64(src[1])).astype(np.uint64) & 0xFFFFFFFF
        elif op == "and.b32":
            r = src[0] & src[1]
        elif op == "add.u32":
            r = (src[0].astype(np.uint64) + src[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            r = _prmt(src[0], src[1], int(src[2]))
        elif op == "lop3.b32":
            r = _lop3(src[0], src[1], src[2], int(src[3]))
        elif op == "mul.rn.f16x2":
            r = _f16x2(np.multiply, src[0], src[1], nan_f16)
        elif op == "add.rn.f16x2":
            r = _f16x2(np.add, src[0], src[1], nan_f16)
        elif op == "sub.rn.f16x2":
            r = _f16x2(np.subtract, src[0], src[1], nan_f16)
        elif op == "min.NaN.f16x2":
            r = _f16x2(_min_nan, src[0], src[1], nan_f16)
        elif op == "abs.f16x2":
            r = src[0] & 0x7FFF7FFF
        elif op == "max.u16x2":
            lo = np.maximum(src[0] & 0xFFFF, src[1] & 0xFFFF)
            hi = np.maximum(src[0] >> 16, src[1] >> 16)
            r = _join(lo, hi)
        elif op == "cvt.rn.satfinite.e4m3x2.f16x2":
            r = _cvt_e4m3x2(src[0], cvt_nan)
        elif op == "cvt.rn.f16x2.e4m3x2":
            r = _cvt_f16x2_from_e4m3x2(src[0])
        else:
            raise NotImplementedError(f"PTX interpreter: unknown instruction {op!r}")
        regs[dst] = np.asarray(r, dtype=np.uint32)
    return regs


def _ptx_module():
    """``nvfp4_indexer.triton.ptx`` (its asm strings are plain module constants)."""
    from nvfp4_indexer.triton import ptx
    return ptx


def _expected_f16_bits(codes, sbytes):
    """fp16 bits (uint32) of dequant_e4m3(code, scale byte) from the reference table, and a
    NaN mask."""
    from nvfp4_indexer import reference as ref
    table = ref.dequant_table().numpy()  # uint8 [16, 256]
    byte = table[codes, sbytes]
    f = byte.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return _bits16(f.astype(np.float16)), np.isnan(f)


@pytest.mark.parametrize("mode", ["ptx", "ptx_arith"])
def test_ptx_dequant_strings_bit_exact_all_pairs(mode):
    """Every output half of the asm equals dequant_e4m3 widened to fp16 for all 16 x 256
    (code, scale byte) pairs in each of the four nibble positions of both packed elements."""
    sc = _ptx_module()
    asm = str(sc.DEQUANT_F16_ARITH_PTX.value if mode == "ptx_arith"
              else sc.DEQUANT_F16_CVT_PTX.value)
    code = np.arange(16, dtype=np.uint32)[:, None].repeat(256, 1).ravel()  # 4096 pairs
    s_a = np.arange(256, dtype=np.uint32)[None, :].repeat(16, 0).ravel()
    s_b = (s_a * 37 + 11) % 256  # element 1 gets a different scale byte
    checked = 0
    for rot in range(4):  # every code visits every nibble position
        nib = [(code + k + rot * 5) % 16 for k in range(8)]  # nibble k of the word
        word = sum(nib[k] << (4 * k) for k in range(8)).astype(np.uint32)
        s16 = [_bits16(np.asarray(s, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16))
               for s in (s_a, s_b)]
        regs = run_ptx(asm, {"$4": word, "$5": _join(s16[0], s16[1])})
        # $0: low nibble of byte 0 / 2; $1: high nibble of byte 0 / 2; $2, $3: bytes 1 / 3.
        for out, (k_el0, k_el1) in enumerate([(0, 4), (1, 5), (2, 6), (3, 7)]):
            lo, hi = _halves(regs[f"${out}"])
            for got, k, s in ((lo, k_el0, s_a), (hi, k_el1, s_b)):
                want, nan = _expected_f16_bits(nib[k], s)
                got_nan = np.isnan(_f16(got))
                assert np.array_equal(got_nan, nan), f"{mode}: NaN mismatch out ${out} nib {k}"
                bad = np.flatnonzero((got != want) & ~nan)
                assert bad.size == 0, (
                    f"{mode}: out ${out} nibble {k}: code {nib[k][bad[0]]} scale byte "
                    f"{s[bad[0]]:#04x}: got {got[bad[0]]:#06x}, want {want[bad[0]]:#06x}")
                checked += got.size
    assert checked == 4 * 8 * 4096


def _bytes_asm_case(rot: int):
    """Inputs of the E4M3-bytes asm for rotation ``rot``: the 8 nibbles of each word (every
    code visits every nibble position over rot = 0..3), the scale bytes of elements 0 / 1,
    the packed operands $2 / $3 and the expected outputs $0 / $1 from the reference table."""
    from nvfp4_indexer import reference as ref
    table = ref.dequant_table().numpy().astype(np.uint32)  # [16 codes, 256 scale bytes]
    code = np.arange(16, dtype=np.uint32)[:, None].repeat(256, 1).ravel()  # 4096 pairs
    s_a = np.arange(256, dtype=np.uint32)[None, :].repeat(16, 0).ravel()
    s_b = (s_a * 37 + 11) % 256  # element 1 gets a different scale byte
    nib = [(code + k + rot * 5) % 16 for k in range(8)]  # nibble k of the word
    word = sum(nib[k] << (4 * k) for k in range(8)).astype(np.uint32)
    s16 = [_bits16(np.asarray(s, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16))
           for s in (s_a, s_b)]
    want = [sum(table[nib[4 * el + j], s] << (8 * j) for j in range(4)).astype(np.uint32)
            for el, s in ((0, s_a), (1, s_b))]
    return nib, (s_a, s_b), word, _join(s16[0], s16[1]), want


def _check_bytes_asm(asm: str, rot: int, nan_f16: str, cvt_nan: str, scales16=None) -> None:
    nib, scales, word, s16, want = _bytes_asm_case(rot)
    regs = run_ptx(asm, {"$2": word, "$3": s16 if scales16 is None else scales16},
                   nan_f16=nan_f16, cvt_nan=cvt_nan)
    for el in (0, 1):
        got = regs[f"${el}"]
        bad = np.flatnonzero(got != want[el])
        if bad.size:
            i = bad[0]
            j = next(j for j in range(4)
                     if ((got[i] >> 8 * j) & 0xFF) != ((want[el][i] >> 8 * j) & 0xFF))
            pytest.fail(f"nan_f16={nan_f16} cvt_nan={cvt_nan} rot {rot}: output ${el} byte "
                        f"{j} (code {nib[4 * el + j][i]}, scale byte {scales[el][i]:#04x}): "
                        f"got word {got[i]:#010x}, want {want[el][i]:#010x} ({bad.size} bad)")


@pytest.mark.parametrize("nan_f16", NAN_F16_MODELS)
@pytest.mark.parametrize("cvt_nan", CVT_NAN_MODELS)
def test_ptx_dequant_bytes_string_bit_exact_all_pairs(nan_f16, cvt_nan):
    """``DEQUANT_E4M3_BYTES_PTX`` (the gather's asm, run as the kernel embeds it): byte j of
    output $e is dequant_e4m3 (``reference.dequant_table``) of nibble 4e + j of the packed code
    word with element e's scale, for all 16 x 256 (code, scale byte) pairs in every nibble
    position, different scales in the two elements. NaN scales (0x7F, 0xFF) must give 0x7F
    and code 8 / negative scales follow IEEE signs, under every NaN model of the hardware."""
    asm = str(_ptx_module().DEQUANT_E4M3_BYTES_PTX.value)
    for rot in range(4):
        _check_bytes_asm(asm, rot, nan_f16, cvt_nan)


def test_ptx_dequant_bytes_any_nan_scale_encoding():
    """The GPU's E4M3 -> fp16 widening may produce other NaN patterns than ml_dtypes: every
    NaN scale half (0x7FFF, 0xFFFF, 0xFE00 or the signalling 0x7C01) still gives 0x7F."""
    asm = str(_ptx_module().DEQUANT_E4M3_BYTES_PTX.value)
    _, _, _, s16, _ = _bytes_asm_case(0)
    for pattern in (0x7FFF, 0xFFFF, 0x7C01, 0xFE00):
        halves = []
        for h in _halves(s16):
            nan = np.isnan(_f16(h))
            assert nan.any()
            halves.append(np.where(nan, pattern, h))
        for cvt_nan in CVT_NAN_MODELS:
            _check_bytes_asm(asm, 1, "propagate", cvt_nan, _join(*halves))


@pytest.mark.parametrize("wrong", ["nibble order", "element scale", "no NaN fix", "pack order"])
def test_ptx_bytes_interpreter_catches_wrong_asm(wrong):
    """The byte-exact check is not vacuous: swapped nibbles, a swapped element scale, a
    missing NaN sign fix (under a sign-keeping cvt) and a swapped 16-bit pack all fail."""
    asm = str(_ptx_module().DEQUANT_E4M3_BYTES_PTX.value)
    bad = {"nibble order": asm.replace("0xC480", "0x84C0"),
           "element scale": asm.replace("0x1010", "0x3232"),
           "no NaN fix": asm.replace("lop3.b32 $0, r0, n0, 0x80808080, 0x70",
                                     "mov.b32 $0, r0"),
           "pack order": asm.replace("{e0, e1}", "{e1, e0}")}[wrong]
    assert bad != asm
    with pytest.raises(pytest.fail.Exception):
        _check_bytes_asm(bad, 0, "propagate", "keep")


def test_ptx_interpreter_catches_wrong_asm():
    """The interpreter is not vacuous: a wrong permute selector or a missing sign restore
    is caught."""
    sc = _ptx_module()
    code = np.arange(16, dtype=np.uint32)[:, None].repeat(256, 1).ravel()
    s = np.arange(256, dtype=np.uint32)[None, :].repeat(16, 0).ravel()
    s16 = _bits16(np.asarray(s, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16))
    word = (code * 0x11111111).astype(np.uint32)  # the same code in every nibble
    want, nan = _expected_f16_bits(code, s)
    for bad_asm in (str(sc.DEQUANT_F16_CVT_PTX.value).replace("0xA280", "0xA200", 1),
                    str(sc.DEQUANT_F16_ARITH_PTX.value).replace("0xD8", "0xF0", 1)):
        regs = run_ptx(bad_asm, {"$4": word, "$5": _join(s16, s16)})
        lo = _halves(regs["$0"])[0]
        assert np.any((lo != want) & ~nan)


# ------------------------------------------------------- plain-Triton twins (interpreter)

def _twin_inputs(rot: int):
    """Every (code, scale byte) pair as the asm blocks take them: uint16 code pairs (int32
    tensor) and fp16 scales, element 2w + e = half e of ``_bytes_asm_case``'s word w; plus
    the expected E4M3 bytes ``[elements, 4]`` (uint8 numpy)."""
    _, _, word, s16, want = _bytes_asm_case(rot)
    pairs = np.stack([word & 0xFFFF, word >> 16], 1).ravel()
    scales = np.stack([s16 & 0xFFFF, s16 >> 16], 1).ravel().astype(np.uint16)
    words = np.stack(want, 1).ravel()
    expect = np.stack([(words >> (8 * j)) & 0xFF for j in range(4)], 1).astype(np.uint8)
    return (torch.from_numpy(pairs.astype(np.int32)),
            torch.from_numpy(scales.view(np.int16)).view(torch.float16), expect)


@triton.jit
def _twin_kernel(codes_ptr, scales_ptr, out_ptr, N: tl.constexpr, BYTES: tl.constexpr):
    i = tl.arange(0, N)
    c = tl.load(codes_ptr + i).to(tl.uint16)
    s = tl.load(scales_ptr + i)
    if BYTES:
        tl.store(out_ptr + i, ptx.dequant_e4m3_bytes_portable(c, s).to(tl.int64))
    else:
        k0, k1, k2, k3 = ptx.dequant_f16_portable(c, s)
        tl.store(out_ptr + 4 * i, k0.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF)
        tl.store(out_ptr + 4 * i + 1, k1.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF)
        tl.store(out_ptr + 4 * i + 2, k2.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF)
        tl.store(out_ptr + 4 * i + 3, k3.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter check runs on CPU-only machines")
@pytest.mark.parametrize("rot", [0, 3])
def test_portable_twins_bit_exact_all_pairs(rot):
    """``dequant_e4m3_bytes_portable`` gives the table's bytes and ``dequant_f16_portable``
    their fp16 widening (NaN where the byte is NaN) for all 16 x 256 (code, scale byte)
    pairs in every nibble position (over ``rot``), different scales per element."""
    codes, scales, expect = _twin_inputs(rot)
    n = codes.numel()
    kernel = _twin_kernel
    got = torch.full((n,), -7, dtype=torch.int64)
    kernel[(1,)](codes, scales, got, N=n, BYTES=True)
    want_words = sum(expect[:, j].astype(np.int64) << (8 * j) for j in range(4))
    assert np.array_equal(got.numpy(), want_words)
    got = torch.full((n * 4,), -7, dtype=torch.int64)
    kernel[(1,)](codes, scales, got, N=n, BYTES=False)
    f = expect.ravel().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want_bits, nan = _bits16(f.astype(np.float16)), np.isnan(f)
    got_bits = got.numpy().astype(np.uint32)
    assert np.array_equal(np.isnan(_f16(got_bits)), nan)
    assert np.array_equal(got_bits[~nan], want_bits[~nan])


# ------------------------------------------------------------------ offline compile for SM90

_COMPILE_SCRIPT = r'''
import os
os.environ.pop("TRITON_INTERPRET", None)
from benchmarks.sass_stats import compile_decode, sass_stats
from nvfp4_indexer.triton.heuristics import MAXNREG
# spill instructions (LDL/STL; "0 B local" cannot see them) at the launch's register cap,
# measured 3 / 0 / 33 on Triton 3.6: a bound that catches a regression, not a target
SPILL_BOUND = {"ptx": 8, "ptx_arith": 8, "triton": 48}
for mode, window in (("ptx", 64), ("ptx_arith", 32), ("triton", 64)):
    k = compile_decode(dequant=mode, window=window, maxnreg=MAXNREG)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx, mode
    n_cvt = ptx.count("cvt.rn.satfinite.e4m3x2.f16x2")
    if mode == "ptx_arith":
        assert n_cvt == 0 and "min.NaN.f16x2" in ptx, mode
    elif mode == "ptx":
        assert n_cvt > 0 and "prmt.b32" in ptx, mode
    st = sass_stats(k)
    assert st["spill_ops"] <= SPILL_BOUND[mode] and any(hg for _, hg in st["loops"]), (mode, st)
    print("ok", mode, st["registers"], st["spill_ops"], [n for n, hg in st["loops"] if hg])
from benchmarks.sass_stats import compile_prefill
pages = {}
for on_n, bound in ((True, 16), (False, 48)):  # 255 registers: measured 8 / 38 spill ops
    st = sass_stats(compile_prefill(tokens_on_n=on_n))
    assert st["spill_ops"] <= bound and any(hg for _, hg in st["loops"]), (on_n, st)
    pages[on_n] = min(n for n, hg in st["loops"] if hg)
assert 2 * pages[True] < pages[False], pages  # the max over tokens stays in registers
print("ok prefill", pages)
from benchmarks.sass_stats import compile_gather
for stream in (True, False):  # the gather's cache hints reach the PTX only when asked for
    ptx = compile_gather(streaming=stream).asm["ptx"]
    assert ("evict_first" in ptx and "st.global.cs" in ptx) == stream, stream
    assert "evict_first" in ptx or "st.global.cs" not in ptx
from benchmarks.sass_stats import elementwise_report
lines = elementwise_report()  # gather (ptx / triton) and insert kernels
per8 = {ln.split(":")[0]: float(ln.split("= ")[1].split()[0]) for ln in lines
        if ln.startswith("gather")}
ptx16 = next(v for k, v in per8.items() if "ptx" in k and "tok_block 16" in k)
tri16 = next(v for k, v in per8.items() if "triton" in k and "tok_block 16" in k)
assert ptx16 * 3 < tri16, per8  # the inline-PTX gather path is the cheap one
assert all(" 0 B local" in ln for ln in lines if ln.startswith("insert")), lines
print("ok elementwise", len(lines))
'''


def test_decode_ptx_modes_compile_offline_for_sm90():
    """The decode kernel compiles to SM90 PTX + cubin (bundled ptxas) in every dequant mode at
    its register cap (``MAXNREG``), with wgmma, a page loop holding the HGMMAs and at most a
    few spill instructions (LDL/STL: ptx 3, triton 33 measured; ``benchmarks.sass_stats``, the
    tool behind the instruction counts in docs/benchmarks.md), and so do the gather and insert
    kernels (``--elementwise``: the PTX gather path issues under a third of the Triton-ops
    path's instructions, no insert local memory) and the prefill score kernel (255 registers,
    8 spill instructions with the tokens on the MMA's N axis, whose page loop is under half as
    long, 38 on M); runs in a subprocess (this process may have interpreted kernels)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is unavailable")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 5, proc.stdout


_INTERP_SCRIPT = r'''
import torch
from benchmarks.labs import dequant_lab as L
rows = L.check_decode(torch.device("cpu"), {"base": {}, "win2": dict(window=2)},
                      lens=(2300, 0, 129, 2100))
for what, verdict in rows:
    print(what, "|", verdict)
'''


@pytest.mark.skipif(tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4),
                    reason="Triton 3.6's interpreter breaks on numpy >= 2.4 (CI pins < 2.4)")
def test_interpreter_decode_default_and_small_window_match_reference():
    """Under the interpreter the default path ("fp32" dot, DEQUANT "triton") is valid vs the
    exact reference scores (SPEC 9 b=15 check of the lab, on a batch with NaN, negative,
    maximal and subnormal scale pages), and a 2-page top-k window gives identical rows."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if "|" in ln]
    assert len(lines) == 2 and all("| ok: tie-aware failures 0" in ln for ln in lines), \
        proc.stdout
    assert "rows == base 1.000" in lines[1], proc.stdout


def test_runner_rejects_bad_knobs():
    """DecodeConfig / DecodeRunner validate the lab knobs before any launch (no GPU needed)."""
    from nvfp4_indexer.triton import DecodeConfig, decode, heuristics

    def make(**knobs):
        return decode.DecodeRunner(4, 2, 8, 2, "cpu", config=DecodeConfig(**knobs),
                                   warmup=False)
    with pytest.raises(ValueError, match="dequant"):
        make(dequant="bogus")
    with pytest.raises(ValueError, match="dequant"):  # ptx modes need a CUDA GPU
        make(dequant="ptx")
    with pytest.raises(ValueError, match="num_warps"):
        make(num_warps=3)
    for bad in (3, 0, 512):  # a power of two with window * BLOCK_M <= 4096 (BLOCK_M 16)
        with pytest.raises(ValueError, match="window"):
            make(window=bad)
    with pytest.raises(ValueError, match="maxnreg"):
        make(maxnreg=8)
    for bad in (-1, 0, 2.5, "3", True, heuristics.MAX_SPLITS + 1):  # never silently unwritten
        with pytest.raises(ValueError, match="num_splits"):
            make(num_splits=bad)
    for bad in (True, 1, "yes"):  # programmatic dependent launch: a bool, SM90+ CUDA only
        with pytest.raises(ValueError, match="pdl"):
            make(pdl=bad)
    r = make(programs_per_sm=1)
    assert r.dequant == "triton" and r.num_splits >= 1


# ------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

if HAS_CUDA:
    # the lab's operand kernel and pages (benchmarks/labs/dequant_lab.py): one definition of both
    from benchmarks.labs.dequant_lab import operand_kernel as _operand_kernel
    from benchmarks.labs.dequant_lab import pair_page_cache as _pair_page_cache


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["ptx", "ptx_arith"])
def test_gpu_ptx_operands_bit_exact(mode):
    """``nvfp4_dequant_ptx`` as the decode kernel calls it (uint16 code pairs loaded from a
    page, fp16 group scales) gives dequant_e4m3 bit for bit on all 16 x 256 (code, scale
    byte) pairs, NaN and negative scales included (operands stored as fp16)."""
    from nvfp4_indexer import reference as ref
    cache = _pair_page_cache()
    want = ref.decode_e4m3(ref.dequantize_nvfp4(*ref.read_blocks(cache, torch.arange(2))))
    got = torch.full((2, 128, 128), -7.0, dtype=torch.float16, device="cuda")
    _operand_kernel()[(2,)](cache.cuda(), got, DEQUANT=mode)
    got = got.float().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    assert torch.equal(got[keep].view(torch.int32), want[keep].view(torch.int32))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode,window", [("ptx", 64), ("ptx", 4), ("ptx_arith", 32),
                                         ("triton", 16)])
def test_gpu_decode_modes_match_triton(mode, window):
    """Decode with the ptx modes / top-k windows selects the same pages as the default path
    (identical operands; fp32 accumulation order may differ, so compare tie-aware through
    the reference checker of test_triton_scoring)."""
    from benchmarks.pool import PagePool, random_index_q
    from nvfp4_indexer import reference as ref
    from nvfp4_indexer.triton import decode
    b, q_len, heads, max_len = 8, 8, 4, 40000
    dev = torch.device("cuda")
    pool = PagePool(b * (max_len // 128 + 1) + 8, dev, seed=5)
    lens = [max_len, 0, 129, 2050, 30000, 12345, 999, 40000]
    bt = pool.block_tables(lens, 1)[0]
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = random_index_q(b * q_len, heads, dev, torch.Generator(device=dev).manual_seed(3))
    outs = {}
    for name, kw in (("base", {}), ("new", {"dequant": mode, "window": window})):
        out = selection_out(b * q_len, heads, device=dev)
        decode.DecodeRunner(heads, b, bt.shape[1], q_len, dev,
                            config=decode.DecodeConfig(**kw)).run(q, pool.cache, bt, sl, out)
        outs[name] = out
    torch.cuda.synchronize()
    if not torch.equal(outs["base"], outs["new"]):  # only exact-tie reorderings are allowed
        qsl = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32, device=dev)
        exact = ref.page_scores(q, pool.cache, bt, sl, qsl)
        diff = (outs["base"] != outs["new"]).any(-1)
        for r, h in diff.nonzero().tolist():
            a, n = outs["base"][r, h, :15].long(), outs["new"][r, h, :15].long()
            sa, sn = exact[r, h, a.clamp(min=0)], exact[r, h, n.clamp(min=0)]
            tol = 2.0 ** -decode.SCORE_ERROR_BITS["fp16"] * sa.abs().max()
            assert torch.all((sa - sn).abs() <= 2 * tol), (r, h, a.tolist(), n.tolist())
