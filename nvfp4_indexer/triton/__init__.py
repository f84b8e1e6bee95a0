"""Triton backend: one kernel (family) per module, each with a plain-Python launcher.

``nvfp4_indexer.api`` imports this package once, lazily, the first time a Triton backend is
used; every launcher is imported here explicitly, so grep and IDEs see who calls what:

- ``numerics``: shared ``@triton.jit`` device functions for E4M3 / E2M1 / NVFP4 (SPEC 1).
- ``encode``: ``encode_e4m3`` (SPEC 1.1).
- ``quantize``: ``quantize_nvfp4`` and ``write_index_k`` (SPEC 1.3, 2).
- ``dequantize``: ``dequantize_nvfp4`` (SPEC 1.4).
- ``insert``: fused RMSNorm + RoPE + quantize + paged write, ``insert_index_k`` (SPEC 3).
- ``query``: fused RMSNorm + RoPE + E4M3 encode of index queries, ``prepare_index_q`` (SPEC 3).
- ``scores``: ``page_scores`` (SPEC 4).
- ``decode``: ``DecodeRunner`` / ``decode_indexer`` (SPEC 5, 6), ``ContextParallelRunner``
  (SPEC 8.2), their kernels and ``decode.dispatch``, the rule that picks them.
- ``prefill``: ``prefill_indexer`` (SPEC 5, 7) and the gather of history pages into the FP8
  workspace, ``gather_index_k_fp8`` / ``gather_into`` (SPEC 7); their kernels and
  ``prefill.dispatch``, the rule that picks them.
- ``config``: the launchers' tuning configs (``DecodeConfig``, ``PrefillConfig``,
  ``GatherConfig``, ``InsertConfig``); ``heuristics``: the host rules that pick launch
  shapes (splits, windows, scratch sizes).

Kernels run on Hopper (SM90) and Blackwell GPUs and, for tests, on CPU tensors under the Triton
interpreter. ``TRITON_INTERPRET=1`` must be in the environment *before* this package is first
imported: Triton reads it when ``@triton.jit`` decorates a function (import time), choosing an
interpreted or a compiled kernel once and for all.
"""

from ._interpreter_compat import patch as _patch_interpreter

_patch_interpreter()  # numpy >= 2.4 under TRITON_INTERPRET=1 (see _interpreter_compat)

# ruff: noqa: E402  (the interpreter patch must run before the kernels are decorated)
from . import heuristics
from .config import DecodeConfig, GatherConfig, InsertConfig, PrefillConfig
from .decode import ContextParallelRunner, DecodeRunner, decode_indexer, score_buffer_size
from .dequantize import dequantize_nvfp4
from .encode import encode_e4m3
from .insert import insert_index_k
from .prefill import gather_index_k_fp8, gather_into, prefill_indexer
from .quantize import quantize_nvfp4, write_index_k
from .query import prepare_index_q
from .scores import page_scores

__all__ = [
    "heuristics", "DecodeConfig", "GatherConfig", "InsertConfig", "PrefillConfig",
    "ContextParallelRunner", "DecodeRunner", "decode_indexer", "score_buffer_size",
    "dequantize_nvfp4", "encode_e4m3", "gather_index_k_fp8", "gather_into", "insert_index_k",
    "prefill_indexer", "quantize_nvfp4", "write_index_k", "prepare_index_q", "page_scores",
]
