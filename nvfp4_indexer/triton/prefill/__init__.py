"""Prefill (SPEC 7): gather history pages into an FP8 workspace, score it, select top-k.

- ``dispatch``: the rule table (score kernel, splits, window, row blocks, gather shape) and
  its constants.
- ``gather``: the gather kernel, ``GatherLauncher``, ``gather_into``, ``gather_index_k_fp8``.
- ``prefill``: the Triton score and merge kernels.
- ``prefill_wgmma``: the Gluon score kernel (CUDA SM90).
- ``launch``: ``resolve_prefill`` / ``plan_prefill_chunk`` / ``launch_prefill_chunk`` (what
  ``prefill_indexer`` and the engine's ``Indexer`` run) and ``prefill_indexer``.
"""

from .gather import GatherLauncher, gather_index_k_fp8, gather_into, gather_launcher
from .launch import (PrefillLaunchPlan, PrefillSettings, fp8_config, launch_prefill_chunk,
                     plan_prefill_chunk, prefill_indexer, resolve_prefill)

__all__ = ["GatherLauncher", "gather_index_k_fp8", "gather_into", "gather_launcher",
           "PrefillLaunchPlan", "PrefillSettings", "fp8_config", "launch_prefill_chunk",
           "plan_prefill_chunk", "prefill_indexer", "resolve_prefill"]
