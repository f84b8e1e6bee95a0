"""NVFP4 quantization of rows of 128 values into dense arrays or the paged cache (SPEC 1.3, 2).

One kernel, ``_quantize_nvfp4_kernel``: ``PAGED=False`` writes dense ``codes [N, 64]`` /
``scales [N, 8]``; ``PAGED=True`` writes each token's 64 code bytes and 8 scale bytes into its
cache page at ``slot_mapping[t]`` (negative = skip) and nothing else. ``store_nvfp4_tokens`` is
shared with the fused insert kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import CODE_BYTES, HEAD_DIM, NUM_GROUPS, PAGE_SIZE, SCALES_OFFSET
from .numerics import nvfp4_quantize_pairs
from .device import launch_rows, rows_per_program


@triton.jit
def pair_dims():
    """Dims of the [1, 8, 8] even tile: element [0, g, j] is dim 16g + 2j (odd tile: + 1)."""
    g = tl.arange(0, 8)
    j = tl.arange(0, 8)
    return g[None, :, None] * 16 + j[None, None, :] * 2


@triton.jit
def paged_token_bases(cache_ptr, slot_ptr, page_stride, t, row_ok):
    """Where tokens ``t [BT]`` (``row_ok`` masks rows past the end) go in the paged cache
    (SPEC 2): ``slot = slot_ptr[t]``, skipped when negative; page ``slot // 128`` at byte
    offset ``page * page_stride``. Returns ``(ok [BT], code pointers [BT] (byte 0 of the
    token's 64 code bytes), scale pointers [BT] (its 8 scale bytes at 8192 + 8 * (slot %
    128)))``, int64 addressing."""
    slot = tl.load(slot_ptr + t, mask=row_ok, other=-1).to(tl.int64)
    ok = row_ok & (slot >= 0)
    slot = tl.where(ok, slot, 0)
    page = (slot // 128) * page_stride
    off = slot % 128
    return ok, cache_ptr + (page + off * 64), cache_ptr + (page + 8192 + off * 8)


@triton.jit
def store_nvfp4_tokens(codes_ptr, scales_ptr, slot_ptr, page_stride, t, row_ok, codes, scales,
                       PAGED: tl.constexpr):
    """Store quantized tokens ``t [BT]`` (int32 row ids; ``row_ok [BT]`` masks rows past the
    end): ``codes uint8 [BT, 8, 8]`` (byte 8g + j), ``scales uint8 [BT, 8]``.

    PAGED=False: dense ``codes_ptr [N, 64]`` / ``scales_ptr [N, 8]`` (contiguous rows).
    PAGED=True: ``codes_ptr`` is the cache base (``scales_ptr`` unused); token t goes to
    ``slot = slot_ptr[t]`` (skipped when negative): page ``slot // 128`` at byte offset
    ``page * page_stride``, codes at ``(slot % 128) * 64``, scales at
    ``8192 + (slot % 128) * 8`` (SPEC 2). int64 addressing throughout."""
    g = tl.arange(0, 8)
    j = tl.arange(0, 8)
    byte = g[None, :, None] * 8 + j[None, None, :]  # [1, 8, 8]
    if PAGED:
        ok, code_row, scale_row = paged_token_bases(codes_ptr, slot_ptr, page_stride, t, row_ok)
    else:
        ok = row_ok
        t64 = t.to(tl.int64)
        code_row = codes_ptr + t64 * 64
        scale_row = scales_ptr + t64 * 8
    tl.store(code_row[:, None, None] + byte, codes, mask=ok[:, None, None])
    tl.store(scale_row[:, None] + g[None, :], scales, mask=ok[:, None])


@triton.jit
def _quantize_nvfp4_kernel(x_ptr, x_row_stride, n_rows, codes_ptr, scales_ptr, slot_ptr,
                           page_stride, PAGED: tl.constexpr, PORTABLE: tl.constexpr,
                           BLOCK_T: tl.constexpr):
    """Rows [pid * BLOCK_T, +BLOCK_T) of ``x [n_rows, 128]`` (any float dtype, unit stride in
    the last dim) -> NVFP4 (SPEC 1.3), stored by ``store_nvfp4_tokens``."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < n_rows
    ptr = x_ptr + t.to(tl.int64)[:, None, None] * x_row_stride + pair_dims()
    m = row_ok[:, None, None]
    x_even = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    x_odd = tl.load(ptr + 1, mask=m, other=0.0).to(tl.float32)
    codes, scales = nvfp4_quantize_pairs(x_even, x_odd, PORTABLE)
    store_nvfp4_tokens(codes_ptr, scales_ptr, slot_ptr, page_stride, t, row_ok, codes, scales,
                       PAGED)


def written_rows(k: torch.Tensor, cache: torch.Tensor) -> torch.Tensor | None:
    """Keys ``k [T, 128]`` of a paged write as unit-stride rows (``_rows_view``), or None when
    nothing is written: no token, or a cache without blocks (every slot is then negative;
    the API validates that)."""
    return None if k.shape[0] == 0 or cache.shape[0] == 0 else _rows_view(k)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 128]`` as ``[N, 128]`` with unit stride in the last dim (copies if needed)."""
    x2 = x.reshape(-1, HEAD_DIM)
    if x2.shape[0] > 0 and (x2.stride(1) != 1 or x2.stride(0) < HEAD_DIM):
        x2 = x2.contiguous()
    return x2


def quantize_nvfp4(x: torch.Tensor, *, portable: bool | None = None):
    """NVFP4-quantize rows of 128 values (SPEC 1.3).

    Args:
        x: float32/float16/bfloat16 ``[..., 128]`` (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        portable: force the PORTABLE constexpr (tests); default ``portable_default``.
    Returns:
        ``(codes uint8 [..., 64], scales float8_e4m3fn [..., 8])``, contiguous; dim 2i in the
        low nibble, dim 2i+1 in the high nibble of code byte i.
    """
    lead = x.shape[:-1]
    x2 = _rows_view(x)
    n = x2.shape[0]
    codes = torch.empty((n, CODE_BYTES), dtype=torch.uint8, device=x.device)
    scales = torch.empty((n, NUM_GROUPS), dtype=torch.uint8, device=x.device)
    if n:
        bt = rows_per_program(n)
        launch_rows(_quantize_nvfp4_kernel, x.device, portable, n, bt,
                    x2, x2.stride(0), n, codes, scales, codes, 0, PAGED=False, BLOCK_T=bt)
    return (codes.reshape(*lead, CODE_BYTES),
            scales.view(torch.float8_e4m3fn).reshape(*lead, NUM_GROUPS))


def write_index_k(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, *,
                  portable: bool | None = None) -> None:
    """NVFP4-quantize keys and write them at their slots of the paged cache (SPEC 1.3, 2).

    Args:
        cache: ``uint8 [num_blocks, 128, 72]`` with strides ``(S, 72, 1)`` (S = page stride).
        k: float32/float16/bfloat16 ``[T, 128]`` (any row stride).
        slot_mapping: int32/int64 ``[T]``, ``block * 128 + offset``; negative slots are skipped.
        portable: force the PORTABLE constexpr (tests).
    Inputs are validated by ``nvfp4_indexer.api.write_index_k`` (slots inside the cache, no
    duplicates). Writes exactly 72 bytes per written token; page padding is never touched.
    """
    assert SCALES_OFFSET == 8192 and PAGE_SIZE == 128  # baked into store_nvfp4_tokens
    k2 = written_rows(k, cache)
    if k2 is not None:
        t = k2.shape[0]
        bt = rows_per_program(t)
        launch_rows(_quantize_nvfp4_kernel, k.device, portable, t, bt, k2, k2.stride(0), t,
                    cache, cache, slot_mapping.contiguous(), cache.stride(0),
                    PAGED=True, BLOCK_T=bt)
