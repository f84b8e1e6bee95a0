"""Decode context parallelism (SPEC 8.2): ``ContextParallelDecodeWrapper`` over gloo process
groups of 2 and 4 CPU processes (reference backend and the Triton interpreter), the packed
candidate keys, and on a GPU the NCCL path captured in a CUDA graph.

Every rank builds the same cache and metadata from one seed and the queries of all heads,
keeps its own heads' slice, and checks its output against the single-process answer of its
own heads: ``reference.decode_indexer`` bit for bit (reference backend) or SPEC 9's
tie-aware rule against the exact scores (Triton). The cases hold padding requests, short
rows (L <= 15), a request whose pages all share one block (every score tied across ranks:
the smaller ids must win) and NaN pages. One spawn per group size runs every scenario, the
bad-use ones first (the group must stay usable after them); collectives time out.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton
import triton.language as tl

import nvfp4_indexer as ni
from nvfp4_indexer import reference as ref
from nvfp4_indexer.context_parallel import ContextParallelDecodeWrapper, exchange_bytes
from nvfp4_indexer.reference import candidates as rc
from nvfp4_indexer.triton.topk import pack_candidate

from nvfp4_indexer.conformance.fixtures import OUT_POISON

HAS_CUDA = torch.cuda.is_available()
COLLECTIVE_TIMEOUT_S = 60
SPAWN_TIMEOUT_S = 240
POISON = OUT_POISON

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy NaN (interpreter)
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]  # all_gather_into_tensor


# ------------------------------------------------------------------------------ test cases

def make_case(seed: int, world: int, heads: int, q_len: int, lens, *, tie_req=None,
              nan_pages=(), device="cpu"):
    """Cache, block table, seq_lens and all heads' queries ``[B*Q, world*heads, 128]``;
    ``tie_req``: a request whose history pages all map to one block (all scores equal);
    ``nan_pages``: (request, page) pairs whose 128 tokens have NaN scales."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    width = max([(s + 127) // 128 for s in lens] + [1]) + 1
    nb = b * width + 2
    cache = ni.new_index_cache(nb)
    pages = cache.as_strided((nb, 9216), (9216, 1))
    pages[:, :8192] = torch.randint(0, 256, (nb, 8192), generator=g, dtype=torch.uint8)
    pages[:, 8192:] = torch.randint(0x28, 0x49, (nb, 1024), generator=g, dtype=torch.uint8)
    bt = torch.randperm(nb, generator=g)[:b * width].view(b, width).to(torch.int32)
    if tie_req is not None:
        bt[tie_req] = bt[tie_req, 0]
    for r, j in nan_pages:
        pages[int(bt[r, j]), 8192:] = 0x7F  # E4M3 NaN scales: every token scores NaN
    sl = torch.tensor([max(s, q_len) if s else 0 for s in lens], dtype=torch.int32)
    q = ref.encode_e4m3(torch.randn((b * q_len, world * heads, 128), generator=g) * 3.0)
    return [x.to(device) for x in (cache, bt, sl, q)]


LENS_A = [2200, 0, 129, 2180, 2250, 1]   # long, padding, short, all-tied, NaN pages, tiny
LENS_B = [2310, 0, 700, 2181, 2300, 0]   # a later step: every request moved (in place)
NAN_PAGES = ((4, 1), (4, 2), (4, 8), (4, 11))   # request 4: 13 numeric of 17 -> 2 NaN picked


def expected(q_all, cache, bt, sl, q_len, rank, heads):
    own = q_all[:, rank * heads:(rank + 1) * heads].contiguous()
    return own, ref.decode_indexer(own, cache, bt, sl, q_len)


def check_tie_and_nan_rows(out, sl, q_len):
    """Rows of the designed requests: the all-tied request selects pages 0..14 (smaller ids
    first, although the ranks hold alternating pages); the NaN request puts its 13 numeric
    pages first and then the NaN pages 1, 2 (smallest ids), never 8 or 11."""
    for r, n in enumerate(sl.tolist()):
        rows = out[r * q_len:(r + 1) * q_len]
        lp = (n - 1) // 128 if n else -1
        if r == 3:
            assert lp >= 16
            assert (rows[..., :15] == torch.arange(15, device=out.device)).all()
            assert (rows[..., 15] == lp).all()
        if r == 4:
            assert lp >= 16
            assert (rows[..., 13:15] == torch.tensor([1, 2], device=out.device)).all()
            assert not torch.isin(rows[..., :15], torch.tensor([8, 11], device=out.device)).any()


def check_triton(out, own, cache, bt, sl, q_len, bits):
    from nvfp4_indexer.conformance import tie_aware_check
    qsl = ref.decode.decode_query_start_loc(bt.shape[0], q_len, own.device)
    exact, mag = ref.page_scores(own, cache, bt, sl, qsl, with_magnitude=True)
    _, pos = ref.scores.row_positions(sl, qsl)
    local = torch.where(pos >= 0, torch.div(pos, 128, rounding_mode="floor"), -1)
    res = tie_aware_check(out, exact, mag, local, bits)
    assert res.failed == 0, f"{res.failed} rows outside SPEC 9's tolerance"


# -------------------------------------------------------------------------------- scenarios

def _cfg(**knobs):
    """A ``DecodeConfig`` for the Triton runner (imported here, after conftest has set
    TRITON_INTERPRET)."""
    from nvfp4_indexer.triton.config import DecodeConfig
    return DecodeConfig(**knobs)


def _expect_raise(fn, exc, *words):
    try:
        fn()
    except exc as e:
        for w in words:
            assert w in str(e), f"{w!r} not in {e!r}"
        return
    raise AssertionError(f"expected {exc.__name__} with {words}")


def bad_use(rank, world, group, device):
    """Mismatched configurations raise on every rank (and return, so nothing hangs)."""
    cache, bt, sl, _ = make_case(1, world, 1, 1, [300, 0])

    def build(**kw):
        args = dict(num_heads=1, block_table_buffer=bt.clone().to(device),
                    seq_lens_buffer=sl.clone().to(device), query_len=1, backend="reference")
        args.update(kw)
        return ContextParallelDecodeWrapper(args.pop("num_heads"), group, **args)

    # Heads the group size does not divide: ranks hold different numbers of heads.
    _expect_raise(lambda: build(num_heads=1 + (rank == world - 1)), ValueError, "num_heads",
                  "group size must divide")
    # Different batch widths.
    wide = torch.zeros((2, bt.shape[1] + rank), dtype=torch.int32, device=device)
    _expect_raise(lambda: build(block_table_buffer=wide), ValueError, "width")
    # A configuration only one rank refuses: that rank names it, the others name the rank.
    if rank == 1:
        _expect_raise(lambda: build(exchange="bogus"), ValueError, "exchange")
    else:
        _expect_raise(build, ValueError, "rank 1", "exchange")
    # Different query lengths at the first plan of wrappers built without one.
    w = build(query_len=None)
    _expect_raise(lambda: w.plan(bt.to(device), sl.to(device), 1 + rank % 2), ValueError,
                  "query_len")
    assert w.query_len is None
    # Bad metadata on every rank: raises before any collective of the first plan matters.
    bad_sl = torch.tensor([300, -1], dtype=torch.int32, device=device)
    _expect_raise(lambda: w.plan(bt.to(device), bad_sl, 1), ValueError, "seq_lens")
    _expect_raise(lambda: w.run(torch.zeros((2, 1, 128), dtype=torch.float8_e4m3fn),
                                cache, torch.empty((2, 1, 16), dtype=torch.int32)),
                  RuntimeError, "before plan")


def decode_steps(rank, world, group, device, *, backend, exchange, heads, q_len, lazy,
                 runner_options=None, seed=3, num_steps=2):
    """Decode steps through one wrapper (the second after in-place metadata changes)."""
    steps = [make_case(seed, world, heads, q_len, LENS_A, tie_req=3, nan_pages=NAN_PAGES),
             make_case(seed + 1, world, heads, q_len, LENS_B, tie_req=3, nan_pages=NAN_PAGES)]
    b = len(LENS_A)
    width = max(s[1].shape[1] for s in steps)
    bt_buf = torch.full((b, width), 10**6, dtype=torch.int32, device=device)  # garbage tail
    sl_buf = torch.zeros((b,), dtype=torch.int32, device=device)
    w = ContextParallelDecodeWrapper(heads, group, block_table_buffer=bt_buf,
                                     seq_lens_buffer=sl_buf, backend=backend,
                                     exchange=exchange, query_len=None if lazy else q_len,
                                     runner_options=runner_options)
    for cache, bt, sl, q_all in steps[:num_steps]:
        cache, bt, sl, q_all = (x.to(device) for x in (cache, bt, sl, q_all))
        if lazy:  # metadata given as separate tensors: copied into the buffers
            w.plan(bt, sl, q_len, num_blocks=cache.shape[0])
        else:  # the caller's persistent buffers, updated in place
            bt_buf.fill_(10**6)
            bt_buf[:, :bt.shape[1]] = bt
            sl_buf.copy_(sl)
            w.plan(bt_buf, sl_buf, q_len)
        own, want = expected(q_all, cache, bt, sl, q_len, rank, heads)
        out = torch.full_like(want, POISON)
        w.run(own, cache, out)
        if backend == "reference":
            assert torch.equal(out, want), f"rank {rank}: differs from the single-process output"
        else:
            check_triton(out, own, cache, bt, sl, q_len, w.error_bits)
        check_tie_and_nan_rows(out, sl, q_len)
    return w


def engine_steps(rank, world, group, device):
    """The engine-facing Indexer with ``context_parallel_group`` (SPEC 8.1, 8.2): a mixed step
    (2 decodes + 1 prefill) and a decode-only step padded to a graph size; every rank's rows
    equal a single-process Indexer's for its own heads, rows past the step stay poisoned."""
    heads, nb = 2, 80
    g = torch.Generator().manual_seed(11)
    cache = ni.new_index_cache(nb)
    ni.write_index_k(cache, torch.randn(nb * 128, 128, generator=g),
                     torch.randperm(nb * 128, generator=g), backend="reference")
    cache = cache.to(device)
    bt = torch.randperm(nb, generator=g)[:3 * 26].view(3, 26).to(torch.int32)
    q_all = ni.encode_e4m3(torch.randn(40, world * heads, 128, generator=g))
    own = q_all[:, rank * heads:(rank + 1) * heads].contiguous().to(device)
    steps = [([2, 2, 9], [2500, 3000, 2900], 2), ([2, 2, 0], [3100, 40, 0], 3)]
    cfg = dict(num_heads=heads, max_model_len=3328, max_num_batched_tokens=64, max_num_seqs=3,
               max_decode_query_len=2, cudagraph_batch_sizes=(1, 2, 4), device=device)
    cp = ni.Indexer(ni.IndexerConfig(**cfg, context_parallel_group=group), backend="reference")
    alone = ni.Indexer(ni.IndexerConfig(**cfg), backend="reference")
    for q_lens, seqs, nd in steps:
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        sl = torch.tensor(seqs, dtype=torch.int32)
        step = ni.StepMetadata(qsl.to(device), qsl, sl.to(device), sl, bt.to(device), nd)
        got = torch.full((40, heads, 16), POISON, dtype=torch.int32, device=device)
        want = torch.full_like(got, POISON)
        cp.forward(own, cache, cp.plan(step), got)
        alone.forward(own, cache, alone.plan(step), want)
        assert torch.equal(got, want), f"rank {rank}: Indexer rows differ from one process"
        end = nd * 2 if nd == len(seqs) else int(qsl[-1])  # padding requests: Q rows each
        assert (got[end:] == POISON).all() and (got[:end] != POISON).all()
    assert cp.memory_bytes()["decoders"] > 0  # the context-parallel exchange buffers
    # a block id past the cache raises on every rank before any write (no one-sided hang)
    q_lens, seqs, nd = steps[1]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    sl = torch.tensor(seqs, dtype=torch.int32)
    bad = bt.clone()
    bad[0, 4] = 10 ** 6
    step = ni.StepMetadata(qsl.to(device), qsl, sl.to(device), sl, bad.to(device), nd)
    got = torch.full((40, heads, 16), POISON, dtype=torch.int32, device=device)
    _expect_raise(lambda: cp.forward(own, cache, cp.plan(step), got), ValueError, "block_table")
    assert (got == POISON).all()
    if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors need the interpreter
        return
    # the Triton decoder's row limit is refused at construction, on every rank
    _expect_raise(lambda: ni.Indexer(ni.IndexerConfig(**dict(cfg, num_heads=8, max_decode_query_len=
                  8), context_parallel_group=group), backend="triton"), NotImplementedError,
                  "context_parallel_group")


def _worker(rank, world, store_path, scenarios, device_kind):
    """One process: ``scenarios`` are (name, group, kwargs) run in order; group "world" is
    every process, "pair" the processes {2k, 2k+1} (only ranks 0 and 1 run those; the others
    wait at the next "world" scenario: subgroups of a larger job, as tensor parallelism
    inside a bigger world makes them)."""
    import time
    try:
        if device_kind == "cuda":
            torch.cuda.set_device(rank)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        pairs = [dist.new_group([k, k + 1]) for k in range(0, world - 1, 2)]
        device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
        for name, which, kw in scenarios:
            if which == "pair":
                if rank > 1:
                    continue
                group, size, grank = pairs[0], 2, rank
            else:
                group, size, grank = dist.group.WORLD, world, rank
            t0 = time.time()
            if name == "bad_use":
                bad_use(grank, size, group, device)
            elif name == "engine":
                engine_steps(grank, size, group, device)
            elif name == "graph":
                graph_steps(grank, size, group, device, **kw)
            else:
                decode_steps(grank, size, group, device, **kw)
            if os.environ.get("CP_TIMING"):
                print(f"rank {rank}: {name} on {size} {time.time() - t0:.1f}s", flush=True)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise


def spawn(world: int, tmp_path, scenarios, device_kind="cpu"):
    """Run ``scenarios`` on ``world`` processes; fail (killing them) past SPAWN_TIMEOUT_S."""
    ctx = mp.start_processes(_worker, args=(world, str(tmp_path / "store"), scenarios,
                                            device_kind),
                             nprocs=world, join=False, start_method="spawn")
    import time
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"context-parallel processes hung past {SPAWN_TIMEOUT_S} s")


REF_STEPS = dict(backend="reference", heads=2, q_len=2)
TRITON_STEPS = dict(backend="triton", heads=1, q_len=2)


def test_gloo_groups_of_2_and_4(tmp_path):
    """4 CPU processes (gloo): groups of 2 (a subgroup) and of all 4; bad use first, then
    decode steps on the reference and on the Triton interpreter, both exchanges, and the
    engine-facing Indexer with ``context_parallel_group`` (2 ranks). (On a CUDA
    machine there is no interpreter: the reference scenarios only; the GPU tests cover
    Triton.)"""
    scenarios = [
        ("bad_use", "pair", {}),
        ("steps", "pair", dict(REF_STEPS, exchange="all_gather", lazy=False)),
        ("steps", "pair", dict(REF_STEPS, exchange="all_to_all", lazy=True)),
        ("steps", "pair", dict(TRITON_STEPS, exchange="all_gather", lazy=True, num_steps=1,
                               runner_options={"config": _cfg(num_splits=2)})),
        ("engine", "pair", {}),
        ("bad_use", "world", {}),
        ("steps", "world", dict(REF_STEPS, heads=1, exchange="all_gather", lazy=True,
                                num_steps=1)),
        ("steps", "world", dict(TRITON_STEPS, q_len=1, exchange="all_to_all", lazy=False,
                                num_steps=1, runner_options={"config": _cfg(num_splits=1)})),
    ]
    if os.environ.get("TRITON_INTERPRET") != "1":
        scenarios = [sc for sc in scenarios if sc[2].get("backend") != "triton"]
    spawn(4, tmp_path, scenarios)


# ------------------------------------------------------------------- single-process pieces

def test_candidate_keys_order_spec5():
    """The packed keys sort exactly as SPEC 5: score descending, equal scores (-0.0 == +0.0)
    by smaller id, NaN (any sign / payload) below every number (-inf included), NaN pages by
    smaller id; ``EMPTY`` below all. Compared with a sort of the rule itself."""
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45,
                             3.4e38, -3.4e38, 1.0, -1.0, 1.0, 2.5], dtype=torch.float32)
    nans = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, -0x7FFFFFFF],
                        dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(200, generator=g) * 10.0 ** torch.randint(-5, 6, (200,), generator=g)
    scores = torch.cat([specials, nans, rnd.float(), rnd[:20].float()])  # exact duplicates too
    ids = torch.randperm(len(scores), generator=g)
    keys = rc.pack_candidates(scores, ids)
    assert torch.equal(rc.candidate_ids(keys), ids.to(torch.int32))
    assert (keys > rc.EMPTY).all()
    got = ids[torch.argsort(keys, descending=True)]
    # The rule: numbers by value descending then id ascending; then NaNs by id ascending.
    num = ~torch.isnan(scores)
    by_rule = sorted(range(len(scores)),
                     key=lambda i: (0, -float(scores[i]), int(ids[i])) if num[i]
                     else (1, 0.0, int(ids[i])))
    assert torch.equal(got, ids[torch.tensor(by_rule)])


@triton.jit
def _pack_kernel(s_ptr, i_ptr, o_ptr, N: tl.constexpr):
    k = tl.arange(0, N)
    tl.store(o_ptr + k, pack_candidate(tl.load(s_ptr + k), tl.load(i_ptr + k)))


def test_candidate_keys_match_triton_packing():
    """The reference keys equal the kernels' ``topk.pack_candidate`` bit for bit."""
    dev = "cuda" if HAS_CUDA else "cpu"
    bits = torch.tensor([0, -2**31, 0x7F800000, -0x00800000, 1, -2**31 + 1, 0x7FC00000,
                         -0x00400000, 0x3F800000, -0x40800000, 0x00000010, 0x7F7FFFFF,
                         0x7F800001, -0x7FFFFFFF, 0x40490FDB, -0x3FB6F025], dtype=torch.int32)
    scores = bits.view(torch.float32)
    ids = torch.tensor([0, 1, 5, 2**31 - 1, 7, 100, 3, 9, 4, 11, 12, 13, 14, 15, 16, 17],
                       dtype=torch.int32)
    out = torch.empty(16, dtype=torch.int64, device=dev)
    _pack_kernel[(1,)](scores.to(dev), ids.to(dev), out, N=16)
    assert torch.equal(out.cpu(), rc.pack_candidates(scores, ids))


def test_reference_split_equals_single_device():
    """Without processes: the union of every rank's subset candidates merges to
    ``select_pages`` of the full scores for W = 1..5, bit for bit."""
    for world in (1, 2, 3, 5):
        cache, bt, sl, q = make_case(7, world, 1, 2, LENS_A, tie_req=3, nan_pages=NAN_PAGES)
        want = ref.decode_indexer(q, cache, bt, sl, 2)
        cand = torch.cat([rc.subset_candidates(q, cache, bt, sl, 2, r, world)
                          for r in range(world)], dim=-1)
        assert torch.equal(rc.merge_candidates(cand, sl, 2), want), world


@pytest.mark.parametrize("world,options", [(2, {"config": _cfg(num_splits=3, window=2),
                                                 "rows_per_program": 1}),
                                           (3, {"config": _cfg(num_splits=2)})])
def test_triton_ranks_in_process(world, options):
    """The Triton runner of every rank in one process, the exchange done by hand: more
    split candidates than 16 per row (the reduce kernel's selection rounds), one row per
    program and the windowed page loop; SPEC 9 against the exact scores, ties by smaller id."""
    from nvfp4_indexer.triton.decode import ContextParallelRunner
    lens, q_len, heads = [0, 4500, 129, 2180], 1, 1
    cache, bt, sl, q = make_case(5, world, heads, q_len, lens, tie_req=3)
    dev = "cuda" if HAS_CUDA else "cpu"
    cache, bt, sl, q = (x.to(dev) for x in (cache, bt, sl, q))
    runners = [ContextParallelRunner(heads, world, r, len(lens), bt.shape[1], q_len, dev,
                                     **options) for r in range(world)]
    if world == 2:
        assert runners[0].num_splits * runners[0].keep > 16
    sends = []
    for r, run in enumerate(runners):
        sends.append(torch.full(run.send_shape(), 12345, dtype=torch.int64, device=dev))
        run.score(q, cache, bt, sl, sends[-1])
    for r, run in enumerate(runners):
        own_cand = torch.stack([s[r] for s in sends])  # what all_to_all delivers to rank r
        out = torch.full((len(lens) * q_len, heads, 16), POISON, dtype=torch.int32, device=dev)
        run.merge(own_cand, own_cand.stride(0), sl, out)
        own = q[:, r * heads:(r + 1) * heads].contiguous()
        check_triton(out, own, cache, bt, sl, q_len, run.error_bits)
        assert (out[3, :, :15] == torch.arange(15, device=dev)).all()  # every score tied


def test_exchange_bytes_match_buffers():
    """``exchange_bytes`` is what the wrapper's buffers move (one-process gloo group)."""
    assert exchange_bytes(8, 2, 4, 4)["cand_recv"] == 3 * 16 * 4 * 4 * 16 * 8
    assert exchange_bytes(8, 2, 4, 4, "all_to_all")["cand_recv"] == 3 * 16 * 4 * 16 * 8
    assert exchange_bytes(8, 2, 4, 1)["total_recv"] == 0
    with pytest.raises(ValueError, match="exchange"):
        exchange_bytes(1, 1, 1, 2, "bogus")
    with pytest.raises(ValueError, match="world"):
        exchange_bytes(1, 1, 1, 0)


def test_not_initialized_raises():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    bt = torch.zeros((1, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="group"):
        ContextParallelDecodeWrapper(1, None, block_table_buffer=bt,
                                     seq_lens_buffer=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_plan_aliasing_and_out_overlap_one_rank(tmp_path, backend):
    """A one-rank group in this process (gloo on the CPU, NCCL on a GPU): plan() given
    ``seq_lens_buffer[:1].expand(2)`` copies it (before: skipped, run() used the old second
    length), as does ``plan_from_host``; run() refuses an ``out`` over the seq lens buffer
    before any write (SPEC 10)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    device = torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else \
        torch.device("cpu")
    dist.init_process_group("nccl" if HAS_CUDA else "gloo",
                            init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        cache, bt, sl, q = (x.to(device) for x in make_case(9, 1, 2, 2, [2300, 2560]))
        bt_buf, sl_buf = bt.clone(), sl.clone()
        w = ContextParallelDecodeWrapper(2, None, block_table_buffer=bt_buf,
                                         seq_lens_buffer=sl_buf, query_len=2, backend=backend)
        w.plan(bt, sl, 2)
        w.plan(bt, sl_buf[:1].expand(2), 2)
        same = sl[:1].expand(2).contiguous()
        assert torch.equal(sl_buf, same)
        out = torch.full((4, 2, 16), POISON, dtype=torch.int32, device=device)
        w.run(q, cache, out)
        want = ref.decode_indexer(q.cpu(), cache.cpu(), bt.cpu(), same.cpu(), 2)
        if backend == "reference":
            assert torch.equal(out.cpu(), want)
        else:
            check_triton(out, q, cache, bt, same, 2, w.error_bits)
        sl_buf.copy_(sl)
        w.plan_from_host(bt, sl_buf[:1].expand(2), 2)
        assert torch.equal(sl_buf, same)
        over = torch.full((4, 2, 16), POISON, dtype=torch.int32, device=device)
        w2 = ContextParallelDecodeWrapper(2, None, block_table_buffer=bt.clone(),
                                          seq_lens_buffer=over.view(-1)[:2], query_len=2,
                                          backend=backend)
        w2.plan(bt, sl, 2)
        snap = over.clone()
        _expect_raise(lambda: w2.run(q, cache, over), ValueError, "out: expected memory that "
                      "overlaps no input", "seq_lens_buffer")
        assert torch.equal(over, snap)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------- GPU

def graph_steps(rank, world, group, device, *, heads=4, q_len=2, exchange="all_gather"):
    """Capture one decode step in a CUDA graph and replay it after in-place changes of the
    queries and metadata; each replay must give each rank's single-process answer (Triton
    tie-aware, and bit-exact against the single-process Triton kernel when W == 1)."""
    steps = [make_case(11, world, heads, q_len, LENS_A, tie_req=3, nan_pages=NAN_PAGES),
             make_case(12, world, heads, q_len, LENS_B, tie_req=3, nan_pages=NAN_PAGES)]
    b = len(LENS_A)
    width = max(s[1].shape[1] for s in steps)
    bt_buf = torch.zeros((b, width), dtype=torch.int32, device=device)
    sl_buf = torch.zeros((b,), dtype=torch.int32, device=device)
    q_buf = torch.zeros((b * q_len, heads, 128), dtype=torch.float8_e4m3fn, device=device)
    out = torch.full((b * q_len, heads, 16), POISON, dtype=torch.int32, device=device)
    # one cache holding both steps' pages: the first case's pool, the second's copied in
    cache = torch.cat([steps[0][0].as_strided((steps[0][0].shape[0], 9216), (9216, 1)),
                       steps[1][0].as_strided((steps[1][0].shape[0], 9216), (9216, 1))])
    n0 = steps[0][0].shape[0]
    cache = cache.to(device).as_strided((cache.shape[0], 128, 72), (9216, 72, 1))
    w = ContextParallelDecodeWrapper(heads, group, block_table_buffer=bt_buf,
                                     seq_lens_buffer=sl_buf, backend="triton",
                                     exchange=exchange, query_len=q_len)
    graph = None
    for k, (_, bt, sl, q_all) in enumerate(steps):
        bt = (bt + (n0 if k else 0)).to(device)
        sl, q_all = sl.to(device), q_all.to(device)
        bt_buf.zero_()
        bt_buf[:, :bt.shape[1]] = bt
        sl_buf.copy_(sl)
        own, _ = expected(q_all.cpu(), cache.cpu(), bt_buf.cpu(), sl.cpu(), q_len, rank, heads)
        q_buf.copy_(own.to(device))
        w.plan(bt_buf, sl_buf, q_len, num_blocks=cache.shape[0])
        out.fill_(POISON)
        if graph is None:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                w.run(q_buf, cache, out)  # warm-up outside capture
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            out.fill_(POISON)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(q_buf, cache, out)
        graph.replay()
        torch.cuda.synchronize()
        check_triton(out, q_buf, cache, bt_buf, sl_buf, q_len, w.error_bits)
        check_tie_and_nan_rows(out, sl_buf, q_len)
        single = ni.decode_indexer(q_buf, cache, bt_buf, sl_buf, q_len, backend="triton")
        same = int((out == single).all(-1).sum())
        print(f"rank {rank}/{world}: replay {k}: {same}/{out.shape[0] * heads} rows equal the "
              f"single-process Triton output", flush=True)
        if world == 1:
            assert torch.equal(out, single)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_gpu_single_rank_nccl_cuda_graph(tmp_path, exchange):
    """One-rank NCCL group in this process: the collectives and kernels captured in a CUDA
    graph, replayed after in-place changes; bit-exact with the single-device kernel."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        graph_steps(0, 1, dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()),
                    exchange=exchange)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_gpu_multi_rank_nccl_cuda_graph(tmp_path, exchange):
    """2 (or 4 when present) GPUs, NCCL: captured decode steps on every rank (SPEC 9)."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    spawn(world, tmp_path, [("bad_use", "world", {}),
                            ("graph", "pair", dict(exchange=exchange)),
                            ("graph", "world", dict(exchange=exchange))], device_kind="cuda")


def test_cp_model_prints_tables(capsys):
    """benchmarks.cp_model (docs/context-parallel.md) runs on the recorded H200 results and its
    exchange column is ``exchange_bytes``; bad flags are usage errors."""
    from benchmarks import cp_model
    assert cp_model.main(["--worlds", "2,4"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| b32_s100000_q8_h4 |"))
    recv_kb = float(row.split("|")[5])
    assert recv_kb == round(exchange_bytes(32, 8, 4, 2)["total_recv"] / 1e3)
    assert "W=4" in text and "n/a" in text  # Q*W*H_r = 128 rows: past the kernel's tile
    with pytest.raises(SystemExit):
        cp_model.main(["--worlds", "1"])
