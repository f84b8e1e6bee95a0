"""Index-query preparation: Gemma RMSNorm + NeoX RoPE + E4M3 encode, no scale (SPEC 3).

Same fp32 norm / rotation as the insert kernel (``insert.py``); results may differ from the
float64 reference only within SPEC 3's band of an E4M3 rounding threshold (or of zero).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import HEAD_DIM
from .insert import norm_rope_inputs
from .layout import HEAD
from .numerics import e4m3_encode_bits, gemma_rstd, norm_pow2_scale, rope_combine
from ..validation import check_eps
from .device import launch_rows, rows_per_program


@triton.jit
def _prepare_index_q_kernel(q_ptr, q_stride_t, q_stride_h, num_heads, n_rows, pos_ptr, w_ptr,
                            cs_ptr, cs_stride0, cs_stride1, eps, out_ptr, ROT: tl.constexpr,
                            PORTABLE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [pid * BLOCK_R, +BLOCK_R) of the flattened (token, head) rows of ``q [T, H, 128]``
    -> E4M3 bytes of ``out [T * H, 128]`` (contiguous)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < n_rows
    m = row_ok[:, None]
    tok = (r // num_heads).to(tl.int64)
    head = (r % num_heads).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int64)
    q_row = q_ptr + (tok * q_stride_t + head * q_stride_h)[:, None]
    cs_row = cs_ptr + (pos * cs_stride0)[:, None]
    d = tl.arange(0, HEAD)[None, :]
    x_d, x_p, w1_d, w1_p, cos, sin = norm_rope_inputs(q_row, w_ptr, cs_row, cs_stride1, m, d,
                                                       ROT)
    scale = norm_pow2_scale(tl.max(tl.abs(x_d), axis=1))  # [BR], exact power of two
    sc = scale[:, None]
    x_d, x_p = x_d * sc, x_p * sc
    rstd = gemma_rstd(tl.sum(x_d * x_d, axis=1), scale, eps, HEAD)[:, None]
    y = rope_combine(x_d * rstd * w1_d, x_p * rstd * w1_p, cos, sin, d, ROT)
    out = e4m3_encode_bits(y, PORTABLE)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * HEAD + d, out, mask=m)


def prepare_index_q(q: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
                    cos_sin_cache: torch.Tensor, rotary_dim: int = 64, eps: float = 1e-6, *,
                    portable: bool | None = None) -> torch.Tensor:
    """Gemma RMSNorm + NeoX RoPE + E4M3 encode of index queries, no scale (SPEC 3).

    Args:
        q: bf16/fp16/fp32 ``[T, H, 128]``, any strides on T and H (a last dim with a non-unit
        stride is copied). positions: int32/int64 ``[T]``. q_norm_weight: float ``[128]``.
        cos_sin_cache: float ``[max_position, rotary_dim]`` (any strides). rotary_dim: even,
        2..128 (constexpr). eps: norm epsilon. portable: force the PORTABLE constexpr (tests).
    Returns:
        contiguous ``float8_e4m3fn [T, H, 128]``.
    Raises:
        ValueError: ``eps`` not finite and > 0 once rounded to fp32 (SPEC 3; the kernel takes
        it in fp32). The other inputs are validated by ``nvfp4_indexer.api.prepare_index_q``.
    """
    eps = check_eps(eps)
    t, h, _ = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty((t, h, HEAD_DIM), dtype=torch.uint8, device=q.device)
    n = t * h
    if n:
        br = rows_per_program(n, 4)
        launch_rows(_prepare_index_q_kernel, q.device, portable, n, br,
                    q, q.stride(0), q.stride(1), h, n, positions.contiguous(),
                    q_norm_weight.contiguous(), cos_sin_cache, cos_sin_cache.stride(0),
                    cos_sin_cache.stride(1), eps, out, ROT=int(rotary_dim), BLOCK_R=br)
    return out.view(torch.float8_e4m3fn)
