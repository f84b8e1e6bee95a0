"""``triton.prefill.launch``: ``prefill_indexer`` and the chunk plan / launch the engine's
``Indexer`` shares (SPEC 4, 5, 7, 9, 10).

CPU (interpreter): selections against the exact reference (tie-aware, SPEC 9) over chunks,
splits, windows and BLOCK_M, NaN pages in both MMA orientations, tuning checks before
anything is written, ``resolve_prefill``'s kernel choice, and the Gluon branch with its
Triton twin in the kernel's place (its launch contract: grid, constexprs, scratch) and the
fp8 routing. GPU: realistic sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nvfp4_indexer as ni
from nvfp4_indexer.conformance.fixtures import OUT_POISON
from kernel_harness import (DEV, HAS_CUDA, assert_guards, assert_unchanged, check_selection,
                          gluon_twin_in_place, local_pages, poisoned_out, prefill_batch, random_q,
                          rows_request_of, score_bits, snapshot)
from nvfp4_indexer import reference as ref
from nvfp4_indexer.triton.config import PrefillConfig
from nvfp4_indexer.triton.prefill import dispatch as D
from nvfp4_indexer.triton.prefill import launch as L
from nvfp4_indexer.triton.prefill import prefill_wgmma as PW

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy NaN in interpreter
BITS = score_bits()


@pytest.mark.parametrize("heads,num_splits,budget,window,block_m",
                         [(1, None, None, None, None), (2, 1, 40, 4, None), (2, 3, 17, 2, None),
                          (2, 2, None, 2, 16)])
def test_prefill_matches_reference(heads, num_splits, budget, window, block_m):
    # Rows straddling page 16 (short and long rows in one block), a one-token request, a
    # request without history, context-free long prompt; budget 17 forces one request per
    # chunk for the long ones.
    specs = [(24, 2060), (1, 1), (3, 2300), (6, 6), (20, 2140)]
    batch, qsl = prefill_batch(specs, seed=40 + heads, alias=[(2, 1, 4)])
    t = int(qsl[-1])
    q = random_q(t, heads, seed=heads)
    snap = snapshot(batch, q)
    big, out = poisoned_out(t, heads)
    if budget is None:
        budget = ref.max_gather_pages(batch.width * 128, t)
    cfg = PrefillConfig(num_splits=num_splits, window=window, block_m=block_m)
    L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, budget,
                            out, config=cfg)
    assert_guards(big)
    assert_unchanged(batch, q, snap)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS, [(2, 1, 4)],
                    rows_request_of(qsl))


def test_prefill_api_and_nan_page():
    batch, qsl = prefill_batch([(4, 2200), (2, 130)], seed=51)
    batch.page_bytes(int(batch.block_table[0, 5]))[8192:] = 0x7F
    q = random_q(6, 1, seed=7)
    out = ni.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens,
                             backend="triton")
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    assert torch.isnan(exact[:4, :, 5]).all()
    check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS)
    assert (out[:4, 0, :15] != 5).all(), "the NaN page must be the one left out (L = 17)"
    # tuning overrides are checked before anything runs (a bad one never leaves out unwritten)
    for kw in ({"num_splits": 0}, {"num_splits": -2}, {"num_splits": 2.5}, {"window": 3},
               {"block_m": 48}, {"block_m": 512}, {"num_warps": 3}, {"num_stages": 0},
               {"block_m": True}, {"num_warps": 4.0}, {"num_stages": True},
               {"window": 64, "block_m": 128}, {"tokens_on_n": 1},
               {"gather": "no"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens,
                                    64, out, config=PrefillConfig(**kw))


@pytest.mark.parametrize("tokens_on_n", [None, False, True])
def test_prefill_partial_nan_page(tokens_on_n):
    """SPEC 4 in both MMA orientations: a page whose first 40 tokens have NaN scales scores the
    max of its other tokens (and is selected where that ranks it), a page of NaN tokens only is
    NaN and left out."""
    batch, qsl = prefill_batch([(4, 2200), (2, 130)], seed=52)
    batch.page_bytes(int(batch.block_table[0, 3]))[8192:8192 + 8 * 40] = 0x7F
    batch.page_bytes(int(batch.block_table[0, 5]))[8192:] = 0x7F
    q = random_q(6, 1, seed=9)
    big, out = poisoned_out(6, 1)
    L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 64, out,
                            config=PrefillConfig(tokens_on_n=tokens_on_n))
    assert_guards(big)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    assert torch.isfinite(exact[:4, :, 3]).all() and torch.isnan(exact[:4, :, 5]).all()
    # the test can fail: page 3 ranks inside some row's top 15 of its 17 history pages
    ranks = (exact[:4, 0, :17].nan_to_num(float("-inf")) > exact[:4, 0, 3:4]).sum(-1)
    assert (ranks < 15).any()
    check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS)
    assert (out[:4, 0, :15] != 5).all()
    assert ((out[:4, 0, :15] == 3).any(-1) == (ranks < 15)).all()


def test_kernel_knob_checked():
    """``PrefillConfig.kernel`` takes None / "triton" / "wgmma"; "wgmma" where it cannot run is
    refused before anything is written."""
    for bad in ("gluon", 1, True):
        with pytest.raises(ValueError, match="kernel"):
            PrefillConfig(kernel=bad)
    if HAS_CUDA and D.prefill_wgmma_ok(torch.device(DEV), "fp16", True):
        cfgs = [PrefillConfig(kernel="wgmma", tokens_on_n=False),
                PrefillConfig(kernel="wgmma", dot="bf16")]
    else:
        cfgs = [PrefillConfig(kernel="wgmma")]
    batch, qsl = prefill_batch([(4, 2200)], seed=3)
    q = random_q(4, 1, seed=3)
    for cfg in cfgs:
        big, out = poisoned_out(4, 1)
        with pytest.raises(ValueError, match="kernel"):
            L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 64,
                                    out, config=cfg)
        assert_guards(big)
        assert (out == OUT_POISON).all()


@pytest.mark.gpu
@pytest.mark.parametrize("specs,budget", [
    ([(1024, 32768 + 1024)], None),
    ([(1024, 1024)] * 2 + [(2048, 34816), (512, 131072 + 512)], None),
    ([(4096, 4096), (1024, 33792), (256, 20000)], 300),  # several chunks
])
@pytest.mark.parametrize("tokens_on_n", [None, False])
def test_gpu_prefill_realistic(specs, budget, tokens_on_n):
    heads = 4
    batch, qsl = prefill_batch(specs, seed=len(specs), page_stride=9216)
    t = int(qsl[-1])
    q = random_q(t, heads, seed=t)
    big, out = poisoned_out(t, heads)
    if budget is None:
        budget = ref.max_gather_pages(batch.width * 128, t)
    L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, budget, out,
                            config=PrefillConfig(tokens_on_n=tokens_on_n))
    torch.cuda.synchronize()
    assert_guards(big)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS)


# ------------------------------------------------------------------ the Gluon branch on the CPU

@pytest.fixture
def gluon_twin(monkeypatch):
    """The Gluon branch on the CPU: ``prefill_wgmma_ok`` says yes, the Gluon kernel is
    ``kernel_cases.gluon_twin_kernel``, plans are rebuilt. Yields the list of the chunks' ``(kernel, score grid, BLOCK_M, candidate elements, window
    elements, the score launch's other constexprs and options)`` as ``launch_prefill_chunk``
    got them."""
    calls = []
    launch = L.launch_prefill_chunk

    def spy(plan, q8, ws8, ws_off, req_base, qsl, seq_lens, caps, blocks, cand, win, out):
        kw = plan.score.kwargs
        opts = {k: v for k, v in kw.items() if k not in ("H", "BLOCK_M", "NUM_SPLITS")}
        calls.append((plan.shape["kernel"], plan.score_grid, plan.block_m, cand.numel(),
                      win.numel(), opts))
        launch(plan, q8, ws8, ws_off, req_base, qsl, seq_lens, caps, blocks, cand, win, out)
    gluon_twin_in_place(monkeypatch)
    monkeypatch.setattr(L, "launch_prefill_chunk", spy)
    yield calls
    L.plan_prefill_chunk.cache_clear()


@pytest.mark.skipif(HAS_CUDA, reason="CPU plumbing check (the GPU test runs the kernel)")
@pytest.mark.parametrize("num_splits,block_m,gluon", [(1, 128, True), (2, 128, True),
                                                      (3, 128, False), (1, 64, False)])
def test_prefill_indexer_gluon_branch_on_cpu(gluon_twin, num_splits, block_m, gluon):
    """``prefill_indexer``'s Gluon branch: a chunk whose splits keep 16 with BLOCK_M 128 takes
    it with the contract's grid, constexprs (``launch_options``) and scratch (candidates
    ``[rows, splits, 16]`` or none, no window scratch); the output (written by the score
    kernel for one split, by the KEEP-16 merge otherwise) passes the reference judge. At most
    8 pages per split (3 splits of 18 pages) and BLOCK_M 64 take the Triton kernel."""
    specs = [(20, 2300), (3, 2200), (5, 40)]  # 18 / 17 pages, and short rows only
    batch, qsl = prefill_batch(specs, seed=61)
    batch.page_bytes(int(batch.block_table[0, 4]))[8192:] = 0x7F  # a NaN page
    t, heads = int(qsl[-1]), 2
    q = random_q(t, heads, seed=62)
    big, out = poisoned_out(t, heads)
    cfg = PrefillConfig(num_splits=num_splits, block_m=block_m)
    L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 10**6, out,
                      config=cfg)
    assert_guards(big)
    (kernel, grid, bm, cand, win, opts), = gluon_twin
    assert (kernel == "wgmma") == gluon and bm == block_m and grid[1] == num_splits
    if gluon:
        assert opts == PW.launch_options() and win == 1
        assert cand == (grid[0] * block_m * num_splits * 16 if num_splits > 1 else 1)
    exact, mag = ref.page_scores(q, batch.cache, batch.block_table, batch.seq_lens, qsl,
                                 with_magnitude=True)
    check_selection(out, exact, mag, local_pages(batch.seq_lens, qsl), BITS)


@pytest.mark.skipif(HAS_CUDA, reason="CPU plumbing check (the GPU test runs the kernel)")
@pytest.mark.parametrize("knob", [{"window": 2}, {"num_stages": 2}])
def test_triton_knobs_select_the_triton_kernel(gluon_twin, knob):
    """With ``kernel`` None a window or num_stages (knobs of the Triton kernel only) selects the
    Triton kernel for every chunk; with ``kernel="wgmma"`` they are ignored."""
    batch, qsl = prefill_batch([(20, 2300)], seed=63)
    q = random_q(20, 2, seed=64)
    for kernel, gluon in ((None, False), ("wgmma", True)):
        gluon_twin.clear()
        big, out = poisoned_out(20, 2)
        cfg = PrefillConfig(num_splits=1, block_m=128, kernel=kernel, **knob)
        L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 10**6,
                          out, config=cfg)
        assert_guards(big)
        assert [c[0] == "wgmma" for c in gluon_twin] == [gluon], (kernel, gluon_twin)


@pytest.mark.skipif(HAS_CUDA, reason="CPU plumbing check (the GPU test runs the kernel)")
@pytest.mark.parametrize("cfg_kw,gluon_fp8", [
    ({}, True),  # the Gluon chunk in E4M3 form, the Triton chunks exact (fp16, tokens on N)
    ({"kernel": "triton"}, False),  # the Triton kernel's fp8 (tokens on M) everywhere
    ({"tokens_on_n": False}, False),
])
def test_prefill_fp8_routing(gluon_twin, monkeypatch, cfg_kw, gluon_fp8):
    """``PrefillConfig(dot="fp8")`` where the Gluon kernel runs: its chunks get
    ``launch_options(fp8=True)`` (``FP8=1``), chunks off it (BLOCK_M 64) the exact
    ``DOT="fp16"`` with tokens on N; with the Triton kernel asked for, or tokens on M, every
    chunk is the Triton kernel's ``DOT="fp8"``. (Plans only: the chunk launches are the
    spy's.)"""
    plans = []
    monkeypatch.setattr(L, "prefill_wgmma_ok", lambda dev, dot, tokens_n: bool(tokens_n))
    monkeypatch.setattr(L, "resolve_dot", lambda dot, dev: dot or "fp32")
    monkeypatch.setattr(L, "launch_prefill_chunk", lambda plan, *a: plans.append(plan))
    batch, qsl = prefill_batch([(20, 2300), (12, 2600)], seed=71)
    q = random_q(32, 2, seed=72)
    for block_m in (128, 64):  # BLOCK_M 64: never the Gluon kernel's
        plans.clear()
        big, out = poisoned_out(32, 2)
        cfg = PrefillConfig(dot="fp8", num_splits=1, block_m=block_m, **cfg_kw)
        L.prefill_indexer(q, batch.cache, batch.block_table, qsl, batch.seq_lens, 10**6, out,
                          config=cfg)
        assert_guards(big)
        (plan,) = plans
        kw = plan.score.kwargs
        if not gluon_fp8:
            want = ("triton", "fp8", False)
            got = (plan.shape["kernel"], kw["DOT"], kw["TOKENS_N"])
        elif block_m == 128:
            want = ("wgmma", 1, PW.launch_options(True))
            got = (plan.shape["kernel"], kw["FP8"], {k: v for k, v in kw.items()
                                                     if k not in ("H", "BLOCK_M", "NUM_SPLITS")})
        else:
            want = ("triton", "fp16", True)
            got = (plan.shape["kernel"], kw["DOT"], kw["TOKENS_N"])
        assert got == want, (block_m, got)


def test_resolve_prefill_and_plan(monkeypatch):
    """``resolve_prefill``: the Gluon kernel only where its probe says yes, unless a Triton
    knob is given; the Indexer's and ``prefill_indexer``'s ``allow_fp8_mma`` config
    (``fp8_config``) is None where the E4M3 form cannot run. ``plan_prefill_chunk``: a
    split chunk has a merge launch with ``merge_config``'s rows (the bitonic top-16), an
    unsplit one none; plans of one shape are shared."""
    cpu = torch.device("cpu")
    assert L.fp8_config(cpu, True) is None and L.fp8_config(cpu, False) is None
    s = L.resolve_prefill(cpu)
    assert not s.wgmma and not s.fp8 and s.num_warps == 4
    with pytest.raises(ValueError, match="kernel"):
        L.resolve_prefill(cpu, PrefillConfig(kernel="wgmma"))
    monkeypatch.setattr(L, "prefill_wgmma_ok", lambda dev, dot, tokens_n: bool(tokens_n))
    monkeypatch.setattr(L, "resolve_dot", lambda dot, dev: dot or "fp16")  # as on a GPU
    assert L.resolve_prefill(cpu, PrefillConfig(dot="fp16")).wgmma
    assert not L.resolve_prefill(cpu, PrefillConfig(dot="fp16", window=2)).wgmma
    assert not L.resolve_prefill(cpu, PrefillConfig(dot="fp16", tokens_on_n=False)).wgmma
    f8 = L.resolve_prefill(cpu, PrefillConfig(dot="fp8"))
    assert f8.fp8 and f8.dot == "fp16" and f8.tokens_on_n
    tri = L.resolve_prefill(cpu, PrefillConfig(dot="fp32"))
    plan = L.plan_prefill_chunk(tri, 4, 8, 100, 64, 132, None)
    assert plan is L.plan_prefill_chunk(tri, 4, 8, 100, 64, 132, None)
    ns = plan.shape["ns"]
    assert ns > 1 and plan.score_grid == (8, ns)
    rows = L.merge_config(ns, plan.shape["keep"], sort=True)[0]
    assert plan.merge_grid == (8, -(-64 // rows)) and plan.merge.kwargs["SORT"] == 1
    one = L.plan_prefill_chunk(dataclasses.replace(tri, num_splits=1), 4, 8, 100, 64, 132)
    assert one.merge is None and one.merge_grid is None and one.cand_elems == 0
