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
  ptxas; no GPU) with wgmma MMAs and no conversion instructions in "ptx_arith".
- GPU (skipped without CUDA): the page operands of the ptx modes equal the portable path's
  bit for bit on all 16 x 256 pairs (decode selections per mode:
  ``tests/triton/decode/test_split_kernel.py``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nvfp4_indexer.triton import ptx  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


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
from nvfp4_indexer.triton.decode.dispatch import MAXNREG
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
    few spill instructions (LDL/STL: ptx 3, triton 33 measured; ``benchmarks.sass_stats``),
    and so do the gather and insert kernels (``--elementwise``: the PTX gather path issues
    under a third of the Triton-ops path's instructions, no insert local memory) and the
    prefill score kernel (255 registers,
    8 spill instructions with the tokens on the MMA's N axis, whose page loop is under half as
    long, 38 on M); runs in a subprocess (this process may have interpreted kernels)."""
    from kernel_harness import offline_lines
    lines = offline_lines(_COMPILE_SCRIPT)
    assert sum(ln.startswith("ok ") for ln in lines) == 5, lines


# ------------------------------------------------------------------------------------ GPU


def _operand_kernel():
    """A Triton kernel: page ``pid``'s keys through ``ptx.nvfp4_dequant_ptx`` exactly as
    the decode kernel calls it (uint16 code pairs, fp16 group scales), stored fp16 [128, 128].
    Defined on call (it needs the GPU backend)."""
    import triton
    import triton.language as tl

    from nvfp4_indexer.triton import ptx

    @triton.jit
    def kernel(cache_ptr, out_ptr, DEQUANT: tl.constexpr):
        pid = tl.program_id(0)
        page = cache_ptr + pid * 9216
        t = tl.arange(0, 128)[:, None]
        codes = tl.load((page + t * 64).to(tl.pointer_type(tl.uint16), bitcast=True)
                        + tl.arange(0, 32)[None, :])
        sb = tl.load(page + 8192 + t * 8 + tl.arange(0, 8)[None, :])
        s8 = sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = tl.reshape(tl.broadcast_to(s8[:, :, None], (128, 8, 4)), (128, 32))
        k0, k1, k2, k3 = ptx.nvfp4_dequant_ptx(codes, s, DEQUANT)
        base = out_ptr + pid * 128 * 128 + t * 128 + 4 * tl.arange(0, 32)[None, :]
        tl.store(base, k0)
        tl.store(base + 1, k1)
        tl.store(base + 2, k2)
        tl.store(base + 3, k3)

    return kernel


def _pair_page_cache() -> torch.Tensor:
    """Two pages (CPU cache) holding all 16 x 256 (code, scale byte) pairs in both nibbles of
    every code byte position class."""
    from nvfp4_indexer import reference as ref
    cache = ref.new_index_cache(2, device="cpu")
    raw = cache.view(2, 9216)
    group = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    raw[0, :8192] = group.repeat(1024)
    raw[1, :8192] = ((group << 4) | (group >> 4)).repeat(1024)
    scales = torch.arange(1024) % 256
    raw[0, 8192:] = scales.to(torch.uint8)
    raw[1, 8192:] = ((scales * 37 + 11) % 256).to(torch.uint8)
    return cache


@pytest.mark.gpu
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


