"""SPEC 2 page layout through the public cache API (``new_index_cache``, ``write_index_k``,
``read_index_k``), checked byte for byte on the cache's raw storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bruteforce as bf
import nvfp4_indexer as ni

REF = {"backend": "reference"}
POISON = 0xA5


def poisoned_cache(num_blocks: int, page_stride: int = 9216) -> torch.Tensor:
    cache = ni.new_index_cache(num_blocks, page_stride=page_stride)
    bf.storage_view(cache).fill_(POISON)
    return cache


def rand_k(t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(t, 8, generator=g) * 2).repeat_interleave(16, dim=1)
    return torch.randn(t, 128, generator=g) * mag


def expected_storage(cache: torch.Tensor, k: torch.Tensor, slots: list[int]) -> np.ndarray:
    """The storage bytes after writing ``k`` at ``slots``, built token by token from SPEC 2."""
    want = bf.storage_view(cache).numpy().copy()
    codes, scales = bf.quantize(k.to(torch.float32).numpy())
    stride, base = cache.stride(0), cache.storage_offset()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, off = divmod(slot, 128)
        page = base + block * stride
        for i in range(64):  # code byte i: dim 2i low nibble, dim 2i+1 high nibble
            want[page + off * 64 + i] = codes[t, i]
        for g in range(8):
            want[page + 8192 + 8 * off + g] = scales[t, g]
    return want


@pytest.mark.parametrize("extra", [0, 1, 64])
def test_write_exact_byte_offsets_and_nothing_else(extra):
    stride = 9216 + 16 * extra
    cache = poisoned_cache(5, page_stride=stride)
    assert cache.shape == (5, 128, 72) and cache.stride() == (stride, 72, 1)
    slots = [0, 127, 128 + 5, 3 * 128 + 64, 4 * 128 + 127, -1, 2 * 128 + 1, -7, 2 * 128]
    k = rand_k(len(slots), seed=extra)
    want = expected_storage(cache, k, slots)
    ni.write_index_k(cache, k, torch.tensor(slots, dtype=torch.int32), **REF)
    got = bf.storage_view(cache).numpy()
    diff = np.nonzero(got != want)[0]
    assert diff.size == 0, f"bytes differ at storage offsets {diff[:10]}"
    # Padding bytes of a strided cache were never touched.
    if extra:
        for b in range(5):
            assert np.all(got[b * stride + 9216:(b + 1) * stride] == POISON)


def test_nibble_order_spelled_out():
    cache = poisoned_cache(1)
    k = torch.zeros(1, 128)
    k[0, :16] = torch.tensor([6.0, 0.5, -1.0, 4.0] + [0.0] * 12)  # scale 1 (amax 6)
    ni.write_index_k(cache, k, torch.tensor([3]), **REF)
    page = bf.page_raw(cache, 0)
    assert page[3 * 64 + 0] == 0x17  # dim 0 = 6.0 (code 7) low, dim 1 = 0.5 (code 1) high
    assert page[3 * 64 + 1] == 0x6A  # dim 2 = -1.0 (code 10) low, dim 3 = 4.0 (code 6) high
    assert page[8192 + 3 * 8 + 0] == 0x38  # group 0 scale 1.0
    assert page[8192 + 3 * 8 + 1] == 0x01  # all-zero group: floor scale
    assert np.all(page[2 * 64:3 * 64] == POISON) and np.all(page[4 * 64:5 * 64] == POISON)
    assert np.all(page[8192 + 2 * 8:8192 + 3 * 8] == POISON)
    assert np.all(page[8192 + 4 * 8:8192 + 5 * 8] == POISON)


def test_full_page_token_t_is_not_row_t():
    # Rows of the [num_blocks, 128, 72] view are page bytes, not tokens (SPEC 2).
    cache = poisoned_cache(2)
    k = rand_k(128, seed=1)
    ni.write_index_k(cache, k, torch.arange(128, 256), **REF)
    codes, scales = bf.quantize(k.numpy())
    flat = cache[1].reshape(-1).numpy()
    assert np.array_equal(flat[:8192].reshape(128, 64), codes)
    assert np.array_equal(flat[8192:].reshape(128, 8), scales)
    assert np.all(bf.storage_view(cache).numpy()[:9216] == POISON)


@pytest.mark.parametrize("page_stride", [9216, 9216 + 16 * 3])
def test_read_index_k_round_trip(page_stride):
    cache = poisoned_cache(3, page_stride)
    k = rand_k(300, seed=2)
    perm = torch.randperm(3 * 128, generator=torch.Generator().manual_seed(0))[:300]
    ni.write_index_k(cache, k, perm, **REF)
    codes, scales = ni.quantize_nvfp4(k, **REF)
    for block in range(3):
        got_codes, got_scales = ni.read_index_k(cache, block)
        assert got_codes.shape == (128, 64) and got_codes.dtype == torch.uint8
        assert got_scales.shape == (128, 8) and got_scales.dtype == torch.float8_e4m3fn
        for t, slot in enumerate(perm.tolist()):
            if slot // 128 == block:
                assert torch.equal(got_codes[slot % 128], codes[t])
                assert torch.equal(got_scales[slot % 128].view(torch.uint8),
                                   scales[t].view(torch.uint8))
        unwritten = sorted(set(range(128)) - {s % 128 for s in perm.tolist() if s // 128 == block})
        assert torch.all(got_codes[unwritten] == POISON)
        assert torch.all(got_scales.view(torch.uint8)[unwritten] == POISON)
        # The read returns a copy: editing it leaves the cache alone.
        before = bf.page_raw(cache, block)
        got_codes.fill_(0)
        got_scales.view(torch.uint8).fill_(0)
        assert np.array_equal(bf.page_raw(cache, block), before)


def test_negative_slots_write_nothing():
    cache = poisoned_cache(2)
    before = bf.storage_view(cache).clone()
    ni.write_index_k(cache, rand_k(4, 3), torch.tensor([-1, -128, -2**31, -5], dtype=torch.int32),
                     **REF)
    ni.write_index_k(cache, rand_k(2, 4), torch.tensor([-1, -(2**40)], dtype=torch.int64), **REF)
    ni.write_index_k(cache, rand_k(0, 5), torch.zeros(0, dtype=torch.int32), **REF)
    assert torch.equal(bf.storage_view(cache), before)


def test_neighbouring_tokens_untouched_by_overwrite():
    cache = poisoned_cache(1)
    k1 = rand_k(128, 6)
    ni.write_index_k(cache, k1, torch.arange(128), **REF)
    k2 = rand_k(1, 7)
    ni.write_index_k(cache, k2, torch.tensor([64]), **REF)
    c1, s1 = bf.quantize(k1.numpy())
    c2, s2 = bf.quantize(k2.numpy())
    c1[64], s1[64] = c2[0], s2[0]
    page = bf.page_raw(cache, 0)
    codes, scales = bf.page_codes_scales(page)
    assert np.array_equal(codes, c1) and np.array_equal(scales, s1)


def test_caller_strided_view_cache():
    # A cache carved out of larger per-block allocations (e.g. a shared KV tensor).
    stride = 9216 + 256
    backing = torch.full((4 * stride + 32,), POISON, dtype=torch.uint8)
    cache = backing[32:].as_strided((4, 128, 72), (stride, 72, 1), storage_offset=32)
    slots = [5, 130, 3 * 128 + 127, 2 * 128]
    k = rand_k(4, 8)
    want = expected_storage(cache, k, slots)
    ni.write_index_k(cache, k, torch.tensor(slots), **REF)
    assert np.array_equal(bf.storage_view(cache).numpy(), want)
    assert np.all(backing[:32].numpy() == POISON)
    codes, scales = ni.read_index_k(cache, 1)
    c, s = bf.quantize(k[1:2].numpy())
    assert np.array_equal(codes[2].numpy(), c[0])
    assert np.array_equal(scales[2].view(torch.uint8).numpy(), s[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_dtypes_and_non_contiguous_k(dtype):
    cache_a, cache_b = ni.new_index_cache(1), ni.new_index_cache(1)
    k = rand_k(128, 9).to(dtype)
    ni.write_index_k(cache_a, k, torch.arange(128), **REF)
    kt = k.T.contiguous().T  # same values, column-major
    assert not kt.is_contiguous()
    ni.write_index_k(cache_b, kt, torch.arange(128, dtype=torch.int32), **REF)
    assert torch.equal(cache_a, cache_b)
    codes, scales = bf.page_codes_scales(bf.page_raw(cache_a, 0))
    want_codes, want_scales = bf.quantize(k.to(torch.float32).numpy())
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)


def test_new_index_cache_is_zero_and_sized():
    cache = ni.new_index_cache(3, page_stride=9216 + 32)
    assert cache.dtype == torch.uint8 and cache.device.type == "cpu"
    assert bf.storage_view(cache).numel() == 3 * (9216 + 32)
    assert torch.all(bf.storage_view(cache) == 0)
    assert ni.new_index_cache(0).shape == (0, 128, 72)
    assert ni.PAGE_BYTES == 9216 == 128 * 72
