"""Fixtures shared by the harness, the tests and the benchmarks: poisoned paged storage and its
cache view (SPEC 2), the output poison, the RoPE cos/sin cache (SPEC 3).

Poison (SPEC 2: a correct kernel never reads or writes it):

* ``POISON_CODE`` / ``POISON_SCALE``: code bytes 0xAB and scale bytes 0x7F (E4M3 NaN) of
  unwritten slots and unused blocks ("NaN poison");
* ``ATTRACTIVE_CODES`` / ``ATTRACTIVE_SCALE``: codes +-6 under scale 448, blocks that score
  huge if a kernel ever reads them ("attractive poison");
* ``OUT_POISON``: the fill of ``int32`` selection buffers before a backend writes them.
"""

from __future__ import annotations

import numpy as np
import torch

from nvfp4_indexer.constants import (CODE_BYTES, NUM_GROUPS, PAGE_BYTES, PAGE_SIZE,
                                     SCALES_OFFSET, TOPK)

POISON_CODE = 0xAB  # code bytes of unwritten slots / unused blocks
POISON_SCALE = 0x7F  # E4M3 NaN: scale bytes of unwritten slots / unused blocks
ATTRACTIVE_SCALE = 0x7E  # 448: "attractive" poison blocks score huge if ever read
ATTRACTIVE_CODES = (0x77, 0xFF)  # +6,+6 and -6,-6
OUT_POISON = -7  # fill value of output buffers before a backend writes them
#: Row width of the ``uint8 [num_blocks, 128, 72]`` cache view (9216 / 128, SPEC 2).
VIEW_ROW_BYTES = PAGE_BYTES // PAGE_SIZE


def cache_view(storage: torch.Tensor, num_blocks: int, page_stride: int) -> torch.Tensor:
    """The ``uint8 [num_blocks, 128, 72]`` cache view of a 1-D uint8 ``storage`` whose pages
    start every ``page_stride`` bytes (SPEC 2)."""
    return storage.as_strided((num_blocks, PAGE_SIZE, VIEW_ROW_BYTES),
                              (page_stride, VIEW_ROW_BYTES, 1))


def cache_storage(cache: torch.Tensor) -> torch.Tensor:
    """Flat ``uint8 [num_blocks * page_stride]`` view of every byte a cache view spans, padding
    between pages included (the inverse of :func:`cache_view`)."""
    return torch.as_strided(cache, (cache.shape[0] * cache.stride(0),), (1,))


def case_cache(inputs: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A private copy of a case's ``storage`` on ``device`` and its cache view (``inputs``
    holds ``storage``, ``num_blocks`` and ``page_stride``)."""
    st = inputs["storage"].to(device).clone()
    return st, cache_view(st, inputs["num_blocks"], inputs["page_stride"])


def poisoned_storage(rng: np.random.Generator, num_blocks: int, page_stride: int,
                     device=None) -> torch.Tensor:
    """``uint8 [num_blocks * page_stride]`` storage, every page poisoned (NaN or attractive,
    chosen per block by ``rng``) and the padding bytes between pages random."""
    st = rng.integers(0, 256, size=num_blocks * page_stride, dtype=np.uint8)
    pages = st.reshape(num_blocks, page_stride) if num_blocks else st.reshape(0, page_stride)
    kind = rng.integers(0, 2, size=num_blocks)
    for b in range(num_blocks):
        if kind[b] == 0:
            pages[b, :SCALES_OFFSET] = POISON_CODE
            pages[b, SCALES_OFFSET:PAGE_BYTES] = POISON_SCALE
        else:
            codes = rng.choice(np.array(ATTRACTIVE_CODES, dtype=np.uint8), size=PAGE_SIZE)
            pages[b, :SCALES_OFFSET] = np.repeat(codes, CODE_BYTES)
            pages[b, SCALES_OFFSET:PAGE_BYTES] = ATTRACTIVE_SCALE
    return torch.from_numpy(st).to(device)


def poison_slots(storage: torch.Tensor, page_stride: int, block: int, first_token: int) -> None:
    """NaN-poison tokens ``first_token .. 127`` of physical ``block`` (unwritten slots)."""
    if first_token >= PAGE_SIZE:
        return
    base = block * page_stride
    storage[base + first_token * CODE_BYTES: base + SCALES_OFFSET] = POISON_CODE
    storage[base + SCALES_OFFSET + first_token * NUM_GROUPS: base + PAGE_BYTES] = POISON_SCALE


def selection_out(rows: int, heads: int, device=None) -> torch.Tensor:
    """An ``int32 [rows, heads, 16]`` selection buffer filled with ``OUT_POISON``."""
    return torch.full((rows, heads, TOPK), OUT_POISON, dtype=torch.int32, device=device)


def rope_cache(max_position: int, rotary_dim: int, dtype: torch.dtype,
               base: float = 10000.0) -> torch.Tensor:
    """vLLM-style ``cos_sin_cache [max_position, rotary_dim]`` of ``dtype``: cos then sin of
    ``position * base^(-2i / rotary_dim)``, evaluated in float64 and rounded once (SPEC 3)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view (CPU, contiguous) of a float8 / uint8 tensor."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t
