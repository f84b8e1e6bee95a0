"""Number formats: E4M3 encode/decode, E2M1 codes, NVFP4 quantize/dequantize (SPEC 1).

Every function here is elementwise and runs on any device. Rounding is written out on the
value grid (no reliance on torch's fp8 cast rounding, which turns overflow into NaN on some
versions): a value is rounded on its own quantum with ties to even, and only the exactly
representable result goes through the final dtype cast.
"""

from __future__ import annotations

import torch

from ..constants import E2M1_MAX, E4M3_MAX, GROUP_SIZE, HEAD_DIM, NUM_GROUPS

E4M3_NAN_BYTE = 0x7F
E4M3_MIN_NORMAL_EXP = -6  # 2^-6 is the smallest normal E4M3 magnitude
E4M3_MANTISSA_BITS = 3
SCALE_FLOOR_BYTE = 0x01  # 2^-9: the scale used when amax/6 rounds to zero (SPEC 1.3)

# Magnitudes of E2M1 codes 0..7; code c + 8 is the negative of code c (SPEC 1.2).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-half-to-even decision points on the E2M1 grid: (threshold, inclusive, code).
# |v| > 5 -> 7; >= 3.5 -> 6; > 2.5 -> 5; >= 1.75 -> 4; > 1.25 -> 3; >= 0.75 -> 2; > 0.25 -> 1.
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                    (2.5, False), (3.5, True), (5.0, False))


def round_to_e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest E4M3 value, ties to even, saturating at +-448.

    Returns fp32 (every finite result is exactly an E4M3 value). NaN stays NaN; +-inf -> +-448;
    the sign of zero is kept.
    """
    x = x.to(torch.float32)
    a = x.abs()
    # Quantum = distance between neighbouring E4M3 values around |x|: 2^(e-3) for normals,
    # 2^-9 in the subnormal range. frexp gives |x| = m * 2^k with m in [0.5, 1), so e = k - 1.
    _, k = torch.frexp(a)
    e = torch.clamp(k.to(torch.int32) - 1, min=E4M3_MIN_NORMAL_EXP)
    quantum = torch.ldexp(torch.ones_like(a), (e - E4M3_MANTISSA_BITS).to(torch.float32))
    # a / quantum and the product back are exact (powers of two); torch.round is half-to-even.
    r = torch.round(torch.where(torch.isfinite(a), a, torch.zeros_like(a)) / quantum) * quantum
    r = torch.where(torch.isinf(a), torch.full_like(a, E4M3_MAX), r)
    r = torch.clamp(r, max=E4M3_MAX)  # 464 and above round past 448: saturate
    r = torch.copysign(r, x)
    return torch.where(torch.isnan(x), x, r)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Encode floats as E4M3 with round-to-nearest-even and saturation (SPEC 1.1).

    Args:
        x: float tensor of any shape (fp16/bf16/fp64 are converted to fp32 first).
    Returns:
        ``torch.float8_e4m3fn`` tensor of the same shape: |x| > 448 and +-inf give +-448,
        NaN gives byte 0x7F (whatever its sign), -0.0 gives 0x80.
    """
    r = round_to_e4m3_grid(x)
    # r is exactly representable (or NaN), so the cast cannot round or overflow.
    out = torch.where(torch.isnan(r), torch.zeros_like(r), r).to(torch.float8_e4m3fn)
    bits = out.view(torch.uint8)
    bits = torch.where(torch.isnan(r), torch.full_like(bits, E4M3_NAN_BYTE), bits)
    return bits.view(torch.float8_e4m3fn)


def decode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 (``float8_e4m3fn`` or its uint8 bytes) to fp32, exactly (SPEC 1.1)."""
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    return x.to(torch.float32)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of 4-bit E2M1 codes (uint8 or int tensor with values 0..15) (SPEC 1.2)."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=code.device)
    c = code.to(torch.long)
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8 0..15) of fp32 ``v`` already divided by its scale (SPEC 1.3 steps 3-4).

    Round half to even on the E2M1 grid, saturating at 6; zero (and NaN) is always +0 (code 0).
    """
    a = torch.clamp(v.abs(), max=E2M1_MAX)  # NaN stays NaN and fails every comparison below
    mag = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, inclusive in _E2M1_THRESHOLDS:
        mag += (a >= threshold if inclusive else a > threshold).to(torch.uint8)
    negative = (v < 0) & (mag != 0)
    return mag | (negative.to(torch.uint8) << 3)


def nvfp4_group_scales(x: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales of fp32 ``x [..., 128]`` as fp32 values ``[..., 8]`` (SPEC 1.3 steps 1-2)."""
    g = x.reshape(*x.shape[:-1], NUM_GROUPS, GROUP_SIZE)
    amax = torch.where(torch.isnan(g), torch.zeros_like(g), g.abs()).amax(dim=-1)
    s = round_to_e4m3_grid(torch.clamp(amax, min=1e-12) / E2M1_MAX)  # IEEE fp32 division
    floor = decode_e4m3(torch.tensor([SCALE_FLOOR_BYTE], dtype=torch.uint8, device=x.device))
    return torch.where(s == 0, floor, s)


def quantize_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize vectors of 128 values (SPEC 1.3).

    Args:
        x: float tensor ``[..., 128]`` (converted to fp32 first).
    Returns:
        codes: uint8 ``[..., 64]``, dim 2i in the low nibble and dim 2i+1 in the high nibble.
        scales: ``float8_e4m3fn [..., 8]``, one per group of 16 dims.
    """
    x = x.to(torch.float32)
    s = nvfp4_group_scales(x)
    g = x.reshape(*x.shape[:-1], NUM_GROUPS, GROUP_SIZE)
    v = g / s.unsqueeze(-1)  # true IEEE division, not a reciprocal multiply
    codes = e2m1_encode(v).reshape(*x.shape[:-1], HEAD_DIM)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, encode_e4m3(s)


def unpack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 ``[..., 64]`` into codes uint8 ``[..., 128]`` (low nibble = even dim) (SPEC 2)."""
    lo = codes & 0x0F
    hi = codes >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def dequantize_nvfp4(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """Dequantize NVFP4 vectors (SPEC 1.4).

    Args:
        codes: uint8 ``[..., 64]`` packed E2M1 codes.
        scales: ``float8_e4m3fn`` (or its uint8 bytes) ``[..., 8]``.
        dtype: ``torch.float8_e4m3fn`` (default) gives ``encode_e4m3(e2m1(code) * s)``, the
            value every scorer scores; ``torch.float32`` gives the exact product (analysis only).
    Returns:
        ``[..., 128]`` tensor of ``dtype``.
    """
    values = e2m1_value(unpack_e2m1(codes))
    s = decode_e4m3(scales).repeat_interleave(GROUP_SIZE, dim=-1)
    product = values * s  # exact in fp32 (2-bit times 4-bit significands, no overflow)
    if dtype == torch.float32:
        return product
    if dtype != torch.float8_e4m3fn:
        raise NotImplementedError(
            f"dequantize_nvfp4: dtype must be torch.float8_e4m3fn or torch.float32, got {dtype}"
        )
    return encode_e4m3(product)


def dequant_table(device=None) -> torch.Tensor:
    """The 16 x 256 table of ``dequant_e4m3(code, scale_byte)`` as uint8 E4M3 bytes (SPEC 1.4)."""
    code = torch.arange(16, dtype=torch.uint8, device=device)[:, None].expand(16, 256)
    scale = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)[None, :].expand(16, 256)
    product = e2m1_value(code) * decode_e4m3(scale.contiguous())
    return encode_e4m3(product).view(torch.uint8)
