"""The context-parallel Triton runner (``triton.decode.context_parallel``): construction checks.
Its kernels run in ``tests/test_context_parallel.py`` (ranks in one process and over gloo)."""

from __future__ import annotations

import pytest

from nvfp4_indexer.triton.config import DecodeConfig
from nvfp4_indexer.triton.decode import ContextParallelRunner


def test_runner_errors():
    """Bad sizes, rank, rows per program and config are refused by name at construction."""
    with pytest.raises(NotImplementedError, match="group size"):
        ContextParallelRunner(8, 4, 0, 2, 40, 4, "cpu", warmup=False)
    with pytest.raises(ValueError, match="rank"):
        ContextParallelRunner(1, 2, 2, 2, 40, 1, "cpu", warmup=False)
    with pytest.raises(ValueError, match="rows_per_program"):
        ContextParallelRunner(1, 2, 0, 2, 40, 1, "cpu", rows_per_program=3, warmup=False)
    with pytest.raises(ValueError, match="num_splits"):
        ContextParallelRunner(1, 2, 0, 2, 40, 1, "cpu", config=DecodeConfig(num_splits=0), warmup=False)
