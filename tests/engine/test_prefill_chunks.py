"""The engine's prefill chunks (SPEC 8.1): ``plan_prefill_chunks`` within the gather
budget (greedy, as ``reference.prefill.plan_chunks``), chunks of several requests and their
staged metadata, the gather's pages per program, host-side plans of many-request steps, and
the Gluon prefill branch's plumbing on the CPU (its Triton twin in its place)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nvfp4_indexer as ni
from nvfp4_indexer.engine import PrefillChunk, plan_prefill_chunks

from .step_inputs import (
    GLUON_STEP, H, POISON, check_forward, expected_rows, make_config, make_step, queries)


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


def test_triton_chunks_of_several_requests(cache):
    """Triton (interpreter): chunks of several requests (one with only short rows: no
    gather, one split), a later multi-request chunk and a one-request chunk; every row
    equals the public ops, rows past the step stay poisoned, and a re-plan of the same
    step (the other staging slot) stages the same metadata."""
    ix = ni.Indexer(make_config(max_model_len=2560, max_num_seqs=8), backend="triton")  # 20 pages
    q_lens = [3, 3, 5, 30, 40, 20, 3]
    seqs = [2300, 900, 700, 2000, 2200, 300, 2400]  # prefill hist 5, 15 | 17, 2 | 18
    step = make_step(q_lens, seqs, 2, seed=11)
    md = ix.plan(step)
    assert [(c.req_start, c.req_end) for c in md.prefill_chunks] == [(0, 2), (2, 4), (4, 5)]
    assert md.prefill_chunks[0].total_pages == 0 and md.prefill_chunks[1].total_pages == 17
    rows = sum(q_lens)
    q = queries(rows + 3)
    want = expected_rows(q, cache, step, 2, 3)
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
    ix = ni.Indexer(make_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    ix._num_sms = sms
    step = make_step([3, 30, 40], [2300, 2200, 300], 1, seed=12)  # prefill hist 17 | 2 (short)
    md = ix.plan(step)
    (c,) = md.prefill_chunks
    assert c.launch["gather_pages"] == pages and list(c.gather_pages) == [17, 0]
    assert c.launch["gather"][0][0] == (-(-17 // pages), 2)
    rows = 73
    q = queries(rows)
    out = torch.full((rows, H, 16), POISON, dtype=torch.int32)
    ws8 = ix.workspace.view(torch.uint8)
    ws8.fill_(0x5A)
    ix.forward(q, cache, md, out)
    assert torch.equal(out, expected_rows(q, cache, step, 1, 3))
    want, _ = ni.gather_index_k_fp8(cache, step.block_table[1:2], step.seq_lens[1:2],
                                    backend="reference")
    assert torch.equal(ws8[:17], want.view(torch.uint8)) and bool((ws8[17:] == 0x5A).all())


@pytest.mark.parametrize("n_pre", [16, 17, 40])
def test_triton_plan_many_request_chunks(n_pre):
    """Triton plan (host side only) of a step with ``n_pre`` prefill requests: chunks equal
    ``plan_prefill_chunks``; each chunk's staged row blocks equal
    ``triton.prefill.dispatch.plan_row_blocks`` (step prefill request, first row), its workspace
    offsets and page counts the chunk's; the fast checks accept the step with the full
    checks' result. The engine checks a step's prefill requests, and stages a chunk's row
    blocks, with host ints up to 16 requests and with numpy past them: 16 and 17 prefill
    requests put the checks on either side; 40 put them on numpy, in chunks of more than 16
    requests and of 2..16."""
    import nvfp4_indexer.engine as eng
    from nvfp4_indexer.triton.prefill.dispatch import plan_row_blocks
    assert eng._SCALAR_MAX == 16, "the cases straddle the engine's host-int / numpy switch"
    rng = np.random.default_rng(14)
    q_pre = rng.integers(1, 12, n_pre)
    long = rng.random(n_pre) < 0.15  # 17..23 history pages: at most one per chunk of 32
    seqs_pre = np.where(long, rng.integers(2200, 3000, n_pre),
                        q_pre + rng.integers(0, 120, n_pre))
    q_lens, seqs = [2, 2] + q_pre.tolist(), [300, 2500] + seqs_pre.tolist()
    ix = ni.Indexer(make_config(max_num_seqs=48, max_num_batched_tokens=1024), backend="triton")
    step = make_step(q_lens, seqs, 2, seed=14)
    fast, full = ix._check_step_fast(step), ix._check_step_full(step)
    assert fast is not None and fast[4:] == full[4:]
    md = ix.plan(step)
    qsl = step.query_start_loc_cpu.tolist()
    want = plan_prefill_chunks(qsl[2:], seqs[2:], ix.config.gather_pages)
    got = md.prefill_chunks
    assert [(c.req_start, c.req_end, c.row_start, c.row_end) for c in got] == \
        [(c.req_start, c.req_end, c.row_start, c.row_end) for c in want]
    if n_pre == 40:  # several-request chunks staged with numpy and with host ints
        sizes = [c.req_end - c.req_start for c in got]
        assert max(sizes) > 16 and any(1 < n <= 16 for n in sizes) and len(got) > 2
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
    ix = ni.Indexer(make_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    assert ix._settings.wgmma
    q_lens, seqs, nd = GLUON_STEP
    if later:  # the 16-page requests first: the 18-page (Gluon) chunk is the second
        q_lens, seqs = [q_lens[0], q_lens[2], q_lens[3], q_lens[1]], \
            [seqs[0], seqs[2], seqs[3], seqs[1]]
    step = make_step(q_lens, seqs, nd, seed=25)
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
    check_forward(ix, cache, md, step, nd, 3, seed=26)
