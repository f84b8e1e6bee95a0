"""Triton elementwise kernels vs the bit-exact reference (SPEC 1-3, 7, 9).

Kernels: encode_e4m3, quantize_nvfp4, write_index_k, dequantize_nvfp4, insert_index_k,
prepare_index_q (``nvfp4_indexer/triton/``; the gather: ``tests/triton/prefill/``).

How the CPU run works: Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a
function, i.e. when a kernel module is imported (it is not re-read at launch). So this module
sets ``TRITON_INTERPRET=1`` when no CUDA device is present *before* importing any
``nvfp4_indexer.triton`` module; if another test module imported them earlier in compiled mode,
``kernel_harness.load_kernels`` reloads them (numerics first) so their kernels become interpreted. With a GPU the
same tests run compiled on CUDA tensors, plus the ``gpu``-marked tests at realistic sizes.

Bit-exact (SPEC 9): encode, quantize, paged write, dequantize. Fused insert / query:
every byte that differs from the float64 reference must be explained by SPEC 3's band rule
(the harness's judges, ``conformance.judges``), and such bytes must be rare.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel modules' import (see above)

from nvfp4_indexer import api  # noqa: E402
from nvfp4_indexer.reference import formats as F  # noqa: E402
from nvfp4_indexer.reference import paging as P  # noqa: E402
from nvfp4_indexer.reference.insert import norm_rope_exact  # noqa: E402

from nvfp4_indexer.conformance.fixtures import cache_storage as _storage  # noqa: E402
from nvfp4_indexer.conformance.fixtures import rope_cache  # noqa: E402
from nvfp4_indexer.conformance.judges import explain_keys, explain_queries  # noqa: E402
from kernel_harness import as_bytes as _bytes  # noqa: E402
from kernel_harness import assert_bytes_equal as _assert_bytes_equal  # noqa: E402
from kernel_harness import load_kernels, offline_stdout, random_cache  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
PAD_STRIDE = 9216 + 64  # a page stride with padding (SPEC 2)
POISON = 0x5A
NAN, INF = float("nan"), float("inf")
_MODULES = ("numerics", "encode", "quantize", "dequantize", "insert", "query")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN/inf in interpreter


K = load_kernels(_MODULES)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned_cache(num_blocks: int, page_stride: int = PAD_STRIDE) -> torch.Tensor:
    cache = api.new_index_cache(num_blocks, device=DEV, page_stride=page_stride)
    _storage(cache).fill_(POISON)
    return cache


def _random_bits_f32(n: int, gen) -> torch.Tensor:
    return torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64) \
        .to(torch.int32).view(torch.float32)


def _all_16bit(dtype) -> torch.Tensor:
    return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


# ---------------------------------------------------------------------------------------------
# Inputs with edge values
# ---------------------------------------------------------------------------------------------

def _edge_rows() -> torch.Tensor:
    """fp32 ``[N, 128]`` rows hitting SPEC 1.3's corners."""
    g = _gen(1)
    rows = [torch.zeros(128), torch.full((128,), -0.0)]
    r = torch.randn(128, generator=g)
    r[5], r[20], r[40], r[77] = NAN, INF, -INF, -0.0
    rows.append(r)
    r = torch.full((128,), NAN)
    r[17] = 1.0  # group 0 all NaN (amax 0 -> scale floor), group 1 one value
    r[40] = -INF
    rows.append(r)
    rows += [torch.randn(128, generator=g) * 1e30, torch.full((128,), 3.4e38),
             torch.full((128,), -3.4e38), torch.randn(128, generator=g) * 1e-30,
             torch.randn(128, generator=g) * 1e-40]  # fp32 subnormals
    # E2M1 decision points (and their neighbours) with exact power-of-two scales 2^(g-4).
    mids = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5,
                         -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    pow2 = 2.0 ** (torch.arange(8) - 4.0)
    exact = (mids[None, :] * pow2[:, None]).reshape(128)
    rows.append(exact)
    rows.append(torch.nextafter(exact, torch.full_like(exact, INF)))
    rows.append(torch.nextafter(exact, torch.full_like(exact, -INF)))
    # amax 6.3125 (amax/6 rounds down to scale 1, values above 6 saturate), E4M3 tie of amax/6
    # (6.375/6 = 1.0625 -> 1.0), outlier 3000 (scale 500 saturates to 448), 2688 = 6 * 448,
    # 2784 = 6 * 464 (tie at the top), amax just above 6e-12 (scale floor).
    for amax in (6.3125, 6.375, 3000.0, 2688.0, 2784.0, 2785.0, 6.1e-12, 0.0234375):
        r = torch.randn(128, generator=g).clamp(-2, 2) * (amax / 4)
        r[::16] = amax
        r[7::16] = -amax / 2
        rows.append(r)
    r = torch.randn(128, generator=g)
    r[3] = 3000.0
    rows.append(r)
    return torch.stack(rows)


def _quant_inputs(dtype) -> torch.Tensor:
    g = _gen(2)
    parts = [_edge_rows(), _random_bits_f32(48 * 128, g).view(48, 128),
             torch.randn(48, 128, generator=g) * torch.logspace(-12, 12, 48)[:, None]]
    return torch.cat(parts).to(dtype).to(DEV)


# ---------------------------------------------------------------------------------------------
# SPEC 3 band: the harness's judges (conformance.judges), as per-token / per-element rejections
# ---------------------------------------------------------------------------------------------

def key_unexplained(codes: torch.Tensor, scales: torch.Tensor, value: torch.Tensor,
                    magnitude: torch.Tensor) -> torch.Tensor:
    """Per-token bool ``[T]``: ``explain_keys`` rejects the token's ``codes uint8 [T, 64]`` /
    ``scales [T, 8]`` against the exact float64 ``value`` and ``magnitude`` (SPEC 1.3, 3)."""
    c, s = codes.cpu(), _bytes(scales).cpu()
    return ~explain_keys(value.cpu(), magnitude.cpu(), c, s, c, s)[0]


def query_unexplained(q_bytes: torch.Tensor, value: torch.Tensor,
                      magnitude: torch.Tensor) -> torch.Tensor:
    """Per-element bool: ``explain_queries`` rejects the E4M3 byte (SPEC 1.1, 3)."""
    return ~explain_queries(value.cpu(), magnitude.cpu(), _bytes(q_bytes).cpu())


def _rope_cache(max_pos: int, rot: int, dtype, transposed: bool = False) -> torch.Tensor:
    """The harness's ``[max_pos, rot]`` cos|sin cache on ``DEV`` (optionally a column-major
    view)."""
    cs = rope_cache(max_pos, rot, dtype)
    if transposed:
        cs = cs.t().contiguous().t()
    return cs.to(DEV)


def _norm_inputs(t: int, gen):
    """Keys with edge rows: random, zeros, NaN, inf, huge, tiny, -0.0, mixed magnitudes."""
    x = torch.randn(t, 128, generator=gen) * 3
    x[0] = 0.0
    x[1, 9] = NAN
    x[2, 70] = INF
    x[3] *= 1e30
    x[4] *= 1e-30
    x[5] = -0.0
    x[6, :64] *= 1e4
    return x


# ---------------------------------------------------------------------------------------------
# Bit-exact kernels (run compiled on a GPU, interpreted on CPU)
# ---------------------------------------------------------------------------------------------

def test_encode_e4m3_exhaustive_16bit_and_random_fp32():
    g = _gen(3)
    specials = torch.tensor([0.0, -0.0, 448, -448, 464, -464, 464.00003, 480, 1e9, INF, -INF,
                             NAN, -NAN, 2**-9, 2**-10, -2**-10, 3 * 2**-10, 2**-10 * 1.0001,
                             2**-6, 2**-6 * (1 - 2**-5), 1e-45, -1e-45, 17.0, 18.0, 19.0])
    cases = [_all_16bit(torch.float16), _all_16bit(torch.bfloat16),
             torch.cat([specials, _random_bits_f32(60000, g),
                        torch.randn(20000, generator=g) * 100])]
    for x in cases:
        x = x.to(DEV)
        got = api.encode_e4m3(x, backend="triton")
        assert got.dtype == torch.float8_e4m3fn and got.shape == x.shape
        _assert_bytes_equal(got, F.encode_e4m3(x))


def test_encode_e4m3_shapes_and_strides():
    x = (torch.randn(3, 5, 40, generator=_gen(4)) * 300).to(DEV)
    view = x.transpose(0, 2)[::2]  # non-contiguous
    _assert_bytes_equal(api.encode_e4m3(view, backend="triton"), F.encode_e4m3(view))
    empty = torch.empty(0, 4, device=DEV)
    assert api.encode_e4m3(empty, backend="triton").shape == (0, 4)
    scalar = torch.tensor(-500.0, device=DEV)
    assert int(_bytes(api.encode_e4m3(scalar, backend="triton"))) == 0xFE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_nvfp4_bit_exact(dtype):
    x = _quant_inputs(dtype)
    codes, scales = api.quantize_nvfp4(x, backend="triton")
    rc, rs = F.quantize_nvfp4(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    _assert_bytes_equal(codes, rc)
    _assert_bytes_equal(scales, rs)


def test_quantize_nvfp4_leading_shape_and_view():
    base = (torch.randn(2, 3, 256, generator=_gen(5)) * 7).to(DEV)
    x = base[..., 64:192]  # row stride 256
    codes, scales = api.quantize_nvfp4(x, backend="triton")
    assert codes.shape == (2, 3, 64) and scales.shape == (2, 3, 8)
    rc, rs = F.quantize_nvfp4(x)
    _assert_bytes_equal(codes, rc)
    _assert_bytes_equal(scales, rs)
    c0, s0 = api.quantize_nvfp4(torch.empty(0, 128, device=DEV), backend="triton")
    assert c0.shape == (0, 64) and s0.shape == (0, 8)


@pytest.mark.parametrize("dtype,slot_dtype", [(torch.float32, torch.int64),
                                              (torch.bfloat16, torch.int32)])
def test_write_index_k_bit_exact_and_untouched_bytes(dtype, slot_dtype):
    g = _gen(6)
    num_blocks, t = 5, 70
    big = _quant_inputs(torch.float32)[:t]
    k = torch.cat([big, big], dim=1).to(dtype)[:, 128:]  # row stride 256
    slots = torch.randperm(num_blocks * 128, generator=g)[:t]
    slots[::7] = -1  # skipped tokens
    slots[3] = -5
    slots[1] = num_blocks * 128 - 1  # last token of the last page
    slots = slots.to(slot_dtype).to(DEV)
    got = _poisoned_cache(num_blocks)
    want = _poisoned_cache(num_blocks)
    api.write_index_k(got, k, slots, backend="triton")
    api.write_index_k(want, k, slots, backend="reference")
    _assert_bytes_equal(_storage(got), _storage(want))
    # Exactly 72 bytes per written token changed; every other byte (padding too) is poison.
    written = int((slots >= 0).sum())
    assert int((_storage(got) != POISON).sum()) <= written * 72
    touched = torch.zeros_like(_storage(got), dtype=torch.bool)
    s = slots[slots >= 0].long()
    blk, off = s // 128, s % 128
    base = blk[:, None] * PAD_STRIDE
    touched[(base + P.code_byte_index(off)).reshape(-1)] = True
    touched[(base + P.scale_byte_index(off)).reshape(-1)] = True
    assert bool((_storage(got)[~touched] == POISON).all())


def test_write_index_k_dense_page_stride_and_empty():
    k = (torch.randn(3, 128, generator=_gen(7)) * 2).to(DEV)
    got, want = _poisoned_cache(2, 9216), _poisoned_cache(2, 9216)
    slots = torch.tensor([255, -1, 0], device=DEV)
    api.write_index_k(got, k, slots, backend="triton")
    api.write_index_k(want, k, slots, backend="reference")
    _assert_bytes_equal(_storage(got), _storage(want))
    api.write_index_k(got, k[:0], slots[:0], backend="triton")  # no-op
    _assert_bytes_equal(_storage(got), _storage(want))
    empty = api.new_index_cache(0, device=DEV)
    api.write_index_k(empty, k, torch.full((3,), -1, device=DEV), backend="triton")


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
            _assert_bytes_equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
        else:
            _assert_bytes_equal(got, want)
    # The fp8 path over all 16 x 256 pairs is the reference table (SPEC 1.4).
    if dtype == torch.float8_e4m3fn:
        got = _bytes(api.dequantize_nvfp4(codes, scales, dtype, backend="triton")).cpu()
        table = F.dequant_table()  # [16 codes, 256 scale bytes]
        code_bytes = torch.arange(256)
        for nibble, code in ((0, code_bytes & 15), (1, code_bytes >> 4)):
            per_scale = got[:, nibble::2].reshape(256, 256)  # [scale byte, code byte]
            assert torch.equal(per_scale, table[code].t())


def test_dequantize_nvfp4_leading_shape_roundtrip():
    x = (torch.randn(2, 5, 128, generator=_gen(8)) * 9).to(DEV)
    codes, scales = api.quantize_nvfp4(x, backend="triton")
    got = api.dequantize_nvfp4(codes, scales, backend="triton")
    assert got.shape == (2, 5, 128)
    _assert_bytes_equal(got, F.dequantize_nvfp4(codes, scales))


# ---------------------------------------------------------------------------------------------
# Fused norm + RoPE kernels: SPEC 3 band rule
# ---------------------------------------------------------------------------------------------

def _token_bytes(cache, slots):
    s = slots[slots >= 0].long()
    pages = P.page_bytes(cache)
    blk, off = s // 128, s % 128
    return pages[blk[:, None], P.code_byte_index(off)], pages[blk[:, None], P.scale_byte_index(off)]


def _check_insert(run, num_blocks, k, positions, weight, cs, rot, g, skip_every) -> None:
    """Insert ``k`` into random slots of ``num_blocks`` poisoned blocks (every ``skip_every``-th
    slot -1) with ``run(cache, slots)`` (the Triton insert) and with the reference, and compare
    (SPEC 3, 9): bytes outside the written tokens (padding included) untouched; written tokens
    identical or explained by SPEC 3's band, at most 2 of them differing; the checker accepts
    the reference's bytes."""
    slots = torch.randperm(num_blocks * 128, generator=g)[:k.shape[0]]
    slots[::skip_every] = -1
    slots = slots.to(DEV)
    got, want = _poisoned_cache(num_blocks), _poisoned_cache(num_blocks)
    run(got, slots)
    api.insert_index_k(want, k, positions, slots, weight, cs, rotary_dim=rot,
                       backend="reference")
    diff = _storage(got) != _storage(want)
    gc, gs = _token_bytes(got, slots)
    wc, ws = _token_bytes(want, slots)
    assert int(diff.sum()) == int((gc != wc).sum() + (gs != ws).sum())  # only token bytes
    value, mag = norm_rope_exact(k[slots >= 0], positions[slots >= 0], weight, cs, rot, 1e-6)
    differs = ((gc != wc).any(1) | (gs != ws).any(1)).cpu()
    unexplained = key_unexplained(gc, gs, value, mag)
    assert not bool((unexplained & differs).any()), differs.nonzero().flatten().tolist()
    assert int(differs.sum()) <= 2
    assert not bool(key_unexplained(wc, ws, value, mag).any())


@pytest.mark.parametrize("dtype,rot,cs_dtype", [(torch.float32, 64, torch.float32),
                                                (torch.bfloat16, 128, torch.bfloat16),
                                                (torch.float16, 6, torch.float32),
                                                (torch.float32, 2, torch.float16)])
def test_insert_index_k_band_exact(dtype, rot, cs_dtype):
    g = _gen(11 + rot)
    t, num_blocks, max_pos = 40, 3, 300
    k = _norm_inputs(t, g)
    if dtype == torch.float16:
        k[3] /= 1e26  # keep the "huge" row finite in fp16
    k = k.to(dtype).to(DEV)
    positions = torch.randint(0, max_pos, (t,), generator=g)
    positions[0] = 0
    positions = positions.to(DEV)
    weight = (torch.randn(128, generator=g) * 0.3).to(DEV)
    cs = _rope_cache(max_pos, rot, cs_dtype, transposed=rot == 64)

    def run(cache, slots):
        api.insert_index_k(cache, k, positions, slots, weight, cs, rotary_dim=rot,
                           backend="triton")
    _check_insert(run, num_blocks, k, positions, weight, cs, rot, g, skip_every=9)


@pytest.mark.parametrize("rot,layout,tile", [(64, "slice", None), (128, "slice", (16, 1)),
                                             (64, "unaligned", (2, 1)), (96, "contiguous", None),
                                             (10, "unaligned", (2, 1)), (32, "slice", (4, 1))])
def test_insert_index_k_layouts_tiles_and_edges(rot, layout, tile):
    """Strided (16-byte aligned) and unaligned k rows, contiguous cos|sin (the GPU's vector
    loads), rotary_dim on (64, 128) and off the vectorized path, explicit tiles that split
    the tokens unevenly, NaN / inf / huge / tiny / zero rows and skipped slots."""
    g = _gen(51 + rot)
    t, num_blocks, max_pos = 37, 2, 70
    x = _norm_inputs(t, g)
    x[7] = NAN
    x[8, 100], x[8, 3] = -INF, INF
    x[9] = torch.randn(128, generator=g) * 1e-37
    x[10, 64:] = 0.0
    x = x.to(torch.bfloat16)
    if layout == "slice":  # row stride 192, rows 16-byte aligned
        big = torch.zeros(t, 192, dtype=x.dtype)
        big[:, 32:160] = x
        k = big.to(DEV)[:, 32:160]
    elif layout == "unaligned":  # row stride 131, odd element offset
        big = torch.zeros(t, 131, dtype=x.dtype)
        big[:, 3:] = x
        k = big.to(DEV)[:, 3:]
    else:
        k = x.to(DEV)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(DEV)
    weight = (torch.randn(128, generator=g) * 0.3).to(DEV)
    cs = _rope_cache(max_pos, rot, torch.bfloat16)
    bt, nw = tile if tile else (None, None)

    def run(cache, slots):
        K["insert"].insert_index_k(cache, k, positions, slots, weight, cs, rot, 1e-6,
                                   config=K["insert"].InsertConfig(block_t=bt, num_warps=nw))
    _check_insert(run, num_blocks, k, positions, weight, cs, rot, g, skip_every=5)


@pytest.mark.parametrize("dtype,rot,layout", [(torch.float32, 64, "slice"),
                                              (torch.bfloat16, 128, "transpose"),
                                              (torch.float16, 10, "contiguous")])
def test_prepare_index_q_band_exact(dtype, rot, layout):
    g = _gen(21 + rot)
    t, h, max_pos = 9, 3, 50
    x = torch.cat([_norm_inputs(t * h, g)[:7], torch.randn(t * h - 7, 128, generator=g) * 40])
    x = x.view(t, h, 128)
    if dtype == torch.float16:
        x[1, 0] /= 1e26
    x = x.to(dtype)
    if layout == "slice":
        big = torch.zeros(t, h + 2, 256, dtype=dtype)
        big[:, 1:h + 1, 64:192] = x
        q = big.to(DEV)[:, 1:h + 1, 64:192]
    elif layout == "transpose":
        q = x.transpose(0, 1).contiguous().to(DEV).transpose(0, 1)
    else:
        q = x.to(DEV)
    positions = torch.randint(0, max_pos, (t,), generator=g).to(DEV)
    weight = (torch.randn(128, generator=g) * 0.3).to(dtype).to(DEV)
    cs = _rope_cache(max_pos, rot, torch.float32)
    got = api.prepare_index_q(q, positions, weight, cs, rotary_dim=rot, backend="triton")
    want = api.prepare_index_q(q, positions, weight, cs, rotary_dim=rot, backend="reference")
    assert got.dtype == torch.float8_e4m3fn and got.shape == (t, h, 128)
    value, mag = norm_rope_exact(q, positions, weight, cs, rot, 1e-6)
    differs = (_bytes(got) != _bytes(want)).cpu()
    assert not bool((query_unexplained(got, value, mag) & differs).any())
    assert int(differs.sum()) <= 4
    assert not bool(query_unexplained(want, value, mag).any())


def test_band_checkers_catch_real_errors():
    """The checkers must reject differences outside the band (or they prove nothing)."""
    g = _gen(31)
    x = (torch.randn(4, 128, generator=g) * 3).to(DEV)
    pos = torch.tensor([0, 5, 9, 2], device=DEV)
    w = torch.zeros(128, device=DEV)
    cs = _rope_cache(16, 64, torch.float32)
    value, mag = norm_rope_exact(x, pos, w, cs, 64, 1e-6)
    y = value.float()
    codes, scales = F.quantize_nvfp4(y)
    assert not bool(key_unexplained(codes, scales, value, mag).any())
    bad = codes.clone()
    bad[1, 10] ^= 0x02  # one code off by a grid step or more
    assert key_unexplained(bad, scales, value, mag).tolist() == [False, True, False, False]
    bad_s = _bytes(scales).clone()
    bad_s[2, 3] += 1  # a scale one E4M3 step off
    assert bool(key_unexplained(codes, bad_s, value, mag)[2])
    qb = _bytes(F.encode_e4m3(y)).clone()
    assert not bool(query_unexplained(qb, value, mag).any())
    qb[3, 7] = (qb[3, 7] + 1) if qb[3, 7] % 128 < 0x7E else (qb[3, 7] - 1)
    assert int(query_unexplained(qb, value, mag).sum()) == 1


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, PORTABLE vs native encoders
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_portable_and_native_encoders_agree():
    g = _gen(41)
    enc = K["encode"].encode_e4m3
    x16 = _all_16bit(torch.float16).cuda()
    xb16 = _all_16bit(torch.bfloat16).cuda()
    x32 = torch.cat([_random_bits_f32(10**6, g), torch.randn(10**6, generator=g) * 64,
                     torch.tensor([0.0, -0.0, NAN, -NAN, INF, -INF, 464.0, 2**-10])]).cuda()
    for x in (x16, xb16, x32, x16.float()):
        a, b = enc(x, portable=True), enc(x, portable=False)
        _assert_bytes_equal(a, b)
        _assert_bytes_equal(a, F.encode_e4m3(x))
    xq = torch.cat([_quant_inputs(torch.float32),
                    _random_bits_f32(4096 * 128, g).view(4096, 128).cuda()])
    qa, qb = K["quantize"].quantize_nvfp4(xq, portable=True), \
        K["quantize"].quantize_nvfp4(xq, portable=False)
    _assert_bytes_equal(qa[0], qb[0])
    _assert_bytes_equal(qa[1], qb[1])
    codes = torch.randint(0, 256, (8192, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, (8192, 8), generator=g, dtype=torch.int32).to(torch.uint8)
    da = K["dequantize"].dequantize_nvfp4(codes.cuda(), scales.cuda(), portable=True)
    db = K["dequantize"].dequantize_nvfp4(codes.cuda(), scales.cuda(), portable=False)
    _assert_bytes_equal(da, db)


@pytest.mark.gpu
def test_gpu_realistic_sizes():
    g = _gen(42)
    # quantize 64k rows over a wide dynamic range
    x = (torch.randn(65536, 128, generator=g) * torch.logspace(-6, 6, 65536)[:, None]).cuda()
    c, s = api.quantize_nvfp4(x, backend="triton")
    rc, rs = F.quantize_nvfp4(x)
    _assert_bytes_equal(c, rc)
    _assert_bytes_equal(s, rs)
    _assert_bytes_equal(api.dequantize_nvfp4(c, s, backend="triton"), F.dequantize_nvfp4(c, s))
    # paged write of 8192 tokens into a padded 100-block cache
    nb, t = 100, 8192
    k = (torch.randn(t, 128, generator=g) * 5).to(torch.bfloat16).cuda()
    slots = torch.randperm(nb * 128, generator=g)[:t]
    slots[::13] = -1
    slots = slots.cuda()
    got, want = _poisoned_cache(nb), _poisoned_cache(nb)
    api.write_index_k(got, k, slots, backend="triton")
    api.write_index_k(want, k, slots, backend="reference")
    _assert_bytes_equal(_storage(got), _storage(want))
    # fused insert, 4096 tokens
    pos = torch.randint(0, 32768, (t,), generator=g).cuda()
    w = (torch.randn(128, generator=g) * 0.3).cuda()
    cs = _rope_cache(32768, 64, torch.bfloat16)
    got, want = _poisoned_cache(nb), _poisoned_cache(nb)
    api.insert_index_k(got, k, pos, slots, w, cs, backend="triton")
    api.insert_index_k(want, k, pos, slots, w, cs, backend="reference")
    gc, gs = _token_bytes(got, slots)
    wc, ws = _token_bytes(want, slots)
    differs = ((gc != wc).any(1) | (gs != ws).any(1)).cpu()
    value, mag = norm_rope_exact(k[slots >= 0], pos[slots >= 0], w, cs, 64, 1e-6)
    assert not bool((key_unexplained(gc, gs, value, mag) & differs).any())
    assert int(differs.sum()) <= t // 100
    assert int((_storage(got) != _storage(want)).sum()) == int((gc != wc).sum() + (gs != ws).sum())
    # query path, 2048 tokens x 4 heads from a strided view
    qf = (torch.randn(2048, 6, 128, generator=g) * 4).to(torch.bfloat16).cuda()
    q = qf[:, 1:5]
    qpos = pos[:2048]
    got_q = api.prepare_index_q(q, qpos, w, cs, backend="triton")
    want_q = api.prepare_index_q(q, qpos, w, cs, backend="reference")
    value, mag = norm_rope_exact(q, qpos, w, cs, 64, 1e-6)
    differs = (_bytes(got_q) != _bytes(want_q)).cpu()
    assert not bool((query_unexplained(got_q, value, mag) & differs).any())
    assert int(differs.sum()) <= q.numel() // 10000
    # gather: 6 requests up to 20k tokens from a 1000-block random cache
    cache = random_cache(1000, g, PAD_STRIDE)
    seq_lens = torch.tensor([20000, 1, 0, 129, 7777, 16384], dtype=torch.int32)
    width = math.ceil(20000 / 128)
    bt = torch.randint(0, 1000, (6, width), generator=g, dtype=torch.int32)
    ws_t, off_t = api.gather_index_k_fp8(cache, bt.cuda(), seq_lens.cuda(), backend="triton")
    ws_r, off_r = api.gather_index_k_fp8(cache, bt.cuda(), seq_lens.cuda(), backend="reference")
    assert torch.equal(off_t, off_r)
    _assert_bytes_equal(ws_t, ws_r)



# ---------------------------------------------------------------------------------------------
# Offline compile for SM90 (no GPU needed): catches compiled-mode-only errors
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r'''
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvfp4_indexer.triton import encode, quantize, dequantize, insert, query
from benchmarks.sass_stats import INSERT_TYPES, QUANT_TYPES, QUERY_TYPES

cases = []
for P in (True, False):
    cases += [
        (encode._encode_e4m3_kernel, dict(x_ptr="*bf16", out_ptr="*u8", n="i32"),
         dict(PORTABLE=P, BLOCK=1024)),
        (quantize._quantize_nvfp4_kernel, QUANT_TYPES, dict(PAGED=True, PORTABLE=P, BLOCK_T=8)),
        (dequantize._dequantize_nvfp4_kernel, dict(codes_ptr="*u8", scales_ptr="*u8",
         out_ptr="*u8", n_rows="i32"), dict(PORTABLE=P, OUT_F32=False, BLOCK_T=16)),
        *[(insert._insert_index_k_kernel, INSERT_TYPES, dict(ROT=rot, PORTABLE=P, BLOCK_T=bt))
          for rot, bt in ((64, 8), (128, 4), (96, 4))],
        (query._prepare_index_q_kernel, QUERY_TYPES, dict(ROT=64, PORTABLE=P, BLOCK_R=4)),
    ]
for fn, types, consts in cases:
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    name = f"{fn.__name__}{consts}"
    for bad in ("div.full", "div.approx", "rsqrt.approx", "sqrt.approx", ".ftz"):
        assert bad not in ptx, f"{name}: {bad} in PTX"
    native = "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert native == (not consts["PORTABLE"]), f"{name}: native fp8 cvt present={native}"
print("compiled", len(cases))
'''


def test_kernels_compile_offline_for_sm90():
    """Every kernel compiles to SM90 PTX + cubin (Triton's bundled ptxas, no GPU): no
    approximate division / sqrt, no flush-to-zero; the native E4M3 cvt only when
    PORTABLE=False (the gather's: ``tests/triton/prefill/test_gather.py``). Runs in a
    subprocess (this process's kernels may be interpreted)."""
    out = offline_stdout(_COMPILE_SCRIPT, gluon=False, timeout=600)
    assert "compiled 14" in out


def test_insert_index_k_rejects_bad_tuning():
    """The insert launcher's tuning overrides are checked before anything is written."""
    cache = torch.full((2, 128, 72), 0x5A, dtype=torch.uint8)
    k = torch.randn(3, 128)
    pos = torch.arange(3)
    slots = torch.arange(3)
    w = torch.zeros(128)
    cs = torch.ones(8, 64)
    for kw in ({"block_t": 3}, {"block_t": 0}, {"block_t": 256}, {"num_warps": 3},
               {"num_warps": 16}, {"block_t": True}, {"num_warps": 4.0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            K["insert"].insert_index_k(cache, k, pos, slots, w, cs, 64,
                                       config=K["insert"].InsertConfig(**kw))
    assert bool((cache == 0x5A).all())
