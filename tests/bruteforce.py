"""Deliberately naive, independent oracle for the reference backend's tests.

Nothing here imports ``nvfp4_indexer``: number formats come from ml_dtypes (E4M3 = float8_e4m3fn,
E2M1 = float4_e2m1fn) and numpy, cache bytes are read at the SPEC 2 offsets from the raw storage,
scores are float64 dot products (exact for E4M3 operands, SPEC 4) taken one (row, head, page) at
a time, and selection is a Python sort on (is NaN, -score, id) (SPEC 5).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

PAGE = 128
DIM = 128
PAGE_BYTES = 9216
SCALES_AT = 8192
F8 = ml_dtypes.float8_e4m3fn
F4 = ml_dtypes.float4_e2m1fn

# SPEC 1.2: magnitudes of codes 0..7; code c + 8 is -(code c), code 8 is -0.
E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUE = np.array([m for m in E2M1_MAG] + [-m for m in E2M1_MAG], dtype=np.float64)


# ----------------------------------------------------------------------------- formats (SPEC 1)

def e4m3_bytes(x) -> np.ndarray:
    """SPEC 1.1 encode via ml_dtypes: clamp to +-448 (ml_dtypes does not saturate), cast,
    NaN -> 0x7F whatever its sign. ``x`` is any float array; it is used at its own precision
    (pass fp32 values to get the fp32 encode)."""
    x = np.asarray(x)
    nan = np.isnan(x)
    c = np.clip(np.where(nan, 0, x), -448.0, 448.0).astype(x.dtype)
    b = c.astype(F8).view(np.uint8).copy()
    b[nan] = 0x7F
    return b


def e4m3_value(b) -> np.ndarray:
    """float64 value of E4M3 bytes (NaN for 0x7F / 0xFF), via ml_dtypes."""
    return np.asarray(b, dtype=np.uint8).view(F8).astype(np.float64)


def e2m1_code_of(v32: np.ndarray) -> np.ndarray:
    """SPEC 1.3 cross-check: code = ml_dtypes float4_e2m1fn cast of clamp(v, -6, 6), -0 -> +0,
    NaN -> 0. ``v32`` fp32."""
    nan = np.isnan(v32)
    c = np.clip(np.where(nan, np.float32(0), v32), -6.0, 6.0).astype(np.float32)
    code = c.astype(F4).view(np.uint8) & 0x0F
    code = np.where(code == 8, 0, code)  # -0 is stored as +0
    return np.where(nan, 0, code).astype(np.uint8)


def quantize(x) -> tuple[np.ndarray, np.ndarray]:
    """SPEC 1.3 on fp32 ``x [..., 128]`` -> (packed codes uint8 [..., 64], scale bytes [..., 8])."""
    x = np.asarray(x, dtype=np.float32)
    g = x.reshape(*x.shape[:-1], 8, 16)
    amax = np.max(np.where(np.isnan(g), np.float32(0), np.abs(g)), axis=-1).astype(np.float32)
    with np.errstate(over="ignore"):
        sb = e4m3_bytes(np.maximum(amax, np.float32(1e-12)) / np.float32(6.0))
    sb = np.where(sb == 0, 1, sb).astype(np.uint8)  # scale floor 0x01 = 2^-9
    s32 = e4m3_value(sb).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (g / s32[..., None]).astype(np.float32)  # IEEE fp32 division
    codes = e2m1_code_of(v).reshape(*x.shape[:-1], DIM)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, sb


def unpack(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., 64] -> codes [..., 128]: dim 2i is the low nibble of byte i."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def dequant_f64(packed, scale_bytes) -> np.ndarray:
    """Exact products e2m1(code) * scale in float64, ``[..., 128]`` (SPEC 1.4 dequant_f32)."""
    codes = unpack(packed)
    s = np.repeat(e4m3_value(scale_bytes), 16, axis=-1)
    with np.errstate(invalid="ignore"):
        return E2M1_VALUE[codes] * s


def dequant_e4m3_bytes(packed, scale_bytes) -> np.ndarray:
    """SPEC 1.4 dequant_e4m3 as bytes ``[..., 128]``: E4M3 encode of the exact product."""
    return e4m3_bytes(dequant_f64(packed, scale_bytes))


# ----------------------------------------------------------------------------- raw cache bytes

def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """Flat uint8 tensor over the cache's whole storage (padding included)."""
    flat = torch.empty(0, dtype=torch.uint8, device=cache.device)
    st = cache.untyped_storage()
    return flat.set_(st, 0, (st.nbytes(),))


def page_raw(cache: torch.Tensor, block: int) -> np.ndarray:
    """The 9216 bytes of physical page ``block`` read straight from storage (SPEC 2)."""
    base = cache.storage_offset() + int(block) * cache.stride(0)
    return storage_view(cache)[base:base + PAGE_BYTES].cpu().numpy().copy()


def token_raw(page: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(64 code bytes, 8 scale bytes) of token ``t`` inside page bytes, at SPEC 2 offsets."""
    return page[t * 64:t * 64 + 64], page[SCALES_AT + 8 * t:SCALES_AT + 8 * t + 8]


def page_codes_scales(page: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token-major (codes uint8 [128, 64], scale bytes [128, 8]) of page bytes: token t's codes
    at t*64 .. t*64+63 and its scales at 8192 + 8t .. 8192 + 8t + 7 (SPEC 2)."""
    return page[:SCALES_AT].reshape(PAGE, 64), page[SCALES_AT:PAGE_BYTES].reshape(PAGE, 8)


def page_keys_bytes(cache: torch.Tensor, block: int) -> np.ndarray:
    """E4M3 key bytes (dequant_e4m3) of one page, ``uint8 [128 tokens, 128 dims]``: the FP8
    workspace page of SPEC 7."""
    codes, scales = page_codes_scales(page_raw(cache, block))
    return dequant_e4m3_bytes(codes, scales)


def page_keys_f64(cache: torch.Tensor, block: int) -> np.ndarray:
    """E4M3 keys of one page as float64 ``[128 tokens, 128 dims]`` (NaN for corrupted bytes)."""
    return e4m3_value(page_keys_bytes(cache, block))


# ----------------------------------------------------------------------------- scores & selection

def _history(seq_len: int) -> int:
    return max(seq_len - 1, 0) // PAGE


def scores(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> np.ndarray:
    """SPEC 4 page scores ``float32 [T, H, W]``, -inf outside each row's history."""
    q = e4m3_value(index_q.view(torch.uint8).cpu().numpy())  # float64 [T, H, 128]
    t_rows, heads, _ = q.shape
    bt = block_table.cpu().numpy()
    width = bt.shape[1]
    sl = [int(s) for s in seq_lens.cpu()]
    qsl = [int(s) for s in query_start_loc.cpu()]
    out = np.full((t_rows, heads, width), -np.inf, dtype=np.float32)
    keys_of = {}
    for r in range(len(sl)):
        q_len = qsl[r + 1] - qsl[r]
        for i in range(q_len):
            row = qsl[r] + i
            p = sl[r] - q_len + i
            if p < 0:
                continue
            local = p // PAGE
            for j in range(local):
                block = int(bt[r, j])
                if block not in keys_of:
                    keys_of[block] = page_keys_f64(cache, block)
                keys = keys_of[block]
                for h in range(heads):
                    with np.errstate(invalid="ignore"):
                        token_scores = keys @ q[row, h]  # exact float64 sums
                    finite = [s for s in token_scores.tolist() if not math.isnan(s)]
                    out[row, h, j] = np.float32(max(finite)) if finite else np.float32("nan")
    return out


def select_row(row_scores, local: int, topk: int = 16) -> list[int]:
    """SPEC 5 for one (row, head): padding, short and ranked rows."""
    if local < 0:
        return [0] + [-1] * (topk - 1)
    if local <= topk - 1:
        return list(range(local + 1)) + [-1] * (topk - 1 - local)

    def key(j):
        s = float(row_scores[j])
        return (1, 0.0, j) if math.isnan(s) else (0, -s, j)

    return sorted(range(local), key=key)[:topk - 1] + [local]


def positions(seq_lens, query_start_loc) -> list[int]:
    """Absolute position of every row (bottom-right aligned, negative for padding)."""
    sl = [int(s) for s in seq_lens]
    qsl = [int(s) for s in query_start_loc]
    pos = []
    for r in range(len(sl)):
        q_len = qsl[r + 1] - qsl[r]
        pos += [sl[r] - q_len + i for i in range(q_len)]
    return pos


def select(score: np.ndarray, seq_lens, query_start_loc, topk: int = 16) -> np.ndarray:
    """SPEC 5 selection of every (row, head) -> int32 [T, H, topk]."""
    pos = positions(seq_lens.cpu(), query_start_loc.cpu())
    t_rows, heads, _ = score.shape
    out = np.empty((t_rows, heads, topk), dtype=np.int32)
    for row in range(t_rows):
        local = pos[row] // PAGE if pos[row] >= 0 else -1
        for h in range(heads):
            out[row, h] = select_row(score[row, h], local, topk)
    return out


def decode(index_q, cache, block_table, seq_lens, query_len: int, topk: int = 16) -> np.ndarray:
    """SPEC 6 uniform decode batch -> int32 [B*Q, H, topk]."""
    qsl = torch.arange(block_table.shape[0] + 1, dtype=torch.int32) * query_len
    return select(scores(index_q, cache, block_table, seq_lens, qsl), seq_lens, qsl, topk)


def prefill(index_q, cache, block_table, cu_seqlens_q, seq_lens, topk: int = 16) -> np.ndarray:
    """SPEC 7 prefill (chunking cannot change the result) -> int32 [Tp, H, topk]."""
    s = scores(index_q, cache, block_table, seq_lens, cu_seqlens_q)
    return select(s, seq_lens, cu_seqlens_q, topk)


def gather(cache, block_table, seq_lens) -> tuple[np.ndarray, list[int]]:
    """SPEC 7 workspace bytes ``uint8 [P, 128, 128]`` and page offsets ``[R+1]``."""
    bt = block_table.cpu().numpy()
    pages, offsets = [], [0]
    for r, s in enumerate(int(x) for x in seq_lens.cpu()):
        for j in range(_history(s)):
            pages.append(page_keys_bytes(cache, int(bt[r, j])))
        offsets.append(offsets[-1] + _history(s))
    ws = np.stack(pages) if pages else np.zeros((0, PAGE, DIM), dtype=np.uint8)
    return ws, offsets


# ----------------------------------------------------------------------------- insert (SPEC 3)

def norm_rope_f32(x, positions_, weight, cos_sin, rotary_dim: int, eps: float) -> np.ndarray:
    """Gemma RMSNorm then NeoX RoPE in float64 (eps rounded to fp32 first, SPEC 3), rounded
    once to fp32. ``x [T, 128]`` or ``[T, H, 128]`` (any float array already upcast exactly to
    float64 by the caller)."""
    eps = float(np.float32(eps))
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    cs = np.asarray(cos_sin, dtype=np.float64)[np.asarray(positions_, dtype=np.int64)]
    rms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x * rms * (1.0 + w)
    half = rotary_dim // 2
    cos, sin = cs[:, :half], cs[:, half:rotary_dim]
    if y.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    out = y.copy()
    a, b = y[..., :half], y[..., half:rotary_dim]
    out[..., :half] = a * cos - b * sin
    out[..., half:rotary_dim] = b * cos + a * sin
    return out.astype(np.float32)
