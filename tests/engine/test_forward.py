"""``Indexer.forward`` row for row against ``decode_indexer`` / ``prefill_indexer`` on the
same step (SPEC 8.1): mixed and padded decode-only steps, host seq lens an upper bound of
the device ones (and device ones edited after plan), ``index_q`` / ``out`` with extra rows,
per-layer caches; rows past the step stay poisoned."""

from __future__ import annotations

import pytest
import torch

import nvfp4_indexer as ni

from .step_inputs import (
    H, MIXED, POISON, check_forward, expected_rows, make_config, make_step, queries)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_equals_public_ops(cache, backend):
    """Mixed step (decode Q=2 + prefill requests in two chunks), then a padded decode-only
    step of another Q; rows past the step stay poisoned. (Triton: smaller, interpreter.)"""
    if backend == "triton":
        ix = ni.Indexer(make_config(max_model_len=2560), backend=backend)  # budget 20 pages
        q_lens, seqs, nd = [2, 2, 60, 100], [2300, 300, 2200, 2500], 2  # prefill needs 36
        dq, ds = [3, 3, 3, 0], [2200, 3, 2400, 0]
    else:
        ix = ni.Indexer(make_config(), backend=backend)  # budget 24 pages: prefill needs 36
        (q_lens, seqs, nd), dq, ds = MIXED, [3, 3, 3, 0], [2200, 3, 2900, 0]
    step = make_step(q_lens, seqs, nd)
    md = ix.plan(step)
    assert len(md.prefill_chunks) == 2 and md.num_decode_rows == 2 * nd and not md.decode_only
    q, out = check_forward(ix, cache, md, step, nd, 4)
    # decode-only, 3 requests padded to 4 (zero-length, seq len 0, garbage block table row)
    step = make_step(dq, ds, 4, seed=5)
    step.block_table[3] = -5
    md = ix.plan(step)
    assert md.decode_only and md.num_rows == 12 and md.decoder is ix.decoders[(4, 3)]
    out.fill_(POISON)
    ix.forward(q, cache, md, out)
    assert torch.equal(out[:12], expected_rows(q, cache, step, 4, 3))
    assert out[9:12, :, 0].eq(0).all() and out[9:12, :, 1:].eq(-1).all()  # padding rows
    assert bool((out[12:] == POISON).all())


def test_forward_host_upper_bound_and_stale_metadata(cache):
    ix = ni.Indexer(make_config(), backend="reference")
    q_lens, seqs, nd = MIXED
    upper = [s + 2 for s in seqs[:nd]] + [min(s + 3, 3072) for s in seqs[nd:]]
    step = make_step(q_lens, seqs, nd, upper=upper)
    md = ix.plan(step)
    rows = sum(q_lens)
    q = queries(rows)
    out = torch.full((rows, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, md, out)
    assert torch.equal(out, expected_rows(q, cache, step, nd, 2))
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
    ix = ni.Indexer(make_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    q_lens, upper, nd = CLAMP
    seqs = [2500, 2250, 1990, 300]  # history pages 18 | 17 (host 18), 15 (host 16), 2
    step = make_step(q_lens, seqs, nd, seed=21, upper=upper)
    md = ix.plan(step)
    assert [(c.req_start, c.req_end) for c in md.prefill_chunks] == [(0, 1), (1, 3)]
    assert md.prefill_chunks[1].total_pages == 16  # sized by the host copies
    check_forward(ix, cache, md, step, nd, 3, seed=22)


def test_triton_device_seq_lens_edited_after_plan_are_clamped(cache):
    """Device seq lens raised after plan (past the planned pages, past a short-only request's
    history, INT32_MAX): the kernels clamp each to its host copy; rows equal the public ops on
    the host values, nothing outside the step's rows is written."""
    ix = ni.Indexer(make_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    q_lens, seqs, nd = CLAMP
    step = make_step(q_lens, seqs, nd, seed=23)
    want_step = make_step(q_lens, seqs, nd, seed=23)  # same block table, device = host values
    md = ix.plan(step)
    step.seq_lens[nd:] = torch.tensor([2540, 2**31 - 1, 300 + 5 * 128], dtype=torch.int32)
    check_forward(ix, cache, md, step, nd, 3, seed=24, truth=want_step)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("q_extra,out_extra", [(0, 3), (3, 0), (2, 5)])
def test_forward_rows_of_index_q_and_out_independent(cache, backend, q_extra, out_extra):
    """``index_q`` and ``out`` may each have more rows than the step (SPEC 8.1), independently
    of each other: the decode rows are written, the rest of ``out`` stays poisoned."""
    ix = ni.Indexer(make_config(), backend=backend)
    s = make_step([2, 2, 2], [300, 2500, 2950], 3, width=24, seed=13)
    md = ix.plan(s)
    q = queries(6 + q_extra, seed=14)
    out = torch.full((6 + out_extra, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, md, out)
    assert torch.equal(out[:6], expected_rows(q, cache, s, 3, 2))
    assert bool((out[6:] == POISON).all())


def test_forward_per_layer_caches_of_other_sizes(cache):
    """Each forward checks its own cache: a later layer's smaller cache (holding every
    block the step reads) is accepted (the decode wrapper remembers no cache size)."""
    ix = ni.Indexer(make_config(), backend="reference")
    step = make_step([2, 2, 9], [300, 2500, 2900], 2, nb=40)
    md = ix.plan(step)
    q = queries(13)
    want = expected_rows(q, cache, step, 2, 2)
    for c in (cache, cache[:40], cache):
        out = torch.full((13, H, 16), POISON, dtype=torch.int32)
        assert torch.equal(ix.forward(q, c, md, out), want)
    with pytest.raises(ValueError, match="block_table"):
        ix.forward(q, cache[:10], md, torch.empty((13, H, 16), dtype=torch.int32))
