"""Bad input to ``Indexer.plan`` / ``forward`` (SPEC 10): refused with a clear exception naming
the field before anything is written (the last good plan still stands); metadata of another
Indexer, by hand or edited; ``out`` overlapping what forward reads; the fast host checks of
plan and forward accept only what the full checks accept."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import nvfp4_indexer as ni

from .step_inputs import DEV, H, MIXED, POISON, expected_rows, make_config, make_step, queries


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
    ix = ni.Indexer(make_config(), backend="reference")
    good = ix.plan(make_step([1, 1, 1], [300, 2500, 130], 3, seed=2))
    bt_before = ix.decode_block_table.clone()
    sl_before = ix.decode_seq_lens.clone()
    q_lens, seqs, nd = MIXED
    step = make_step(q_lens, seqs, nd, seed=4)
    mutate(step)
    with pytest.raises(exc) as e:
        ix.plan(step)
    assert words in str(e.value)
    assert torch.equal(ix.decode_block_table, bt_before)
    assert torch.equal(ix.decode_seq_lens, sl_before)
    out = torch.full((3, H, 16), POISON, dtype=torch.int32)
    ix.forward(queries(3), cache, good, out)  # the last good plan still stands
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
    ix = ni.Indexer(make_config(), backend="reference")
    with pytest.raises(ValueError) as e:
        ix.plan(make_step(q_lens, seqs, nd))
    assert words in str(e.value)
    assert not ix.decoders


@pytest.mark.parametrize("q_lens,seqs,nd,field,words", [
    ([2, 2, 0, 5], [300, 300, 200, 400], 2, "query_start_loc_cpu", "q_len >= 1"),
    ([2, 2, 50], [300, 300, 40], 2, "seq_lens_cpu", "q_len <= seq_len"),
])
def test_prefill_errors_name_their_field(q_lens, seqs, nd, field, words):
    ix = ni.Indexer(make_config(), backend="reference")
    with pytest.raises(ValueError) as e:
        ix.plan(make_step(q_lens, seqs, nd))
    assert str(e.value).startswith(field + ":") and words in str(e.value)
    assert not ix.decoders


def test_mixed_step_max_num_seqs():
    """A step with prefill requests has no padding: at most max_num_seqs requests in all
    (a decode-only step may be padded up to the largest CUDA-graph size)."""
    ix = ni.Indexer(make_config(max_num_seqs=4), backend="reference")
    before = ix.decode_block_table.clone()
    for fast in (True, False):
        step = make_step([1, 1, 1, 1, 9], [300, 400, 500, 600, 2000], 4)
        if not fast:
            step.num_decodes = np.int64(4)  # other int types take the full checks
        with pytest.raises(ValueError) as e:
            ix.plan(step)
        assert "max_num_seqs=4" in str(e.value) and str(e.value).startswith("step:")
    assert torch.equal(ix.decode_block_table, before) and not ix.decoders
    assert ix.plan(make_step([1, 1, 1, 9], [300, 400, 500, 2000], 3)).num_rows == 12
    md = ix.plan(make_step([1] * 5 + [0] * 3, [300] * 5 + [0] * 3, 8))  # padded to 8 > 4
    assert md.decode_only and md.num_decodes == 8


def test_forward_bad_shapes(cache):
    ix = ni.Indexer(make_config(), backend="reference")
    md = ix.plan(make_step([2, 2], [300, 2500], 2))
    out = torch.full((4, H, 16), POISON, dtype=torch.int32)
    with pytest.raises(ValueError, match="index_q"):
        ix.forward(queries(3), cache, md, out)
    with pytest.raises(ValueError, match="out"):
        ix.forward(queries(4), cache, md, out[:3])
    with pytest.raises(ValueError, match="index_q"):
        ix.forward(ni.encode_e4m3(torch.randn(4, 3, 128)), cache, md, out)
    assert bool((out == POISON).all())


def test_forward_refuses_bad_caches_and_metadata_before_writing(cache):
    """Review findings (SPEC 10): an empty cache is refused by name on both backends; on the
    reference backend a prefill block id outside the cache raises before the decode rows are
    written; the plan's metadata cannot be edited (it sizes what forward writes)."""
    for backend in ("reference", "triton"):
        ix = ni.Indexer(make_config(), backend=backend)
        md = ix.plan(make_step([2, 2, 9], [300, 2500, 2900], 2))
        out = torch.full((13, H, 16), POISON, dtype=torch.int32)
        with pytest.raises(ValueError, match="cache"):
            ix.forward(queries(13), ni.new_index_cache(0), md, out)
        assert bool((out == POISON).all())
        with pytest.raises(dataclasses.FrozenInstanceError):
            md.num_rows = 4
    ix = ni.Indexer(make_config(), backend="reference")
    step = make_step([2, 2, 9], [300, 2500, 2900], 2)
    step.block_table[2, 5] = 10 ** 6  # a prefill page past the cache
    md = ix.plan(step)
    out = torch.full((13, H, 16), POISON, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        ix.forward(queries(13), cache, md, out)
    assert bool((out == POISON).all())


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
    step = _on_dev(make_step([2, 2, 9], [300, 2500, 2900], 2))
    a = ni.Indexer(make_config(device=DEV), backend=backend)
    b = ni.Indexer(make_config(device=DEV), backend=backend)
    md_a, md_b = a.plan(step), b.plan(step)
    assert md_a.generation == md_b.generation
    q, out = queries(13).to(DEV), _poisoned(13)
    with pytest.raises(ValueError, match="metadata: expected the IndexerMetadata this "
                       "Indexer's latest plan.. returned, got metadata of another Indexer"):
        b.forward(q, cache, md_a, out)
    four = ni.Indexer(make_config(num_heads=4, device=DEV), backend=backend)
    with pytest.raises(ValueError, match=r"another Indexer \(num_heads=4\)"):
        a.forward(q, cache, four.plan(step), out)
    assert bool((out == POISON).all())
    b.forward(q, cache, md_b, out)
    assert torch.equal(out.cpu(), expected_rows(q.cpu(), cache.cpu(), make_step([2, 2, 9],
                                                                        [300, 2500, 2900], 2),
                                            2, 2))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_refuses_hand_built_and_changed_metadata_by_field(cache, backend):
    """Metadata built by hand (``decoder=None``) or copied with a field changed is refused
    with a ValueError naming the field (before: AttributeError: 'NoneType' object has no
    attribute 'run'); a faithful copy is the plan's metadata."""
    cache = cache.to(DEV)
    ix = ni.Indexer(make_config(device=DEV), backend=backend)
    md = ix.plan(_on_dev(make_step([2, 2, 9], [300, 2500, 2900], 2)))
    q, out = queries(13).to(DEV), _poisoned(13)
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
    ix = ni.Indexer(make_config(device=DEV), backend=backend)
    step = _on_dev(make_step([2, 2, 9], [300, 2500, 2900], 2))
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
        ix.forward(queries(20).to(DEV), cache, md, big)
    assert torch.equal(big, snap)


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
    ix = ni.Indexer(make_config(), backend="reference")
    bases = [make_step([1] * 5, [300, 2500, 130, 1, 3000], 5),
             make_step([3, 3, 3, 0], [2300, 4, 2700, 0], 4),
             make_step(*MIXED),
             make_step([4, 4, 9, 1], [40, 2000, 9, 1], 2),
             make_step([7, 20], [7, 2000], 0)]
    bases.append(make_step([2, 2, 9], [300, 2500, 2900], 2))  # one prefill request
    bases.append(make_step([5], [2900], 0))

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


def test_forward_plain_checks_imply_full_checks(cache):
    """forward's fast checks accept only what the full checks accept."""
    ix = ni.Indexer(make_config(), backend="reference")
    md = ix.plan(make_step([2, 2, 9], [300, 2500, 2900], 2))
    q, out = queries(13), torch.empty((13, H, 16), dtype=torch.int32)
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
    stale = dataclasses.replace(md, generation=md.generation - 1)
    assert not ix._forward_inputs_plain(q, cache, stale, out)
