"""SPEC 3 on the reference backend: ``ni.insert_index_k`` and ``ni.prepare_index_q`` against an
independent float64 numpy evaluation of Gemma RMSNorm + NeoX RoPE rounded once to fp32, then the
ml_dtypes quantization / E4M3 encode of tests/bruteforce.py. The reference is defined as that
float64 evaluation, so the comparison is bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bruteforce as bf
import nvfp4_indexer as ni
from nvfp4_indexer.conformance.fixtures import rope_cache as cos_sin_cache  # vLLM layout: cos | sin

REF = {"backend": "reference"}


def f32_numpy(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy()  # exact for bf16 / fp16 / fp32


def inputs(t: int, seed: int, dtype, heads: int | None = None):
    g = torch.Generator().manual_seed(seed)
    shape = (t, 128) if heads is None else (t, heads, 128)
    x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g)
                                                      * 2)).to(dtype)
    w = (torch.randn(128, generator=g) * 0.3).to(dtype)
    pos = torch.randint(0, 5000, (t,), generator=g)
    return x, w, pos


ROTARY_DIMS = pytest.mark.parametrize("rotary_dim", [64, 128])
COS_SIN_DTYPES = pytest.mark.parametrize("cs_dtype", [torch.bfloat16, torch.float32])
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@ROTARY_DIMS
@COS_SIN_DTYPES
@pytest.mark.parametrize("k_dtype", FLOAT_DTYPES)
def test_insert_index_k_bit_exact(rotary_dim, cs_dtype, k_dtype):
    t = 600
    cs = cos_sin_cache(5000, rotary_dim, cs_dtype)
    k, w, pos = inputs(t, seed=rotary_dim + t, dtype=k_dtype)
    cache = ni.new_index_cache(8, page_stride=9216 + 16)
    bf.storage_view(cache).fill_(0xA5)
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(8 * 128, generator=g)[:t]
    slots[::7] = -1  # skipped tokens
    before = bf.storage_view(cache).numpy().copy()
    ni.insert_index_k(cache, k, pos, slots, w, cs, rotary_dim=rotary_dim, **REF)
    y = bf.norm_rope_f32(f32_numpy(k), pos.numpy(), f32_numpy(w), f32_numpy(cs), rotary_dim,
                         1e-6)
    codes, scales = bf.quantize(y)
    want = before
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        base = (slot // 128) * cache.stride(0)
        off = slot % 128
        want[base + 64 * off:base + 64 * off + 64] = codes[i]
        want[base + 8192 + 8 * off:base + 8192 + 8 * off + 8] = scales[i]
    got = bf.storage_view(cache).numpy()
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:8]}"


def test_eps_is_rounded_to_fp32_before_the_norm():
    """SPEC 3: the norm adds fp32(eps). Rows whose mean square is near eps show it: eps = 1e-6
    and its fp32 rounding give the same exact values, the unrounded float64 eps other ones."""
    from nvfp4_indexer.reference.insert import norm_rope_exact
    x, w, pos = inputs(6, seed=11, dtype=torch.float32)
    x = x / x.norm(dim=-1, keepdim=True) * 1e-2  # mean(x^2) = 7.8e-7, comparable to eps
    cs = cos_sin_cache(5000, 64, torch.float32)
    eps32 = float(np.float32(1e-6))
    assert eps32 != 1e-6
    got, _ = norm_rope_exact(x, pos, w, cs, 64, 1e-6)
    want, _ = norm_rope_exact(x, pos, w, cs, 64, eps32)
    assert torch.equal(got, want)
    x64 = x.to(torch.float64)
    rms64 = torch.rsqrt((x64 * x64).mean(dim=-1, keepdim=True) + 1e-6)  # eps not rounded
    assert not torch.equal(got[:, 64:], x64[:, 64:] * rms64 * (1.0 + w.to(torch.float64)[64:]))
    assert torch.equal(got[:, 64:], (x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True)
                                                       + eps32) * (1.0 + w.double()))[:, 64:])


def test_insert_equals_write_of_norm_rope():
    # insert = write_index_k of the fp32 norm/rope output; eps and positions matter.
    cs = cos_sin_cache(300, 64, torch.float32)
    k, w, pos = inputs(128, seed=3, dtype=torch.float32)
    k[5] = 0.0  # an all-zero key: rms = 1/sqrt(eps)
    for eps in (1e-6, 1e-2):
        a, b = ni.new_index_cache(1), ni.new_index_cache(1)
        pos = pos % 300
        ni.insert_index_k(a, k, pos, torch.arange(128), w, cs, eps=eps, **REF)
        y = bf.norm_rope_f32(k.numpy(), pos.numpy(), w.numpy(), cs.numpy(), 64, eps)
        ni.write_index_k(b, torch.from_numpy(y), torch.arange(128), **REF)
        assert torch.equal(a, b)
    # Positions select cos/sin rows: a different position changes the rotated dims only.
    y0 = bf.norm_rope_f32(k.numpy(), np.zeros(128, dtype=np.int64), w.numpy(), cs.numpy(), 64,
                          1e-6)
    c = ni.new_index_cache(1)
    ni.insert_index_k(c, k, torch.zeros(128, dtype=torch.int32), torch.arange(128), w, cs,
                      **REF)
    codes, scales = bf.quantize(y0)  # position 0: cos 1, sin 0 -> no rotation
    assert np.array_equal(bf.page_codes_scales(bf.page_raw(c, 0))[0], codes)


@ROTARY_DIMS
@COS_SIN_DTYPES
@pytest.mark.parametrize("q_dtype", FLOAT_DTYPES)
def test_prepare_index_q_bit_exact(rotary_dim, cs_dtype, q_dtype):
    t, heads = 200, 4
    cs = cos_sin_cache(5000, rotary_dim, cs_dtype)
    q, w, pos = inputs(t, seed=rotary_dim + 7, dtype=q_dtype, heads=heads)
    got = ni.prepare_index_q(q, pos, w, cs, rotary_dim=rotary_dim, **REF)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (t, heads, 128)
    y = bf.norm_rope_f32(f32_numpy(q), pos.numpy(), f32_numpy(w), f32_numpy(cs), rotary_dim,
                         1e-6)
    want = bf.e4m3_bytes(y)
    assert np.array_equal(got.view(torch.uint8).numpy(), want)


def test_prepare_index_q_saturates_large_values():
    # Large (1 + w) factors push normalized values past 448: the encode saturates (SPEC 1.1).
    cs = cos_sin_cache(16, 64, torch.float32)
    q = torch.zeros(1, 1, 128)
    q[0, 0, 100] = 1.0  # rms-normalized to sqrt(128) = 11.3 on dim 100
    w = torch.zeros(128)
    w[100] = 100.0
    got = ni.prepare_index_q(q, torch.tensor([3]), w, cs, **REF).view(torch.uint8)
    assert got[0, 0, 100] == 0x7E
    others = torch.cat([got[0, 0, :100], got[0, 0, 101:]])
    assert torch.all(others & 0x7F == 0)  # +-0 (IEEE signs of the rotation's zero products)
    y = bf.norm_rope_f32(q.numpy(), np.array([3]), w.numpy(), cs.numpy(), 64, 1e-6)
    assert np.array_equal(got.numpy(), bf.e4m3_bytes(y))
