"""SPEC 10: every public function rejects bad input with an exception that names the argument,
before anything is written (cache bytes, padding included, ``out`` buffers and the wrapper's
persistent buffers are compared byte for byte after each failed call).

Device mismatches are provoked with ``meta`` tensors on CPU (the checks read metadata only);
CUDA-vs-CPU mismatches run only where CUDA exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bruteforce as bf
import nvfp4_indexer as ni
from nvfp4_indexer.conformance.fixtures import OUT_POISON, selection_out

REF = {"backend": "reference"}
NUM_BLOCKS = 6
STRIDE = 9216 + 32


class Setup:
    """A small valid decode/prefill problem on a poisoned, padded cache."""

    def __init__(self):
        self.cache = ni.new_index_cache(NUM_BLOCKS, page_stride=STRIDE)
        bf.storage_view(self.cache).fill_(0x3C)
        g = torch.Generator().manual_seed(0)
        self.k = torch.randn(10, 128, generator=g)
        self.slots = torch.arange(10, dtype=torch.int32) * 37
        ni.write_index_k(self.cache, self.k, self.slots, **REF)
        # Two requests; request 1's third entry is garbage (past its 2 pages).
        self.block_table = torch.tensor([[0, 1, 2, 5], [3, 4, -1, -1]], dtype=torch.int32)
        self.seq_lens = torch.tensor([300, 200], dtype=torch.int32)
        self.q_len = 2
        self.index_q = ni.encode_e4m3(torch.randn(4, 2, 128, generator=g), **REF)
        self.out = selection_out(4, 2)
        self.cu = torch.tensor([0, 3, 4], dtype=torch.int32)
        self.cs = torch.randn(64, 64, generator=g)
        self.pos = torch.arange(10, dtype=torch.int64)
        self.w = torch.zeros(128)

    def decode_args(self, **kw):
        return self._args("index_q", "cache", "block_table", "seq_lens", "query_len", "out",
                          **kw)

    def prefill_args(self, **kw):
        return self._args("index_q", "cache", "block_table", "cu_seqlens_q", "seq_lens", "out",
                          **kw)

    def insert_args(self, **kw):
        return self._args("cache", "k", "positions", "slot_mapping", "k_norm_weight",
                          "cos_sin_cache", **kw)

    def _args(self, *names, **kw):
        """Keyword arguments of the valid call, ``kw`` replacing some of them."""
        valid = dict(index_q=self.index_q, cache=self.cache, block_table=self.block_table,
                     seq_lens=self.seq_lens, query_len=self.q_len, out=self.out,
                     cu_seqlens_q=self.cu, k=self.k, positions=self.pos,
                     slot_mapping=self.slots + 1, k_norm_weight=self.w, cos_sin_cache=self.cs)
        return {**{n: valid[n] for n in names}, **kw}


@pytest.fixture
def s():
    return Setup()


def expect(exc, name: str, fn, *args, watch=(), **kwargs):
    """Call ``fn`` expecting ``exc`` whose message names ``name``; tensors in ``watch`` (and
    the storage under them) must come out byte-identical."""
    flat = [bf.storage_view(t) for t in watch]
    before = [f.clone() for f in flat]
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), f"message does not name {name!r}: {info.value}"
    for f, b in zip(flat, before):
        assert torch.equal(f, b), "a failed call wrote bytes"
    return info.value


def meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def bad_stride_cache(page_stride: int, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    backing = torch.zeros(num_blocks * max(page_stride, 9216) + 128, dtype=torch.uint8)
    return backing.as_strided((num_blocks, 128, 72), (page_stride, 72, 1))


# ----------------------------------------------------------------------------- formats

def test_encode_e4m3_errors():
    expect(ValueError, "x", ni.encode_e4m3, torch.arange(4), **REF)
    expect(ValueError, "x", ni.encode_e4m3, torch.zeros(4, dtype=torch.float8_e4m3fn), **REF)
    expect(TypeError, "x", ni.encode_e4m3, [1.0, 2.0], **REF)
    expect(ValueError, "backend", ni.encode_e4m3, torch.zeros(4), backend="cuda")
    expect(ValueError, "backend", ni.encode_e4m3, torch.zeros(4), backend=None)


def test_quantize_nvfp4_errors():
    expect(ValueError, "x", ni.quantize_nvfp4, torch.zeros(3, 127), **REF)
    expect(ValueError, "x", ni.quantize_nvfp4, torch.zeros(128, 3), **REF)
    expect(ValueError, "x", ni.quantize_nvfp4, torch.tensor(1.0), **REF)
    expect(ValueError, "x", ni.quantize_nvfp4, torch.zeros(2, 128, dtype=torch.int32), **REF)
    expect(TypeError, "x", ni.quantize_nvfp4, np.zeros((2, 128), np.float32), **REF)


def test_dequantize_nvfp4_errors():
    codes = torch.zeros(3, 64, dtype=torch.uint8)
    scales = torch.zeros(3, 8, dtype=torch.uint8).view(torch.float8_e4m3fn)
    expect(ValueError, "codes", ni.dequantize_nvfp4, codes.to(torch.int8), scales, **REF)
    expect(ValueError, "codes", ni.dequantize_nvfp4, codes[:, :63], scales, **REF)
    expect(ValueError, "scales", ni.dequantize_nvfp4, codes, scales.float(), **REF)
    expect(ValueError, "scales", ni.dequantize_nvfp4, codes, scales[:, :7], **REF)
    expect(ValueError, "scales", ni.dequantize_nvfp4, codes, scales[:2], **REF)
    expect(ValueError, "scales", ni.dequantize_nvfp4, codes, meta_like(scales), **REF)
    expect(NotImplementedError, "dtype", ni.dequantize_nvfp4, codes, scales, torch.float16,
           **REF)
    expect(NotImplementedError, "dtype", ni.dequantize_nvfp4, codes, scales, torch.bfloat16,
           **REF)


# ----------------------------------------------------------------------------- cache & writes

def test_new_index_cache_errors():
    for stride in (9215, 9216 - 16, 9224, 9216 + 8, 9216.0, 0):
        expect(ValueError, "page_stride", ni.new_index_cache, 2, page_stride=stride)
    for n in (-1, 2.0, "2"):
        expect(ValueError, "num_blocks", ni.new_index_cache, n)


@pytest.mark.parametrize("kw,words", [
    (dict(num_blocks=np.uint64(2 ** 63)), ["num_blocks: expected a size that fits",
                                           "85002596691653613846528 bytes",
                                           "num_blocks=9223372036854775808 x page_stride=9216"]),
    (dict(num_blocks=2 ** 40), ["num_blocks: expected a size that fits", "10133099161583616 "
                                "bytes (num_blocks=1099511627776 x page_stride=9216)"]),
    (dict(num_blocks=2, page_stride=2 ** 62), ["page_stride: expected a size that fits",
                                               "9223372036854775808 bytes"]),
    (dict(num_blocks=1, device="bogus"), ["device: expected a torch device", "'bogus'"]),
    (dict(num_blocks=1, device="cuda:64"), ["device: expected a device that exists"]),
])
def test_new_index_cache_sizes_and_devices_name_the_argument(kw, words):
    """SPEC 10: sizes past int64 or past the device's memory and devices that do not exist
    are ValueErrors naming the argument and the bytes asked for (before: a C++ overflow from
    torch, the allocator's message, torch's RuntimeError)."""
    e = expect(ValueError, words[0].split(":")[0], ni.new_index_cache, **kw)
    for w in words:
        assert w in str(e), f"{w!r} not in {e}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA devices")
def test_new_index_cache_cuda_without_cuda_names_the_device():
    """(before: AssertionError: Torch not compiled with CUDA enabled)"""
    expect(ValueError, "device: expected a device that exists (no CUDA device is available)",
           ni.new_index_cache, 1, device="cuda")


def test_new_index_cache_cpu_0_is_the_cpu():
    c = ni.new_index_cache(np.int64(2), device="cpu:0")
    assert c.device == torch.device("cpu") and c.shape == (2, 128, 72) and bool((c == 0).all())


def test_read_index_k_errors(s):
    for block in (-1, NUM_BLOCKS, 1.0, "0"):
        expect(ValueError, "block", ni.read_index_k, s.cache, block)
    expect(ValueError, "cache", ni.read_index_k, bad_stride_cache(9216 + 8), 0)
    expect(ValueError, "cache", ni.read_index_k, s.cache.to(torch.int8), 0)


def test_write_index_k_errors(s):
    c, k, sl = s.cache, s.k, s.slots + 1
    w = dict(watch=[c])
    expect(ValueError, "cache", ni.write_index_k, c.to(torch.int8), k, sl, **REF)
    expect(ValueError, "cache", ni.write_index_k, torch.zeros(2, 128, 64, dtype=torch.uint8), k,
           sl, **REF)
    expect(ValueError, "cache", ni.write_index_k, bad_stride_cache(9216 + 8), k, sl, **REF)
    expect(ValueError, "cache", ni.write_index_k, bad_stride_cache(9216 - 16), k, sl, **REF)
    expect(ValueError, "cache", ni.write_index_k,
           torch.zeros(2, 72, 128, dtype=torch.uint8).transpose(1, 2), k, sl, **REF)
    expect(TypeError, "cache", ni.write_index_k, np.zeros((2, 128, 72), np.uint8), k, sl, **REF)
    expect(ValueError, "k", ni.write_index_k, c, k.to(torch.int32), sl, **w, **REF)
    expect(ValueError, "k", ni.write_index_k, c, k.to(torch.int32), sl, **w, **REF)
    expect(ValueError, "k", ni.write_index_k, c, k[:, :64], sl, **w, **REF)
    expect(ValueError, "k", ni.write_index_k, c, k[:, None], sl, **w, **REF)
    expect(ValueError, "k", ni.write_index_k, c, meta_like(k), sl, **w, **REF)
    expect(ValueError, "slot_mapping", ni.write_index_k, c, k, sl.float(), **w, **REF)
    expect(ValueError, "slot_mapping", ni.write_index_k, c, k, sl.to(torch.int16), **w, **REF)
    expect(ValueError, "slot_mapping", ni.write_index_k, c, k, sl[:9], **w, **REF)
    expect(ValueError, "slot_mapping", ni.write_index_k, c, k, sl[:, None], **w, **REF)
    expect(ValueError, "slot_mapping", ni.write_index_k, c, k, meta_like(sl), **w, **REF)
    # Cache too small for a slot (one past the end), duplicate non-negative slots.
    big = sl.clone()
    big[4] = NUM_BLOCKS * 128
    e = expect(ValueError, "slot_mapping", ni.write_index_k, c, k, big, **w, **REF)
    assert "cache too small" in str(e) and str(NUM_BLOCKS * 128) in str(e)
    dup = sl.clone()
    dup[7] = dup[2]
    e = expect(ValueError, "slot_mapping", ni.write_index_k, c, k, dup, **w, **REF)
    assert str(int(dup[2])) in str(e)
    # Duplicates among negative slots are fine (they write nothing).
    neg = sl.clone()
    neg[[1, 2, 3]] = -1
    ni.write_index_k(c, k, neg, **REF)
    expect(ValueError, "backend", ni.write_index_k, c, k, sl, backend="gpu", **w)


def test_insert_index_k_errors(s):
    w = dict(watch=[s.cache])
    f = ni.insert_index_k
    expect(ValueError, "k", f, **s.insert_args(k=s.k[:, :100]), **w, **REF)
    expect(ValueError, "k", f, **s.insert_args(k=s.k.to(torch.int64)), **w, **REF)
    expect(ValueError, "positions", f, **s.insert_args(positions=s.pos.float()), **w, **REF)
    expect(ValueError, "positions", f, **s.insert_args(positions=s.pos[:5]), **w, **REF)
    expect(ValueError, "positions", f, **s.insert_args(positions=meta_like(s.pos)), **w, **REF)
    bad = s.pos.clone()
    bad[3] = 64  # cos_sin_cache has 64 rows
    e = expect(ValueError, "positions", f, **s.insert_args(positions=bad), **w, **REF)
    assert "64" in str(e)
    bad[3] = -1
    expect(ValueError, "positions", f, **s.insert_args(positions=bad), **w, **REF)
    expect(ValueError, "k_norm_weight", f, **s.insert_args(k_norm_weight=s.w[:64]), **w, **REF)
    expect(ValueError, "k_norm_weight", f, **s.insert_args(k_norm_weight=s.w.long()), **w,
           **REF)
    expect(ValueError, "cos_sin_cache", f, **s.insert_args(cos_sin_cache=s.cs[:, :32]), **w,
           **REF)
    expect(ValueError, "cos_sin_cache", f, **s.insert_args(cos_sin_cache=s.cs[0]), **w, **REF)
    expect(ValueError, "cos_sin_cache", f,
           **s.insert_args(cos_sin_cache=torch.zeros(64, 128)), **w, **REF)
    for rd in (63, 0, -2, 130, 64.0):
        expect(ValueError, "rotary_dim", f, **s.insert_args(), rotary_dim=rd, **w, **REF)
    for eps in (0.0, -1e-6, "1e-6", float("nan")):
        expect(ValueError, "eps", f, **s.insert_args(), eps=eps, **w, **REF)
    dup = s.slots + 1
    dup[9] = dup[0]
    expect(ValueError, "slot_mapping", f, **s.insert_args(slot_mapping=dup), **w, **REF)
    big = s.slots + 1
    big[0] = NUM_BLOCKS * 128 + 5
    expect(ValueError, "slot_mapping", f, **s.insert_args(slot_mapping=big), **w, **REF)
    expect(ValueError, "slot_mapping", f, **s.insert_args(slot_mapping=s.slots[:3]), **w,
           **REF)
    expect(ValueError, "cache", f, **s.insert_args(cache=bad_stride_cache(9216 + 4)), **REF)


def test_prepare_index_q_errors(s):
    q = torch.randn(10, 2, 128)
    f = ni.prepare_index_q
    a = dict(positions=s.pos, q_norm_weight=s.w, cos_sin_cache=s.cs)
    expect(ValueError, "q", f, q[:, 0], **a, **REF)
    expect(ValueError, "q", f, q[..., :64], **a, **REF)
    expect(ValueError, "q", f, q.to(torch.int32), **a, **REF)
    expect(ValueError, "positions", f, q, **{**a, "positions": s.pos[:9]}, **REF)
    expect(ValueError, "positions", f, q, **{**a, "positions": s.pos + 60}, **REF)
    expect(ValueError, "q_norm_weight", f, q, **{**a, "q_norm_weight": s.w[None]}, **REF)
    expect(ValueError, "cos_sin_cache", f, q, **{**a, "cos_sin_cache": s.cs.long()}, **REF)
    expect(ValueError, "rotary_dim", f, q, **a, rotary_dim=3, **REF)
    expect(ValueError, "eps", f, q, **a, eps=0, **REF)
    expect(ValueError, "positions", f, q, **{**a, "positions": meta_like(s.pos)}, **REF)


# ----------------------------------------------------------------------------- paged reads

def test_gather_index_k_fp8_errors(s):
    f = ni.gather_index_k_fp8
    c, bt, sl = s.cache, s.block_table, s.seq_lens
    expect(ValueError, "block_table", f, c, bt.long(), sl, **REF)
    expect(ValueError, "block_table", f, c, bt[0], sl, **REF)
    expect(ValueError, "block_table", f, c, torch.zeros(2, 8, dtype=torch.int32)[:, ::2], sl,
           **REF)
    expect(ValueError, "block_table", f, c, meta_like(bt), sl, **REF)
    expect(ValueError, "seq_lens", f, c, bt, sl.long(), **REF)
    expect(ValueError, "seq_lens", f, c, bt, sl[:1], **REF)
    expect(ValueError, "seq_lens", f, c, bt, torch.tensor([300, 0, 200, 0],
                                                          dtype=torch.int32)[::2], **REF)
    expect(ValueError, "seq_lens", f, c, bt, torch.tensor([300, -1], dtype=torch.int32), **REF)
    # Block table narrower than request 0 needs (4 * 128 < 513).
    expect(ValueError, "block_table", f, c, bt, torch.tensor([513, 0], dtype=torch.int32), **REF)
    # Block ids a request reads outside the cache: -1 and num_blocks.
    expect(ValueError, "block_table", f, c, bt, torch.tensor([300, 400], dtype=torch.int32),
           **REF)
    bad = bt.clone()
    bad[0, 1] = NUM_BLOCKS
    expect(ValueError, "block_table", f, c, bad, sl, **REF)
    expect(ValueError, "cache", f, bad_stride_cache(9216 + 4), bt, sl, **REF)


def test_page_scores_errors(s):
    f = ni.page_scores
    c, bt, sl, q = s.cache, s.block_table, s.seq_lens, s.index_q
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    expect(ValueError, "index_q", f, q.float(), c, bt, sl, qsl, **REF)
    expect(ValueError, "index_q", f, q[..., :64], c, bt, sl, qsl, **REF)
    expect(ValueError, "index_q", f, q[:, 0], c, bt, sl, qsl, **REF)
    strided = torch.zeros(4, 2, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)[..., ::2]
    expect(ValueError, "index_q", f, strided, c, bt, sl, qsl, **REF)
    expect(ValueError, "index_q", f, meta_like(q), c, bt, sl, qsl, **REF)
    expect(ValueError, "query_start_loc", f, q, c, bt, sl, qsl.long(), **REF)
    expect(ValueError, "query_start_loc", f, q, c, bt, sl, qsl[:2], **REF)
    expect(ValueError, "query_start_loc", f, q, c, bt, sl,
           torch.tensor([0, 2, 3], dtype=torch.int32), **REF)
    expect(ValueError, "query_start_loc", f, q, c, bt, sl,
           torch.tensor([1, 2, 4], dtype=torch.int32), **REF)
    e = expect(ValueError, "seq_lens", f, q, c, bt, torch.tensor([1, 200], dtype=torch.int32),
               qsl, **REF)
    assert "query_start_loc" in str(e)  # q_len comes from query_start_loc
    # decreasing offsets are the offsets' fault, not seq_lens'
    e = expect(ValueError, "query_start_loc", f, q, c, bt, sl,
               torch.tensor([0, 5, 4], dtype=torch.int32), **REF)
    assert str(e).startswith("query_start_loc:"), e
    # q_len 3 > seq_len 2 raises; seq_len 0 with 3 rows is a padding request (SPEC 5): its rows
    # are -inf, as the docstring says
    expect(ValueError, "seq_lens", f, q[:3], c, bt, torch.tensor([2, 200], dtype=torch.int32),
           torch.tensor([0, 3, 3], dtype=torch.int32), **REF)
    pad = f(q[:3], c, bt, torch.tensor([0, 200], dtype=torch.int32),
            torch.tensor([0, 3, 3], dtype=torch.int32), **REF)
    assert pad.shape == (3, 2, bt.shape[1]) and bool(torch.isneginf(pad).all())
    expect(ValueError, "block_table", f, q, c, bt, torch.tensor([600, 2], dtype=torch.int32),
           qsl, **REF)
    bad = bt.clone()
    bad[1, 0] = -1
    expect(ValueError, "block_table", f, q, c, bad, sl, qsl, **REF)


# ----------------------------------------------------------------------------- decode

def test_decode_indexer_errors(s):
    f = ni.decode_indexer
    w = dict(watch=[s.cache, s.out])
    for ql in (0, 9, -1, 2.0, True, "2", None):
        expect(ValueError, "query_len", f, **s.decode_args(query_len=ql), **w, **REF)
    expect(ValueError, "index_q", f, **s.decode_args(index_q=s.index_q[:3]), **w, **REF)
    expect(ValueError, "index_q", f, **s.decode_args(index_q=s.index_q.view(torch.uint8)), **w,
           **REF)
    expect(ValueError, "index_q", f, **s.decode_args(index_q=meta_like(s.index_q)), **w, **REF)
    # seq_len below query_len (not padding), negative.
    for bad in ([1, 200], [300, -2]):
        expect(ValueError, "seq_lens", f,
               **s.decode_args(seq_lens=torch.tensor(bad, dtype=torch.int32)), **w, **REF)
    expect(ValueError, "seq_lens", f, **s.decode_args(seq_lens=s.seq_lens.long()), **w, **REF)
    expect(ValueError, "seq_lens", f, **s.decode_args(seq_lens=s.seq_lens[:1]), **w, **REF)
    # Block table narrower than request 0 needs, block ids outside the cache.
    e = expect(ValueError, "block_table", f,
               **s.decode_args(seq_lens=torch.tensor([513, 200], dtype=torch.int32)), **w,
               **REF)
    assert "513" in str(e)
    expect(ValueError, "block_table", f,
           **s.decode_args(block_table=s.block_table[:, :2]), **w, **REF)
    for bad_id in (-1, NUM_BLOCKS, 2**31 - 1):
        bt = s.block_table.clone()
        bt[1, 0] = bad_id
        expect(ValueError, "block_table", f, **s.decode_args(block_table=bt), **w, **REF)
    expect(ValueError, "block_table", f, **s.decode_args(block_table=s.block_table.long()),
           **w, **REF)
    # topk: invalid anywhere, other than 16 unsupported on Triton (checked before any kernel).
    expect(ValueError, "topk", f, **s.decode_args(), topk=1, **w, **REF)
    expect(NotImplementedError, "topk", f, **s.decode_args(out=None), topk=8, backend="triton",
           watch=[s.cache])
    # out: dtype, shape, topk width, contiguity, device.
    for bad_out in (torch.zeros(4, 2, 16, dtype=torch.int64), torch.zeros(4, 2, 15,
                    dtype=torch.int32), torch.zeros(4, 1, 16, dtype=torch.int32),
                    torch.zeros(4, 16, 2, dtype=torch.int32).transpose(1, 2),
                    torch.empty(4, 2, 16, dtype=torch.int32, device="meta")):
        if bad_out.device.type != "meta":
            bad_out.fill_(OUT_POISON)
        expect(ValueError, "out", f, **s.decode_args(out=bad_out),
               watch=[s.cache] + ([bad_out] if bad_out.device.type != "meta" else []), **REF)
    expect(ValueError, "out", f, **s.decode_args(), topk=8, **w, **REF)
    expect(ValueError, "cache", f, **s.decode_args(cache=bad_stride_cache(9216 + 4)),
           watch=[s.out], **REF)
    expect(ValueError, "backend", f, **s.decode_args(), backend="Reference", **w)


def test_prefill_indexer_errors(s):
    f = ni.prefill_indexer
    w = dict(watch=[s.cache, s.out])
    expect(ValueError, "cu_seqlens_q", f, **s.prefill_args(cu_seqlens_q=s.cu.long()), **w,
           **REF)
    expect(ValueError, "cu_seqlens_q", f, **s.prefill_args(cu_seqlens_q=s.cu[:2]), **w, **REF)
    for bad in ([1, 3, 4], [0, 3, 5], [0, 3, 3]):
        expect(ValueError, "cu_seqlens_q", f,
               **s.prefill_args(cu_seqlens_q=torch.tensor(bad, dtype=torch.int32)), **w, **REF)
    # a zero-length request ([0, 4, 4]) and decreasing offsets are the offsets' fault (issue
    # 18: they were blamed on seq_lens, "got q_len=-1")
    for bad in ([0, 4, 4], [0, 5, 4]):
        e = expect(ValueError, "cu_seqlens_q", f,
                   **s.prefill_args(cu_seqlens_q=torch.tensor(bad, dtype=torch.int32)), **w,
                   **REF)
        assert not str(e).startswith("seq_lens"), e
    # q_len > seq_len
    expect(ValueError, "seq_lens", f,
           **s.prefill_args(seq_lens=torch.tensor([2, 200], dtype=torch.int32)), **w, **REF)
    expect(ValueError, "seq_lens", f,
           **s.prefill_args(seq_lens=torch.tensor([0, 200], dtype=torch.int32)), **w, **REF)
    expect(ValueError, "block_table", f,
           **s.prefill_args(seq_lens=torch.tensor([300, 513], dtype=torch.int32)), **w, **REF)
    bt = s.block_table.clone()
    bt[0, 1] = -5
    expect(ValueError, "block_table", f, **s.prefill_args(block_table=bt), **w, **REF)
    expect(ValueError, "index_q", f, **s.prefill_args(index_q=s.index_q.float()), **w, **REF)
    # max_gather_pages: request 0 reads 2 history pages.
    e = expect(ValueError, "max_gather_pages", f, **s.prefill_args(), max_gather_pages=1, **w,
               **REF)
    assert "2" in str(e)
    for bad in (-1, 2.5, "4"):
        expect(ValueError, "max_gather_pages", f, **s.prefill_args(), max_gather_pages=bad, **w,
               **REF)
    expect(NotImplementedError, "topk", f, **s.prefill_args(out=None), topk=4, backend="triton",
           watch=[s.cache])
    expect(ValueError, "topk", f, **s.prefill_args(out=None), topk=0, watch=[s.cache], **REF)
    expect(ValueError, "out", f, **s.prefill_args(out=s.out[:3]), **w, **REF)
    expect(ValueError, "out", f, **s.prefill_args(out=s.out.float()), **w, **REF)
    expect(ValueError, "out", f, **s.prefill_args(out=s.out[:, :, ::2]), **w, **REF)


def test_max_gather_pages_errors():
    for bad in (0, -5, 1.5, None):
        expect(ValueError, "max_model_len", ni.max_gather_pages, bad, 16)
        expect(ValueError, "max_num_batched_tokens", ni.max_gather_pages, 1024, bad)


# ----------------------------------------------------------------------------- wrapper

def make_wrapper(s, **kw):
    bt_buf = torch.full((2, 6), -1, dtype=torch.int32)
    sl_buf = torch.zeros(2, dtype=torch.int32)
    return ni.DecodeIndexerWrapper(2, block_table_buffer=bt_buf, seq_lens_buffer=sl_buf,
                                   use_cuda_graph=False, backend="reference", **kw)


def test_wrapper_constructor_errors():
    bt = torch.zeros(2, 6, dtype=torch.int32)
    sl = torch.zeros(2, dtype=torch.int32)
    W = ni.DecodeIndexerWrapper
    for h in (0, -1, 2.0):
        expect(ValueError, "num_heads", W, h, block_table_buffer=bt, seq_lens_buffer=sl)
    expect(ValueError, "block_table_buffer", W, 2, block_table_buffer=bt.long(),
           seq_lens_buffer=sl)
    expect(ValueError, "block_table_buffer", W, 2, block_table_buffer=bt[0],
           seq_lens_buffer=sl)
    expect(ValueError, "block_table_buffer", W, 2,
           block_table_buffer=torch.zeros(6, 2, dtype=torch.int32).T, seq_lens_buffer=sl)
    expect(ValueError, "seq_lens_buffer", W, 2, block_table_buffer=bt, seq_lens_buffer=sl[:1])
    expect(ValueError, "seq_lens_buffer", W, 2, block_table_buffer=bt,
           seq_lens_buffer=sl.long())
    expect(ValueError, "seq_lens_buffer", W, 2, block_table_buffer=bt,
           seq_lens_buffer=meta_like(sl))
    expect(ValueError, "backend", W, 2, block_table_buffer=bt, seq_lens_buffer=sl,
           backend="fast")


def test_wrapper_run_before_plan(s):
    wr = make_wrapper(s)
    expect(RuntimeError, "plan", wr.run, s.index_q, s.cache, s.out, watch=[s.out, s.cache])


def test_wrapper_plan_errors_write_nothing(s):
    wr = make_wrapper(s)
    bufs = dict(watch=[wr.block_table, wr.seq_lens])
    bt = s.block_table
    # Values: seq_len below Q, negative, table too narrow, ids outside the given cache size.
    for bad in ([1, 200], [-3, 200]):
        expect(ValueError, "seq_lens", wr.plan, bt, torch.tensor(bad, dtype=torch.int32), 2,
               **bufs)
    expect(ValueError, "block_table", wr.plan, bt, torch.tensor([513, 200], dtype=torch.int32),
           2, **bufs)
    bad_bt = bt.clone()
    bad_bt[0, 0] = NUM_BLOCKS
    expect(ValueError, "block_table", wr.plan, bad_bt, s.seq_lens, 2, num_blocks=NUM_BLOCKS,
           **bufs)
    # Shapes and dtypes.
    expect(ValueError, "block_table", wr.plan, torch.zeros(2, 7, dtype=torch.int32),
           s.seq_lens, 2, **bufs)
    expect(ValueError, "block_table", wr.plan, bt[:1], s.seq_lens, 2, **bufs)
    expect(ValueError, "block_table", wr.plan, bt.long(), s.seq_lens, 2, **bufs)
    expect(ValueError, "seq_lens", wr.plan, bt, s.seq_lens.long(), 2, **bufs)
    expect(ValueError, "seq_lens", wr.plan, bt, s.seq_lens[:1], 2, **bufs)
    expect(ValueError, "query_len", wr.plan, bt, s.seq_lens, 9, **bufs)
    # A failed plan leaves the wrapper unplanned.
    expect(RuntimeError, "plan", wr.run, s.index_q, s.cache, s.out, watch=[s.out])
    wr.plan(bt, s.seq_lens, 2, num_blocks=NUM_BLOCKS)
    expect(ValueError, "query_len", wr.plan, bt, s.seq_lens, 1, **bufs)
    expect(ValueError, "query_len", wr.plan, bt, s.seq_lens, 3, **bufs)


def test_wrapper_run_errors(s):
    wr = make_wrapper(s)
    wr.plan(s.block_table, s.seq_lens, 2)
    w = dict(watch=[s.cache, s.out])
    expect(ValueError, "index_q", wr.run, s.index_q[:, :1], s.cache, s.out, **w)
    expect(ValueError, "index_q", wr.run, s.index_q[:2], s.cache, s.out, **w)
    expect(ValueError, "index_q", wr.run, s.index_q.float(), s.cache, s.out, **w)
    expect(ValueError, "out", wr.run, s.index_q, s.cache, s.out[:, :1], **w)
    expect(ValueError, "out", wr.run, s.index_q, s.cache, s.out.long(), **w)
    expect(ValueError, "out", wr.run, s.index_q, s.cache, s.out.transpose(0, 1).contiguous()
           .transpose(0, 1), **w)
    expect(ValueError, "cache", wr.run, s.index_q, bad_stride_cache(9216 + 4), s.out,
           watch=[s.out])
    expect(ValueError, "cache", wr.run, s.index_q, s.cache.to(torch.int8), s.out, watch=[s.out])


# ----------------------------------------------------------------------------- devices

@pytest.mark.gpu
def test_cpu_cuda_mismatch(s):
    w = dict(watch=[s.cache])
    expect(ValueError, "k", ni.write_index_k, s.cache, s.k.cuda(), s.slots, **w, **REF)
    expect(ValueError, "slot_mapping", ni.write_index_k, s.cache, s.k, s.slots.cuda(), **w,
           **REF)
    expect(ValueError, "block_table", ni.decode_indexer,
           **s.decode_args(block_table=s.block_table.cuda()), watch=[s.cache, s.out], **REF)
    expect(ValueError, "index_q", ni.decode_indexer, **s.decode_args(index_q=s.index_q.cuda()),
           watch=[s.cache, s.out], **REF)
    expect(ValueError, "out", ni.decode_indexer, **s.decode_args(out=s.out.cuda()),
           watch=[s.cache], **REF)
    expect(ValueError, "cu_seqlens_q", ni.prefill_indexer,
           **s.prefill_args(cu_seqlens_q=s.cu.cuda()), watch=[s.cache, s.out], **REF)
    expect(ValueError, "positions", ni.prepare_index_q, torch.randn(10, 2, 128), s.pos.cuda(),
           s.w, s.cs, **REF)
