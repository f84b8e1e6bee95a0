"""Run one layer's index keys/queries through the indexer and measure what it selects.

Metrics (rows with at least 16 history pages, where selection is a real choice):
- agreement with selection by exact bf16 scores (no NVFP4/E4M3 quantization): share of
  (row, head) pairs with the same 15 history pages, and mean overlap of the two 15-page sets;
- attention recall: share of the model's softmax attention mass (mean over the query heads
  behind each index head) inside the 16 selected pages, for the NVFP4 indexer, bf16-exact
  selection, a local window of the last 16 pages, and the oracle (16 heaviest pages);
- decode vs prefill: decode batches re-select sampled positions and must match prefill;
- backend agreement: Triton vs reference under SPEC 9 (on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import PAGE_SIZE, TOPK
from nvfp4_indexer.reference.insert import norm_rope
from nvfp4_indexer.reference.scores import nan_max
from nvfp4_indexer.reference.selection import select_pages

from .index_heads import IndexInputs

# attention(rows [R] long) -> probabilities [R, n_model_heads, T] (causal, rows sum to 1)
AttentionFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerResult:
    layer: int
    tokens: int
    rows: int  # (row, head) pairs with >= 16 history pages
    same_set: float
    overlap: float
    recall: dict[str, float]
    decode_rows: int
    decode_match: bool
    backend_check: str
    recall_by_page: dict[str, list[float]] = field(default_factory=dict)  # indexed by local page


def paged_cache(t: int, device, seed: int = 0):
    """A cache holding one request of ``t`` tokens in scattered physical blocks.

    Returns ``(cache, block_table int32 [1, pages], slot_mapping int64 [t])``; unused blocks
    are poisoned with 0x7F (NaN scale) bytes.
    """
    pages = (t + PAGE_SIZE - 1) // PAGE_SIZE
    g = torch.Generator().manual_seed(seed)
    pool = 2 * pages + 3
    cache = ni.new_index_cache(pool, device=device)
    cache.fill_(0x7F)
    blocks = torch.randperm(pool, generator=g)[:pages].to(torch.int32)
    slots = blocks.long().repeat_interleave(PAGE_SIZE)[:t] * PAGE_SIZE \
        + torch.arange(t) % PAGE_SIZE
    return cache, blocks[None].to(device), slots.to(device)


def bf16_selection(inputs: IndexInputs) -> torch.Tensor:
    """Selection ``int32 [T, H, 16]`` by exact scores of bf16 (unquantized) keys and queries."""
    t = inputs.k.shape[0]
    pos = torch.arange(t)
    zero = torch.zeros(128)
    k = norm_rope(inputs.k.cpu(), pos, zero, inputs.cos_sin_cache.cpu()).bfloat16().double()
    q = norm_rope(inputs.q.cpu(), pos, zero, inputs.cos_sin_cache.cpu()).bfloat16().double()
    pages = t // PAGE_SIZE  # full pages; only history pages (< L) are ever selected
    kp = k[:pages * PAGE_SIZE].reshape(pages, PAGE_SIZE, 128)
    local = pos // PAGE_SIZE
    out = torch.empty((t, q.shape[1], TOPK), dtype=torch.int32)
    for r0 in range(0, t, 512):
        s = torch.einsum("rhd,ptd->rhpt", q[r0:r0 + 512], kp)
        s = nan_max(s, -1).float()
        out[r0:r0 + 512] = select_pages(s, local[r0:r0 + 512])
    return out


def page_mass(probs: torch.Tensor, pages: int) -> torch.Tensor:
    """Attention mass per page: ``[R, heads, T]`` -> ``[R, heads, pages]``."""
    r, h, t = probs.shape
    padded = torch.nn.functional.pad(probs, (0, pages * PAGE_SIZE - t))
    return padded.reshape(r, h, pages, PAGE_SIZE).sum(-1)


def selection_recall(sel: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Mass inside selected pages: ``sel [R, H, 16]`` (-1 = empty), ``mass [R, H, pages]`` ->
    ``[R, H]``."""
    valid = sel >= 0
    picked = torch.gather(mass, -1, sel.clamp(min=0).long())
    return (picked * valid).sum(-1)


def local_window(local: torch.Tensor, heads: int) -> torch.Tensor:
    """The last 16 pages up to the local page, ``int32 [R, heads, 16]``."""
    ids = local[:, None] - torch.arange(TOPK - 1, -1, -1)
    return ids.clamp(min=-1).to(torch.int32)[:, None, :].expand(-1, heads, -1)


def decode_check(q8, cache, block_table, sel, positions: list[int], query_len: int, backend):
    """Re-select ``positions`` (each the last of Q decode queries) through the decode path.

    Returns ``(decode selection [len*Q, H, 16], prefill rows of the same positions)``.
    """
    b = len(positions)
    rows = torch.tensor([p - query_len + 1 + i for p in positions for i in range(query_len)],
                        device=q8.device)
    seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=q8.device)
    bt = block_table.expand(b, -1).contiguous()
    out = ni.decode_indexer(q8[rows], cache, bt, seq_lens, query_len, backend=backend)
    return out, sel[rows]


def compare_with_reference(sel, q8, cache, bt, seq, cu) -> str:
    """SPEC 9 verdict of a Triton selection against the reference's exact scores:
    "exact" / "ok (n tol.)" / "FAIL (n rows)"."""
    from nvfp4_indexer.conformance.checks import tie_aware_check
    from nvfp4_indexer.reference.scores import page_scores, row_positions
    from nvfp4_indexer.triton.decode import SCORE_ERROR_BITS
    from nvfp4_indexer.triton.dot_modes import DEFAULT_GPU_DOT
    exact, mag = page_scores(q8, cache, bt, seq, cu, with_magnitude=True)
    _, pos = row_positions(seq, cu)
    res = tie_aware_check(sel, exact, mag, torch.div(pos, PAGE_SIZE, rounding_mode="floor"),
                          SCORE_ERROR_BITS[DEFAULT_GPU_DOT])
    if res.failed:
        return f"FAIL ({res.failed} rows)"
    tol = int(res.needed_bound.sum())
    differ = int((res.status == 1).sum())
    return "exact" if differ == 0 else f"ok ({differ} differ, {tol} tol.)"


def analyze_layer(layer: int, inputs: IndexInputs, attention: AttentionFn, *, device,
                  backend: str = "auto", query_len: int = 4, decode_samples: int = 16,
                  compare_backends: bool = False) -> LayerResult:
    """Run the insert, query, prefill and decode paths for one layer and measure them."""
    t, h, _ = inputs.q.shape
    pos = torch.arange(t, device=device)
    zero = torch.zeros(128, device=device)
    cos_sin = inputs.cos_sin_cache.to(device)
    cache, bt, slots = paged_cache(t, device, seed=layer)
    ni.insert_index_k(cache, inputs.k.to(device), pos, slots, zero, cos_sin, backend=backend)
    q8 = ni.prepare_index_q(inputs.q.to(device), pos, zero, cos_sin, backend=backend)
    cu = torch.tensor([0, t], dtype=torch.int32, device=device)
    seq = torch.tensor([t], dtype=torch.int32, device=device)
    sel = ni.prefill_indexer(q8, cache, bt, cu, seq, backend=backend)

    # Decode path on sampled positions with >= 16 history pages.
    first = 16 * PAGE_SIZE
    samples = torch.linspace(first, t - 1, decode_samples).long().unique().tolist() \
        if t > first else []
    decode_match = True
    if samples:
        dsel, psel = decode_check(q8, cache, bt, sel, samples, query_len, backend)
        decode_match = bool(torch.equal(dsel, psel))

    backend_check = "not run"
    if compare_backends:
        backend_check = compare_with_reference(sel, q8, cache, bt, seq, cu)

    sel_cpu = sel.cpu()
    exact = bf16_selection(inputs)
    local = torch.arange(t) // PAGE_SIZE
    rows = (local >= TOPK).nonzero().flatten()
    pages = (t + PAGE_SIZE - 1) // PAGE_SIZE
    names = ("nvfp4", "bf16", "local", "oracle")
    sums = dict.fromkeys(names, 0.0)
    by_page = {n: torch.zeros(pages, dtype=torch.float64) for n in names}
    counts = torch.zeros(pages, dtype=torch.float64)
    same = overlap = 0.0
    for r0 in range(0, len(rows), 256):
        rr = rows[r0:r0 + 256]
        probs = attention(rr)  # [R, n_model_heads, T]
        mass = torch.stack([probs[:, list(hs)].mean(1) for hs in inputs.heads_behind], 1)
        mass = page_mass(mass.float().cpu(), pages)
        oracle = mass.topk(min(TOPK, pages), dim=-1).indices.to(torch.int32)
        sels = {"nvfp4": sel_cpu[rr], "bf16": exact[rr], "local": local_window(local[rr], h),
                "oracle": oracle}
        for n in names:
            rec = selection_recall(sels[n], mass)  # [R, H]
            sums[n] += float(rec.sum())
            by_page[n].index_add_(0, local[rr], rec.double().mean(1))
        counts.index_add_(0, local[rr], torch.ones(len(rr), dtype=torch.float64))
        a = torch.sort(sel_cpu[rr][..., :15], -1).values
        b = torch.sort(exact[rr][..., :15], -1).values
        same += float((a == b).all(-1).sum())
        overlap += float((a[..., :, None] == b[..., None, :]).any(-1).sum(-1).sum()) / 15
    n_pairs = max(len(rows) * h, 1)
    keep = counts > 0
    return LayerResult(
        layer=layer, tokens=t, rows=len(rows) * h, same_set=same / n_pairs,
        overlap=overlap / n_pairs, recall={n: sums[n] / n_pairs for n in names},
        decode_rows=len(samples) * query_len, decode_match=decode_match,
        backend_check=backend_check,
        recall_by_page={n: (by_page[n][keep] / counts[keep]).tolist() for n in names}
        | {"page": keep.nonzero().flatten().tolist()},
    )
