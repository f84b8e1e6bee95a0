"""NVFP4 dequantization to E4M3 (what scorers score) or the exact fp32 product (SPEC 1.4).

``dequant_code_tile`` is shared with the gather kernel (``gather.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import CODE_BYTES, HEAD_DIM, NUM_GROUPS
from .numerics import e2m1_value, e4m3_decode, e4m3_encode_bits
from .device import launch_rows, rows_per_program


@triton.jit
def dequant_code_tile(code_bytes, scale_bytes, PORTABLE: tl.constexpr, OUT_F32: tl.constexpr):
    """Dequantize packed codes ``uint8 [BT, 64]`` with ``scale_bytes [BT, 64]`` (E4M3 byte of
    each code byte's group, i.e. group ``i // 8`` for byte i) (SPEC 1.4).

    Returns ``[BT, 128]`` in dim order (dim 2i from the low nibble, 2i+1 from the high):
    fp32 exact products when OUT_F32, else uint8 E4M3 bytes of dequant_e4m3."""
    s = e4m3_decode(scale_bytes)
    lo = e2m1_value(code_bytes & 0xF) * s  # exact in fp32
    hi = e2m1_value(code_bytes >> 4) * s
    if OUT_F32:
        out = tl.interleave(lo, hi)
    else:
        out = tl.interleave(e4m3_encode_bits(lo, PORTABLE), e4m3_encode_bits(hi, PORTABLE))
    return out


@triton.jit
def _dequantize_nvfp4_kernel(codes_ptr, scales_ptr, out_ptr, n_rows, PORTABLE: tl.constexpr,
                             OUT_F32: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows [pid * BLOCK_T, +BLOCK_T) of contiguous ``codes [n, 64]`` / ``scales [n, 8]``
    (uint8) -> ``out [n, 128]`` (fp32, or uint8 E4M3 bytes)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    row_ok = (t < n_rows)[:, None]
    i = tl.arange(0, 64)[None, :]
    code_bytes = tl.load(codes_ptr + t[:, None] * 64 + i, mask=row_ok, other=0)
    scale_bytes = tl.load(scales_ptr + t[:, None] * 8 + i // 8, mask=row_ok, other=0)
    out = dequant_code_tile(code_bytes, scale_bytes, PORTABLE, OUT_F32)
    d = tl.arange(0, 128)[None, :]
    tl.store(out_ptr + t[:, None] * 128 + d, out, mask=row_ok)


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float8_e4m3fn, *,
                     portable: bool | None = None) -> torch.Tensor:
    """Dequantize NVFP4 vectors (SPEC 1.4).

    Args:
        codes: uint8 ``[..., 64]``; scales: ``float8_e4m3fn`` or uint8 ``[..., 8]`` (same
            leading shape). CUDA, or CPU under ``TRITON_INTERPRET=1``.
        dtype: ``torch.float8_e4m3fn`` -> ``encode_e4m3(e2m1 * scale)``; ``torch.float32`` ->
            the exact product.
        portable: force the PORTABLE constexpr (tests).
    Returns:
        contiguous ``[..., 128]`` tensor of ``dtype``.
    Raises:
        NotImplementedError: another ``dtype``.
    """
    if dtype not in (torch.float8_e4m3fn, torch.float32):
        raise NotImplementedError(f"dtype: expected torch.float8_e4m3fn or torch.float32, "
                                  f"got {dtype}")
    lead = codes.shape[:-1]
    c2 = codes.reshape(-1, CODE_BYTES).contiguous()
    s2 = scales.reshape(-1, NUM_GROUPS).contiguous().view(torch.uint8)
    n = c2.shape[0]
    out_f32 = dtype == torch.float32
    out = torch.empty((n, HEAD_DIM), dtype=torch.float32 if out_f32 else torch.uint8,
                      device=codes.device)
    if n:
        bt = rows_per_program(n, 16)
        launch_rows(_dequantize_nvfp4_kernel, codes.device, portable, n, bt,
                    c2, s2, out, n, OUT_F32=out_f32, BLOCK_T=bt)
    if not out_f32:
        out = out.view(torch.float8_e4m3fn)
    return out.reshape(*lead, HEAD_DIM)
