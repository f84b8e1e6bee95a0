"""Index keys and queries built from a real model's attention projections.

Construction (documented in docs/demo.md): SmolLM2 has 9 query heads in 3 KV groups of 3, head
dim 64. An index key concatenates the pre-RoPE key projections of two KV heads ``(g0, g1)``:
``k_idx = [k_pre[g0], k_pre[g1]]`` (128 dims). Index head ``m`` concatenates the pre-RoPE
projections of query head ``m`` of each group: ``q_idx[m] = [q_pre[3*g0 + m], q_pre[3*g1 + m]]``,
so ``q_idx[m] . k_idx`` is the sum of those two query heads' attention logits (before RoPE).
The indexer's insert then applies Gemma RMSNorm with unit weight and NeoX RoPE on dims [0, 64)
with the model's own frequencies: the first half gets exactly the model's rotation of head g0,
the second half stays position-free (SPEC 3 rotates ``rotary_dim = 64`` dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IndexInputs:
    """One layer's indexer inputs.

    Attributes:
        k: float32 ``[T, 128]`` index keys (pre-norm, pre-RoPE).
        q: float32 ``[T, H, 128]`` index queries (pre-norm, pre-RoPE).
        heads_behind: ``H`` tuples of the model's query heads behind each index head.
        cos_sin_cache: float32 ``[T, 64]``: cos then sin of the model's RoPE angles.
    """

    k: torch.Tensor
    q: torch.Tensor
    heads_behind: list[tuple[int, ...]]
    cos_sin_cache: torch.Tensor


def rope_cos_sin_cache(max_position: int, rotary_dim: int = 64, base: float = 1e5,
                       device=None) -> torch.Tensor:
    """``float32 [max_position, rotary_dim]`` cos/sin table of NeoX RoPE (vLLM layout)."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float32).to(device)


def build_index_inputs(q_pre: torch.Tensor, k_pre: torch.Tensor, num_index_heads: int = 2,
                       kv_heads: tuple[int, int] = (0, 1), rope_base: float = 1e5) -> IndexInputs:
    """Index keys/queries from pre-RoPE projections (see the module docstring).

    Args:
        q_pre: ``[T, n_heads, 64]`` query projections before RoPE (half-split row order).
        k_pre: ``[T, n_kv_heads, 64]`` key projections before RoPE.
        num_index_heads: H, at most the group size (query heads per KV head).
        kv_heads: the two KV heads whose keys form the index key.
    Raises:
        ValueError: H larger than the group size, or a head dim other than 64.
    """
    t, n_heads, d = q_pre.shape
    n_kv = k_pre.shape[1]
    group = n_heads // n_kv
    if d != 64:
        raise ValueError(f"q_pre: expected head dim 64, got {d}")
    if not 1 <= num_index_heads <= group:
        raise ValueError(f"num_index_heads: expected 1..{group} (query heads per KV head), "
                         f"got {num_index_heads}")
    g0, g1 = kv_heads
    k = torch.cat([k_pre[:, g0], k_pre[:, g1]], dim=-1).float()
    heads = [(group * g0 + m, group * g1 + m) for m in range(num_index_heads)]
    q = torch.stack([torch.cat([q_pre[:, a], q_pre[:, b]], dim=-1) for a, b in heads], dim=1)
    return IndexInputs(k=k, q=q.float(), heads_behind=heads,
                       cos_sin_cache=rope_cos_sin_cache(t, 64, rope_base, q_pre.device))
