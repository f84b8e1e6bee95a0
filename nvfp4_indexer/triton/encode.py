"""E4M3 encoding of float tensors (SPEC 1.1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import e4m3_encode_bits
from .device import interpreting, launch_rows


@triton.jit
def _encode_e4m3_kernel(x_ptr, out_ptr, n, PORTABLE: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = encode_e4m3(x[i])`` as uint8 bytes for flat ``x [n]`` (any float dtype)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, e4m3_encode_bits(x, PORTABLE), mask=m)


def encode_e4m3(x: torch.Tensor, *, portable: bool | None = None) -> torch.Tensor:
    """Encode floats as E4M3, round to nearest even, saturating (SPEC 1.1).

    Args:
        x: float32/float16/bfloat16, any shape (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        portable: force the PORTABLE constexpr (tests); default ``portable_default``.
    Returns:
        contiguous ``float8_e4m3fn`` of ``x``'s shape: beyond +-448 and +-inf give +-448, NaN
        gives 0x7F, -0.0 gives 0x80.
    """
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if n:
        block = 16384 if interpreting() else 1024
        launch_rows(_encode_e4m3_kernel, x.device, portable, n, block, flat, out, n, BLOCK=block)
    return out.view(torch.float8_e4m3fn)
