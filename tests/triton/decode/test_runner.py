"""The decode runner (``triton.decode.runner``: ``DecodeRunner``, ``score_buffer_size``,
``decode_indexer``) vs the reference (SPEC 4-6, 9, 10): the one-launch kernel under the
interpreter; on a GPU realistic batches, CUDA-graph replays and the public wrapper."""

from __future__ import annotations

import pytest
import torch

from kernel_harness import (  # sets TRITON_INTERPRET before the kernels are imported
    BITS, DEV, HAS_CUDA, K, PAD_STRIDE, SCORES, Batch, cache_storage, assert_guards,
    assert_unchanged, check_scores, check_selection, decode_check, decode_lens, decode_qsl,
    local_pages, poisoned_out, random_q, realistic_lens, snapshot)

import triton  # noqa: E402

import nvfp4_indexer as ni  # noqa: E402
from nvfp4_indexer import reference as ref  # noqa: E402
from nvfp4_indexer.triton.decode import dispatch as dsp  # noqa: E402
from nvfp4_indexer.triton.device import num_sms  # noqa: E402
from nvfp4_indexer.triton.heuristics import MAX_SPLITS, WINDOW  # noqa: E402
from nvfp4_indexer.conformance.fixtures import OUT_POISON, selection_out  # noqa: E402

DECODE = K["decode.runner"]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter


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


def _fixed_buffers(b, width, q_len, heads, bt_fill):
    """The buffers a replayed decode reads and writes at fixed addresses: block table
    ``int32 [b, width]`` (all ``bt_fill``), seq_lens ``int32 [b]``, queries E4M3
    ``[b * q_len, heads, 128]`` (zeros) and ``poisoned_out``'s (guarded buffer, output)."""
    bt_buf = torch.full((b, width), bt_fill, dtype=torch.int32, device=DEV)
    sl_buf = torch.zeros(b, dtype=torch.int32, device=DEV)
    q_buf = torch.zeros((b * q_len, heads, 128), dtype=torch.float8_e4m3fn, device=DEV)
    return (bt_buf, sl_buf, q_buf, *poisoned_out(b * q_len, heads))


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
    raw = cache_storage(cache)
    tables = []
    at = 0
    for c, n in zip(caches, sizes):
        raw[at * PAD_STRIDE:(at + n) * PAD_STRIDE] = cache_storage(c.cache)[:n * PAD_STRIDE]
        t = torch.full((b, width), -1, dtype=torch.int32, device=DEV)
        hist = torch.arange(c.width, device=DEV)[None, :] < torch.tensor(
            c.history, device=DEV)[:, None]
        t[:, :c.width] = torch.where(hist, c.block_table + at, c.block_table)
        tables.append(t)
        at += n
    bt_buf, sl_buf, q_buf, big, out = _fixed_buffers(b, width, q_len, heads, bt_fill=77)
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
    assert dsp.choose_num_splits(1, 1, 132) == 1
    assert dsp.choose_num_splits(5000, 2000, 132) == 1
    assert dsp.choose_num_splits(1, 1024, 132) == MAX_SPLITS
    assert 1 < dsp.choose_num_splits(8, 400, 132) <= 200
    n = DECODE.score_buffer_size(2, 20, 2, 2, num_sms=2)
    ns = dsp.choose_num_splits(2, 20, 2)
    keep = dsp.keep_per_split(ns, 20)
    assert n == 2 * 2 * 16 * ns * keep and ns > 1 and dsp.decode_window(ns, 20, 16) == 1
    assert keep == min(16, triton.next_power_of_2(-(-19 // ns)))
    assert DECODE.score_buffer_size(2000, 20, 2, 2, num_sms=2) == 0
    # long splits buffer WINDOW pages of scores per program (two halves)
    assert dsp.decode_window(1, 2000, 16) == WINDOW
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
    ns3 = dsp.choose_num_splits(3, 2000, 2)
    assert DECODE.score_buffer_size(3, 2000, 2, 2, num_sms=2) == \
        2 * 3 * 16 * ns3 * dsp.keep_per_split(ns3, 2000) + 3 * ns3 * 2 * WINDOW * 16
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


@pytest.mark.gpu
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
    bt_buf, sl_buf, q_buf, big, out = _fixed_buffers(b, width, q_len, heads, bt_fill=0)
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


@pytest.mark.parametrize("dequant", ["lut", "triton"])
def test_decode_runner_refuses_an_empty_cache(dequant):
    """Block ids are clamped into the cache (SPEC 10), so an empty cache is refused by name
    before any launch (it crashed the interpreter)."""
    if HAS_CUDA:
        pytest.skip("CPU runner (interpreter)")
    runner = DECODE.DecodeRunner(1, 1, 20, 1, DEV,
                                 config=DECODE.DecodeConfig(dequant=dequant, dot="fp32"))
    q = random_q(1, 1, seed=1)
    bt = torch.zeros((1, 20), dtype=torch.int32)
    sl = torch.tensor([2500], dtype=torch.int32)
    big, out = poisoned_out(1, 1)
    with pytest.raises(ValueError, match="cache"):
        runner.run(q, ref.new_index_cache(0), bt, sl, out)
    assert_guards(big)
    assert bool((out == OUT_POISON).all())


def test_runner_rejects_bad_knobs():
    """DecodeConfig / DecodeRunner validate the lab knobs before any launch (no GPU needed)."""
    from nvfp4_indexer.triton import DecodeConfig, decode, heuristics

    def make(**knobs):
        return decode.DecodeRunner(4, 2, 8, 2, "cpu", config=DecodeConfig(**knobs),
                                   warmup=False)
    with pytest.raises(ValueError, match="dequant"):
        make(dequant="bogus")
    with pytest.raises(ValueError, match="dequant"):  # ptx modes need a CUDA GPU
        make(dequant="ptx")
    with pytest.raises(ValueError, match="num_warps"):
        make(num_warps=3)
    for bad in (3, 0, 512):  # a power of two with window * BLOCK_M <= 4096 (BLOCK_M 16)
        with pytest.raises(ValueError, match="window"):
            make(window=bad)
    with pytest.raises(ValueError, match="maxnreg"):
        make(maxnreg=8)
    for bad in (-1, 0, 2.5, "3", True, heuristics.MAX_SPLITS + 1):  # never silently unwritten
        with pytest.raises(ValueError, match="num_splits"):
            make(num_splits=bad)
    for bad in (True, 1, "yes"):  # programmatic dependent launch: a bool, SM90+ CUDA only
        with pytest.raises(ValueError, match="pdl"):
            make(pdl=bad)
    r = make(programs_per_sm=1)
    assert r.dequant == "triton" and r.num_splits >= 1


def test_runner_ring_stages_option():
    """``DecodeConfig.ring_stages`` (the "mma" / "wgflat" cp.async ring slots): 2, 4 or 8,
    refused otherwise by name; it reaches the plan's score constexprs of those modes only
    (simulated SM90: a host check), and the default plan keeps 4 slots."""
    for bad in (0, 1, 3, 16, True, "4"):
        with pytest.raises(ValueError, match="ring_stages"):
            DECODE.DecodeConfig(ring_stages=bad)
    cfg = DECODE.DecodeConfig(dequant="mma", ring_stages=2)
    plan = dsp.plan_decode(4, 64, 129, 8, cfg, capability=(9, 0), num_sms=132)
    assert plan.score.constexprs["STAGES"] == 2
    plan = dsp.plan_decode(4, 256, 1025, 8, DECODE.DecodeConfig(ring_stages=8),
                           capability=(9, 0), num_sms=132)
    assert plan.dequant == "wgflat" and plan.score.constexprs["STAGES"] == 8
    plan = dsp.plan_decode(4, 256, 1025, 8, None, capability=(9, 0), num_sms=132)
    assert plan.score.constexprs["STAGES"] == dsp.WGFLAT_STAGES == 4
    plan = dsp.plan_decode(4, 1, 129, 8, DECODE.DecodeConfig(ring_stages=8), capability=(9, 0),
                           num_sms=132)
    assert plan.dequant == "ptx" and "STAGES" not in plan.score.constexprs


def test_decode_window_variants_select_the_same_rows():
    """Under the interpreter the default path ("fp32" dot, DEQUANT "triton") and a 2-page
    top-k window are valid against the exact reference scores on a batch with NaN pages,
    negative and saturating scales, and select identical rows."""
    q_len, heads = 2, 2
    batch = Batch([2300, 0, 129, 2100], seed=3, scale_range=(0x01, 0x7E))
    for r, j in ((0, 3), (3, 10)):
        batch.page_bytes(int(batch.block_table[r, j]))[8192:] = 0x7F  # NaN pages
    neg = batch.page_bytes(int(batch.block_table[0, 5]))
    neg[8192:] = neg[8192:] | 0x80  # negative scales
    b = batch.seq_lens.shape[0]
    q = random_q(b * q_len, heads, seed=8)
    outs = []
    for cfg in (None, DECODE.DecodeConfig(window=2)):
        big, out = poisoned_out(b * q_len, heads)
        runner = DECODE.DecodeRunner(heads, b, batch.width, q_len, DEV, config=cfg)
        runner.run(q, batch.cache, batch.block_table, batch.seq_lens, out)
        assert_guards(big)
        decode_check(batch, q, q_len, out, runner.error_bits)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
