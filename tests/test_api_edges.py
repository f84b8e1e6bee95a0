"""Edge cases found by a newcomer review: wrapper planning failures, empty batches, the Triton
backend off CUDA, integer arguments, float64 inputs (SPEC 10, 11)."""

import pytest
import torch

import nvfp4_indexer as ni

# Triton runs on CUDA tensors, or on CPU tensors under the interpreter (conftest sets it
# without a GPU).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(b=2, w=4, h=2, device="cpu"):
    cache = ni.new_index_cache(8, device=device)
    torch.manual_seed(0)
    bt = torch.randperm(8)[: b * w].view(b, w).to(torch.int32).to(device)
    seq = torch.full((b,), w * 128, dtype=torch.int32, device=device)
    return cache, bt, seq


def test_failed_plan_writes_nothing_and_leaves_wrapper_unplanned():
    cache, bt, seq = _batch(device=DEV)
    btb = torch.full_like(bt, 7)
    slb = torch.full_like(seq, 0)
    w = ni.DecodeIndexerWrapper(16, block_table_buffer=btb, seq_lens_buffer=slb,
                                backend="triton")  # Triton interpreter on CPU (conftest)
    with pytest.raises(NotImplementedError, match="query_len \\* num_heads"):
        w.plan(bt, seq, 8)  # Q * H = 128 > 64
    assert torch.all(btb == 7) and torch.all(slb == 0)
    assert w.query_len is None
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(torch.zeros(16, 16, 128, dtype=torch.float8_e4m3fn, device=DEV), cache,
              torch.zeros(16, 16, 16, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_empty_and_all_padding_batches(backend):
    z = dict(dtype=torch.int32, device=DEV)
    cache = ni.new_index_cache(4, device=DEV)
    q0 = torch.zeros(0, 2, 128, dtype=torch.float8_e4m3fn, device=DEV)
    out = ni.decode_indexer(q0, cache, torch.zeros(0, 3, **z), torch.zeros(0, **z), 1,
                            backend=backend)
    assert out.shape == (0, 2, 16)
    q = torch.zeros(2, 2, 128, dtype=torch.float8_e4m3fn, device=DEV)
    out = ni.decode_indexer(q, cache, torch.zeros(2, 0, **z), torch.zeros(2, **z), 1,
                            backend=backend)
    assert out[..., 0].eq(0).all() and out[..., 1:].eq(-1).all()
    out = ni.prefill_indexer(q0, cache, torch.zeros(0, 3, **z), torch.zeros(1, **z),
                             torch.zeros(0, **z), backend=backend)
    assert out.shape == (0, 2, 16)


def test_wrapper_all_padding_width_zero():
    bt = torch.zeros(3, 0, dtype=torch.int32)
    seq = torch.zeros(3, dtype=torch.int32)
    w = ni.DecodeIndexerWrapper(2, block_table_buffer=bt, seq_lens_buffer=seq)
    w.plan(bt, seq, 2)
    out = torch.full((6, 2, 16), 5, dtype=torch.int32)
    w.run(torch.zeros(6, 2, 128, dtype=torch.float8_e4m3fn), ni.new_index_cache(1), out)
    assert out[..., 0].eq(0).all() and out[..., 1:].eq(-1).all()


def test_triton_backend_on_cpu_without_interpreter_names_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = ni.new_index_cache(1)
    with pytest.raises(ValueError, match="backend"):
        ni.write_index_k(cache, torch.randn(2, 128), torch.tensor([0, 1]), backend="triton")
    assert cache.eq(0).all()


def test_zero_heads_and_bool_arguments_are_refused():
    cache, bt, seq = _batch()
    with pytest.raises(ValueError, match="index_q"):
        ni.decode_indexer(torch.zeros(2, 0, 128, dtype=torch.float8_e4m3fn), cache, bt, seq, 1,
                          backend="reference")
    with pytest.raises(ValueError, match="num_blocks"):
        ni.new_index_cache(True)
    with pytest.raises(ValueError, match="block"):
        ni.read_index_k(cache, True)
    with pytest.raises(ValueError, match="max_model_len"):
        ni.max_gather_pages(True, 4)
    import numpy as np
    assert ni.max_gather_pages(np.int64(1000), 10) == 8  # numpy integers are integers


def test_float64_inputs_are_converted_to_fp32_first():
    k = torch.randn(5, 128, dtype=torch.float64)
    c1, c2 = ni.new_index_cache(1), ni.new_index_cache(1)
    slots = torch.arange(5)
    ni.write_index_k(c1, k, slots, backend="reference")
    ni.write_index_k(c2, k.float(), slots, backend="reference")
    assert torch.equal(c1, c2)


def test_plan_checks_block_ids_against_num_blocks():
    cache, bt, seq = _batch()
    w = ni.DecodeIndexerWrapper(2, block_table_buffer=bt.clone(), seq_lens_buffer=seq.clone())
    with pytest.raises(ValueError, match=r"block_table: expected block ids in \[0, 3\)"):
        w.plan(bt, seq, 1, num_blocks=3)
    bad = bt.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="block ids >= 0"):
        w.plan(bad, seq, 1)
