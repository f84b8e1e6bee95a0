"""nvfp4_indexer: page selection for sparse attention over an NVFP4 index-K cache.

The public API (SPEC 11) lives in ``nvfp4_indexer.api`` and is re-exported here. The names are
resolved on first use (PEP 562), so ``import nvfp4_indexer`` and ``nvfp4-indexer --help`` /
``--version`` do not import torch.
"""

from typing import TYPE_CHECKING

from .constants import HEAD_DIM, PAGE_BYTES, PAGE_SIZE, SPEC_VERSION, TOPK

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from .api import (DecodeIndexerWrapper, decode_indexer, dequantize_nvfp4, encode_e4m3,
                      gather_index_k_fp8, insert_index_k, max_gather_pages, new_index_cache,
                      page_scores, prefill_indexer, prepare_index_q, quantize_nvfp4,
                      read_index_k, write_index_k)
    from .engine import Indexer, IndexerConfig, IndexerMetadata, StepMetadata

__version__ = "0.1.0"  # the one place (pyproject reads it)

__all__ = [
    "PAGE_SIZE", "HEAD_DIM", "TOPK", "PAGE_BYTES", "SPEC_VERSION", "encode_e4m3",
    "quantize_nvfp4", "dequantize_nvfp4", "new_index_cache", "write_index_k", "read_index_k",
    "insert_index_k", "prepare_index_q", "gather_index_k_fp8", "page_scores", "decode_indexer",
    "prefill_indexer", "DecodeIndexerWrapper", "max_gather_pages",
    "IndexerConfig", "Indexer", "StepMetadata", "IndexerMetadata",
]

_ENGINE_NAMES = ("Indexer", "IndexerConfig", "IndexerMetadata", "StepMetadata")
# exported name -> submodule defining it (imported on first access; the constants are eager)
_LAZY = {name: ".engine" if name in _ENGINE_NAMES else ".api"
         for name in __all__ if name not in globals()}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module == ".api":
        from . import api as source
    else:
        from . import engine as source
    value = getattr(source, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
