"""Dot modes of the Triton scorers (SPEC 4, 9): which MMA a page score uses, and the exact
conversion of E4M3 bytes to its operands.

The ``DOT`` constexpr, a string (error bounds: ``SCORE_ERROR_BITS``, below):

- "fp16" (GPU default) / "bf16": E4M3 operands converted exactly to fp16 / bf16 (every E4M3
  value is both), 16-bit MMA with fp32 accumulation, every product exact. fp16 is the default
  because E4M3 -> fp16 is one hardware conversion per pair on SM89+; the two are equally
  accurate here.
- "fp8": fp8 x fp8 MMA; on SM90 the accumulation keeps ~13 fraction bits (truncating).
- "fp32": the PORTABLE path (interpreter / CPU, or a GPU cross-check): integer-bit decoding
  and E4M3 rounding (``numerics``) to fp32 values and an IEEE fp32 dot (the interpreter's
  16-bit dot and fp8 casts are not trustworthy).

Error bound (SPEC 9)
--------------------
A scorer's page score differs from the exact one by at most ``e = 2^-b * max_t sum_d |q_d K_d|``
(max over the row's history tokens); ``SCORE_ERROR_BITS[dot]`` is b. Every product of two
E4M3 values is exact in fp32 and inside 16-bit MMAs, so only the accumulation of a token's
128 products rounds; the max over tokens is 1-Lipschitz, so a per-token bound carries over.

- "fp32" (interpreter / PORTABLE, IEEE fp32 dot): recursive summation of 128 terms errs by at
  most gamma_127 * sum|x_i| < 2^-16.99 * sum|x_i| in any order: b = 16.
- "fp16" (GPU default) / "bf16" (16-bit MMA, fp32 accumulation): tensor cores align the
  addends of one MMA step to the largest exponent and truncate (not round) to the fp32
  significand (Fasi et al. 2021 for V100/A100; Hopper assumed no worse). Each addend then errs
  by < 2^-23 * M (M <= sum|x_i| bounds every partial sum and addend); with k = 8 products per
  step: 128 products + 16 accumulator terms + 16 normalizations = 160 error terms
  < 2^-15.68 * sum|x_i|: b = 15 (one bit below the 16 a rounding accumulator would give).
- "fp8" (SM90 fp8 MMA): the accumulator keeps 13 fraction bits (e8m13, truncating; reported by
  the DeepSeek-V3 paper and public measurements). Worst-case model: every one of the 128
  products plus 4 accumulator steps truncated at 13 fraction bits relative to the running
  maximum: 132 * 2^-13 < 2^-5.95: b = 5. Typical errors are far smaller (about 2^-12); the
  GPU tests print the observed worst error in bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import e4m3_decode
from .device import portable_default

DOT_MODES = ("fp16", "bf16", "fp8", "fp32")
DEFAULT_GPU_DOT = "fp16"
# b of SPEC 9's tie tolerance e = 2^-b * max_t sum_d |q_d K_d|, per dot mode (module doc)
SCORE_ERROR_BITS = {"fp16": 15, "bf16": 15, "fp8": 5, "fp32": 16}


def resolve_dot(dot, device) -> str:
    """The ``DOT`` constexpr of a launch: ``dot`` if given (one of ``DOT_MODES``), else "fp32"
    under the interpreter / off CUDA and ``DEFAULT_GPU_DOT`` on a GPU.

    Raises:
        ValueError: ``dot`` not in ``DOT_MODES``, or a mode other than "fp32" under the
        interpreter / off CUDA.
    """
    return pick_dot(dot, portable_default(device))


def pick_dot(dot, portable: bool) -> str:
    """``resolve_dot`` for a device that is ``portable`` (interpreter / off CUDA) or not."""
    if dot is None:
        return "fp32" if portable else DEFAULT_GPU_DOT
    if dot not in DOT_MODES:
        raise ValueError(f"dot: expected one of {DOT_MODES}, got {dot!r}")
    if dot != "fp32" and portable:
        raise ValueError(f"dot: only 'fp32' runs under the interpreter / off CUDA, got {dot!r}")
    return dot


@triton.jit
def e4m3_operand(byte, DOT: tl.constexpr):
    """MMA operand of E4M3 bytes (uint8) for dot mode ``DOT``; every conversion is exact."""
    if DOT == "fp32":
        return e4m3_decode(byte)
    else:
        return _widen_e4m3(byte.to(tl.float8e4nv, bitcast=True), DOT)


@triton.jit
def e4m3_round_operand(x_f16, DOT: tl.constexpr):
    """encode_e4m3 of exact fp16 products (SPEC 1.1, 1.4) as an MMA operand of ``DOT``
    (fp16 / bf16 / fp8): one native round-to-nearest-even saturating conversion
    (``cvt.rn.satfinite``: beyond +-448 -> +-448, NaN -> 0x7F), exact widening after."""
    return _widen_e4m3(x_f16.to(tl.float8e4nv, fp_downcast_rounding="rtne"), DOT)


@triton.jit
def _widen_e4m3(f8, DOT: tl.constexpr):
    """E4M3 tensor ``f8`` as an MMA operand of ``DOT`` (fp16 / bf16 / fp8): itself for "fp8",
    else widened exactly."""
    if DOT == "fp8":
        return f8
    elif DOT == "bf16":
        return f8.to(tl.bfloat16)
    else:
        return f8.to(tl.float16)
