"""``triton.quantize``: ``quantize_nvfp4`` and the paged ``write_index_k`` vs the bit-exact
reference (SPEC 1.3, 2, 9).

CPU (interpreter): edge rows, random bit patterns and 24 decades in fp32 / fp16 / bf16, views;
the paged write's bytes and every byte it must not touch (padding included). GPU: the portable
and the native encoder agree; realistic sizes. Offline: the kernel compiles for SM90 (inputs,
interpreter switch: ``codec_inputs``).
"""

from __future__ import annotations

import pytest
import torch

from codec_inputs import (  # sets TRITON_INTERPRET before the kernels are imported
    DEV, K, PAD_STRIDE, POISON, compile_offline_sm90, generator, gpu_tokens, poisoned_cache,
    quant_inputs, random_bits_f32)
from kernel_harness import assert_bytes_equal

from nvfp4_indexer import api
from nvfp4_indexer.conformance.fixtures import cache_storage
from nvfp4_indexer.reference import formats as F
from nvfp4_indexer.reference import paging as P

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN/inf in interpreter


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_nvfp4_bit_exact(dtype):
    x = quant_inputs(dtype)
    codes, scales = api.quantize_nvfp4(x, backend="triton")
    rc, rs = F.quantize_nvfp4(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert_bytes_equal(codes, rc)
    assert_bytes_equal(scales, rs)


def test_quantize_nvfp4_leading_shape_and_view():
    base = (torch.randn(2, 3, 256, generator=generator(5)) * 7).to(DEV)
    x = base[..., 64:192]  # row stride 256
    codes, scales = api.quantize_nvfp4(x, backend="triton")
    assert codes.shape == (2, 3, 64) and scales.shape == (2, 3, 8)
    rc, rs = F.quantize_nvfp4(x)
    assert_bytes_equal(codes, rc)
    assert_bytes_equal(scales, rs)
    c0, s0 = api.quantize_nvfp4(torch.empty(0, 128, device=DEV), backend="triton")
    assert c0.shape == (0, 64) and s0.shape == (0, 8)


@pytest.mark.parametrize("dtype,slot_dtype", [(torch.float32, torch.int64),
                                              (torch.bfloat16, torch.int32)])
def test_write_index_k_bit_exact_and_untouched_bytes(dtype, slot_dtype):
    g = generator(6)
    num_blocks, t = 5, 70
    big = quant_inputs(torch.float32)[:t]
    k = torch.cat([big, big], dim=1).to(dtype)[:, 128:]  # row stride 256
    slots = torch.randperm(num_blocks * 128, generator=g)[:t]
    slots[::7] = -1  # skipped tokens
    slots[3] = -5
    slots[1] = num_blocks * 128 - 1  # last token of the last page
    slots = slots.to(slot_dtype).to(DEV)
    got = poisoned_cache(num_blocks)
    want = poisoned_cache(num_blocks)
    api.write_index_k(got, k, slots, backend="triton")
    api.write_index_k(want, k, slots, backend="reference")
    assert_bytes_equal(cache_storage(got), cache_storage(want))
    # Exactly 72 bytes per written token changed; every other byte (padding too) is poison.
    written = int((slots >= 0).sum())
    assert int((cache_storage(got) != POISON).sum()) <= written * 72
    touched = torch.zeros_like(cache_storage(got), dtype=torch.bool)
    s = slots[slots >= 0].long()
    blk, off = s // 128, s % 128
    base = blk[:, None] * PAD_STRIDE
    touched[(base + P.code_byte_index(off)).reshape(-1)] = True
    touched[(base + P.scale_byte_index(off)).reshape(-1)] = True
    assert bool((cache_storage(got)[~touched] == POISON).all())


def test_write_index_k_dense_page_stride_and_empty():
    k = (torch.randn(3, 128, generator=generator(7)) * 2).to(DEV)
    got, want = poisoned_cache(2, 9216), poisoned_cache(2, 9216)
    slots = torch.tensor([255, -1, 0], device=DEV)
    api.write_index_k(got, k, slots, backend="triton")
    api.write_index_k(want, k, slots, backend="reference")
    assert_bytes_equal(cache_storage(got), cache_storage(want))
    api.write_index_k(got, k[:0], slots[:0], backend="triton")  # no-op
    assert_bytes_equal(cache_storage(got), cache_storage(want))
    empty = api.new_index_cache(0, device=DEV)
    api.write_index_k(empty, k, torch.full((3,), -1, device=DEV), backend="triton")


@pytest.mark.gpu
def test_gpu_portable_and_native_quantize_agree():
    """The portable and the native E4M3 scale encoders give the same codes and scales."""
    g = generator(41)
    xq = torch.cat([quant_inputs(torch.float32),
                    random_bits_f32(4096 * 128, g).view(4096, 128).cuda()])
    qa, qb = K["quantize"].quantize_nvfp4(xq, portable=True), \
        K["quantize"].quantize_nvfp4(xq, portable=False)
    assert_bytes_equal(qa[0], qb[0])
    assert_bytes_equal(qa[1], qb[1])


@pytest.mark.gpu
def test_gpu_quantize_and_write_realistic_sizes():
    """64k rows over a wide dynamic range; a paged write of 8192 tokens into a padded
    100-block cache."""
    g = generator(42)
    x = (torch.randn(65536, 128, generator=g) * torch.logspace(-6, 6, 65536)[:, None]).cuda()
    c, s = api.quantize_nvfp4(x, backend="triton")
    rc, rs = F.quantize_nvfp4(x)
    assert_bytes_equal(c, rc)
    assert_bytes_equal(s, rs)
    k, slots = gpu_tokens(g, 100, 8192)
    got, want = poisoned_cache(100), poisoned_cache(100)
    api.write_index_k(got, k, slots, backend="triton")
    api.write_index_k(want, k, slots, backend="reference")
    assert_bytes_equal(cache_storage(got), cache_storage(want))


def test_quantize_kernel_compiles_offline_for_sm90():
    """The paged quantize kernel compiles to SM90, both encoders (``compile_offline_sm90``)."""
    assert compile_offline_sm90("quantize") == 2
