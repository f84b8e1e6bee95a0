"""Fused insert of index keys: Gemma RMSNorm + NeoX RoPE + NVFP4 quantize + paged write
(SPEC 3), one launch.

Norm and rotation run in fp32 (a different reduction order than the float64 reference), so
results may differ from the reference only within SPEC 3's band of a rounding threshold; the
quantization of the fp32 vector is the shared bit-exact one (``nvfp4_quantize_pairs``).
The row is pre-scaled by an exact power of two (``norm_pow2_scale``) so its fp32 sum of
squares cannot overflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import (device_guard, gemma_rstd, norm_pow2_scale, nvfp4_quantize_pairs,
                       portable_default, rope_combine, rope_freq, rope_partner)
from .quantize import _rows_view, pair_dims, rows_per_program, store_nvfp4_tokens


@triton.jit
def _norm_rope_inputs(x_row, w_ptr, cs_row, cs_stride1, m, d, ROT: tl.constexpr):
    """Loads for the dims ``d`` of a tile: (x_d, x_partner, 1 + w_d, 1 + w_partner, cos, sin),
    all fp32; ``x_row`` / ``cs_row`` are per-token pointers broadcastable to ``d``."""
    H: tl.constexpr = ROT // 2
    p = rope_partner(d, ROT)
    x_d = tl.load(x_row + d, mask=m, other=0.0).to(tl.float32)
    x_p = tl.load(x_row + p, mask=m, other=0.0).to(tl.float32)
    w1_d = 1.0 + tl.load(w_ptr + d).to(tl.float32)
    w1_p = 1.0 + tl.load(w_ptr + p).to(tl.float32)
    f = rope_freq(d, ROT)
    mr = m & (d < ROT)
    cos = tl.load(cs_row + f * cs_stride1, mask=mr, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + (f + H) * cs_stride1, mask=mr, other=0.0).to(tl.float32)
    return x_d, x_p, w1_d, w1_p, cos, sin


@triton.jit
def _insert_index_k_kernel(x_ptr, x_row_stride, n_rows, pos_ptr, w_ptr, cs_ptr, cs_stride0,
                           cs_stride1, eps, cache_ptr, slot_ptr, page_stride,
                           ROT: tl.constexpr, PORTABLE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens [pid * BLOCK_T, +BLOCK_T) of ``k [n_rows, 128]``: norm, rotate, quantize and
    write at ``slot_ptr[t]`` (negative = skip) into the paged cache."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < n_rows
    m = row_ok[:, None, None]
    pos = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int64)
    x_row = x_ptr + (t.to(tl.int64) * x_row_stride)[:, None, None]
    cs_row = cs_ptr + (pos * cs_stride0)[:, None, None]
    de = pair_dims()  # [1, 8, 8] even dims; odd dims are de + 1
    do = de + 1
    xe, xe_p, we, we_p, ce, se = _norm_rope_inputs(x_row, w_ptr, cs_row, cs_stride1, m, de, ROT)
    xo, xo_p, wo, wo_p, co, so = _norm_rope_inputs(x_row, w_ptr, cs_row, cs_stride1, m, do, ROT)
    # Gemma RMSNorm in fp32 on the row pre-scaled by an exact power of two.
    amax = tl.maximum(tl.max(tl.max(tl.abs(xe), axis=2), axis=1),
                      tl.max(tl.max(tl.abs(xo), axis=2), axis=1))
    scale = norm_pow2_scale(amax)  # [BT]
    sc = scale[:, None, None]
    xe, xe_p, xo, xo_p = xe * sc, xe_p * sc, xo * sc, xo_p * sc
    sumsq = tl.sum(tl.sum(xe * xe, axis=2), axis=1) + tl.sum(tl.sum(xo * xo, axis=2), axis=1)
    rstd = gemma_rstd(sumsq, scale, eps, 128)[:, None, None]
    ye = rope_combine(xe * rstd * we, xe_p * rstd * we_p, ce, se, de, ROT)
    yo = rope_combine(xo * rstd * wo, xo_p * rstd * wo_p, co, so, do, ROT)
    codes, scales = nvfp4_quantize_pairs(ye, yo, PORTABLE)
    store_nvfp4_tokens(cache_ptr, cache_ptr, slot_ptr, page_stride, t, row_ok, codes, scales,
                       True)


def insert_index_k(cache: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, k_norm_weight: torch.Tensor,
                   cos_sin_cache: torch.Tensor, rotary_dim: int = 64, eps: float = 1e-6, *,
                   portable: bool | None = None, block_t: int | None = None,
                   num_warps: int = 4) -> None:
    """Fused Gemma RMSNorm + NeoX RoPE + NVFP4 quantize + paged write of index keys (SPEC 3).

    Args:
        cache: ``uint8 [num_blocks, 128, 72]``, strides ``(S, 72, 1)``.
        k: bf16/fp16/fp32 ``[T, 128]`` (any row stride). positions: int32/int64 ``[T]``.
        slot_mapping: int32/int64 ``[T]`` (negative = skip). k_norm_weight: float ``[128]``
        (the norm multiplies by ``1 + w``). cos_sin_cache: float ``[max_position, rotary_dim]``
        (cos first half, sin second; any strides). rotary_dim: even, 2..128 (a constexpr:
        one compile per value). eps: norm epsilon.
        portable: force the PORTABLE constexpr (tests).
        block_t: tokens per program, a power of two in 1..128 (tuning; default
        ``quantize.rows_per_program``). num_warps: 1, 2, 4 or 8 (tuning).
    Inputs are validated by ``nvfp4_indexer.api.insert_index_k``. Writes exactly 72 bytes per
    written token.
    """
    if block_t is not None and (not isinstance(block_t, int) or block_t < 1 or block_t > 128
                                or block_t & (block_t - 1)):
        raise ValueError(f"block_t: expected None or a power of two in 1..128, got {block_t!r}")
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps: expected 1, 2, 4 or 8, got {num_warps!r}")
    t = k.shape[0]
    if t == 0 or cache.shape[0] == 0:  # no block: every slot is negative (validated)
        return
    k2 = _rows_view(k)
    portable = portable_default(k.device) if portable is None else portable
    bt = block_t or rows_per_program(t)
    with device_guard(k.device):
        _insert_index_k_kernel[(triton.cdiv(t, bt),)](
            k2, k2.stride(0), t, positions.contiguous(), k_norm_weight.contiguous(),
            cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.stride(1), float(eps),
            cache, slot_mapping.contiguous(), cache.stride(0),
            ROT=rotary_dim, PORTABLE=portable, BLOCK_T=bt, num_warps=num_warps)
