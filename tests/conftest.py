"""Test session setup: without a GPU, Triton kernels run under its CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set here,
before test modules import nvfp4_indexer.triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip when there is no CUDA device (the marker's meaning)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
