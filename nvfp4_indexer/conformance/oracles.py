"""Oracles: the expected outputs of a case's inputs, computed by the reference on the inputs'
device (returned on the CPU). One function per op; ``conformance.ops`` maps ops to them.

Also the row layouts the selection ops share: ``decode_rows`` (uniform decode batches),
``mixed_qsl`` (decode-first batches, SPEC 8), ``local_pages`` (L = p // 128, SPEC 4).
"""

from __future__ import annotations

import torch

from nvfp4_indexer import reference as ref
from nvfp4_indexer.constants import PAGE_SIZE, TOPK
from nvfp4_indexer.reference import formats as F
from nvfp4_indexer.reference.scores import row_positions

from .fixtures import as_bytes, case_cache

#: Output dtypes of ``dequantize_nvfp4`` cases (``inputs["dtype"]``).
DEQUANT_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}


def decode_rows(inputs: dict, device=None) -> torch.Tensor:
    """``query_start_loc`` of a uniform decode batch: ``int32 [B + 1]`` = ``arange(B + 1) * Q``
    (SPEC 6)."""
    q = inputs["query_len"]
    b = inputs["block_table"].shape[0]
    return torch.arange(b + 1, dtype=torch.int32, device=device) * q


def mixed_qsl(inputs: dict) -> torch.Tensor:
    """``query_start_loc`` of a decode-first batch (SPEC 8): ``num_decode_reqs`` requests of
    ``query_len`` rows, then the prefill requests of ``cu_seqlens_q``."""
    bd, q = inputs["num_decode_reqs"], inputs["query_len"]
    cu = inputs["cu_seqlens_q"].to(torch.int64)
    d = torch.arange(bd + 1, dtype=torch.int64, device=cu.device) * q
    return torch.cat([d, bd * q + cu[1:]]).to(torch.int32)


def local_pages(seq_lens: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    """Local page ``L = p // 128`` of every query row (int64 ``[T]``, -1 for padding rows whose
    position is -1) (SPEC 4, 5)."""
    _, pos = row_positions(seq_lens, qsl)
    return torch.div(pos, PAGE_SIZE, rounding_mode="floor")


def encode_oracle(inp: dict) -> dict:
    return {"bytes": as_bytes(F.encode_e4m3(inp["x"]))}


def quantize_oracle(inp: dict) -> dict:
    c, s = F.quantize_nvfp4(inp["x"])
    return {"codes": c.cpu(), "scales": as_bytes(s)}


def dequantize_oracle(inp: dict) -> dict:
    dt = DEQUANT_DTYPES[inp["dtype"]]
    out = F.dequantize_nvfp4(inp["codes"], inp["scales"], dt)
    return {"out": out.cpu() if dt == torch.float32 else as_bytes(out)}


def write_oracle(inp: dict) -> dict:
    st, cache = case_cache(inp, inp["storage"].device)
    c, s = F.quantize_nvfp4(inp["k"])
    ref.write_tokens(cache, c, s, inp["slot_mapping"])
    return {"storage": st.cpu()}


def _norm_rope(inp: dict, x: torch.Tensor):
    return ref.norm_rope_exact(x, inp["positions"], inp["weight"], inp["cos_sin_cache"],
                               inp["rotary_dim"], inp["eps"])


def insert_oracle(inp: dict) -> dict:
    st, cache = case_cache(inp, inp["storage"].device)
    ref.insert_index_k(cache, inp["k"], inp["positions"], inp["slot_mapping"], inp["weight"],
                       inp["cos_sin_cache"], inp["rotary_dim"], inp["eps"])
    val, mag = _norm_rope(inp, inp["k"])
    return {"storage": st.cpu(), "value": val.cpu(), "magnitude": mag.cpu()}


def query_oracle(inp: dict) -> dict:
    val, mag = _norm_rope(inp, inp["q"])
    return {"q": as_bytes(F.encode_e4m3(val.to(torch.float32))), "value": val.cpu(),
            "magnitude": mag.cpu()}


def gather_oracle(inp: dict) -> dict:
    _, cache = case_cache(inp, inp["storage"].device)
    ws, off = ref.gather_index_k_fp8(cache, inp["block_table"], inp["seq_lens"])
    return {"workspace": as_bytes(ws), "page_offsets": off.cpu()}


def selection_oracle(inp: dict, qsl: torch.Tensor) -> dict:
    """Exact page scores, row magnitudes, local pages and the reference selection of the query
    rows ``qsl`` over the case's cache (SPEC 4, 5)."""
    _, cache = case_cache(inp, inp["storage"].device)
    scores, mag = ref.page_scores(inp["index_q"], cache, inp["block_table"], inp["seq_lens"],
                                  qsl, with_magnitude=True)
    local = local_pages(inp["seq_lens"], qsl)
    sel = ref.select_pages(scores, local, TOPK)
    return {"selection": sel.cpu(), "scores": scores.cpu(), "magnitude": mag.cpu(),
            "local_page": local.cpu()}


def scores_oracle(inp: dict) -> dict:
    return selection_oracle(inp, inp["query_start_loc"])


def decode_oracle(inp: dict) -> dict:
    return selection_oracle(inp, decode_rows(inp, inp["index_q"].device))


def prefill_oracle(inp: dict) -> dict:
    return selection_oracle(inp, inp["cu_seqlens_q"])


def mixed_oracle(inp: dict) -> dict:
    return selection_oracle(inp, mixed_qsl(inp))
