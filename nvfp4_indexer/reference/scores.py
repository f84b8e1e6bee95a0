"""Exact page scores: max over a page's tokens of the E4M3 q . dequantized-K dot product (SPEC 4).

A dot product of 128 E4M3 x E4M3 products is exact in float64 (every product has an 8-bit
significand and all partial sums fit 53 bits between 2^-18 and 2^25), so the float64 matmul
below is exact in any summation order; it is rounded once to fp32.
"""

from __future__ import annotations

import torch

from ..constants import GROUP_SIZE, PAGE_SIZE
from .formats import decode_e4m3, dequant_table, unpack_e2m1
from .paging import history_pages, local_pages, read_blocks

# float64 elements one score block may hold (bounds the reference's memory: 256 MiB).
_BLOCK_ELEMS = 1 << 25


_TABLES: dict[torch.device, torch.Tensor] = {}


def dequantize_pages(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Keys of physical ``blocks [n]`` as ``float8_e4m3fn [n, 128, 128]`` (SPEC 1.4, 2).

    Same bytes as ``dequantize_nvfp4`` (tested bitwise), through its 16 x 256 table: one
    gather per value instead of the elementwise rounding, which dominates reference scoring.
    """
    codes, scales = read_blocks(cache, blocks)
    table = _TABLES.get(cache.device)
    if table is None:
        table = _TABLES[cache.device] = dequant_table(cache.device)
    s = scales.view(torch.uint8).to(torch.long).repeat_interleave(GROUP_SIZE, dim=-1)
    return table[unpack_e2m1(codes).to(torch.long), s].view(torch.float8_e4m3fn)


def nan_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Max over ``dim`` skipping NaN; NaN only where every element is NaN (SPEC 4)."""
    nan = torch.isnan(x)
    m = torch.where(nan, torch.full_like(x, -torch.inf), x).amax(dim=dim)
    return torch.where(nan.all(dim=dim), torch.full_like(m, torch.nan), m)


def scores_from_keys(q: torch.Tensor, keys: torch.Tensor, local_page: torch.Tensor,
                     with_magnitude: bool = False):
    """Exact scores of one request's query rows against its history keys (SPEC 4).

    Args:
        q: E4M3 queries ``[rows, H, 128]`` (``float8_e4m3fn``).
        keys: E4M3 keys of the request's logical pages 0..n-1, ``[n, 128, 128]`` token-major.
        local_page: int ``[rows]``; row r scores pages ``j < local_page[r]`` only.
        with_magnitude: also return ``[rows, H]`` float64: max over the row's history tokens of
            sum_d |q_d K_d| (the scale of the SPEC 9 tie tolerance), 0 for rows without history.
    Returns:
        ``(scores, magnitude)``: float32 ``[rows, H, n]`` with -inf at pages that are not the
        row's history, and the magnitude (None unless asked).
    """
    rows, h, d = q.shape
    n = keys.shape[0]
    out = torch.full((rows, h, n), -torch.inf, dtype=torch.float32, device=q.device)
    mag = torch.zeros((rows, h), dtype=torch.float64, device=q.device) if with_magnitude else None
    if n == 0 or rows == 0:
        return out, mag
    q64 = decode_e4m3(q).to(torch.float64).reshape(rows * h, d)
    pages_per_block = max(1, _BLOCK_ELEMS // (rows * h * PAGE_SIZE))
    for p0 in range(0, n, pages_per_block):  # blocks of pages, bounded memory
        k64 = decode_e4m3(keys[p0:p0 + pages_per_block]).to(torch.float64)
        m = k64.shape[0]
        k64 = k64.reshape(m * PAGE_SIZE, d)
        token_scores = (q64 @ k64.T).reshape(rows, h, m, PAGE_SIZE)
        out[:, :, p0:p0 + m] = nan_max(token_scores, dim=-1).to(torch.float32)
        if with_magnitude:
            a = (q64.abs() @ k64.abs().T).reshape(rows, h, m, PAGE_SIZE)
            a = torch.nan_to_num(a, nan=0.0).amax(dim=-1)
            visible = torch.arange(p0, p0 + m, device=q.device) < local_page[:, None]
            a = torch.where(visible[:, None, :], a, torch.zeros_like(a))
            mag = torch.maximum(mag, a.amax(dim=-1))
    pages = torch.arange(n, device=q.device)
    history = pages[None, :] < local_page.to(q.device)[:, None]  # [rows, n]
    out = torch.where(history[:, None, :], out, torch.full_like(out, -torch.inf))
    return out, mag


def row_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor):
    """Request id and absolute position of every query row (SPEC 4, 6, 7).

    Queries are bottom-right aligned: query i of a request with q_len rows sits at
    seq_len - q_len + i. Returns long tensors ``(request [T], position [T])``; a position is
    negative for the padding rows of zero-length requests.
    """
    qsl = query_start_loc.to(torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    request = torch.repeat_interleave(torch.arange(len(q_lens), device=qsl.device), q_lens)
    t = torch.arange(int(qsl[-1]), device=qsl.device)
    i = t - qsl[:-1][request]
    position = seq_lens.to(torch.long)[request] - q_lens[request] + i
    return request, position


def page_scores(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                with_magnitude: bool = False):
    """Exact page scores of every query row, ``float32 [T, H, W]`` (SPEC 4).

    W is the block table width; entries that are not the row's history are -inf. Only block
    table entries below each request's history page count are read.
    """
    t, h, _ = index_q.shape
    w = block_table.shape[1]
    out = torch.full((t, h, w), -torch.inf, dtype=torch.float32, device=index_q.device)
    mag = torch.zeros((t, h), dtype=torch.float64, device=index_q.device)
    request, position = row_positions(seq_lens, query_start_loc)
    local = local_pages(position)
    qsl = query_start_loc.tolist()
    n_hist = history_pages(seq_lens).tolist()
    for r, n in enumerate(n_hist):  # one request at a time: its own keys
        lo, hi = qsl[r], qsl[r + 1]
        if n == 0 or hi == lo:
            continue
        keys = dequantize_pages(cache, block_table[r, :n])
        s, m = scores_from_keys(index_q[lo:hi], keys, local[lo:hi], with_magnitude)
        out[lo:hi, :, :n] = s
        if with_magnitude:
            mag[lo:hi] = m
    return (out, mag) if with_magnitude else out
