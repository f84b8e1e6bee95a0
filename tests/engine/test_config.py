"""``IndexerConfig`` (SPEC 8.1, 10): field validation, normalization and derived sizes, the
device, the context-parallel group; the package's exported names."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import nvfp4_indexer as ni

from .step_inputs import H, POISON, expected_rows, make_config, make_step, queries


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
        make_config(**kw)
    assert words in str(e.value)


def test_config_normalizes_and_derives():
    c = make_config(cudagraph_batch_sizes=[8, 2, np.int64(4), 2], max_num_seqs=3)
    assert c.cudagraph_batch_sizes == (2, 4, 8)
    assert c.max_decode_reqs == 8 and c.max_pages == 24
    assert c.gather_pages == ni.max_gather_pages(3072, 512)
    assert c.padded_batch_size(3) == 4 and c.padded_batch_size(9) == 9
    assert c.device == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_heads = 4


def test_context_parallel_group_needs_torch_distributed():
    """A context-parallel Indexer (SPEC 8.2) builds its decoders over torch.distributed: without
    an initialized process group the first decode batch size is refused, naming the group
    (the multi-process runs are in test_context_parallel.py)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a group object, no default group
    ix = ni.Indexer(make_config(context_parallel_group=group), backend="reference")
    with pytest.raises(ValueError, match="group"):
        ix.decoder(1, 1)


@pytest.mark.parametrize("group", ["not-a-group", object(), 0, torch.zeros(1)])
def test_config_refuses_a_context_parallel_group_that_is_not_a_process_group(group):
    """SPEC 8.1, 10: the group is validated at construction, by name (before: accepted, and
    plan raised AttributeError: 'str' object has no attribute 'size')."""
    with pytest.raises(TypeError, match="context_parallel_group: expected None or a "
                       "torch.distributed.ProcessGroup"):
        make_config(context_parallel_group=group)


def test_config_device_compares_as_torch_does(cache):
    """SPEC 10: a tensor is on the configured device when ``torch.empty(0, device=...)``
    would be there: "cpu:0" is the CPU (before: every CPU step was refused, "expected a tensor
    on cpu:0 ..., got device cpu"); a device that does not exist is a ValueError."""
    c = make_config(device="cpu:0")
    assert c.device == torch.device("cpu")
    ix = ni.Indexer(c, backend="reference")
    step = make_step([2, 2, 9], [300, 2500, 2900], 2)
    q, out = queries(13), torch.full((13, H, 16), POISON, dtype=torch.int32)
    ix.forward(q, cache, ix.plan(step), out)
    assert torch.equal(out, expected_rows(q, cache, step, 2, 2))
    for bad in ("bogus", "cuda:64", 3.5):
        with pytest.raises(ValueError, match="device: expected"):
            make_config(device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA devices")
def test_config_cuda_device_without_cuda_names_the_device():
    with pytest.raises(ValueError, match="device"):
        make_config(device="cuda")
