"""``triton.encode``: ``encode_e4m3`` vs the bit-exact reference (SPEC 1.1, 9).

CPU (interpreter): every 16-bit input, random fp32 bit patterns and specials, views and empty
tensors. GPU: the portable and the native encoder agree at realistic sizes. Offline: the
kernel compiles for SM90 (inputs, interpreter switch: ``codec_inputs``).
"""

from __future__ import annotations

import pytest
import torch

from codec_inputs import (  # sets TRITON_INTERPRET before the kernels are imported
    DEV, INF, K, NAN, all_16bit, compile_offline_sm90, generator, random_bits_f32)
from kernel_harness import as_bytes, assert_bytes_equal

from nvfp4_indexer import api
from nvfp4_indexer.reference import formats as F

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN/inf in interpreter


def test_encode_e4m3_exhaustive_16bit_and_random_fp32():
    g = generator(3)
    specials = torch.tensor([0.0, -0.0, 448, -448, 464, -464, 464.00003, 480, 1e9, INF, -INF,
                             NAN, -NAN, 2**-9, 2**-10, -2**-10, 3 * 2**-10, 2**-10 * 1.0001,
                             2**-6, 2**-6 * (1 - 2**-5), 1e-45, -1e-45, 17.0, 18.0, 19.0])
    cases = [all_16bit(torch.float16), all_16bit(torch.bfloat16),
             torch.cat([specials, random_bits_f32(60000, g),
                        torch.randn(20000, generator=g) * 100])]
    for x in cases:
        x = x.to(DEV)
        got = api.encode_e4m3(x, backend="triton")
        assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape
        assert_bytes_equal(got, F.encode_e4m3(x))


def test_encode_e4m3_shapes_and_strides():
    x = (torch.randn(3, 5, 40, generator=generator(4)) * 300).to(DEV)
    view = x.transpose(0, 2)[::2]  # non-contiguous
    assert_bytes_equal(api.encode_e4m3(view, backend="triton"), F.encode_e4m3(view))
    empty = torch.empty(0, 4, device=DEV)
    assert api.encode_e4m3(empty, backend="triton").shape == (0, 4)
    scalar = torch.tensor(-500.0, device=DEV)
    assert int(as_bytes(api.encode_e4m3(scalar, backend="triton"))) == 0xFE


@pytest.mark.gpu
def test_gpu_portable_and_native_encoders_agree():
    """The portable (integer) and the native (``cvt``) E4M3 encoders write the reference's
    bytes on every 16-bit input and 2M fp32 values."""
    g = generator(41)
    enc = K["encode"].encode_e4m3
    x16 = all_16bit(torch.float16).cuda()
    xb16 = all_16bit(torch.bfloat16).cuda()
    x32 = torch.cat([random_bits_f32(10**6, g), torch.randn(10**6, generator=g) * 64,
                     torch.tensor([0.0, -0.0, NAN, -NAN, INF, -INF, 464.0, 2**-10])]).cuda()
    for x in (x16, xb16, x32, x16.float()):
        a, b = enc(x, portable=True), enc(x, portable=False)
        assert_bytes_equal(a, b)
        assert_bytes_equal(a, F.encode_e4m3(x))


def test_encode_kernel_compiles_offline_for_sm90():
    """The encode kernel compiles to SM90, portable and native (``compile_offline_sm90``)."""
    assert compile_offline_sm90("encode") == 2
