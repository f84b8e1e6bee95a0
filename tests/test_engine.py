"""The engine-facing indexer (SPEC 8.1): config validation, planning from host copies, forward
row for row against decode_indexer / prefill_indexer, untouched rows, from_vllm, memory."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import nvfp4_indexer as ni
from nvfp4_indexer.engine import PrefillChunk, plan_prefill_chunks

from nvfp4_indexer.conformance.fixtures import OUT_POISON as POISON

H = 2


def _config(**kw):
    args = dict(num_heads=H, max_model_len=3072, max_num_batched_tokens=512, max_num_seqs=6,
                max_decode_query_len=4, cudagraph_batch_sizes=(1, 2, 4, 8))
    args.update(kw)
    return ni.IndexerConfig(**args)


@pytest.fixture(scope="module")
def cache():
    nb = 96
    gen = torch.Generator().manual_seed(3)
    c = ni.new_index_cache(nb, page_stride=9216 + 16)
    ni.write_index_k(c, torch.randn(nb * 128, 128, generator=gen),
                     torch.randperm(nb * 128, generator=gen), backend="reference")
    return c


def _step(q_lens, seqs, nd, width=26, nb=96, seed=0, upper=None):
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    sl = torch.tensor(seqs, dtype=torch.int32)
    bt = torch.randint(0, nb, (len(seqs), width), dtype=torch.int32, generator=gen)
    sl_cpu = sl.clone() if upper is None else torch.tensor(upper, dtype=torch.int32)
    return ni.StepMetadata(qsl.clone(), qsl, sl, sl_cpu, bt, nd)


def _queries(rows, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return ni.encode_e4m3(torch.randn(rows, H, 128, generator=gen))


def _forward_poisoned(ix, cache, md, rows, extra, seed=1):
    """``ix.forward`` of ``rows + extra`` random query rows into an output poisoned everywhere:
    ``(q, out)`` (the step's rows are the first ``rows``; the rest must stay poisoned)."""
    q = _queries(rows + extra, seed=seed)
    out = torch.full((rows + extra, H, 16), POISON, dtype=torch.int32)
    assert ix.forward(q, cache, md, out) is out
    return q, out


def _expected(q, cache, step, nd, qlen):
    """decode_indexer on the decode rows, prefill_indexer on the rest (public API)."""
    sl, bt, qsl = step.seq_lens, step.block_table, step.query_start_loc_cpu
    parts = []
    if nd:
        parts.append(ni.decode_indexer(q[:nd * qlen], cache, bt[:nd], sl[:nd], qlen,
                                       backend="reference"))
    if nd < len(sl):
        p0, p1 = int(qsl[nd]), int(qsl[-1])
        parts.append(ni.prefill_indexer(q[p0:p1], cache, bt[nd:], qsl[nd:] - qsl[nd], sl[nd:],
                                        backend="reference"))
    return torch.cat(parts)


# ---------------------------------------------------------------------------------- config

def test_names_exported():
    for name in ("IndexerConfig", "Indexer", "StepMetadata", "IndexerMetadata"):
        assert name in ni.__all__ and hasattr(ni, name)


@pytest.mark.parametrize("kw,exc,words", [
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(num_heads=True), ValueError, "num_heads"),
    (dict(max_model_len=-1), ValueError, "max_model_len"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens"),
    (dict(max_num_seqs=1.5), ValueError, "max_num_seqs"),
    (dict(max_decode_query_len=0), ValueError, "max_decode_query_len"),
    (dict(max_decode_query_len=9), NotImplementedError, "1..8"),
    (dict(num_heads=17, max_decode_query_len=4), NotImplementedError, "1..16"),
    (dict(cudagraph_batch_sizes=(1, 0)), ValueError, "cudagraph_batch_sizes"),
    (dict(cudagraph_batch_sizes=3), ValueError, "cudagraph_batch_sizes"),
    (dict(topk=8), NotImplementedError, "16"),
    (dict(block_size=64), NotImplementedError, "128"),
    (dict(init_blocks=1), NotImplementedError, "(16, 0, 1, 128, 128, 'max')"),
    (dict(max_model_len=2 ** 31), ValueError, "max_model_len"),
    (dict(max_num_batched_tokens=2 ** 31), ValueError, "int32"),
    (dict(allow_fp8_mma=1), ValueError, "allow_fp8_mma"),
])
def test_config_validation(kw, exc, words):
    with pytest.raises(exc, match=None) as e:
        _config(**kw)
    assert words in str(e.value)


def test_config_normalizes_and_derives():
    c = _config(cudagraph_batch_sizes=[8, 2, np.int64(4), 2], max_num_seqs=3)
    assert c.cudagraph_batch_sizes == (2, 4, 8)
    assert c.max_decode_reqs == 8 and c.max_pages == 24
    assert c.gather_pages == ni.max_gather_pages(3072, 512)
    assert c.padded_batch_size(3) == 4 and c.padded_batch_size(9) == 9
    assert c.device == torch.device("cpu")
    with pytest.raises(dataclasses_frozen_error()):
        c.num_heads = 4


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_context_parallel_group_needs_torch_distributed():
    """A context-parallel Indexer (SPEC 8.2) builds its decoders over torch.distributed: without
    an initialized process group the first decode batch size is refused, naming the group
    (the multi-process runs are in test_context_parallel.py)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a group object, no default group
    ix = ni.Indexer(_config(context_parallel_group=group), backend="reference")
    with pytest.raises(ValueError, match="group"):
        ix.decoder(1, 1)


@pytest.mark.parametrize("group", ["not-a-group", object(), 0, torch.zeros(1)])
def test_config_refuses_a_context_parallel_group_that_is_not_a_process_group(group):
    """SPEC 8.1, 10: the group is validated at construction, by name (before: accepted, and
    plan raised AttributeError: 'str' object has no attribute 'size')."""
    with pytest.raises(TypeError, match="context_parallel_group: expected None or a "
                       "torch.distributed.ProcessGroup"):
        _config(context_parallel_group=group)


def test_memory_report():
    c = _config()
    ix = ni.Indexer(c, backend="reference")
    m = ix.memory_bytes()
    assert m["workspace"] == c.gather_pages * 128 * 128
    assert m["decode_buffers"] == c.max_decode_reqs * (c.max_pages + 1) * 4
    assert m["total_device"] == m["workspace"] + m["score_scratch"] + m["decode_buffers"] + \
        m["staging_device"]
    big = ni.Indexer(_config(max_model_len=6144), backend="reference").memory_bytes()
    assert big["workspace"] == 2 * m["workspace"]


def test_memory_report_triton_scratch_covers_every_decode_runner():
    from nvfp4_indexer.triton.decode import score_buffer_size
    c = _config()
    ix = ni.Indexer(c, backend="triton")
    need = max(score_buffer_size(b, c.max_pages, H, q) for b in range(1, 9) for q in range(1, 5))
    assert ix.score_buffer.numel() >= need
    assert ix.memory_bytes()["score_scratch"] == ix.score_buffer.numel() * 4


# ------------------------------------------------------------------------------- chunking

def test_plan_prefill_chunks_fits_budget():
    seqs = [2500, 100, 3000, 1, 2200, 129]
    qsl = [10, 14, 20, 30, 31, 40, 45]
    chunks = plan_prefill_chunks(qsl, seqs, 30)
    hist = [(s - 1) // 128 for s in seqs]
    assert [c.req_start for c in chunks][0] == 0 and chunks[-1].req_end == len(seqs)
    for a, b in zip(chunks, chunks[1:]):
        assert a.req_end == b.req_start and a.row_end == b.row_start
    for c in chunks:
        assert sum(hist[c.req_start:c.req_end]) <= 30
        assert c.page_offsets[-1] == c.total_pages == sum(c.gather_pages)
        assert all(g in (0, h) for g, h in zip(c.gather_pages, hist[c.req_start:c.req_end]))
    assert chunks[0].row_start == 0 and chunks[-1].row_end == 35
    full = plan_prefill_chunks(qsl, seqs, 30, skip_short=False)
    assert [c.gather_pages for c in full] == [hist[c.req_start:c.req_end] for c in full]
    assert isinstance(full[0], PrefillChunk)
    with pytest.raises(ValueError, match="max_gather_pages"):
        plan_prefill_chunks(qsl, seqs, 20)


# ---------------------------------------------------------------------------- forward

MIXED = ([2, 2, 2, 100, 37, 300], [2500, 300, 2950, 2100, 37, 2600], 3)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_equals_public_ops(cache, backend):
    """Mixed step (decode Q=2 + prefill requests in two chunks), then a padded decode-only
    step of another Q; rows past the step stay poisoned. (Triton: smaller, interpreter.)"""
    if backend == "triton":
        ix = ni.Indexer(_config(max_model_len=2560), backend=backend)  # budget 20 pages
        q_lens, seqs, nd = [2, 2, 60, 100], [2300, 300, 2200, 2500], 2  # prefill needs 36
        dq, ds = [3, 3, 3, 0], [2200, 3, 2400, 0]
    else:
        ix = ni.Indexer(_config(), backend=backend)  # budget 24 pages: prefill needs 36
        (q_lens, seqs, nd), dq, ds = MIXED, [3, 3, 3, 0], [2200, 3, 2900, 0]
    step = _step(q_lens, seqs, nd)
    md = ix.plan(step)
    assert len(md.prefill_chunks) == 2 and md.num_decode_rows == 2 * nd and not md.decode_only
    rows = sum(q_lens)
    q, out = _forward_poisoned(ix, cache, md, rows, 4)
    assert torch.equal(out[:rows], _expected(q, cache, step, nd, 2))
    assert bool((out[rows:] == POISON).all())
    # decode-only, 3 requests padded to 4 (zero-length, seq len 0, garbage block table row)
    step = _step(dq, ds, 4, seed=5)
    step.block_table[3] = -5
    md = ix.plan(step)
    assert md.decode_only and md.num_rows == 12 and md.decoder is ix.decoders[(4, 3)]
    out.fill_(POISON)
    ix.forward(q, cache, md, out)
    assert torch.equal(out[:12], _expected(q, cache, step, 4, 3))
    assert out[9:12, :, 0].eq(0).all() and out[9:12, :, 1:].eq(-1).all()  # padding rows
    assert bool((out[12:] == POISON).all())


def test_forward_host_upper_bound_and_stale_metadata(cache):
    ix = ni.Indexer(_config(), backend="reference")
    q_lens, seqs, nd = MIXED
    upper = [s + 2 for s in seqs[:nd]] + [min(s + 3, 3072) for s in seqs[nd:]]
    step = _step(q_lens, seqs, nd, upper=upper)
    md = ix.plan(step)
    rows = sum(q_lens)
    q = _queries(rows)
    out = torch.full((rows, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, md, out)
    assert torch.equal(out, _expected(q, cache, step, nd, 2))
    ix.plan(step)
    with pytest.raises(RuntimeError, match="latest plan"):
        ix.forward(q, cache, md, out)


# Triton (interpreter): decode Q=2 + prefill requests in a one-request chunk (18 pages) and a
# two-request chunk (16 pages + one of short rows only); budget 20 pages.
CLAMP = ([2, 20, 10, 30], [2500, 2400, 2100, 300], 1)


def test_triton_device_seq_lens_below_host_copies(cache):
    """seq_lens_cpu an upper bound (SPEC 8.1): the device seq lens are the truth, rows equal
    the public ops on them (one request's host copy crosses a page boundary, one's makes
    short-only rows look long), rows past the step stay poisoned."""
    ix = ni.Indexer(_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    q_lens, upper, nd = CLAMP
    seqs = [2500, 2250, 1990, 300]  # history pages 18 | 17 (host 18), 15 (host 16), 2
    step = _step(q_lens, seqs, nd, seed=21, upper=upper)
    md = ix.plan(step)
    assert [(c.req_start, c.req_end) for c in md.prefill_chunks] == [(0, 1), (1, 3)]
    assert md.prefill_chunks[1].total_pages == 16  # sized by the host copies
    rows = sum(q_lens)
    q, out = _forward_poisoned(ix, cache, md, rows, 3, seed=22)
    assert torch.equal(out[:rows], _expected(q, cache, step, nd, 2))
    assert bool((out[rows:] == POISON).all())


def test_triton_device_seq_lens_edited_after_plan_are_clamped(cache):
    """Device seq lens raised after plan (past the planned pages, past a short-only request's
    history, INT32_MAX): the kernels clamp each to its host copy; rows equal the public ops on
    the host values, nothing outside the step's rows is written."""
    ix = ni.Indexer(_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    q_lens, seqs, nd = CLAMP
    step = _step(q_lens, seqs, nd, seed=23)
    want_step = _step(q_lens, seqs, nd, seed=23)  # same block table, device = host values
    md = ix.plan(step)
    step.seq_lens[nd:] = torch.tensor([2540, 2**31 - 1, 300 + 5 * 128], dtype=torch.int32)
    rows = sum(q_lens)
    q, out = _forward_poisoned(ix, cache, md, rows, 3, seed=24)
    assert torch.equal(out[:rows], _expected(q, cache, want_step, nd, 2))
    assert bool((out[rows:] == POISON).all())


@pytest.fixture
def gluon_twin(monkeypatch):
    """The Gluon prefill branch on the CPU: its probe says yes and the Gluon kernel is its
    Triton twin under the Gluon contract (``kernel_cases.gluon_twin_kernel``); plans are
    rebuilt. Construct the Indexer inside (it resolves the branch once)."""
    from kernel_harness import gluon_twin_in_place
    launch = gluon_twin_in_place(monkeypatch)
    yield launch
    launch.plan_prefill_chunk.cache_clear()


# a step whose first prefill request (40 tokens x 2 heads: BLOCK_M 128, 18 history pages)
# is a chunk of its own on the Gluon kernel (2 splits of 9 pages), the other two a chunk of
# BLOCK_M 64 on the Triton kernel
GLUON_STEP = ([2, 40, 10, 30], [2500, 2400, 2100, 300], 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plumbing check")
@pytest.mark.parametrize("later", [False, True])
def test_triton_gluon_prefill_branch_plumbing(cache, gluon_twin, later):
    """The Indexer's Gluon prefill branch (``plan_prefill_chunk``'s ``kernel``) on the CPU,
    with the Triton twin in the Gluon kernel's place: the 18-page chunk of BLOCK_M 128 takes
    it (2 splits of 9 pages), with the real kernel's constexprs and runtime arity, the other
    chunk the Triton kernel; rows equal the public ops, the rest stays poisoned. ``later``:
    the two chunks swapped, so the Gluon chunk is the second one (request base 1, the step's
    block table sliced)."""
    from nvfp4_indexer.triton.prefill import prefill_wgmma as pw
    ix = ni.Indexer(_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    assert ix._settings.wgmma
    q_lens, seqs, nd = GLUON_STEP
    if later:  # the 16-page requests first: the 18-page (Gluon) chunk is the second
        q_lens, seqs = [q_lens[0], q_lens[2], q_lens[3], q_lens[1]], \
            [seqs[0], seqs[2], seqs[3], seqs[1]]
    step = _step(q_lens, seqs, nd, seed=25)
    md = ix.plan(step)
    kinds = []
    for ch in md.prefill_chunks:
        plan = ch.launch["plan"]
        kinds.append((plan.shape["kernel"], plan.score_grid[1]))
        if plan.shape["kernel"] == "wgmma":
            assert plan.shape["win"] == 1 and plan.block_m == 128
            opts = {k: v for k, v in plan.score.kwargs.items()
                    if k not in ("H", "BLOCK_M", "NUM_SPLITS")}
            assert opts == pw.launch_options()
            assert plan.score.num_runtime == 3 + len(ch.launch["score_args"]) + 2
    assert kinds == ([("triton", 4), ("wgmma", 2)] if later
                     else [("wgmma", 2), ("triton", 4)]), kinds
    rows = sum(q_lens)
    q, out = _forward_poisoned(ix, cache, md, rows, 3, seed=26)
    assert torch.equal(out[:rows], _expected(q, cache, step, nd, 2))
    assert bool((out[rows:] == POISON).all())


def _work_ops(fn) -> list:
    """Names of the aten ops that do work (views left out) ``fn()`` issues, in call order."""
    from torch.utils._python_dispatch import TorchDispatchMode
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))
    with Record():
        fn()
    return [f.overloadpacket.__name__ for f in calls if not f.is_view]


def test_plan_device_ops_are_the_copies():
    """A Triton plan issues no torch op that does work (views left out) but the prefill
    staging copy and, in a decode-only step, the decode wrapper's multi-tensor copy: the
    prefill seq-len clamp is in the kernels, and a mixed step's decode rows read the step's
    tensors in place. (CPU:
    the staging copy is forced; no kernel runs.)"""
    ix = ni.Indexer(_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    for st in ix._staging:
        st.copies = True  # as on a GPU (on the CPU the device buffer is the host one)
    cases = [
        (_step([3, 3, 5, 30, 40, 20, 3], [2300, 900, 700, 2000, 2200, 300, 2400], 2),
         ["copy_"]),  # decode (read in place) + three prefill chunks
        (_step([20, 10, 30], [2400, 2100, 300], 0), ["copy_"]),  # prefill only
        (_step([2, 2, 0, 0], [300, 2500, 0, 0], 4), ["_foreach_copy_"]),  # decode only
    ]
    for step, want in cases:
        ix.plan(step)  # first use of a decode batch builds its wrapper
        for _ in range(2):  # both staging slots
            assert sorted(_work_ops(lambda: ix.plan(step))) == want


def test_decoder_reused_and_buffers_never_move(cache):
    ix = ni.Indexer(_config(), backend="reference")
    s1 = _step([1, 1], [300, 2500], 2)
    md1 = ix.plan(s1)
    ptr = md1.decoder.block_table.data_ptr()
    md2 = ix.plan(_step([1, 1], [301, 2501], 2, seed=9))
    assert md2.decoder is md1.decoder and md2.decoder.block_table.data_ptr() == ptr
    assert md2.decoder.block_table.data_ptr() == ix.decode_block_table.data_ptr()


# -------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("mutate,exc,words", [
    (lambda s: setattr(s, "num_decodes", 7), ValueError, "num_decodes"),
    (lambda s: s.query_start_loc_cpu.__setitem__(2, 3), ValueError, "query_start_loc_cpu"),
    (lambda s: s.query_start_loc_cpu.__setitem__(slice(1, None), s.query_start_loc_cpu[1:] + 5),
     ValueError, "query_start_loc_cpu"),
    (lambda s: s.seq_lens_cpu.__setitem__(1, 1), ValueError, "seq_lens_cpu"),
    (lambda s: s.seq_lens_cpu.__setitem__(4, 4000), ValueError, "seq_lens_cpu"),
    (lambda s: s.seq_lens_cpu.__setitem__(4, 36), ValueError, "q_len <= seq_len"),
    (lambda s: setattr(s, "seq_lens", s.seq_lens.long()), ValueError, "seq_lens"),
    (lambda s: setattr(s, "block_table", s.block_table[:, :2]), ValueError, "seq_lens_cpu"),
    (lambda s: setattr(s, "query_start_loc_cpu", s.query_start_loc_cpu[:-1]), ValueError,
     "query_start_loc_cpu"),
    (lambda s: setattr(s, "seq_lens_cpu", [1, 2]), TypeError, "seq_lens_cpu"),
])
def test_bad_step_raises_before_writing(cache, mutate, exc, words):
    ix = ni.Indexer(_config(), backend="reference")
    good = ix.plan(_step([1, 1, 1], [300, 2500, 130], 3, seed=2))
    bt_before = ix.decode_block_table.clone()
    sl_before = ix.decode_seq_lens.clone()
    q_lens, seqs, nd = MIXED
    step = _step(q_lens, seqs, nd, seed=4)
    mutate(step)
    with pytest.raises(exc) as e:
        ix.plan(step)
    assert words in str(e.value)
    assert torch.equal(ix.decode_block_table, bt_before)
    assert torch.equal(ix.decode_seq_lens, sl_before)
    out = torch.full((3, H, 16), POISON, dtype=torch.int32)
    ix.forward(_queries(3), cache, good, out)  # the last good plan still stands
    assert not bool((out == POISON).any())


@pytest.mark.parametrize("q_lens,seqs,nd,words", [
    ([2, 3], [100, 100], 2, "one query length"),
    ([2, 0, 2], [100, 0, 100], 3, "padding"),
    ([0, 0], [0, 0], 2, "at least one decode request"),
    ([5, 5], [100, 100], 2, "1..4"),
    ([2, 0, 10], [100, 0, 100], 2, "no zero-length"),
    ([2, 0], [100, 7], 2, "0 for zero-length"),
])
def test_bad_decode_batches(q_lens, seqs, nd, words):
    ix = ni.Indexer(_config(), backend="reference")
    with pytest.raises(ValueError) as e:
        ix.plan(_step(q_lens, seqs, nd))
    assert words in str(e.value)
    assert not ix.decoders


def test_forward_bad_shapes(cache):
    ix = ni.Indexer(_config(), backend="reference")
    md = ix.plan(_step([2, 2], [300, 2500], 2))
    out = torch.full((4, H, 16), POISON, dtype=torch.int32)
    with pytest.raises(ValueError, match="index_q"):
        ix.forward(_queries(3), cache, md, out)
    with pytest.raises(ValueError, match="out"):
        ix.forward(_queries(4), cache, md, out[:3])
    with pytest.raises(ValueError, match="index_q"):
        ix.forward(ni.encode_e4m3(torch.randn(4, 3, 128)), cache, md, out)
    assert bool((out == POISON).all())


def test_forward_refuses_bad_caches_and_metadata_before_writing(cache):
    """Review findings (SPEC 10): an empty cache is refused by name on both backends; on the
    reference backend a prefill block id outside the cache raises before the decode rows are
    written; the plan's metadata cannot be edited (it sizes what forward writes)."""
    import dataclasses
    for backend in ("reference", "triton"):
        ix = ni.Indexer(_config(), backend=backend)
        md = ix.plan(_step([2, 2, 9], [300, 2500, 2900], 2))
        out = torch.full((13, H, 16), POISON, dtype=torch.int32)
        with pytest.raises(ValueError, match="cache"):
            ix.forward(_queries(13), ni.new_index_cache(0), md, out)
        assert bool((out == POISON).all())
        with pytest.raises(dataclasses.FrozenInstanceError):
            md.num_rows = 4
    ix = ni.Indexer(_config(), backend="reference")
    step = _step([2, 2, 9], [300, 2500, 2900], 2)
    step.block_table[2, 5] = 10 ** 6  # a prefill page past the cache
    md = ix.plan(step)
    out = torch.full((13, H, 16), POISON, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        ix.forward(_queries(13), cache, md, out)
    assert bool((out == POISON).all())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA devices")
def test_config_cuda_device_without_cuda_names_the_device():
    with pytest.raises(ValueError, match="device"):
        _config(device="cuda")


# ------------------------------------------------------------------------------ vLLM

def test_from_vllm_reads_fields_by_name(cache):
    q_lens, seqs, nd = MIXED
    s = _step(q_lens, seqs, nd)
    upper = s.seq_lens_cpu + 1
    cam = types.SimpleNamespace(query_start_loc=s.query_start_loc,
                                query_start_loc_cpu=s.query_start_loc_cpu, seq_lens=s.seq_lens,
                                seq_lens_cpu_upper_bound=upper, seq_lens_cpu=s.seq_lens_cpu,
                                block_table_tensor=s.block_table, num_reqs=len(seqs))
    st = ni.StepMetadata.from_vllm(cam, nd)
    assert st.seq_lens_cpu is upper and st.block_table is s.block_table and st.num_decodes == nd
    cam.seq_lens_cpu_upper_bound = None
    assert ni.StepMetadata.from_vllm(cam, nd).seq_lens_cpu is s.seq_lens_cpu
    ix = ni.Indexer(_config(), backend="reference")
    md = ix.plan(ni.StepMetadata.from_vllm(cam, nd))
    q = _queries(sum(q_lens))
    out = ix.forward(q, cache, md, torch.empty((sum(q_lens), H, 16), dtype=torch.int32))
    assert torch.equal(out, _expected(q, cache, s, nd, 2))
    del cam.block_table_tensor
    with pytest.raises(AttributeError, match="block_table_tensor"):
        ni.StepMetadata.from_vllm(cam, nd)
    del cam.seq_lens, cam.seq_lens_cpu
    with pytest.raises(AttributeError) as e:  # every missing field is named
        ni.StepMetadata.from_vllm(cam, nd)
    assert all(w in str(e.value) for w in ("block_table_tensor", "'seq_lens'", "seq_lens_cpu"))


# ------------------------------------------------------------------------------- GPU

def _gpu_cache(nb, gen=None):
    """A CUDA cache of ``nb`` blocks: random keys (``gen``: a CUDA generator) in a random slot
    order."""
    dev = torch.device("cuda")
    c = ni.new_index_cache(nb, device=dev)
    ni.write_index_k(c, torch.randn(nb * 128, 128, device=dev, generator=gen),
                     torch.randperm(nb * 128, device=dev, generator=gen))
    return c


def _to_cuda(s, pin=False):
    """``s`` with its device tensors on the GPU; its host tensors pinned when ``pin``."""
    dev = torch.device("cuda")
    host = (lambda t: t.pin_memory()) if pin else (lambda t: t)
    return ni.StepMetadata(s.query_start_loc.to(dev), host(s.query_start_loc_cpu),
                           s.seq_lens.to(dev), host(s.seq_lens_cpu), s.block_table.to(dev),
                           s.num_decodes)


@pytest.mark.gpu
def test_staging_reused_while_the_stream_is_busy():
    """The pageable prefill staging buffer may be rewritten as soon as its copy is enqueued:
    with the stream held by a sleeping kernel, plan / forward of step A, then B, then A'
    (A's staging slot rewritten with other metadata before A's copy has run) give every
    step its own rows (a copy that read the host buffer late would give A the rows of A')."""
    dev = torch.device("cuda")
    nb = 96
    c = _gpu_cache(nb)
    ix = ni.Indexer(_config(device=dev, max_num_seqs=8))
    cpu = [_step([2, 2, 30, 9], [300, 2500, 2400, 900], 2, seed=51),
           _step([2, 2, 12, 40, 5], [2900, 700, 3000, 2100, 2600], 2, seed=52),
           _step([2, 2, 44], [1900, 2200, 2700], 2, seed=53)]
    steps = [_to_cuda(s) for s in cpu]
    for s in steps:  # first uses (compiles) outside the timed part
        ix.forward(_queries(int(s.query_start_loc_cpu[-1])).to(dev), c, ix.plan(s),
                   torch.empty((int(s.query_start_loc_cpu[-1]), H, 16), dtype=torch.int32,
                               device=dev))
    torch.cuda.synchronize()
    qs = [_queries(int(s.query_start_loc_cpu[-1]), seed=60 + i).to(dev)
          for i, s in enumerate(steps)]
    outs = [torch.full((q.shape[0], H, 16), POISON, dtype=torch.int32, device=dev) for q in qs]
    torch.cuda._sleep(200_000_000)  # ~0.1 s: every copy below runs after the plans
    for s, q, o in zip(steps, qs, outs):
        ix.forward(q, c, ix.plan(s), o)
    assert not torch.cuda.current_stream().query()  # the plans ran while the stream was busy
    for s, q, o in zip(cpu, qs, outs):
        assert torch.equal(o.cpu(), _expected(q.cpu(), c.cpu(), s, 2, 2))


@pytest.mark.gpu
def test_plan_never_syncs_and_decode_graph_replays():
    dev = torch.device("cuda")
    nb = 96
    c = _gpu_cache(nb)
    ix = ni.Indexer(_config(device=dev))
    q_lens, seqs, nd = MIXED
    mixed = _to_cuda(_step(q_lens, seqs, nd), pin=True)
    dec = _to_cuda(_step([3, 3, 3, 0], [2200, 3, 2900, 0], 4, seed=5), pin=True)
    ix.decoder(3, 2)  # first use compiles (one sync): outside the debug mode
    ix.decoder(4, 3)
    q = _queries(sum(q_lens)).to(dev)
    out = torch.full((sum(q_lens) + 4, H, 16), POISON, dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = ix.plan(mixed)
        md2 = None
        for _ in range(3):
            md2 = ix.plan(dec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    md = ix.plan(mixed)
    ix.forward(q, c, md, out)
    cpu_step = _step(q_lens, seqs, nd)
    cache_cpu = c.cpu()  # a contiguous copy has the default page stride
    want = _expected(q.cpu(), cache_cpu, cpu_step, nd, 2)
    torch.cuda.synchronize()
    ok = _tie_free_equal(out[:sum(q_lens)].cpu(), want)
    assert ok, "mixed step differs from the reference beyond ties"
    md2 = ix.plan(dec)
    ix.forward(q, c, md2, out)  # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ix.forward(q, c, md2, out)
    dstep = _step([3, 3, 3, 0], [2300, 4, 2700, 0], 4, seed=8)
    ix.plan(_to_cuda(dstep, pin=True))
    out.fill_(POISON)
    g.replay()
    torch.cuda.synchronize()
    assert _tie_free_equal(out[:12].cpu(), _expected(q.cpu(), cache_cpu, dstep, 4, 3))
    assert bool((out[12:] == POISON).all())


@pytest.mark.gpu
def test_decode_steps_replay_their_copies():
    """Decode-only steps of one (B, Q) with the engine's tensors kept at fixed addresses and
    rewritten in place every step: captured at the second plan, a graph replay from the third; plans
    never sync; each step's rows equal the reference, rows past the step stay poisoned; other
    tensors (another key) and a narrower block table copy correctly too."""
    dev = torch.device("cuda")
    nb = 96
    c = _gpu_cache(nb)
    cache_cpu = c.cpu()
    ix = ni.Indexer(_config(device=dev))
    q_lens, nd, width = [2, 2, 2, 0], 4, 26
    qsl = torch.tensor([0, 2, 4, 6, 6], dtype=torch.int32)
    bt = torch.zeros(4, width, dtype=torch.int32, device=dev)  # the engine's buffers
    sl = torch.zeros(4, dtype=torch.int32, device=dev)
    qsl_d = qsl.to(dev)
    gen = torch.Generator().manual_seed(9)
    ix.decoder(4, 2)  # first use compiles (one sync)
    q = _queries(10).to(dev)
    out = torch.empty((10, H, 16), dtype=torch.int32, device=dev)
    dec = ix.decoders[(4, 2)]
    for i in range(5):
        seqs = torch.randint(3, 3072, (3,), generator=gen).tolist() + [0]
        bt_cpu = torch.randint(0, nb, (4, width), dtype=torch.int32, generator=gen)
        bt.copy_(bt_cpu)
        sl.copy_(torch.tensor(seqs, dtype=torch.int32))
        step = ni.StepMetadata(qsl_d, qsl, sl, sl.cpu(), bt, nd)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms: a plan that waited for the device would see it end
        torch.cuda.set_sync_debug_mode("error")
        try:
            md = ix.plan(step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert not torch.cuda.current_stream().query(), f"plan {i} waited for the device"
        out.fill_(POISON)
        ix.forward(q, c, md, out)
        cpu_step = ni.StepMetadata(qsl, qsl, torch.tensor(seqs, dtype=torch.int32),
                                   torch.tensor(seqs, dtype=torch.int32), bt_cpu, nd)
        want = _expected(q.cpu(), cache_cpu, cpu_step, 4, 2)  # the padding request's rows too
        got = out.cpu()
        assert _tie_free_equal(got[:8], want), f"step {i}"
        assert bool((got[8:] == POISON).all())
    assert (dec._copies.captures, dec._copies.replays) == (1, 3)
    # other tensors (a new key, eager; fresh ones may reuse a freed address) and narrower or
    # wider block tables (their own keys); the buffer is 24 pages wide
    for w in (26, 20, 20, 20, 26, 26):
        bt2 = torch.randint(0, nb, (4, w), dtype=torch.int32, device=dev)
        sl2 = torch.tensor([500, 2000, min(w * 128, 3072), 0], dtype=torch.int32, device=dev)
        ix.decode_block_table.fill_(-7)
        ix.plan(ni.StepMetadata(qsl_d, qsl, sl2, sl2.cpu(), bt2, nd))
        torch.cuda.synchronize()
        wb = min(w, 24)
        assert torch.equal(ix.decode_block_table[:4, :wb], bt2[:, :wb])
        assert bool((ix.decode_block_table[:4, wb:] == -7).all())
        assert torch.equal(ix.decode_seq_lens[:4], sl2)
    # a repeated mixed step whose block table is narrower than the buffers (its decode rows
    # are copied: captured at step 2, replayed from step 3), planned and run on a
    # user stream
    q_lens, seqs, nd = [2, 2, 2, 100, 37, 300], [2500, 300, 2550, 2100, 37, 2500], 3
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    bt = torch.zeros(6, 20, dtype=torch.int32, device=dev)
    sl = torch.tensor(seqs, dtype=torch.int32, device=dev)
    q = _queries(sum(q_lens) + 2, seed=4).to(dev)
    out = torch.empty((sum(q_lens) + 2, H, 16), dtype=torch.int32, device=dev)
    user = torch.cuda.Stream()
    for i in range(3):
        bt_cpu = torch.randint(0, nb, (6, 20), dtype=torch.int32, generator=gen)
        with torch.cuda.stream(user):
            bt.copy_(bt_cpu)
            out.fill_(POISON)
            md = ix.plan(ni.StepMetadata(qsl.to(dev), qsl, sl, sl.cpu(), bt, nd))
            ix.forward(q, c, md, out)
        user.synchronize()
        want = _expected(q.cpu(), cache_cpu,
                         ni.StepMetadata(qsl, qsl, sl.cpu(), sl.cpu(), bt_cpu, nd), nd, 2)
        got = out.cpu()
        assert _tie_free_equal(got[:sum(q_lens)], want), f"mixed step {i}"
        assert bool((got[sum(q_lens):] == POISON).all())
    cg = ix.decoders[(3, 2)]._copies
    assert (cg.captures, cg.replays) == (1, 1)


def _tie_free_equal(got, want) -> bool:
    """Random gaussian keys and queries: ties are rare; allow rows that differ only in order
    of the 15 history slots (a GPU scorer rounds differently)."""
    same = (got == want).all(dim=-1)
    if bool(same.all()):
        return True
    g, w = got[~same], want[~same]
    return bool((g[:, 15] == w[:, 15]).all()) and \
        bool((g[:, :15].sort(dim=-1).values == w[:, :15].sort(dim=-1).values).float().mean()
             > 0.98)


# ------------------------------------------------------------------- plan host fast path

def _mutations(step, rng):
    """One random edit of a step's host values / metadata (valid or not)."""
    s = ni.StepMetadata(step.query_start_loc.clone(), step.query_start_loc_cpu.clone(),
                        step.seq_lens.clone(), step.seq_lens_cpu.clone(),
                        step.block_table.clone(), step.num_decodes)
    r = s.seq_lens_cpu.shape[0]
    k = int(rng.integers(0, 9))
    i = int(rng.integers(0, r + 1))
    d = int(rng.choice([-2 ** 31, -300, -2, -1, 1, 2, 130, 3000, 2 ** 31 - 1]))
    if k == 0:
        s.query_start_loc_cpu = s.query_start_loc_cpu.long()
        s.query_start_loc_cpu[i] += d
    elif k == 1:
        s.query_start_loc_cpu[i:] = (s.query_start_loc_cpu[i:].long() + d).clamp(
            -2 ** 31, 2 ** 31 - 1).int()
    elif k == 2:
        s.seq_lens_cpu = s.seq_lens_cpu.long()
        s.seq_lens_cpu[min(i, r - 1)] += d
    elif k == 3:
        s.num_decodes = int(rng.integers(0, r + 2))
    elif k == 4:
        s.block_table = s.block_table[:, :int(rng.integers(1, 27))]
    elif k == 5:
        s.seq_lens_cpu[min(i, r - 1)] = int(rng.integers(-1, 3100))
    elif k == 6:
        s.num_decodes = np.int64(s.num_decodes)  # other int types: the full checks
    elif k == 7:
        s.seq_lens = s.seq_lens.long()
    return s


def test_plan_fast_checks_imply_full_checks():
    """The vectorized host checks only accept what the full checks accept, with the same
    result; they accept the common well-formed steps (the fast path is taken)."""
    ix = ni.Indexer(_config(), backend="reference")
    bases = [_step([1] * 5, [300, 2500, 130, 1, 3000], 5),
             _step([3, 3, 3, 0], [2300, 4, 2700, 0], 4),
             _step(*MIXED),
             _step([4, 4, 9, 1], [40, 2000, 9, 1], 2),
             _step([7, 20], [7, 2000], 0)]
    bases.append(_step([2, 2, 9], [300, 2500, 2900], 2))  # one prefill request
    bases.append(_step([5], [2900], 0))

    def same(fast, want):
        def ints(x):
            return x if x is None or isinstance(x, list) else x.tolist()
        return fast[:2] == want[:2] and all(
            (f is None and w is None) or (f is not None and w is not None
                                          and ints(f) == ints(w)
                                          and isinstance(f, list) == isinstance(w, list))
            for f, w in zip(fast[2:], want[2:]))
    for s in bases:
        fast = ix._check_step_fast(s)
        assert fast is not None
        want = ix._check_step_full(s)
        assert len(fast) == len(want) == 6 and same(fast, want)
    rng = np.random.default_rng(5)
    accepted = rejected = 0
    for n in range(600):
        s = _mutations(bases[n % len(bases)], rng)
        fast = ix._check_step_fast(s)
        try:
            want = ix._check_step_full(s)
        except (ValueError, TypeError):
            assert fast is None, f"fast checks accepted a bad step (case {n})"
            rejected += 1
            continue
        accepted += 1
        if fast is not None:
            assert same(fast, want)
    assert accepted > 50 and rejected > 50




@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_plan_in_place_shared_buffers(cache, backend):
    """An engine may keep a decode-only step's block table / seq lens in the indexer's shared
    decode buffers (no copy); rows equal the copied step's."""
    ix = ni.Indexer(_config(), backend=backend)
    s = _step([2, 2, 2], [300, 2500, 2950], 3, width=24, seed=9)
    q = _queries(6)
    out = torch.full((6, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, ix.plan(s), out)
    nd, w = 3, s.block_table.shape[1]
    ix.decode_block_table.fill_(-1)
    ix.decode_block_table[:nd, :w] = s.block_table
    ix.decode_seq_lens[:nd] = s.seq_lens
    inplace = ni.StepMetadata(s.query_start_loc, s.query_start_loc_cpu,
                              ix.decode_seq_lens[:nd], s.seq_lens_cpu,
                              ix.decode_block_table[:nd], nd)
    bt_ptr = ix.decode_block_table.data_ptr()
    out2 = torch.full_like(out, POISON)
    ix.forward(q, cache, ix.plan(inplace), out2)
    assert ix.decode_block_table.data_ptr() == bt_ptr
    assert torch.equal(out, out2)
    assert torch.equal(out, _expected(q, cache, s, nd, 2))


# ------------------------------------------------------------------ gaps, prepared launches

def test_mixed_step_max_num_seqs():
    """A step with prefill requests has no padding: at most max_num_seqs requests in all
    (a decode-only step may be padded up to the largest CUDA-graph size)."""
    ix = ni.Indexer(_config(max_num_seqs=4), backend="reference")
    before = ix.decode_block_table.clone()
    for fast in (True, False):
        step = _step([1, 1, 1, 1, 9], [300, 400, 500, 600, 2000], 4)
        if not fast:
            step.num_decodes = np.int64(4)  # other int types take the full checks
        with pytest.raises(ValueError) as e:
            ix.plan(step)
        assert "max_num_seqs=4" in str(e.value) and str(e.value).startswith("step:")
    assert torch.equal(ix.decode_block_table, before) and not ix.decoders
    assert ix.plan(_step([1, 1, 1, 9], [300, 400, 500, 2000], 3)).num_rows == 12
    md = ix.plan(_step([1] * 5 + [0] * 3, [300] * 5 + [0] * 3, 8))  # padded to 8 > 4
    assert md.decode_only and md.num_decodes == 8


@pytest.mark.parametrize("q_lens,seqs,nd,field,words", [
    ([2, 2, 0, 5], [300, 300, 200, 400], 2, "query_start_loc_cpu", "q_len >= 1"),
    ([2, 2, 50], [300, 300, 40], 2, "seq_lens_cpu", "q_len <= seq_len"),
])
def test_prefill_errors_name_their_field(q_lens, seqs, nd, field, words):
    ix = ni.Indexer(_config(), backend="reference")
    with pytest.raises(ValueError) as e:
        ix.plan(_step(q_lens, seqs, nd))
    assert str(e.value).startswith(field + ":") and words in str(e.value)
    assert not ix.decoders


def test_decode_copies_are_one_multi_tensor_copy(monkeypatch):
    """plan copies the step's block table and seq lens into the decode buffers in one
    ``torch._foreach_copy_`` (one launch on CUDA); narrower / wider block tables too."""
    calls = []
    real = torch._foreach_copy_

    def counting(dst, src, **kw):
        calls.append(len(dst))
        return real(dst, src, **kw)
    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    ix = ni.Indexer(_config(), backend="reference")
    for width in (24, 26, 20):  # max_pages is 24
        ix.decode_block_table.fill_(-9)
        s = _step([1, 1, 1], [300, 2500, 130], 3, width=width, seed=width)
        calls.clear()
        ix.plan(s)
        assert calls == [2]
        w = min(width, 24)
        assert torch.equal(ix.decode_block_table[:3, :w], s.block_table[:, :w])
        assert bool((ix.decode_block_table[:3, w:] == -9).all())  # never past the step's
        assert torch.equal(ix.decode_seq_lens[:3], s.seq_lens)


@pytest.mark.parametrize("width", [24, 26, 20])  # max_pages is 24
def test_mixed_step_decode_rows_read_the_step_in_place(cache, width):
    """Triton (interpreter): a mixed step's decode rows read the step's block table and seq
    lens at ``forward`` (no copy in ``plan``: the shared decode buffers stay poisoned) when
    its block table is at least as wide as the buffers (a view of the first 24 columns when
    wider); a narrower one is copied as before. Rows equal the public ops either way."""
    ix = ni.Indexer(_config(max_num_seqs=8), backend="triton")
    q_lens, seqs = [2, 2, 2, 9], [300, 2500, 2550, 2400]
    step = _step(q_lens, seqs, 3, width=width, seed=width)
    ix.plan(_step([2, 2, 2], seqs[:3], 3, width=width, seed=1))  # the wrapper exists
    ix.decode_block_table.fill_(-5)
    ix.decode_seq_lens.fill_(-5)
    md = ix.plan(step)
    copied = width < 24
    assert (md.decode_inputs is None) == copied
    if not copied:
        bt, sl = md.decode_inputs
        assert bt.shape == (3, 24) and bt.data_ptr() == step.block_table.data_ptr()
        assert sl.data_ptr() == step.seq_lens.data_ptr()
    assert bool((ix.decode_block_table[:3, :width] == -5).all()) != copied
    rows = sum(q_lens)
    q, out = _forward_poisoned(ix, cache, md, rows, 2, seed=width)
    assert torch.equal(out[:rows], _expected(q, cache, step, 3, 2))
    assert bool((out[rows:] == POISON).all())
    # the decode-only step after it copies into the buffers again (its graph reads them)
    dstep = _step([2, 2, 2], seqs[:3], 3, width=width, seed=width + 1)
    md = ix.plan(dstep)
    assert md.decode_inputs is None
    assert torch.equal(ix.decode_seq_lens[:3], dstep.seq_lens)
    w = min(width, 24)
    assert torch.equal(ix.decode_block_table[:3, :w], dstep.block_table[:, :w])


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("q_extra,out_extra", [(0, 3), (3, 0), (2, 5)])
def test_forward_rows_of_index_q_and_out_independent(cache, backend, q_extra, out_extra):
    """``index_q`` and ``out`` may each have more rows than the step (SPEC 8.1), independently
    of each other: the decode rows are written, the rest of ``out`` stays poisoned."""
    ix = ni.Indexer(_config(), backend=backend)
    s = _step([2, 2, 2], [300, 2500, 2950], 3, width=24, seed=13)
    md = ix.plan(s)
    q = _queries(6 + q_extra, seed=14)
    out = torch.full((6 + out_extra, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, md, out)
    assert torch.equal(out[:6], _expected(q, cache, s, 3, 2))
    assert bool((out[6:] == POISON).all())


def test_forward_per_layer_caches_of_other_sizes(cache):
    """Each forward checks its own cache: a later layer's smaller cache (holding every
    block the step reads) is accepted (the decode wrapper remembers no cache size)."""
    ix = ni.Indexer(_config(), backend="reference")
    step = _step([2, 2, 9], [300, 2500, 2900], 2, nb=40)
    md = ix.plan(step)
    q = _queries(13)
    want = _expected(q, cache, step, 2, 2)
    for c in (cache, cache[:40], cache):
        out = torch.full((13, H, 16), POISON, dtype=torch.int32)
        assert torch.equal(ix.forward(q, c, md, out), want)
    with pytest.raises(ValueError, match="block_table"):
        ix.forward(q, cache[:10], md, torch.empty((13, H, 16), dtype=torch.int32))


def test_triton_chunks_of_several_requests(cache):
    """Triton (interpreter): chunks of several requests (one with only short rows: no
    gather, one split), a later multi-request chunk and a one-request chunk; every row
    equals the public ops, rows past the step stay poisoned, and a re-plan of the same
    step (the other staging slot) stages the same metadata."""
    ix = ni.Indexer(_config(max_model_len=2560, max_num_seqs=8), backend="triton")  # 20 pages
    q_lens = [3, 3, 5, 30, 40, 20, 3]
    seqs = [2300, 900, 700, 2000, 2200, 300, 2400]  # prefill hist 5, 15 | 17, 2 | 18
    step = _step(q_lens, seqs, 2, seed=11)
    md = ix.plan(step)
    assert [(c.req_start, c.req_end) for c in md.prefill_chunks] == [(0, 2), (2, 4), (4, 5)]
    assert md.prefill_chunks[0].total_pages == 0 and md.prefill_chunks[1].total_pages == 17
    rows = sum(q_lens)
    q = _queries(rows + 3)
    want = _expected(q, cache, step, 2, 3)
    out = torch.full((rows + 3, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, md, out)
    assert torch.equal(out[:rows], want)
    assert bool((out[rows:] == POISON).all())

    def staged(m):
        return [[c.dev[k][:n].tolist() for k, n in (("qsl", 6), ("seq", 5), ("ws_off", 3),
                                                     ("pages", 2), ("blocks", 4))]
                for c in m.prefill_chunks]
    first = staged(md)
    md2 = ix.plan(step)  # the other staging slot: the same metadata
    assert md2.prefill_chunks[0].dev["qsl"].data_ptr() != md.prefill_chunks[0].dev["qsl"].data_ptr()
    assert staged(md2) == first
    assert first[0][0] == [6, 11, 41, 81, 101, 104]  # absolute rows of index_q / out



@pytest.mark.parametrize("sms,pages", [(1, 2), (132, 1)])
def test_triton_gather_pages_per_program(cache, sms, pages):
    """Triton (interpreter): the chunk's gather takes 2 pages per program when one page per
    program would take 1-2 waves (``gather_pages_per_program``; the Indexer's SM count is
    lowered to 1 so that 17 one-warp programs x 2 requests do), 1 otherwise; the workspace
    holds the reference's 17 pages (an odd count: the last program's second page is not
    written, the rest of the workspace stays poisoned) and the rows equal the public ops."""
    ix = ni.Indexer(_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    ix._num_sms = sms
    step = _step([3, 30, 40], [2300, 2200, 300], 1, seed=12)  # prefill hist 17 | 2 (short)
    md = ix.plan(step)
    (c,) = md.prefill_chunks
    assert c.launch["gather_pages"] == pages and list(c.gather_pages) == [17, 0]
    assert c.launch["gather"][0][0] == (-(-17 // pages), 2)
    rows = 73
    q = _queries(rows)
    out = torch.full((rows, H, 16), POISON, dtype=torch.int32)
    ws8 = ix.workspace.view(torch.uint8)
    ws8.fill_(0x5A)
    ix.forward(q, cache, md, out)
    assert torch.equal(out, _expected(q, cache, step, 1, 3))
    want, _ = ni.gather_index_k_fp8(cache, step.block_table[1:2], step.seq_lens[1:2],
                                    backend="reference")
    assert torch.equal(ws8[:17], want.view(torch.uint8)) and bool((ws8[17:] == 0x5A).all())

def test_forward_plain_checks_imply_full_checks(cache):
    """forward's fast checks accept only what the full checks accept."""
    ix = ni.Indexer(_config(), backend="reference")
    md = ix.plan(_step([2, 2, 9], [300, 2500, 2900], 2))
    q, out = _queries(13), torch.empty((13, H, 16), dtype=torch.int32)
    assert ix._forward_inputs_plain(q, cache, md, out)
    variants = [
        (q[:12], cache, out), (q, cache, out[:12]), (q.view(torch.uint8), cache, out),
        (q, cache, out.long()), (q, cache.view(torch.int8), out),
        (q, cache[:0], out), (q, cache[:, :64], out), (q, cache[..., :64], out),
        (q[:, :1], cache, out), (q, cache, out[:, :1]), (q, cache, out.transpose(0, 1)),
        (torch.cat([q, q], dim=-1)[..., ::2], cache, out), (q, cache, out[..., :8]),
        (q.float(), cache, out), (q, cache, out.unsqueeze(0)), (q, cache.flatten(), out),
        (q, cache, out[::2]), (torch.cat([q, q])[::2], cache, out),
    ]
    plain = 0
    for qq, cc, oo in variants:
        if ix._forward_inputs_plain(qq, cc, md, oo):
            plain += 1
            ix._check_forward_full(qq, cc, md, oo)  # must not raise
        else:
            with pytest.raises((ValueError, TypeError)):
                ix._check_forward_full(qq, cc, md, oo)
    assert plain == 1  # the strided index_q (rows of unit last stride) is fine
    assert not ix._forward_inputs_plain(q, cache, dataclasses_replace(md), out)


def dataclasses_replace(md):
    import dataclasses
    return dataclasses.replace(md, generation=md.generation - 1)


@pytest.mark.parametrize("scalar_max", [0, 16, 1000])
def test_triton_plan_many_request_chunks(monkeypatch, scalar_max):
    """Triton plan (host side only) of a step with 40 prefill requests: chunks equal
    ``plan_prefill_chunks``; each chunk's staged row blocks equal
    ``triton.prefill.dispatch.plan_row_blocks`` (step prefill request, first row), its workspace
    offsets and page counts the chunk's; the fast checks accept the step with the full
    checks' result. ``scalar_max`` moves the host-int / numpy switch of the checks and of
    the row blocks (0: numpy everywhere, 1000: host ints everywhere)."""
    import nvfp4_indexer.engine as eng
    from nvfp4_indexer.triton.prefill.dispatch import plan_row_blocks
    monkeypatch.setattr(eng, "_SCALAR_MAX", scalar_max)
    rng = np.random.default_rng(14)
    n_pre = 40
    q_pre = rng.integers(1, 12, n_pre)
    long = rng.random(n_pre) < 0.15  # 17..23 history pages: at most one per chunk of 32
    seqs_pre = np.where(long, rng.integers(2200, 3000, n_pre),
                        q_pre + rng.integers(0, 120, n_pre))
    q_lens, seqs = [2, 2] + q_pre.tolist(), [300, 2500] + seqs_pre.tolist()
    ix = ni.Indexer(_config(max_num_seqs=48, max_num_batched_tokens=1024), backend="triton")
    step = _step(q_lens, seqs, 2, seed=14)
    fast, full = ix._check_step_fast(step), ix._check_step_full(step)
    assert fast is not None and fast[4:] == full[4:]
    md = ix.plan(step)
    qsl = step.query_start_loc_cpu.tolist()
    want = plan_prefill_chunks(qsl[2:], seqs[2:], ix.config.gather_pages)
    got = md.prefill_chunks
    assert [(c.req_start, c.req_end, c.row_start, c.row_end) for c in got] == \
        [(c.req_start, c.req_end, c.row_start, c.row_end) for c in want]
    assert max(c.req_end - c.req_start for c in got) > 16 and len(got) > 2
    pq = qsl[2:]
    for c, w in zip(got, want):
        assert list(c.page_offsets) == w.page_offsets and list(c.gather_pages) == w.gather_pages
        assert c.total_pages == w.total_pages
        n, nb, bm = c.req_end - c.req_start, c.dev["num_blocks"], c.launch["block_m"]
        a, b = c.req_start, c.req_end
        reqs, row0s, _ = plan_row_blocks(np.diff(pq)[a:b], np.asarray(seqs[2:])[a:b], H, bm)
        assert c.dev["blocks"][:2 * nb].tolist() == (reqs + a).tolist() + row0s.tolist()
        assert c.dev["ws_off"][:n + 1].tolist() == w.page_offsets
        assert c.dev["pages"][:n].tolist() == w.gather_pages
        assert c.dev["block_table"].data_ptr() == step.block_table[2 + c.req_start].data_ptr()
    assert md.prefill_chunks[0].dev["seq"].tolist() == seqs[2:]


def test_chunks_are_greedy():
    """The chunking the Indexer and ``prefill_indexer`` plan with (``plan_chunks``) takes
    requests in order while their history pages fit the budget."""
    from nvfp4_indexer.reference.prefill import plan_chunks

    def greedy(pages, budget):
        chunks, start = [], 0
        while start < len(pages):
            end, total = start, 0
            while end < len(pages) and total + pages[end] <= budget:
                total += pages[end]
                end += 1
            chunks.append((start, end))
            start = end
        return chunks
    rng = np.random.default_rng(15)
    for _ in range(200):
        budget = int(rng.integers(1, 40))
        hist = rng.integers(0, budget + 1, int(rng.integers(1, 30)))
        hist[rng.random(hist.shape[0]) < 0.3] = 0
        assert plan_chunks(hist.tolist(), budget) == greedy(hist.tolist(), budget)


@pytest.mark.gpu
def test_allow_fp8_mma_decode_steps():
    """``IndexerConfig(allow_fp8_mma=True)``: on SM90 a decode batch of >= 2048 pages runs the
    "wgflat" scorer with E4M3 operands (kernel dot "fp8", SPEC 9 b = 5; a small one the exact
    kernels), its rows valid tie-aware at b = 5 against the exact scores, in a replayed CUDA
    graph; the shared score scratch covers it."""
    from nvfp4_indexer.conformance.judges import tie_aware_check
    from nvfp4_indexer import reference as ref
    dev = torch.device("cuda")
    nb, b, qlen, width = 2400, 8, 2, 300
    gen = torch.Generator(device=dev).manual_seed(4)
    c = _gpu_cache(nb, gen)
    ix = ni.Indexer(_config(device=dev, max_model_len=width * 128, max_num_seqs=b,
                            allow_fp8_mma=True, num_heads=16))
    seqs = [width * 128 - 5 * i for i in range(b)]
    step = ni.StepMetadata(
        torch.arange(0, b * qlen + 1, qlen, dtype=torch.int32, device=dev),
        torch.arange(0, b * qlen + 1, qlen, dtype=torch.int32),
        torch.tensor(seqs, dtype=torch.int32, device=dev), torch.tensor(seqs, dtype=torch.int32),
        torch.randperm(nb, device=dev)[:b * width].view(b, width).to(torch.int32), b)
    md = ix.plan(step)
    runner = ix.decoder(b, qlen)._runner
    if torch.cuda.get_device_capability(dev) == (9, 0):
        assert runner.dequant == "wgflat" and runner.kernel_dot == "fp8"
        assert runner.error_bits == 5
    q = ni.encode_e4m3(torch.randn(b * qlen, 16, 128, device=dev, generator=gen))
    out = torch.full((b * qlen, 16, 16), POISON, dtype=torch.int32, device=dev)
    ix.forward(q, c, md, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ix.forward(q, c, md, out)
    out.fill_(POISON)
    g.replay()
    torch.cuda.synchronize()
    qsl = step.query_start_loc
    exact, mag = ref.page_scores(q, c, step.block_table, step.seq_lens, qsl, with_magnitude=True)
    pos = step.seq_lens.repeat_interleave(qlen) - qlen + torch.arange(qlen, device=dev).repeat(b)
    res = tie_aware_check(out, exact, mag, torch.div(pos, 128, rounding_mode="floor"),
                          runner.error_bits)
    assert res.failed == 0
    small = ix.decoder(1, 1)._runner  # 1 request: below FP8_MIN_PAGES_NARROW, exact kernels
    assert small.kernel_dot == "fp16" and small.error_bits == 15


@pytest.mark.gpu
def test_allow_fp8_mma_prefill_step():
    """``IndexerConfig(allow_fp8_mma=True)`` on SM90: prefill chunks score in dot mode "fp8"
    (the Gluon kernel's E4M3 form for a chunk with context), rows valid tie-aware at b = 5;
    without it the same step stays exact (dot fp16)."""
    from nvfp4_indexer.conformance.judges import tie_aware_check
    from nvfp4_indexer import reference as ref
    from nvfp4_indexer.triton.decode import SCORE_ERROR_BITS
    from nvfp4_indexer.triton.prefill.dispatch import prefill_wgmma_ok
    dev = torch.device("cuda")
    nb, new, ctx = 400, 1024, 40000
    gen = torch.Generator(device=dev).manual_seed(6)
    c = _gpu_cache(nb, gen)
    seq = new + ctx
    width = -(-seq // 128)
    step = ni.StepMetadata(
        torch.tensor([0, new], dtype=torch.int32, device=dev),
        torch.tensor([0, new], dtype=torch.int32),
        torch.tensor([seq], dtype=torch.int32, device=dev), torch.tensor([seq], dtype=torch.int32),
        torch.randperm(nb, device=dev)[:width].view(1, width).to(torch.int32), 0)
    q = ni.encode_e4m3(torch.randn(new, 4, 128, device=dev, generator=gen))
    exact, mag = ref.page_scores(q, c, step.block_table, step.seq_lens, step.query_start_loc,
                                 with_magnitude=True)
    pos = torch.arange(seq - new, seq, device=dev)
    local = torch.div(pos, 128, rounding_mode="floor")
    for fp8 in (True, False):
        ix = ni.Indexer(_config(device=dev, max_model_len=width * 128, max_num_seqs=1,
                                max_num_batched_tokens=new, allow_fp8_mma=fp8, num_heads=4))
        want = "fp8" if fp8 and prefill_wgmma_ok(dev, "fp8", True) else "fp16"
        assert ix._settings.fp8 == (want == "fp8") and ix._settings.dot == "fp16"
        md = ix.plan(step)
        out = torch.full((new, 4, 16), POISON, dtype=torch.int32, device=dev)
        ix.forward(q, c, md, out)
        torch.cuda.synchronize()
        bits = SCORE_ERROR_BITS[want]
        assert tie_aware_check(out, exact, mag, local, bits).failed == 0
        # the same launches as the stateless call with the same opt-in (same FP8 kernel form)
        assert torch.equal(out, ni.prefill_indexer(q, c, step.block_table, step.query_start_loc,
                                                   step.seq_lens, allow_fp8_mma=fp8))
        if want == "fp16":
            assert torch.equal(out, ni.prefill_indexer(q, c, step.block_table,
                                                       step.query_start_loc, step.seq_lens,
                                                       backend="reference"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plumbing check (the GPU test runs it)")
@pytest.mark.parametrize("fp8", [False, True])
def test_engine_fp8_prefill_routing_on_cpu(gluon_twin, monkeypatch, fp8):
    """``IndexerConfig(allow_fp8_mma=True)`` with the Gluon branch forced (CPU): the Gluon
    chunks' planned launches take ``launch_options(fp8=True)``, the Triton chunks the exact
    dot mode; without it, the fp16 form. (Plans only: nothing is launched.)"""
    from nvfp4_indexer.triton.prefill import prefill_wgmma as pw
    monkeypatch.setattr(gluon_twin, "resolve_dot", lambda dot, dev: dot or "fp16")
    ix = ni.Indexer(_config(max_model_len=2560, max_num_seqs=8, allow_fp8_mma=fp8),
                    backend="triton")
    assert ix._settings.fp8 == fp8 and ix._settings.dot == "fp16"
    md = ix.plan(_step(*GLUON_STEP, seed=25))
    seen = [(ch.launch["plan"].shape["kernel"], ch.launch["plan"].score.kwargs)
            for ch in md.prefill_chunks]
    assert [k for k, _ in seen] == ["wgmma", "triton"], seen
    opts = {k: v for k, v in seen[0][1].items() if k not in ("H", "BLOCK_M", "NUM_SPLITS")}
    assert opts == pw.launch_options(fp8)
    assert seen[1][1]["DOT"] == "fp16" and seen[1][1]["TOKENS_N"]


# ------------------------------------------- metadata owner, aliasing, devices, allocation

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: the interpreter off CUDA


def _on_dev(step: ni.StepMetadata) -> ni.StepMetadata:
    """``step`` with its device tensors on ``DEV`` (host copies stay on the CPU)."""
    return ni.StepMetadata(step.query_start_loc.to(DEV), step.query_start_loc_cpu,
                           step.seq_lens.to(DEV), step.seq_lens_cpu, step.block_table.to(DEV),
                           step.num_decodes)


def _poisoned(rows, heads=H):
    return torch.full((rows, heads, 16), POISON, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_refuses_metadata_of_another_indexer(cache, backend):
    """SPEC 8.1: forward accepts only its own latest plan's metadata: not another Indexer's
    of the same config and plan count (before: accepted; Triton gave 112 wrong prefill
    elements), nor one of H = 4 given to H = 2 (before: 306 wrong elements). Nothing is
    written."""
    cache = cache.to(DEV)
    step = _on_dev(_step([2, 2, 9], [300, 2500, 2900], 2))
    a = ni.Indexer(_config(device=DEV), backend=backend)
    b = ni.Indexer(_config(device=DEV), backend=backend)
    md_a, md_b = a.plan(step), b.plan(step)
    assert md_a.generation == md_b.generation
    q, out = _queries(13).to(DEV), _poisoned(13)
    with pytest.raises(ValueError, match="metadata: expected the IndexerMetadata this "
                       "Indexer's latest plan.. returned, got metadata of another Indexer"):
        b.forward(q, cache, md_a, out)
    four = ni.Indexer(_config(num_heads=4, device=DEV), backend=backend)
    with pytest.raises(ValueError, match=r"another Indexer \(num_heads=4\)"):
        a.forward(q, cache, four.plan(step), out)
    assert bool((out == POISON).all())
    b.forward(q, cache, md_b, out)
    assert torch.equal(out.cpu(), _expected(q.cpu(), cache.cpu(), _step([2, 2, 9],
                                                                        [300, 2500, 2900], 2),
                                            2, 2))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_refuses_hand_built_and_changed_metadata_by_field(cache, backend):
    """Metadata built by hand (``decoder=None``) or copied with a field changed is refused
    with a ValueError naming the field (before: AttributeError: 'NoneType' object has no
    attribute 'run'); a faithful copy is the plan's metadata."""
    import dataclasses
    cache = cache.to(DEV)
    ix = ni.Indexer(_config(device=DEV), backend=backend)
    md = ix.plan(_on_dev(_step([2, 2, 9], [300, 2500, 2900], 2)))
    q, out = _queries(13).to(DEV), _poisoned(13)
    hand = ni.IndexerMetadata(md.num_decodes, md.decode_query_len, md.num_decode_rows,
                              md.prefill_row_start, md.num_prefill_rows, md.num_rows,
                              decoder=None, prefill_chunks=md.prefill_chunks,
                              generation=md.generation)
    with pytest.raises(ValueError, match=r"metadata built by hand \(owner None\).*decoder=None"):
        ix.forward(q, cache, hand, out)
    with pytest.raises(ValueError, match="a changed copy .*decoder=None"):
        ix.forward(q, cache, dataclasses.replace(md, decoder=None), out)
    with pytest.raises(ValueError, match="num_rows=20"):
        ix.forward(q, cache, dataclasses.replace(md, num_rows=20), out)
    assert bool((out == POISON).all())
    ix.forward(q, cache, dataclasses.replace(md), out)
    want = out.clone()
    ix.forward(q, cache, md, out.fill_(POISON))
    assert torch.equal(out, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_refuses_out_overlapping_what_it_reads(cache, backend):
    """SPEC 10: ``out`` overlapping ``index_q``, the cache or the step's tensors that a mixed
    step reads at forward is refused before any row is written (the plain checks pass it to
    the full checks, which name it)."""
    cache = cache.to(DEV)
    ix = ni.Indexer(_config(device=DEV), backend=backend)
    step = _on_dev(_step([2, 2, 9], [300, 2500, 2900], 2))
    md = ix.plan(step)
    both = torch.full((13 * H * 32,), 0x38383838, dtype=torch.int32, device=DEV)
    q = both.view(torch.float8_e4m3fn).view(13, H, 128)
    out = both[:13 * H * 16].view(13, H, 16)
    snap = both.clone()
    assert not ix._forward_inputs_plain(q, cache, md, out)
    with pytest.raises(ValueError, match="out: expected memory that overlaps no input .*index_q"):
        ix.forward(q, cache, md, out)
    assert torch.equal(both, snap)
    big = _poisoned(20)
    step2 = ni.StepMetadata(step.query_start_loc, step.query_start_loc_cpu,
                            big.view(-1)[-3:].copy_(step.seq_lens), step.seq_lens_cpu,
                            step.block_table, 2)
    md = ix.plan(step2)
    snap = big.clone()
    with pytest.raises(ValueError, match="out: .*the step's seq_lens"):
        ix.forward(_queries(20).to(DEV), cache, md, big)
    assert torch.equal(big, snap)


def test_config_device_compares_as_torch_does(cache):
    """SPEC 10: a tensor is on the configured device when ``torch.empty(0, device=...)``
    would be there: "cpu:0" is the CPU (before: every CPU step was refused, "expected a tensor
    on cpu:0 ..., got device cpu"); a device that does not exist is a ValueError."""
    c = _config(device="cpu:0")
    assert c.device == torch.device("cpu")
    ix = ni.Indexer(c, backend="reference")
    step = _step([2, 2, 9], [300, 2500, 2900], 2)
    q, out = _queries(13), torch.full((13, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, ix.plan(step), out)
    assert torch.equal(out, _expected(q, cache, step, 2, 2))
    for bad in ("bogus", "cuda:64", 3.5):
        with pytest.raises(ValueError, match="device: expected"):
            _config(device=bad)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_indexer_buffers_past_memory_name_the_field(backend):
    """SPEC 10: configs whose buffers the device cannot hold are refused before anything is
    allocated, naming the field that sized the largest buffer, the bytes and
    ``memory_bytes()``'s figures (before: the allocator's own message, or a 1 TB
    workspace on a large host)."""
    huge = dict(max_model_len=2 ** 31 - 1, max_num_batched_tokens=2 ** 31 - 1, device=DEV)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: expected a size that fits "
                       r".*workspace, 1099511627776 bytes; memory_bytes\(\): workspace="):
        ni.Indexer(_config(**huge), backend=backend)
    from nvfp4_indexer.validation import device_memory_bytes
    if device_memory_bytes(torch.device(DEV)) < 275 * 10 ** 9:  # the 275 GB workspace
        with pytest.raises(ValueError, match=r"max_model_len: expected .*2147483647 sizes "
                           r"workspace, 274877906944 bytes"):
            ni.Indexer(_config(max_model_len=2 ** 31 - 1, device=DEV), backend=backend)


def test_memory_bytes_computed_before_allocating_equal_the_buffers():
    """``memory_bytes()`` comes from the config (computed before allocating) and equals the
    buffers' sizes."""
    for backend in ("reference", "triton"):
        ix = ni.Indexer(_config(), backend=backend)
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        m = ix.memory_bytes()
        assert m["workspace"] == nb(ix.workspace)
        assert m["score_scratch"] == nb(ix.score_buffer)
        assert m["decode_buffers"] == nb(ix.decode_block_table) + nb(ix.decode_seq_lens)
        assert m["staging_host"] == sum(nb(s.host) for s in ix._staging)
        assert m["staging_device"] == (0 if ix.device.type == "cpu" else
                                       sum(nb(s.dev) for s in ix._staging))
