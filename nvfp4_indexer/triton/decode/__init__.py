"""Triton / Gluon decode indexer (SPEC 4-6, 8.2): every decode kernel and the rule that picks them.

- ``dispatch``: the rule table: ``plan_decode`` / ``plan_context_parallel`` turn a static shape,
  a ``DecodeConfig`` and the device's capability into a frozen plan naming every kernel and
  its launch parameters (every decode constant lives there).
- ``runner``: ``DecodeRunner`` (executes a plan; capturable), ``score_buffer_size``,
  ``decode_indexer``.
- ``split_kernel``: the one-launch kernel (split-K over pages, fused top-k) and its Triton
  merge.
- ``page_scores``: the page-score family's launch (``PageScoreLaunch``), flat partition and
  plain-Triton "lut" scorer; its Gluon scorers ``mma``, ``wgflat``, ``wgmma`` and their shared
  device functions ``fragments``; the table lookup ``lut``.
- ``select`` (plain Triton) and ``redux`` (Gluon): the select kernels of the page-score family
  and the Gluon merge of the one-launch kernel.
- ``context_parallel``: ``ContextParallelRunner`` (one rank's share, SPEC 8.2).

Nothing here imports a Gluon kernel module until a plan needs it.
"""

from ..dot_modes import SCORE_ERROR_BITS
from .context_parallel import ContextParallelRunner
from .dispatch import DecodePlan, plan_context_parallel, plan_decode
from .runner import DecodeRunner, decode_indexer, score_buffer_size

__all__ = ["SCORE_ERROR_BITS", "ContextParallelRunner", "DecodePlan", "plan_context_parallel",
           "plan_decode", "DecodeRunner", "decode_indexer", "score_buffer_size"]
