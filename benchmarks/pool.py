"""A cold-cache page pool: many physical pages of random NVFP4 keys, handed out as disjoint
random page sets (WORKLOADS.md "How to measure").

The pool is one index cache (``nvfp4_indexer.new_index_cache``) much larger than L2, filled
through the library's write path (``nvfp4_indexer.write_index_k``: NVFP4 quantization of
random keys with per-channel and per-token magnitudes, so scales vary across groups and
tokens; never zeros). Every benchmark case draws its block tables from a fresh random
permutation of the pool, so a request's logical pages land on scattered physical blocks and
the K rotation slots of a case never share a page.
"""

from __future__ import annotations

from typing import Callable

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import HEAD_DIM, PAGE_SIZE

from .workloads import pages_needed

def random_keys(tokens: int, device: torch.device, gen: torch.Generator,
                channel_scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``[tokens, 128]`` keys: standard normal x a fixed per-channel scale x a per-token
    log-normal magnitude (outlier channels and varying norms, as real index keys have)."""
    k = torch.randn(tokens, HEAD_DIM, device=device, generator=gen)
    k *= channel_scale
    k *= torch.exp(0.5 * torch.randn(tokens, 1, device=device, generator=gen))
    return k.to(dtype)


def random_index_q(rows: int, heads: int, device: torch.device, gen: torch.Generator):
    """E4M3 index queries ``[rows, heads, 128]`` from scaled normals (SPEC 1.1 encode through
    the reference path, which runs on any device)."""
    x = torch.randn(rows, heads, HEAD_DIM, device=device, generator=gen) * 2.0
    return ni.encode_e4m3(x, backend="reference")


class PagePool:
    """``num_pages`` physical pages of random NVFP4 keys in one cache.

    Args:
        num_pages: pages in the pool (9216 B each).
        device: where the cache lives.
        seed: fixes the keys and every page permutation drawn later.
        fill_backend: backend of ``write_index_k`` ("auto" = Triton on CUDA; recorded in
            ``self.fill_backend``). An error of the write path propagates.
        chunk_tokens: tokens written per ``write_index_k`` call.
        log: progress callback (the fill itself logs nothing).
    """

    def __init__(self, num_pages: int, device: torch.device, *, seed: int = 0,
                 fill_backend: str = "auto", chunk_tokens: int = 1 << 21,
                 log: Callable[[str], None] = lambda s: None):
        self.num_pages = num_pages
        self.device = device
        self.cache = ni.new_index_cache(num_pages, device=device)
        self._cpu_gen = torch.Generator().manual_seed(seed)
        self._dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
        self.channel_scale = torch.exp(
            0.75 * torch.randn(HEAD_DIM, generator=self._cpu_gen)).to(device)
        self.fill_backend = self._fill(fill_backend, chunk_tokens)

    @property
    def nbytes(self) -> int:
        return self.num_pages * ni.PAGE_BYTES

    def _fill(self, backend: str, chunk_tokens: int) -> str:
        total = self.num_pages * PAGE_SIZE
        for t0 in range(0, total, chunk_tokens):
            t = min(chunk_tokens, total - t0)
            k = random_keys(t, self.device, self._dev_gen, self.channel_scale)
            slots = torch.arange(t0, t0 + t, dtype=torch.int64, device=self.device)
            ni.write_index_k(self.cache, k, slots, backend=backend)
            del k, slots
        return backend

    def page_sets(self, pages_per_set: int, num_sets: int) -> torch.Tensor:
        """``int64 [num_sets, pages_per_set]`` (CPU): disjoint sets of physical pages from a
        fresh random permutation of the pool.

        Raises:
            ValueError: the sets do not fit the pool.
        """
        if pages_per_set * num_sets > self.num_pages:
            raise ValueError(f"pool: expected num_sets * pages_per_set <= {self.num_pages} "
                             f"pages, got {num_sets} x {pages_per_set}")
        perm = torch.randperm(self.num_pages, generator=self._cpu_gen)
        return perm[:pages_per_set * num_sets].view(num_sets, pages_per_set)

    def block_tables(self, seq_lens: list[int], num_sets: int,
                     width: int | None = None) -> list[torch.Tensor]:
        """``num_sets`` block tables, int32 ``[B, W]`` each, on the pool's device.

        Request b's first ceil(seq_len/128) entries (its history pages and its local page)
        are distinct random physical pages, disjoint across requests and across sets; the
        entries past them hold -1 (SPEC 2: never read). Each table starts on a 256-byte
        boundary of one shared allocation, so no two tables differ in pointer alignment.
        """
        need = [pages_needed(s) for s in seq_lens]
        b = len(seq_lens)
        w = max(1, max(need)) if width is None else width
        ids = self.page_sets(sum(need), num_sets)  # [S, total]
        mask = torch.arange(w)[None, :] < torch.tensor(need)[:, None]  # [B, W]
        tables = torch.full((num_sets, b, w), -1, dtype=torch.int32)
        tables[:, mask] = ids.to(torch.int32)
        stride = -(-(b * w) // 64) * 64  # int32 elements: 256-byte aligned slots
        storage = torch.full((num_sets, stride), -1, dtype=torch.int32)
        storage[:, :b * w] = tables.view(num_sets, b * w)
        storage = storage.to(self.device)
        return [storage[s, :b * w].view(b, w) for s in range(num_sets)]
