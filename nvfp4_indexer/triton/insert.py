"""Fused insert of index keys: Gemma RMSNorm + NeoX RoPE + NVFP4 quantize + paged write
(SPEC 3), one launch.

Norm and rotation run in fp32 (a different reduction order than the float64 reference), so
results may differ from the reference only within SPEC 3's band of a rounding threshold. The
quantization multiplies by correctly rounded reciprocals instead of dividing
(``nvfp4_quantize_pairs_fused`` / ``nvfp4_quantize_halves_fused``, same bits as each other;
within 2^-23 relative of SPEC 1.3's quotients, far inside the band: see ``numerics``). The
standalone quantize (``quantize.py``) keeps SPEC 1.3's IEEE divisions.
The row is pre-scaled by an exact power of two (``norm_pow2_scale``) so its fp32 sum of
squares cannot overflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import heuristics as hz
from .config import InsertConfig, check_config
from .numerics import gemma_rstd, norm_pow2_scale, nvfp4_quantize_halves_fused, nvfp4_quantize_pairs_fused, rope_combine, rope_freq, rope_partner
from ..validation import check_eps
from .device import launch_rows
from .quantize import written_rows, paged_token_bases, pair_dims, store_nvfp4_tokens


@triton.jit
def norm_rope_inputs(x_row, w_ptr, cs_row, cs_stride1, m, d, ROT: tl.constexpr):
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
def _dims(Q: tl.constexpr, H: tl.constexpr):
    """Dims of half-group tile (Q, H), int32 ``[1, 2, 8]``: element [0, p, i] is dim
    32Q + 16p + 8H + i, i.e. half H of group 2Q + p. The eight tiles (Q < 4, H < 2) cover the
    row; all share one layout (8 contiguous dims per thread, axis p over two threads), so
    thread p holds groups p, 2 + p, 4 + p, 6 + p whole, and the RoPE partners of ROT 64
    (tile Q + 1) and ROT 128 (tile Q + 2) in the same registers' owner."""
    p = tl.arange(0, 2)[None, :, None]
    i = tl.arange(0, 8)[None, None, :]
    return 32 * Q + 8 * H + 16 * p + i


@triton.jit
def _x_tile(x_ptr, x_row, m, Q: tl.constexpr, H: tl.constexpr):
    return tl.load(x_ptr + x_row + _dims(Q, H), mask=m, other=0.0).to(tl.float32)


@triton.jit
def _normed(xs, rstd, w_ptr, Q: tl.constexpr, H: tl.constexpr):
    """``xs * rstd * (1 + w)`` on tile (Q, H) (the order of the general path)."""
    return xs * rstd * (1.0 + tl.load(w_ptr + _dims(Q, H)).to(tl.float32))


@triton.jit
def _rotate(y_a, y_b, cs_row, cs_stride1, m, F: tl.constexpr, H: tl.constexpr,
            HALF: tl.constexpr):
    """NeoX rotation of dims ``f`` (tile ``y_a``) and ``f + HALF`` (``y_b``), f = the dims of
    tile (F, H) = the cos column; sin column f + HALF. Same operations as ``rope_combine``
    (``y_d * cos`` fused into the fma, ``y_p * sin`` rounded)."""
    f = _dims(F, H)
    cos = tl.load(cs_row + f * cs_stride1, mask=m, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + (f + HALF) * cs_stride1, mask=m, other=0.0).to(tl.float32)
    return y_a * cos - y_b * sin, y_b * cos + y_a * sin


@triton.jit
def _quantize_store(y_lo, y_hi, code_ptr, scale_ptr, ok, Q: tl.constexpr,
                    PORTABLE: tl.constexpr):
    """Quantize groups 2Q + p (halves ``y_lo`` / ``y_hi`` = tiles (Q, 0) / (Q, 1)) and store
    code bytes 8g + 4h + k at ``code_ptr [BT, 1, 1]``, scale bytes g at ``scale_ptr [BT, 1]``."""
    c_lo, c_hi, sb = nvfp4_quantize_halves_fused(y_lo, y_hi, PORTABLE)
    p = tl.arange(0, 2)
    k = tl.arange(0, 4)[None, None, :]
    byte = (16 * Q + 8 * p)[None, :, None] + k
    tl.store(code_ptr + byte, c_lo, mask=ok[:, None, None])
    tl.store(code_ptr + (byte + 4), c_hi, mask=ok[:, None, None])
    tl.store(scale_ptr + (2 * Q + p)[None, :], sb, mask=ok[:, None])


@triton.jit
def _insert_index_k_kernel(x_ptr, x_row_stride, n_rows, pos_ptr, w_ptr, cs_ptr, cs_stride0,
                           cs_stride1, eps, cache_ptr, slot_ptr, page_stride,
                           ROT: tl.constexpr, PORTABLE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens [pid * BLOCK_T, +BLOCK_T) of ``k [n_rows, 128]``: norm, rotate, quantize and
    write at ``slot_ptr[t]`` (negative = skip) into the paged cache.

    ROT 64 / 128: eight half-group tiles ``[BT, 2, 8]`` (``_dims``): two threads per token,
    vector loads, each thread owns whole quantization groups and the RoPE partners of its
    dims; the only cross-thread steps are the token's amax and sum of squares (one shuffle).
    Other ROT: per-dim partner gathers on ``[BT, 8, 8]`` even / odd tiles (general)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < n_rows
    pos = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int64)
    if ROT == 64 or ROT == 128:
        m = row_ok[:, None, None]
        x_row = (t.to(tl.int64) * x_row_stride)[:, None, None]
        cs_row = cs_ptr + (pos * cs_stride0)[:, None, None]
        x00 = _x_tile(x_ptr, x_row, m, 0, 0)
        x01 = _x_tile(x_ptr, x_row, m, 0, 1)
        x10 = _x_tile(x_ptr, x_row, m, 1, 0)
        x11 = _x_tile(x_ptr, x_row, m, 1, 1)
        x20 = _x_tile(x_ptr, x_row, m, 2, 0)
        x21 = _x_tile(x_ptr, x_row, m, 2, 1)
        x30 = _x_tile(x_ptr, x_row, m, 3, 0)
        x31 = _x_tile(x_ptr, x_row, m, 3, 1)
        # Gemma RMSNorm in fp32 on the row pre-scaled by an exact power of two.
        a = tl.maximum(tl.maximum(tl.maximum(tl.abs(x00), tl.abs(x01)),
                                  tl.maximum(tl.abs(x10), tl.abs(x11))),
                       tl.maximum(tl.maximum(tl.abs(x20), tl.abs(x21)),
                                  tl.maximum(tl.abs(x30), tl.abs(x31))))
        scale = norm_pow2_scale(tl.max(tl.max(a, axis=2), axis=1))  # [BT]
        sc = scale[:, None, None]
        x00, x01, x10, x11 = x00 * sc, x01 * sc, x10 * sc, x11 * sc
        x20, x21, x30, x31 = x20 * sc, x21 * sc, x30 * sc, x31 * sc
        sq = x00 * x00 + x01 * x01 + x10 * x10 + x11 * x11 \
            + x20 * x20 + x21 * x21 + x30 * x30 + x31 * x31
        rstd = gemma_rstd(tl.sum(tl.sum(sq, axis=2), axis=1), scale, eps, 128)[:, None, None]
        y00 = _normed(x00, rstd, w_ptr, 0, 0)
        y01 = _normed(x01, rstd, w_ptr, 0, 1)
        y10 = _normed(x10, rstd, w_ptr, 1, 0)
        y11 = _normed(x11, rstd, w_ptr, 1, 1)
        y20 = _normed(x20, rstd, w_ptr, 2, 0)
        y21 = _normed(x21, rstd, w_ptr, 2, 1)
        y30 = _normed(x30, rstd, w_ptr, 3, 0)
        y31 = _normed(x31, rstd, w_ptr, 3, 1)
        if ROT == 64:  # dims [0, 32) with [32, 64); [64, 128) unchanged
            y00, y10 = _rotate(y00, y10, cs_row, cs_stride1, m, 0, 0, 32)
            y01, y11 = _rotate(y01, y11, cs_row, cs_stride1, m, 0, 1, 32)
        else:  # dims [0, 64) with [64, 128)
            y00, y20 = _rotate(y00, y20, cs_row, cs_stride1, m, 0, 0, 64)
            y01, y21 = _rotate(y01, y21, cs_row, cs_stride1, m, 0, 1, 64)
            y10, y30 = _rotate(y10, y30, cs_row, cs_stride1, m, 1, 0, 64)
            y11, y31 = _rotate(y11, y31, cs_row, cs_stride1, m, 1, 1, 64)
        ok, code_row, scale_row = paged_token_bases(cache_ptr, slot_ptr, page_stride, t, row_ok)
        code_ptr = code_row[:, None, None]
        scale_ptr = scale_row[:, None]
        _quantize_store(y00, y01, code_ptr, scale_ptr, ok, 0, PORTABLE)
        _quantize_store(y10, y11, code_ptr, scale_ptr, ok, 1, PORTABLE)
        _quantize_store(y20, y21, code_ptr, scale_ptr, ok, 2, PORTABLE)
        _quantize_store(y30, y31, code_ptr, scale_ptr, ok, 3, PORTABLE)
    else:
        m = row_ok[:, None, None]
        x_row = x_ptr + (t.to(tl.int64) * x_row_stride)[:, None, None]
        cs_row = cs_ptr + (pos * cs_stride0)[:, None, None]
        de = pair_dims()  # [1, 8, 8] even dims; odd dims are de + 1
        do = de + 1
        xe, xe_p, we, we_p, ce, se = norm_rope_inputs(x_row, w_ptr, cs_row, cs_stride1, m, de,
                                                       ROT)
        xo, xo_p, wo, wo_p, co, so = norm_rope_inputs(x_row, w_ptr, cs_row, cs_stride1, m, do,
                                                       ROT)
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
        codes, scales = nvfp4_quantize_pairs_fused(ye, yo, PORTABLE)
        store_nvfp4_tokens(cache_ptr, cache_ptr, slot_ptr, page_stride, t, row_ok, codes,
                           scales, True)


def insert_index_k(cache: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, k_norm_weight: torch.Tensor,
                   cos_sin_cache: torch.Tensor, rotary_dim: int = 64, eps: float = 1e-6, *,
                   portable: bool | None = None, config: InsertConfig | None = None) -> None:
    """Fused Gemma RMSNorm + NeoX RoPE + NVFP4 quantize + paged write of index keys (SPEC 3).

    Args:
        cache: ``uint8 [num_blocks, 128, 72]``, strides ``(S, 72, 1)``.
        k: bf16/fp16/fp32 ``[T, 128]`` (any row stride). positions: int32/int64 ``[T]``.
        slot_mapping: int32/int64 ``[T]`` (negative = skip). k_norm_weight: float ``[128]``
        (the norm multiplies by ``1 + w``). cos_sin_cache: float ``[max_position, rotary_dim]``
        (cos first half, sin second; any strides). rotary_dim: even, 2..128 (a constexpr:
        one compile per value; 64 and 128 take the vectorized path). eps: norm epsilon.
        portable: force the PORTABLE constexpr (tests).
        config: tuning (``config.InsertConfig``: block_t, num_warps); None = defaults
        (``heuristics.insert_launch_shape``).
    Raises:
        ValueError: ``config`` not None or an ``InsertConfig``; ``eps`` not finite and > 0
        once rounded to fp32 (SPEC 3; the kernel takes it in fp32).
    The other inputs are validated by ``nvfp4_indexer.api.insert_index_k``. Writes exactly 72
    bytes per written token.
    """
    cfg = check_config("config", config, InsertConfig)
    eps = check_eps(eps)
    rotary_dim = int(rotary_dim)
    k2 = written_rows(k, cache)
    if k2 is None:
        return
    t = k2.shape[0]
    bt, nw = hz.insert_launch_shape(rotary_dim, t, cfg.block_t, cfg.num_warps)
    launch_rows(_insert_index_k_kernel, k.device, portable, t, bt,
                k2, k2.stride(0), t, positions.contiguous(), k_norm_weight.contiguous(),
                cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.stride(1), eps,
                cache, slot_mapping.contiguous(), cache.stride(0),
                ROT=rotary_dim, BLOCK_T=bt, num_warps=nw)
