"""Dot modes of the Triton scorers (SPEC 4, 9): which MMA a page score uses, and the exact
conversion of E4M3 bytes to its operands.

The ``DOT`` constexpr, a string (error bounds in ``decode.SCORE_ERROR_BITS``):

- "fp16" (GPU default) / "bf16": E4M3 operands converted exactly to fp16 / bf16 (every E4M3
  value is both), 16-bit MMA with fp32 accumulation, every product exact. fp16 is the default
  because E4M3 -> fp16 is one hardware conversion per pair on SM89+; the two are equally
  accurate here.
- "fp8": fp8 x fp8 MMA; on SM90 the accumulation keeps ~13 fraction bits (truncating).
- "fp32": the PORTABLE path (interpreter / CPU, or a GPU cross-check): integer-bit decoding
  and E4M3 rounding (``numerics``) to fp32 values and an IEEE fp32 dot (the interpreter's
  16-bit dot and fp8 casts are not trustworthy).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import e4m3_decode
from .device import portable_default

DOT_MODES = ("fp16", "bf16", "fp8", "fp32")
DEFAULT_GPU_DOT = "fp16"


def resolve_dot(dot, device) -> str:
    """The ``DOT`` constexpr of a launch: ``dot`` if given (one of ``DOT_MODES``), else "fp32"
    under the interpreter / off CUDA and ``DEFAULT_GPU_DOT`` on a GPU.

    Raises:
        ValueError: ``dot`` not in ``DOT_MODES``, or a mode other than "fp32" under the
        interpreter / off CUDA.
    """
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
