"""nvfp4_indexer: page selection for sparse attention over an NVFP4 index-K cache.

The public API (SPEC 11) lives in ``nvfp4_indexer.api`` and is re-exported here.
"""

from .api import (HEAD_DIM, PAGE_BYTES, PAGE_SIZE, TOPK, DecodeIndexerWrapper,
                  decode_indexer, dequantize_nvfp4, encode_e4m3, gather_index_k_fp8,
                  insert_index_k, max_gather_pages, new_index_cache, page_scores,
                  prefill_indexer, prepare_index_q, quantize_nvfp4, read_index_k,
                  write_index_k)
from .constants import SPEC_VERSION
from .engine import Indexer, IndexerConfig, IndexerMetadata, StepMetadata

__version__ = "0.1.0"

__all__ = [
    "PAGE_SIZE", "HEAD_DIM", "TOPK", "PAGE_BYTES", "SPEC_VERSION", "encode_e4m3",
    "quantize_nvfp4", "dequantize_nvfp4", "new_index_cache", "write_index_k", "read_index_k",
    "insert_index_k", "prepare_index_q", "gather_index_k_fp8", "page_scores", "decode_indexer",
    "prefill_indexer", "DecodeIndexerWrapper", "max_gather_pages",
    "IndexerConfig", "Indexer", "StepMetadata", "IndexerMetadata",
]
