"""``triton.dequantize``: ``dequantize_nvfp4`` vs the bit-exact reference (SPEC 1.4, 9).

CPU (interpreter): every (code, scale byte) pair to fp8 and fp32, the reference table, leading
shapes. GPU: the portable and the native path agree; realistic sizes. Offline: the kernel
compiles for SM90 (inputs, interpreter switch: ``codec_inputs``).
"""

from __future__ import annotations

import pytest
import torch

from codec_inputs import (  # sets TRITON_INTERPRET before the kernels are imported
    DEV, K, compile_offline_sm90, generator)
from kernel_harness import as_bytes, assert_bytes_equal

from nvfp4_indexer import api
from nvfp4_indexer.reference import formats as F

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN/inf in interpreter


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32])
def test_dequantize_nvfp4_all_code_scale_pairs(dtype):
    # For every scale byte s (256, incl. NaN 0x7F/0xFF and negative scales), four rows whose
    # 256 code bytes cover every (low, high) code pair.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 64).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(4)
    scales = scales[:, None].expand(1024, 8).contiguous()
    codes, scales = codes.to(DEV), scales.to(DEV)
    for sc in (scales.view(torch.float8_e4m3fn), scales):  # fp8 or raw uint8 scale bytes
        got = api.dequantize_nvfp4(codes, sc, dtype, backend="triton")
        want = F.dequantize_nvfp4(codes, sc, dtype)
        assert got.dtype == dtype and got.shape == (1024, 128)
        if dtype == torch.float32:
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan)
            assert_bytes_equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
        else:
            assert_bytes_equal(got, want)
    # The fp8 path over all 16 x 256 pairs is the reference table (SPEC 1.4).
    if dtype == torch.float8_e4m3fn:
        got = as_bytes(api.dequantize_nvfp4(codes, scales, dtype, backend="triton")).cpu()
        table = F.dequant_table()  # [16 codes, 256 scale bytes]
        code_bytes = torch.arange(256)
        for nibble, code in ((0, code_bytes & 15), (1, code_bytes >> 4)):
            per_scale = got[:, nibble::2].reshape(256, 256)  # [scale byte, code byte]
            assert torch.equal(per_scale, table[code].t())


def test_dequantize_nvfp4_leading_shape_roundtrip():
    x = (torch.randn(2, 5, 128, generator=generator(8)) * 9).to(DEV)
    codes, scales = api.quantize_nvfp4(x, backend="triton")
    got = api.dequantize_nvfp4(codes, scales, backend="triton")
    assert got.shape == (2, 5, 128)
    assert_bytes_equal(got, F.dequantize_nvfp4(codes, scales))


@pytest.mark.gpu
def test_gpu_portable_and_native_dequantize_agree():
    """The portable and the native E4M3 conversion give the same bytes on random codes and
    scale bytes (NaN and negative scales included)."""
    g = generator(41)
    codes = torch.randint(0, 256, (8192, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, (8192, 8), generator=g, dtype=torch.int32).to(torch.uint8)
    da = K["dequantize"].dequantize_nvfp4(codes.cuda(), scales.cuda(), portable=True)
    db = K["dequantize"].dequantize_nvfp4(codes.cuda(), scales.cuda(), portable=False)
    assert_bytes_equal(da, db)


@pytest.mark.gpu
def test_gpu_dequantize_realistic_sizes():
    """64k rows quantized over a wide dynamic range, dequantized."""
    g = generator(42)
    x = (torch.randn(65536, 128, generator=g) * torch.logspace(-6, 6, 65536)[:, None]).cuda()
    c, s = F.quantize_nvfp4(x)
    assert_bytes_equal(api.dequantize_nvfp4(c, s, backend="triton"), F.dequantize_nvfp4(c, s))


def test_dequantize_kernel_compiles_offline_for_sm90():
    """The dequantize kernel compiles to SM90, portable and native (``compile_offline_sm90``)."""
    assert compile_offline_sm90("dequantize") == 2
