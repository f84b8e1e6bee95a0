"""``Indexer.plan`` (SPEC 8.1): what it copies (the prefill staging copy, the decode
buffers' one multi-tensor copy, a mixed step's decode rows read in place), decode wrappers
and buffers that never move, steps kept in the shared decode buffers, and
``StepMetadata.from_vllm``."""

from __future__ import annotations

import types

import pytest
import torch

import nvfp4_indexer as ni

from .step_inputs import (
    H, MIXED, POISON, check_forward, expected_rows, make_config, make_step, queries)


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
    ix = ni.Indexer(make_config(max_model_len=2560, max_num_seqs=8), backend="triton")
    for st in ix._staging:
        st.copies = True  # as on a GPU (on the CPU the device buffer is the host one)
    cases = [
        (make_step([3, 3, 5, 30, 40, 20, 3], [2300, 900, 700, 2000, 2200, 300, 2400], 2),
         ["copy_"]),  # decode (read in place) + three prefill chunks
        (make_step([20, 10, 30], [2400, 2100, 300], 0), ["copy_"]),  # prefill only
        (make_step([2, 2, 0, 0], [300, 2500, 0, 0], 4), ["_foreach_copy_"]),  # decode only
    ]
    for step, want in cases:
        ix.plan(step)  # first use of a decode batch builds its wrapper
        for _ in range(2):  # both staging slots
            assert sorted(_work_ops(lambda: ix.plan(step))) == want


def test_decoder_reused_and_buffers_never_move(cache):
    ix = ni.Indexer(make_config(), backend="reference")
    s1 = make_step([1, 1], [300, 2500], 2)
    md1 = ix.plan(s1)
    ptr = md1.decoder.block_table.data_ptr()
    md2 = ix.plan(make_step([1, 1], [301, 2501], 2, seed=9))
    assert md2.decoder is md1.decoder and md2.decoder.block_table.data_ptr() == ptr
    assert md2.decoder.block_table.data_ptr() == ix.decode_block_table.data_ptr()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_plan_in_place_shared_buffers(cache, backend):
    """An engine may keep a decode-only step's block table / seq lens in the indexer's shared
    decode buffers (no copy); rows equal the copied step's."""
    ix = ni.Indexer(make_config(), backend=backend)
    s = make_step([2, 2, 2], [300, 2500, 2950], 3, width=24, seed=9)
    q = queries(6)
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
    assert torch.equal(out, expected_rows(q, cache, s, nd, 2))


def test_decode_copies_are_one_multi_tensor_copy(monkeypatch):
    """plan copies the step's block table and seq lens into the decode buffers in one
    ``torch._foreach_copy_`` (one launch on CUDA); narrower / wider block tables too."""
    calls = []
    real = torch._foreach_copy_

    def counting(dst, src, **kw):
        calls.append(len(dst))
        return real(dst, src, **kw)
    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    ix = ni.Indexer(make_config(), backend="reference")
    for width in (24, 26, 20):  # max_pages is 24
        ix.decode_block_table.fill_(-9)
        s = make_step([1, 1, 1], [300, 2500, 130], 3, width=width, seed=width)
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
    ix = ni.Indexer(make_config(max_num_seqs=8), backend="triton")
    q_lens, seqs = [2, 2, 2, 9], [300, 2500, 2550, 2400]
    step = make_step(q_lens, seqs, 3, width=width, seed=width)
    ix.plan(make_step([2, 2, 2], seqs[:3], 3, width=width, seed=1))  # the wrapper exists
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
    check_forward(ix, cache, md, step, 3, 2, seed=width)
    # the decode-only step after it copies into the buffers again (its graph reads them)
    dstep = make_step([2, 2, 2], seqs[:3], 3, width=width, seed=width + 1)
    md = ix.plan(dstep)
    assert md.decode_inputs is None
    assert torch.equal(ix.decode_seq_lens[:3], dstep.seq_lens)
    w = min(width, 24)
    assert torch.equal(ix.decode_block_table[:3, :w], dstep.block_table[:, :w])


def test_from_vllm_reads_fields_by_name(cache):
    q_lens, seqs, nd = MIXED
    s = make_step(q_lens, seqs, nd)
    upper = s.seq_lens_cpu + 1
    cam = types.SimpleNamespace(query_start_loc=s.query_start_loc,
                                query_start_loc_cpu=s.query_start_loc_cpu, seq_lens=s.seq_lens,
                                seq_lens_cpu_upper_bound=upper, seq_lens_cpu=s.seq_lens_cpu,
                                block_table_tensor=s.block_table, num_reqs=len(seqs))
    st = ni.StepMetadata.from_vllm(cam, nd)
    assert st.seq_lens_cpu is upper and st.block_table is s.block_table and st.num_decodes == nd
    cam.seq_lens_cpu_upper_bound = None
    assert ni.StepMetadata.from_vllm(cam, nd).seq_lens_cpu is s.seq_lens_cpu
    ix = ni.Indexer(make_config(), backend="reference")
    md = ix.plan(ni.StepMetadata.from_vllm(cam, nd))
    q = queries(sum(q_lens))
    out = ix.forward(q, cache, md, torch.empty((sum(q_lens), H, 16), dtype=torch.int32))
    assert torch.equal(out, expected_rows(q, cache, s, nd, 2))
    del cam.block_table_tensor
    with pytest.raises(AttributeError, match="block_table_tensor"):
        ni.StepMetadata.from_vllm(cam, nd)
    del cam.seq_lens, cam.seq_lens_cpu
    with pytest.raises(AttributeError) as e:  # every missing field is named
        ni.StepMetadata.from_vllm(cam, nd)
    assert all(w in str(e.value) for w in ("block_table_tensor", "'seq_lens'", "seq_lens_cpu"))
