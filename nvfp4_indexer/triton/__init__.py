"""Triton backend: one kernel per module, each with a plain-Python launcher.

Modules are imported lazily by ``nvfp4_indexer.api`` (nothing heavy is imported here):

- ``numerics``: shared ``@triton.jit`` device functions for E4M3 / E2M1 / NVFP4 (SPEC 1).
- ``encode``: ``encode_e4m3`` (SPEC 1.1).
- ``quantize``: ``quantize_nvfp4`` and ``write_index_k`` (SPEC 1.3, 2).
- ``dequantize``: ``dequantize_nvfp4`` (SPEC 1.4).
- ``insert``: fused RMSNorm + RoPE + quantize + paged write, ``insert_index_k`` (SPEC 3).
- ``query``: fused RMSNorm + RoPE + E4M3 encode of index queries, ``prepare_index_q`` (SPEC 3).
- ``gather``: history pages -> FP8 workspace, ``gather_index_k_fp8`` / ``gather_into`` (SPEC 7).

Kernels run on Hopper (SM90) and Blackwell GPUs and, for tests, on CPU tensors under the Triton
interpreter. ``TRITON_INTERPRET=1`` must be in the environment *before* these modules are first
imported: Triton reads it when ``@triton.jit`` decorates a function (import time), choosing an
interpreted or a compiled kernel once and for all.
"""

from ._interpreter_compat import patch as _patch_interpreter

_patch_interpreter()  # numpy >= 2.4 under TRITON_INTERPRET=1 (see _interpreter_compat)
