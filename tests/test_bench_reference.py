"""CPU micro-benchmarks of the PyTorch reference (pytest-benchmark), so that regressions in
the reference's speed show up next to its correctness.

Each test times one reference operation at a tiny size with the ``benchmark`` fixture
(``pedantic``: a fixed, small number of rounds, so the suite stays fast with timing on) and
then checks the timed call's result against the naive oracle in ``bruteforce.py``, so it
passes or fails on correctness also under ``--benchmark-disable`` (one call, no timing).
Compare runs with ``pytest tests/test_bench_reference.py --benchmark-autosave`` and
``pytest-benchmark compare``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bruteforce as bf
import nvfp4_indexer as ni
from nvfp4_indexer.reference import select_pages

ROUNDS = 3


def _bench(benchmark, fn, *args, rounds: int = ROUNDS):
    return benchmark.pedantic(fn, args=args, rounds=rounds, iterations=1, warmup_rounds=0)


def _keys(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(0.75 * torch.randn(128, generator=g))
    return torch.randn(n, 128, generator=g) * scale * torch.exp(0.5 * torch.randn(n, 1, generator=g))


def _paged_batch(seq_lens: list[int], heads: int, rows: int, seed: int):
    """A cache holding random keys for every page the requests use, scattered block tables
    (distinct blocks), and E4M3 queries ``[rows, heads, 128]``."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // 128) for s in seq_lens]
    width = max(need)
    nblocks = sum(need) + 3
    cache = ni.new_index_cache(nblocks)
    perm = torch.randperm(nblocks, generator=g)
    bt = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(need):
        bt[r, :n] = perm[at:at + n].to(torch.int32)
        at += n
    slots = torch.arange(nblocks * 128)
    ni.write_index_k(cache, _keys(nblocks * 128, seed + 1), slots)
    q = ni.encode_e4m3(2 * torch.randn(rows, heads, 128, generator=g))
    return cache, bt, torch.tensor(seq_lens, dtype=torch.int32), q


@pytest.mark.benchmark(group="reference-formats")
def test_bench_encode_e4m3(benchmark):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 16, generator=g) * torch.exp(4 * torch.randn(1 << 16, generator=g))
    x[:4] = torch.tensor([1e6, -1e6, 0.0, -0.0])
    got = _bench(benchmark, ni.encode_e4m3, x)
    np.testing.assert_array_equal(got.view(torch.uint8).numpy(), bf.e4m3_bytes(x.numpy()))


@pytest.mark.benchmark(group="reference-formats")
def test_bench_quantize_nvfp4(benchmark):
    x = _keys(4096, 2)
    codes, scales = _bench(benchmark, ni.quantize_nvfp4, x)
    exp_codes, exp_scales = bf.quantize(x.numpy())
    np.testing.assert_array_equal(codes.numpy(), exp_codes)
    np.testing.assert_array_equal(scales.view(torch.uint8).numpy(), exp_scales)


@pytest.mark.benchmark(group="reference-paging")
def test_bench_write_index_k(benchmark):
    nblocks, t = 32, 2048
    cache = ni.new_index_cache(nblocks)
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(nblocks * 128, generator=g)[:t]
    k = _keys(t, 4)

    def write():
        bf.storage_view(cache).fill_(0x5A)  # poison: bytes of unwritten tokens stay 0x5A
        ni.write_index_k(cache, k, slots)
    _bench(benchmark, write)
    exp_codes, exp_scales = bf.quantize(k.numpy())
    written = {int(s): i for i, s in enumerate(slots)}
    for block in range(nblocks):
        page = bf.page_raw(cache, block)
        for tok in range(128):
            codes, scales = bf.token_raw(page, tok)
            i = written.get(block * 128 + tok)
            if i is None:
                assert (codes == 0x5A).all() and (scales == 0x5A).all()
            else:
                np.testing.assert_array_equal(codes, exp_codes[i])
                np.testing.assert_array_equal(scales, exp_scales[i])


@pytest.mark.benchmark(group="reference-indexer")
def test_bench_decode_small(benchmark):
    seq_lens, q_len, heads = [2600, 130, 4000, 1900], 2, 2
    cache, bt, sl, q = _paged_batch(seq_lens, heads, len(seq_lens) * q_len, 5)
    got = _bench(benchmark, ni.decode_indexer, q, cache, bt, sl, q_len)
    np.testing.assert_array_equal(got.numpy(), bf.decode(q, cache, bt, sl, q_len))


@pytest.mark.benchmark(group="reference-indexer")
def test_bench_prefill_small(benchmark):
    seq_lens, q_lens, heads = [2200, 2100], [16, 24], 2
    cache, bt, sl, q = _paged_batch(seq_lens, heads, sum(q_lens), 6)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    # a budget of one request's pages forces two chunks (SPEC 7)
    got = _bench(benchmark, lambda: ni.prefill_indexer(q, cache, bt, cu, sl,
                                                       max_gather_pages=17))
    np.testing.assert_array_equal(got.numpy(), bf.prefill(q, cache, bt, cu, sl))


@pytest.mark.benchmark(group="reference-indexer")
def test_bench_gather_small(benchmark):
    seq_lens = [2200, 900, 1]
    cache, bt, sl, _ = _paged_batch(seq_lens, 1, 1, 7)
    ws, offsets = _bench(benchmark, ni.gather_index_k_fp8, cache, bt, sl)
    exp_ws, exp_off = bf.gather(cache, bt, sl)
    np.testing.assert_array_equal(ws.view(torch.uint8).numpy(), exp_ws)
    assert offsets.tolist() == exp_off


@pytest.mark.benchmark(group="reference-selection")
def test_bench_select_pages(benchmark):
    g = torch.Generator().manual_seed(8)
    n, h, w = 256, 4, 64
    # few distinct values (many ties) and some NaN pages: every ordering rule is exercised
    scores = torch.randint(-4, 5, (n, h, w), generator=g).float() / 2
    scores[torch.rand(n, h, w, generator=g) < 0.05] = float("nan")
    local = torch.randint(-1, w + 1, (n,), generator=g)
    got = _bench(benchmark, select_pages, scores, local)
    s = scores.numpy()
    for r in range(n):
        for hh in range(h):
            assert got[r, hh].tolist() == bf.select_row(s[r, hh], int(local[r]))
