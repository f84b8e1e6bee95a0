"""Fixtures of the engine tests: ``cache`` (96 blocks of random keys, a padded page stride)
and ``gluon_twin`` (the Gluon prefill branch on the CPU)."""

from __future__ import annotations

import pytest
import torch

import nvfp4_indexer as ni


@pytest.fixture(scope="module")
def cache():
    """96 blocks of random keys in a random slot order, page stride 9216 + 16 (CPU)."""
    nb = 96
    gen = torch.Generator().manual_seed(3)
    c = ni.new_index_cache(nb, page_stride=9216 + 16)
    ni.write_index_k(c, torch.randn(nb * 128, 128, generator=gen),
                     torch.randperm(nb * 128, generator=gen), backend="reference")
    return c


@pytest.fixture
def gluon_twin(monkeypatch):
    """The Gluon prefill branch on the CPU: its probe says yes and the Gluon kernel is its
    Triton twin under the Gluon contract (``kernel_harness.gluon_twin_kernel``); plans are
    rebuilt. Construct the Indexer inside (it resolves the branch once)."""
    from kernel_harness import gluon_twin_in_place
    launch = gluon_twin_in_place(monkeypatch)
    yield launch
    launch.plan_prefill_chunk.cache_clear()
