"""Fused insert: Gemma RMSNorm + NeoX RoPE, then NVFP4 keys into the cache or E4M3 queries
(SPEC 3).

The reference evaluates norm and rotation in float64 and rounds once to fp32, so it is the same
on every device; a fused fp32 kernel may differ only within SPEC 3's band of a rounding
threshold, which ``norm_rope_exact`` provides the inputs to check.
"""

from __future__ import annotations

import torch

from .formats import encode_e4m3, quantize_nvfp4
from .paging import write_tokens


def norm_rope_exact(x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor,
                    cos_sin_cache: torch.Tensor, rotary_dim: int = 64, eps: float = 1e-6):
    """Normalized, rotated vectors in float64 with their SPEC 3 term magnitudes.

    Args:
        x: ``[T, 128]`` or ``[T, H, 128]`` float (any float dtype; upcast).
        positions: int ``[T]`` rows of ``cos_sin_cache``.
        weight: ``[128]`` Gemma norm weight (the norm multiplies by ``1 + weight``).
        cos_sin_cache: ``[max_position, rotary_dim]``: cos in the first half, sin in the second.
    Returns:
        ``(value, magnitude)`` float64 like ``x``: y after norm and RoPE, and the size of the
        terms that formed it (``|y_i cos| + |y_j sin|`` on rotated dims, ``|y_i|`` elsewhere).
    """
    x64 = x.to(torch.float64)
    w = weight.to(torch.float32).to(torch.float64)
    eps32 = torch.tensor(float(eps), dtype=torch.float32).item()  # SPEC 3: eps in fp32
    rms = torch.rsqrt((x64 * x64).mean(dim=-1, keepdim=True) + eps32)
    y = x64 * rms * (1.0 + w)
    half = rotary_dim // 2
    cs = cos_sin_cache[positions.to(torch.long)].to(torch.float32).to(torch.float64)
    cos, sin = cs[:, :half], cs[:, half:rotary_dim]
    if y.dim() == 3:  # [T, H, D]: one cos/sin row per token, shared by its heads
        cos, sin = cos[:, None, :], sin[:, None, :]
    a, b = y[..., :half], y[..., half:rotary_dim]
    value = torch.cat([a * cos - b * sin, b * cos + a * sin, y[..., rotary_dim:]], dim=-1)
    magnitude = torch.cat([(a * cos).abs() + (b * sin).abs(), (b * cos).abs() + (a * sin).abs(),
                           y[..., rotary_dim:].abs()], dim=-1)
    return value, magnitude


def norm_rope(x, positions, weight, cos_sin_cache, rotary_dim: int = 64, eps: float = 1e-6):
    """fp32 result of Gemma RMSNorm + NeoX RoPE (SPEC 3 steps 1-2), shape of ``x``."""
    value, _ = norm_rope_exact(x, positions, weight, cos_sin_cache, rotary_dim, eps)
    return value.to(torch.float32)


def insert_index_k(cache, k, positions, slot_mapping, k_norm_weight, cos_sin_cache,
                   rotary_dim: int = 64, eps: float = 1e-6) -> None:
    """Norm, rotate, NVFP4-quantize and write index keys ``k [T, 128]`` at their slots (SPEC 3)."""
    y = norm_rope(k, positions, k_norm_weight, cos_sin_cache, rotary_dim, eps)
    codes, scales = quantize_nvfp4(y)
    write_tokens(cache, codes, scales, slot_mapping)


def prepare_index_q(q, positions, q_norm_weight, cos_sin_cache, rotary_dim: int = 64,
                    eps: float = 1e-6) -> torch.Tensor:
    """Norm, rotate and E4M3-encode index queries ``q [T, H, 128]`` (no scale) (SPEC 3)."""
    return encode_e4m3(norm_rope(q, positions, q_norm_weight, cos_sin_cache, rotary_dim, eps))
