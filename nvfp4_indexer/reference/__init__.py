"""Bit-exact PyTorch reference of every step of the indexer (SPEC 1-7); CPU or GPU tensors.

Functions here assume valid input: ``nvfp4_indexer.api`` validates (SPEC 10) and dispatches.
"""

from .decode import decode_indexer
from .formats import decode_e4m3, dequant_table, dequantize_nvfp4, encode_e4m3, quantize_nvfp4
from .insert import insert_index_k, norm_rope, norm_rope_exact, prepare_index_q
from .paging import new_index_cache, read_blocks, write_tokens
from .prefill import gather_index_k_fp8, max_gather_pages, plan_chunks, prefill_indexer
from .scores import page_scores, scores_from_keys
from .selection import select_pages
