"""Triton scoring and top-k kernels vs the reference (SPEC 4-7, 9).

Kernels: the decode indexer (``DecodeRunner`` / ``decode_indexer``, NVFP4 pages read in place),
``page_scores``, and the top-k device functions (the prefill indexer:
``tests/triton/prefill/``).

How the CPU run works: without CUDA this module sets ``TRITON_INTERPRET=1`` before importing
any ``nvfp4_indexer.triton`` module (Triton reads it when ``@triton.jit`` decorates a function)
and reloads the kernel modules if something imported them compiled earlier. Under the
interpreter the scorers use an IEEE fp32 dot of exactly decoded E4M3 values; on a GPU the
default fp16 MMA (and the bf16, fp8 and fp32 comparison modes) run in the ``gpu`` tests.

Checks (SPEC 9): output structure bit-exact (local slot, -1 padding, ascending when L <= 15,
padding rows, no duplicates, ids in [0, L)); scores tie-aware against the exact reference
scores with e = 2^-b * max_t sum_d |q_d K_d| (b = ``SCORE_ERROR_BITS`` of the dot mode); NaN
pages exactly (below every number, by id among themselves); exact ties (two logical pages on
one physical block) by smaller id; and, where the scores are identical by construction, the
selection bit-exact (decode == reference ``select_pages`` of the kernel's own page scores).
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede triton's and the kernels' import

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import nvfp4_indexer as ni  # noqa: E402
from nvfp4_indexer import reference as ref  # noqa: E402

from conformance.fixtures import OUT_POISON, selection_out  # noqa: E402
from kernel_cases import (DEV, PAD_STRIDE, Batch, _storage, _to_device,  # noqa: E402
                          assert_guards, assert_unchanged, check_scores, check_selection,
                          decode_check, decode_qsl, local_pages, poisoned_out, prefill_batch,
                          random_q, snapshot)

_MODULES = ("numerics", "dequantize", "layout", "dot_modes", "ptx", "operands", "topk", "scan",
            "prefill.gather", "scoring", "lut", "decode_wgmma", "decode", "scores",
            "prefill.prefill", "prefill.launch")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


def _kernels():
    """The kernel modules, interpreted when there is no GPU (reloaded if imported compiled)."""
    mods = {n: importlib.import_module(f"nvfp4_indexer.triton.{n}") for n in _MODULES}
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(mods["numerics"].e4m3_round, InterpretedFunction):
            for name in _MODULES:  # dependency order
                mods[name] = importlib.reload(sys.modules[f"nvfp4_indexer.triton.{name}"])
    return mods


K = _kernels()
TOPK_MOD, DECODE, SCORES, PREFILL = K["topk"], K["decode"], K["scores"], K["prefill.launch"]
from nvfp4_indexer.triton import heuristics as HZ  # noqa: E402  (host rules: no kernels)
from nvfp4_indexer.triton.device import num_sms  # noqa: E402
EMPTY = TOPK_MOD.EMPTY
empty_topk, pack_candidate, topk_insert = (TOPK_MOD.empty_topk, TOPK_MOD.pack_candidate,
                                           TOPK_MOD.topk_insert)
store_candidates, load_candidates, write_selection = (
    TOPK_MOD.store_candidates, TOPK_MOD.load_candidates, TOPK_MOD.write_selection)
nvfp4_page_operands = K["operands"].nvfp4_page_operands
BITS = DECODE.SCORE_ERROR_BITS["fp32" if not HAS_CUDA else K["dot_modes"].DEFAULT_GPU_DOT]


# ----------------------------------------------------------------------- top-k device functions

@triton.jit
def _select_kernel(scores_ptr, local_ptr, cand_ptr, out_ptr, C: tl.constexpr, R: tl.constexpr,
                   NS: tl.constexpr, NS_PAD: tl.constexpr):
    """Per row: NS splits of the C columns, each a running top-16, stored, merged, written."""
    rows = tl.arange(0, R)
    local = tl.load(local_ptr + rows)
    per = tl.cdiv(C, NS)
    for s in tl.static_range(NS):
        top = empty_topk(R)
        for c in range(s * per, tl.minimum(s * per + per, C)):
            score = tl.load(scores_ptr + rows * C + c)
            cand = pack_candidate(score, c + tl.zeros([R], tl.int32))
            top = topk_insert(top, tl.where(c < local, cand, EMPTY))
        store_candidates(cand_ptr, rows.to(tl.int64), top, s, NS)
    tl.debug_barrier()
    keys = load_candidates(cand_ptr, rows.to(tl.int64), rows < R, NS, NS_PAD)
    write_selection(keys, tl.maximum(local, 0), out_ptr + rows * 16, rows < R)


@pytest.mark.parametrize("seed,num_splits", [(0, 1), (1, 3), (2, 4)])
def test_topk_selection_bit_exact(seed, num_splits):
    """Selection given identical scores is bit-exact (SPEC 5, 9): heavy ties, -0.0 vs +0.0,
    +-inf, NaN pages, every L from padding to W."""
    g = torch.Generator().manual_seed(seed)
    r, c = 32, 40
    palette = torch.tensor([-2.0, -0.0, 0.0, 1.0, 1.5, 1e30, -1e-30, math.inf, -math.inf,
                            math.nan, 3.0, 3.0000002])
    scores = palette[torch.randint(0, len(palette), (r, c), generator=g)]
    scores[:4] = torch.randn((4, c), generator=g)  # some rows without ties
    scores[4] = math.nan
    local = torch.randint(-1, c + 1, (r,), generator=g, dtype=torch.int32)
    local[:8] = torch.tensor([-1, 0, 1, 15, 16, 17, c, c - 1], dtype=torch.int32)
    cand = torch.empty(r * num_splits * 16, dtype=torch.int64)
    big, out = poisoned_out(r, 1, "cpu")
    if HAS_CUDA:
        scores, local, cand, big = scores.cuda(), local.cuda(), cand.cuda(), big.cuda()
        out = big[1:r + 1]
    _select_kernel[(1,)](scores, local, cand, out, C=c, R=r, NS=num_splits,
                         NS_PAD=triton.next_power_of_2(num_splits))
    want = ref.select_pages(scores.cpu()[:, None, :], local.cpu().long())
    assert torch.equal(out.cpu(), want)
    assert_guards(big)


# ---------------------------------------------------------------- in-register page dequantization

@triton.jit
def _page_operands_kernel(cache_ptr, page_stride, blocks_ptr, out_ptr, DOT: tl.constexpr):
    """The scorers' dequantized keys of page ``blocks[pid]``, stored as fp32 [128, 128]."""
    pid = tl.program_id(0)
    block = tl.load(blocks_ptr + pid).to(tl.int64)
    k_a, k_b = nvfp4_page_operands(cache_ptr + block * page_stride, DOT)
    t = tl.arange(0, 128)[:, None]
    base = out_ptr + pid * (128 * 128) + t * 128
    if DOT == "fp32":
        tl.store(base + tl.arange(0, 128)[None, :], k_a)
    else:
        i = tl.arange(0, 64)[None, :]
        tl.store(base + 2 * i, k_a.to(tl.float32))
        tl.store(base + 2 * i + 1, k_b.to(tl.float32))


@pytest.mark.parametrize("dot", ["fp32"] if not HAS_CUDA else ["fp16", "bf16", "fp8", "fp32"])
def test_page_operands_bit_exact(dot):
    """What the scorers multiply is dequant_e4m3 (SPEC 1.4), bit for bit, for all 16 x 256
    (code, scale byte) pairs in both nibbles (NaN and negative scales included)."""
    cache = ref.new_index_cache(3, device="cpu", page_stride=PAD_STRIDE)
    raw = _storage(cache).view(3, PAD_STRIDE)
    raw[:, 9216:] = 0xFF
    group = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    raw[0, :8192] = group.repeat(1024)  # low nibbles even codes, high nibbles odd codes
    raw[2, :8192] = ((group << 4) | (group >> 4)).repeat(1024)  # and the other way round
    scales = torch.arange(1024) % 256
    raw[0, 8192:9216] = scales.to(torch.uint8)
    raw[2, 8192:9216] = ((scales * 37 + 11) % 256).to(torch.uint8)
    raw[1, :9216] = 0xAB  # never read
    blocks = torch.tensor([2, 0], dtype=torch.int32)
    want = ref.decode_e4m3(ref.dequantize_nvfp4(*ref.read_blocks(cache, blocks.long())))
    cache = cache if DEV == "cpu" else _to_device(cache)
    blocks = blocks.to(DEV)
    got = torch.full((2, 128, 128), -7.0, device=DEV)
    _page_operands_kernel[(2,)](cache, cache.stride(0), blocks, got, DOT=dot)
    got = got.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    assert torch.equal(got[keep].view(torch.int32), want[keep].view(torch.int32))


# ------------------------------------------------------------------------ decode (interpreter)

def decode_lens(q_len: int) -> list[int]:
    """0 (padding), tiny, page edges, and long enough for L >= 16 with rows on both sides of
    a page boundary (2050 - Q + i crosses 2048)."""
    return [max(s, q_len) if s else 0 for s in (2100, 0, 1, 127, 128, 129, 2050, 2333)]


@pytest.mark.parametrize("q_len,heads,num_splits,window", [(1, 1, 1, 4), (2, 2, 3, 2),
                                                           (4, 2, None, 64), (8, 1, 5, 1),
                                                           (1, 4, 2, 64)])
def test_decode_matches_reference(q_len, heads, num_splits, window):
    """Decode equals the reference (tie-aware), including several top-k windows per program
    (small ``window``: the alternating halves of the window buffer and the merge rounds)."""
    aliases = ((0, 2, 9), (7, 0, 5))  # request, u, w: page w shares page u's block
    batch = Batch(decode_lens(q_len), seed=10 * q_len + heads,
                  alias=[(r, u, w) for r, u, w in aliases])
    b = batch.seq_lens.shape[0]
    q = random_q(b * q_len, heads, seed=q_len)
    snap = snapshot(batch, q)
    big, out = poisoned_out(b * q_len, heads)
    runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV,
                                 config=DECODE.DecodeConfig(num_splits=num_splits, window=window))
    if num_splits is not None:
        assert runner.num_splits == num_splits
    runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
    assert_guards(big)
    assert_unchanged(batch, q, snap)
    decode_check(batch, q, q_len, out, runner.error_bits, aliases)
    if not HAS_CUDA:
        # Same tiles, same dot: page_scores computes the very scores decode selected from,
        # so the selection must be the reference's selection of them, bit for bit.
        qsl = decode_qsl(b, q_len)
        s = SCORES.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl)
        assert torch.equal(out, ref.select_pages(s, local_pages(batch.seq_lens, qsl)))


def test_decode_nan_pages_and_api():
    """Corrupted pages (SPEC 4): an all-NaN page scores NaN and ranks below every number, NaN
    pages among themselves by smaller id; a partly NaN page scores the max of its other tokens.
    Through the public API with backend="triton"."""
    q_len, heads = 2, 2
    batch = Batch([2230, 2200], seed=5)
    nan_pages = ((0, 14), (0, 3), (0, 11), (1, 6))
    for r, j in nan_pages:  # all 128 tokens NaN
        batch.page_bytes(int(batch.block_table[r, j]))[8192:] = 0x7F
    part = batch.page_bytes(int(batch.block_table[1, 2]))
    part[8192:8192 + 8 * 100] = 0xFF  # tokens 0..99 NaN (negative-NaN byte), 100..127 not
    q = random_q(4, heads, seed=3)
    qsl = decode_qsl(2, q_len)
    s = SCORES.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    for r, j in nan_pages:
        assert torch.isnan(exact[2 * r:2 * r + 2, :, j]).all()
    assert torch.isfinite(exact[2:, :, 2]).all()
    check_scores(s, exact, mag, BITS)
    out = ni.decode_indexer(q, batch.cache, batch.block_table, batch.seq_lens, q_len,
                            backend="triton")
    check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS)
    # Request 0: L = 17, 14 numeric history pages, then the NaN page with the smallest id.
    for row in (0, 1):
        for h in range(heads):
            got = out[row, h].tolist()
            assert got[14] == 3 and got[15] == 17 and not {11, 14} & set(got)
    # Request 1: L = 17, 16 numeric pages: the NaN page 6 is never selected.
    assert (out[2:, :, :15] != 6).all()
    if not HAS_CUDA:
        assert torch.equal(out, ref.select_pages(s, local_pages(batch.seq_lens, qsl)))


def test_decode_runner_in_place_updates():
    """One runner, its buffers changed in place between runs (the CUDA-graph contract, SPEC 6):
    seq_lens grow / shrink / become padding, block tables are rewritten, q changes."""
    q_len, heads, b = 2, 2, 3
    first = Batch([2100, 0, 300], seed=21)
    second = Batch([0, 2400, 2110], seed=22)
    third = Batch([129, 2060, 0], seed=23)
    width = max(first.width, second.width, third.width)
    # One cache holding all three batches' blocks; block ids offset per batch.
    caches = [first, second, third]
    sizes = [c.cache.shape[0] for c in caches]
    cache = ref.new_index_cache(sum(sizes), device=DEV, page_stride=PAD_STRIDE)
    raw = _storage(cache)
    tables = []
    at = 0
    for c, n in zip(caches, sizes):
        raw[at * PAD_STRIDE:(at + n) * PAD_STRIDE] = _storage(c.cache)[:n * PAD_STRIDE]
        t = torch.full((b, width), -1, dtype=torch.int32, device=DEV)
        hist = torch.arange(c.width, device=DEV)[None, :] < torch.tensor(
            c.history, device=DEV)[:, None]
        t[:, :c.width] = torch.where(hist, c.block_table + at, c.block_table)
        tables.append(t)
        at += n
    bt_buf = torch.full((b, width), 77, dtype=torch.int32, device=DEV)
    sl_buf = torch.zeros(b, dtype=torch.int32, device=DEV)
    q_buf = torch.zeros((b * q_len, heads, 128), dtype=torch.float8_e4m3fn, device=DEV)
    big, out = poisoned_out(b * q_len, heads)
    runner = DECODE.DecodeRunner(heads, b, width, q_len, DEV,
                                 config=DECODE.DecodeConfig(num_splits=3), warmup=True)
    for step, (c, t) in enumerate(zip(caches + caches[:1], tables + tables[:1])):
        bt_buf.copy_(t)
        sl_buf.copy_(c.seq_lens)
        q_buf.copy_(random_q(b * q_len, heads, seed=100 + step))
        out.fill_(OUT_POISON)
        runner.run(q_buf, cache, bt_buf, sl_buf, out)
        assert_guards(big)
        qsl = decode_qsl(b, q_len)
        exact, mag = ref.page_scores(q_buf, cache, bt_buf, sl_buf, qsl, with_magnitude=True)
        check_selection(out, exact, mag, local_pages(sl_buf, qsl), runner.error_bits)


def test_decode_score_buffer_and_splits():
    """score_buffer_size / NUM_SPLITS are static-shape functions; a shared buffer works and a
    short or misaligned one is refused."""
    hz = HZ
    assert hz.choose_num_splits(1, 1, 132) == 1
    assert hz.choose_num_splits(5000, 2000, 132) == 1
    assert hz.choose_num_splits(1, 1024, 132) == hz.MAX_SPLITS
    assert 1 < hz.choose_num_splits(8, 400, 132) <= 200
    n = DECODE.score_buffer_size(2, 20, 2, 2, num_sms=2)
    ns = hz.choose_num_splits(2, 20, 2)
    keep = hz.keep_per_split(ns, 20)
    assert n == 2 * 2 * 16 * ns * keep and ns > 1 and hz.decode_window(ns, 20, 16) == 1
    assert keep == min(16, triton.next_power_of_2(-(-19 // ns)))
    assert DECODE.score_buffer_size(2000, 20, 2, 2, num_sms=2) == 0
    # long splits buffer WINDOW pages of scores per program (two halves)
    assert hz.decode_window(1, 2000, 16) == hz.WINDOW
    # a runner with overrides fits a buffer sized with the same overrides, not a smaller one
    for kw in ({"num_splits": 7}, {"programs_per_sm": 1}, {"window": 4, "num_splits": 2}):
        cfg = DECODE.DecodeConfig(**kw)
        need = DECODE.score_buffer_size(3, 2000, 2, 2, num_sms=num_sms(DEV), config=cfg)
        DECODE.DecodeRunner(2, 3, 2000, 2, DEV, warmup=False,
                            score_buffer=torch.empty(need, device=DEV), config=cfg)
        if need > 2:
            with pytest.raises(ValueError, match="score_buffer"):
                DECODE.DecodeRunner(2, 3, 2000, 2, DEV, warmup=False,
                                    score_buffer=torch.empty(need - 2, device=DEV), config=cfg)
    ns3 = hz.choose_num_splits(3, 2000, 2)
    assert DECODE.score_buffer_size(3, 2000, 2, 2, num_sms=2) == \
        2 * 3 * 16 * ns3 * hz.keep_per_split(ns3, 2000) + 3 * ns3 * 2 * hz.WINDOW * 16
    split_ns = DECODE.DecodeConfig(num_splits=ns)
    with pytest.raises(ValueError, match="score_buffer"):
        DECODE.DecodeRunner(2, 2, 20, 2, DEV, score_buffer=torch.empty(4, device=DEV),
                            config=split_ns)
    with pytest.raises(ValueError, match="score_buffer"):
        DECODE.DecodeRunner(2, 2, 20, 2, DEV, score_buffer=torch.empty(n + 2, device=DEV)[1:],
                            config=split_ns)
    with pytest.raises(NotImplementedError, match="query_len"):
        DECODE.DecodeRunner(16, 2, 20, 8, DEV)
    batch = Batch([2100, 2200], seed=31)
    buf = torch.full((n + 6,), float("nan"), device=DEV)
    q = random_q(4, 2, seed=4)
    out = selection_out(4, 2, device=DEV)
    runner = DECODE.DecodeRunner(2, 2, batch.width, 2, DEV, score_buffer=buf, config=split_ns)
    runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
    decode_check(batch, q, 2, out, runner.error_bits)
    with pytest.raises(ValueError, match="expected index_q"):
        runner.run(q[:2], batch.cache, batch.block_table, batch.seq_lens, out)

def test_merge_config_rows_per_program():
    """``heuristics.merge_config``: where the merge sorts (``merge_sorts``: 16-64 columns)
    one warp holds ``MERGE_SORT_KEYS_PER_WARP`` keys; the rounds keep one row per program.
    (The kernel at these rows: ``test_prefill_merge_sort_equals_rounds``.)"""
    assert HZ.merge_config(2, 16, sort=True) == (8, 1)
    assert HZ.merge_config(3, 16, sort=True) == (4, 1)  # 4 x 16 columns
    assert HZ.merge_config(2, 8, sort=True) == (16, 1)
    assert HZ.merge_config(8, 16, sort=True) == (1, 1)  # 128 columns: the rounds
    assert HZ.merge_config(2, 4, sort=True) == (1, 1)  # 8 columns: the rounds
    assert HZ.merge_config(2, 16) == (1, 1)
    assert not HZ.merge_sorts(HZ.MERGE_SORT_MAX_COLUMNS * 2, True)


# ---------------------------------------------------------------------------------- page scores

def test_page_scores_matches_reference():
    # Mixed layout: a decode padding request with rows, a request with no rows, prefill rows.
    batch = Batch([0, 2100, 300, 2180], seed=61)
    qsl = torch.tensor([0, 2, 5, 5, 9], dtype=torch.int32, device=DEV)
    q = random_q(9, 2, seed=8)
    got = ni.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                         backend="triton")
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    assert got.shape == exact.shape and got.dtype == torch.float32
    check_scores(got, exact, mag, BITS)


# ------------------------------------------------------------------------------ GPU (realistic)

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def realistic_lens(b: int, max_len: int, q_len: int, seed: int, padding: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(q_len, max_len + 1, (b,), generator=g).tolist()
    lens[0] = max_len
    for i in range(1, 1 + padding):
        lens[i] = 0
    return lens


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("b,max_len,q_len,heads", [(1, 131072, 8, 4), (4, 131072, 1, 1),
                                                   (8, 40000, 4, 2), (64, 20000, 8, 4),
                                                   (64, 131072, 1, 2), (32, 3000, 2, 4)])
def test_gpu_decode_realistic(b, max_len, q_len, heads):
    batch = Batch(realistic_lens(b, max_len, q_len, seed=b + max_len, padding=min(2, b - 1)),
                  seed=b, page_stride=9216, alias=[(0, 3, 700)] if max_len > 100000 else ())
    q = random_q(b * q_len, heads, seed=b)
    big, out = poisoned_out(b * q_len, heads)
    runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV)
    runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
    torch.cuda.synchronize()
    assert_guards(big)
    aliases = ((0, 3, 700),) if max_len > 100000 else ()
    decode_check(batch, q, q_len, out, runner.error_bits, aliases)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_decode_cuda_graph_replays(pdl):
    """Capture DecodeRunner.run once; 50 replays after in-place changes of q, seq_lens
    (including zero-length padding requests) and block tables, each against the reference.
    ``pdl``: the merge kernel launched with programmatic dependent launch (SM90+)."""
    if pdl and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs SM90+")
    b, q_len, heads, max_len = 16, 4, 4, 65536
    pool = Batch([max_len] * 4, seed=71, page_stride=PAD_STRIDE, spare=16)
    width = pool.width
    blocks_per_req = max_len // 128 - 1  # history blocks of a full request
    pool_blocks = torch.cat([pool.block_table[r, :blocks_per_req] for r in range(4)])
    bt_buf = torch.zeros((b, width), dtype=torch.int32, device=DEV)
    sl_buf = torch.zeros(b, dtype=torch.int32, device=DEV)
    q_buf = torch.zeros((b * q_len, heads, 128), dtype=torch.float8_e4m3fn, device=DEV)
    big, out = poisoned_out(b * q_len, heads)
    runner = DECODE.DecodeRunner(heads, b, width, q_len, DEV,
                                 config=DECODE.DecodeConfig(pdl=pdl))
    assert runner.num_splits > 1  # the merge kernel (the PDL launch) runs
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        runner.run(q_buf, pool.cache, bt_buf, sl_buf, out)  # warm (already compiled)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        runner.run(q_buf, pool.cache, bt_buf, sl_buf, out)
    g = torch.Generator().manual_seed(72)
    qsl = decode_qsl(b, q_len)
    for step in range(50):
        lens = torch.randint(q_len, max_len, (b,), generator=g)
        lens[torch.rand(b, generator=g) < 0.2] = 0
        if step % 7 == 0:
            lens[:] = 0
        perm = torch.randperm(len(pool_blocks), generator=g)[:width].to(DEV)
        t = torch.full((b, width), 2**31 - 1, dtype=torch.int32, device=DEV)
        for r in range(b):
            n = max(int(lens[r]) - 1, 0) // 128
            shift = int(torch.randint(0, len(pool_blocks) - width, (1,), generator=g))
            t[r, :n] = pool_blocks[(perm[:n] + shift) % len(pool_blocks)]
        bt_buf.copy_(t)
        sl_buf.copy_(lens.to(torch.int32))
        q_buf.copy_(random_q(b * q_len, heads, seed=1000 + step))
        out.fill_(OUT_POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert_guards(big)
        exact, mag = ref.page_scores(q_buf, pool.cache, bt_buf, sl_buf, qsl,
                                     with_magnitude=True)
        check_selection(out, exact, mag, local_pages(sl_buf, qsl), runner.error_bits)


@pytest.mark.gpu
@gpu
def test_gpu_wrapper_graph():
    """The public DecodeIndexerWrapper (plan outside, run captured) over DecodeRunner."""
    b, q_len, heads = 8, 2, 4
    batch = Batch(realistic_lens(b, 30000, q_len, seed=81, padding=1), seed=81)
    bt_buf = torch.zeros_like(batch.block_table)
    sl_buf = torch.zeros_like(batch.seq_lens)
    wrapper = ni.DecodeIndexerWrapper(heads, block_table_buffer=bt_buf, seq_lens_buffer=sl_buf)
    wrapper.plan(batch.block_table, batch.seq_lens, q_len)
    q_buf = random_q(b * q_len, heads, seed=82)
    out = selection_out(b * q_len, heads, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_buf, batch.cache, out)
    for step in range(3):
        lens = realistic_lens(b, 30000, q_len, seed=83 + step, padding=step)
        lens = [min(s, int(batch.seq_lens[r])) if s else 0 for r, s in enumerate(lens)]
        wrapper.plan(batch.block_table, torch.tensor(lens, dtype=torch.int32, device=DEV),
                     q_len)
        q_buf.copy_(random_q(b * q_len, heads, seed=84 + step))
        graph.replay()
        torch.cuda.synchronize()
        qsl = decode_qsl(b, q_len)
        exact, mag = ref.page_scores(q_buf, batch.cache, bt_buf, sl_buf, qsl,
                                     with_magnitude=True)
        check_selection(out, exact, mag, local_pages(sl_buf, qsl), wrapper._runner.error_bits)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dot", ["fp16", "bf16", "fp8", "fp32"])
def test_gpu_dot_modes(dot):
    """Every dot mode on the GPU: observed score error within SCORE_ERROR_BITS; decode and
    prefill selections valid under that bound. Prints the observed worst error in bits."""
    bits = DECODE.SCORE_ERROR_BITS[dot]
    b, q_len, heads = 8, 8, 4
    batch = Batch(realistic_lens(b, 50000, q_len, seed=91), seed=91)
    q = random_q(b * q_len, heads, seed=92)
    qsl = decode_qsl(b, q_len)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    got = SCORES.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl, dot=dot)
    observed = check_scores(got, exact, mag, bits)
    print(f"\n{dot}: bound 2^-{bits}, observed worst error 2^-{observed:.2f} x magnitude")
    out = selection_out(b * q_len, heads, device=DEV)
    runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV,
                                 config=DECODE.DecodeConfig(dot=dot))
    runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
    n_tol = check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), bits)
    print(f"{dot}: decode rows that needed the tolerance: {n_tol}")
    pb, pqsl = prefill_batch([(300, 20000), (64, 5000)], seed=93)
    pq = random_q(364, heads, seed=94)
    pe, pm = ref.page_scores(pq, pb.cache, pb.block_table, pb.seq_lens, pqsl,
                             with_magnitude=True)
    for on_n in (None, dot not in HZ.TOKENS_ON_N_DOTS) if dot != "fp32" else (None,):
        pout = selection_out(364, heads, device=DEV)
        PREFILL.prefill_indexer(pq, pb.cache, pb.block_table, pqsl, pb.seq_lens, 10**6, pout,
                                config=PREFILL.PrefillConfig(dot=dot, tokens_on_n=on_n))
        check_selection(pout, pe, pm, local_pages(pb.seq_lens, pqsl), bits)


@pytest.mark.gpu
@gpu
def test_gpu_page_scores_realistic():
    batch = Batch([70000, 0, 5000, 129], seed=101)
    qsl = torch.tensor([0, 8, 9, 200, 204], dtype=torch.int32, device=DEV)
    q = random_q(204, 4, seed=102)
    got = ni.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_scores(got, exact, mag, BITS)

