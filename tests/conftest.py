"""Test session setup: without a GPU, Triton kernels run under its CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set here,
before test modules import nvfp4_indexer.triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
