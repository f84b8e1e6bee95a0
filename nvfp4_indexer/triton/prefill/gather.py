"""Gather of requests' history pages into a compact FP8 workspace (SPEC 7).

Workspace page ``page_offsets[r] + j`` holds request r's logical page j, token-major
``[128 tokens, 128 dims]``, as dequant_e4m3 bytes (SPEC 1.4), bit-exact.

Dequantization modes (the ``DEQUANT`` constexpr, ``GatherConfig(dequant=...)``):

- "ptx" (GPU default, SM89+): code bytes read as uint16 pairs, one inline-PTX call
  (``ptx.dequant_e4m3_bytes``) turns 2 pairs (8 dims) into two uint32 words of
  E4M3 bytes with f16x2 arithmetic and native conversions, stored through a uint32 view.
- "triton": fp32 per value from Triton ops (``dequantize.dequant_code_tile``); the only mode
  under the interpreter / with ``PORTABLE`` (integer-bit E4M3 encoder).

``gather_kernel``: one program per (page part, request, PAGES pages); each walks the
dependent chain lengths / offsets -> block table -> page -> store once, with the loads of its
PAGES (1 or 2: ``dispatch.gather_pages_per_program``) pages in flight together.
``GatherLauncher`` resolves a tuning once and plans / launches it with little host work (the
``Indexer``'s gathers); ``gather_into`` is the one-call form.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...constants import HEAD_DIM, PAGE_SIZE
from ...reference.paging import history_pages
from ...validation import check_int
from ..config import GatherConfig, check_config
from ..dequantize import dequant_code_tile
from ..device import device_guard, interpreting, portable_default
from ..launcher import CachedLaunch
from ..layout import CODE_BYTES, GROUPS, HEAD, PAGE, SCALES_OFFSET, WS_PAGE, num_history_pages
from ..ptx import dequant_e4m3_bytes
from .dispatch import (MAX_GRID_Y, gather_defaults, gather_grid, gather_pages_per_program,
                       gather_request_ranges)


@triton.jit
def _load_tile(page, tok0, live, TILE: tl.constexpr, DEQUANT: tl.constexpr,
               STREAM: tl.constexpr):
    """Codes and scale bytes of tokens ``[tok0, tok0 + TILE)`` of ``page`` (a uint8 pointer),
    read only when ``live`` (a scalar; zeros otherwise): "ptx": uint16 code pairs
    ``[TILE, 8 groups, 4 pairs]`` and scale bytes ``[TILE, 8, 1]``; "triton": code bytes
    ``[TILE, 64]`` and each code byte's scale byte ``[TILE, 64]``."""
    if DEQUANT == "ptx":
        # [tokens, group g, pair k]: uint16 code pair 4g + k = dims 16g + 4k .. + 3. The
        # group axis lets the [TILE, 8, 1] scales broadcast in registers; their load
        # is told contiguity 1 so it takes the codes' layout (vectorized, it would get
        # another layout and a shared-memory conversion every step: SM90 SASS).
        g = tl.arange(0, GROUPS)[None, :, None]
        k = tl.arange(0, 4)[None, None, :]  # code pairs per group
        tok = (tok0 + tl.arange(0, TILE))[:, None, None]
        cptr = (page + tok * CODE_BYTES).to(tl.pointer_type(tl.uint16), bitcast=True) \
            + g * 4 + k
        sptr = page + SCALES_OFFSET + tok * GROUPS + tl.max_contiguous(g, [1, 1, 1])
        if STREAM:
            codes = tl.load(cptr, mask=live, other=0, eviction_policy="evict_first")
            scales = tl.load(sptr, mask=live, other=0, eviction_policy="evict_first")
        else:
            codes = tl.load(cptr, mask=live, other=0)
            scales = tl.load(sptr, mask=live, other=0)
    else:
        i = tl.arange(0, CODE_BYTES)[None, :]
        tok = (tok0 + tl.arange(0, TILE))[:, None]
        codes = tl.load(page + tok * CODE_BYTES + i, mask=live, other=0)
        scales = tl.load(page + SCALES_OFFSET + tok * GROUPS + i // 8, mask=live, other=0)
    return codes, scales


@triton.jit
def _store_tile(out_page, tok0, codes, scales, TILE: tl.constexpr, DEQUANT: tl.constexpr,
                PORTABLE: tl.constexpr, STREAM: tl.constexpr):
    """dequant_e4m3 bytes (SPEC 1.4) of ``_load_tile``'s ``codes, scales`` into tokens
    ``[tok0, tok0 + TILE)`` of workspace page ``out_page`` (a uint8 pointer)."""
    if DEQUANT == "ptx":
        g = tl.arange(0, GROUPS)[None, :, None]
        k = tl.arange(0, 4)[None, None, :]
        tok = (tok0 + tl.arange(0, TILE))[:, None, None]
        optr = (out_page + tok * HEAD).to(tl.pointer_type(tl.uint32), bitcast=True) \
            + g * 4 + k
        s = scales.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact
        out = dequant_e4m3_bytes(codes, s)  # uint32: 4 E4M3 bytes, dim order
        if STREAM:
            tl.store(optr, out, cache_modifier=".cs")
        else:
            tl.store(optr, out)
    else:
        d = tl.arange(0, HEAD)[None, :]
        tok = (tok0 + tl.arange(0, TILE))[:, None]
        out = dequant_code_tile(codes, scales, PORTABLE, False)
        tl.store(out_page + tok * HEAD + d, out)


@triton.jit
def gather_kernel(cache_ptr, page_stride, bt_ptr, bt_row_stride, len_ptr, off_ptr, ws_ptr,
                  ws_pages, width, num_blocks, FROM_SEQ_LENS: tl.constexpr, PORTABLE: tl.constexpr,
                  TOK_BLOCK: tl.constexpr, DEQUANT: tl.constexpr = "triton",
                  PAGE_PARTS: tl.constexpr = 1, STREAM: tl.constexpr = False,
                  PAGES: tl.constexpr = 1):
    """Program (i * PAGE_PARTS + part, r): part ``part`` (128 / PAGE_PARTS tokens) of request
    r's logical pages j = PAGES * i + p (p < PAGES, PAGES 1 or 2), each if j < its page count
    clamped to ``width`` (``gather_into`` passes min(W, max_pages): the grid's pages),
    into workspace page ``off_ptr[r] + j`` (skipped when that lies outside ``[0, ws_pages)``),
    ``TOK_BLOCK`` tokens per step, every page's loads of a step before its stores (more bytes
    in flight per program), dequantized per ``DEQUANT`` (module docstring). ``STREAM``:
    evict-first page loads and streaming (``.cs``) workspace stores (ptx mode)."""
    PART: tl.constexpr = PAGE // PAGE_PARTS
    r = tl.program_id(1)
    j = (tl.program_id(0) // PAGE_PARTS) * PAGES
    tok0 = (tl.program_id(0) % PAGE_PARTS) * PART
    length = tl.load(len_ptr + r).to(tl.int64)
    if FROM_SEQ_LENS:
        num_pages = num_history_pages(length)  # SPEC 4, 7
    else:
        num_pages = length
    num_pages = tl.minimum(num_pages, width)  # SPEC 10: never past the block-table row
    dst = tl.load(off_ptr + r).to(tl.int64) + j
    ok0 = (j < num_pages) & (dst >= 0) & (dst < ws_pages)
    if PAGES == 2:
        ok1 = (j + 1 < num_pages) & (dst + 1 >= 0) & (dst + 1 < ws_pages)
        any_ok = ok0 | ok1
    else:
        any_ok = ok0
    if any_ok:
        row = bt_ptr + r.to(tl.int64) * bt_row_stride
        # block-table entries of pages past the count are not read (SPEC 2)
        block = tl.load(row + j, mask=ok0, other=0)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)  # inside the cache
        page = cache_ptr + block * page_stride
        out_page = ws_ptr + dst * WS_PAGE
        if PAGES == 2:
            block1 = tl.load(row + j + 1, mask=ok1, other=0)
            block1 = tl.minimum(tl.maximum(block1, 0), num_blocks - 1).to(tl.int64)
            page1 = cache_ptr + block1 * page_stride
        for t0 in tl.static_range(0, PART, TOK_BLOCK):
            codes, scales = _load_tile(page, tok0 + t0, ok0, TOK_BLOCK, DEQUANT, STREAM)
            if PAGES == 2:
                codes1, scales1 = _load_tile(page1, tok0 + t0, ok1, TOK_BLOCK, DEQUANT, STREAM)
            if ok0:
                _store_tile(out_page, tok0 + t0, codes, scales, TOK_BLOCK, DEQUANT, PORTABLE,
                            STREAM)
            if PAGES == 2:
                if ok1:
                    _store_tile(out_page + WS_PAGE, tok0 + t0, codes1, scales1, TOK_BLOCK,
                                DEQUANT, PORTABLE, STREAM)


class GatherTuning(NamedTuple):
    """A gather launch's resolved tuning (``resolve_tuning``): the kernel's constexprs
    PORTABLE, DEQUANT, TOK_BLOCK, PAGE_PARTS, STREAM, the launch's ``num_warps`` and PAGES
    (``pages_per_program``; None: ``dispatch.gather_pages_per_program`` per launch)."""

    portable: bool
    dequant: str
    tok_block: int
    num_warps: int
    page_parts: int
    streaming: bool
    pages_per_program: int | None

    def pages_for(self, num_reqs: int, max_pages: int, width: int, device,
                  sms: int | None = None) -> int:
        """PAGES of a launch with this tuning on host shapes (requests, max pages, table
        width W): ``pages_per_program`` or ``dispatch.gather_pages_per_program`` (``sms``: the
        device's SM count if known)."""
        return self.pages_per_program or gather_pages_per_program(
            num_reqs, max_pages, width, self.page_parts, self.num_warps, device, sms)


def resolve_tuning(device, portable: bool | None = None,
                   config: GatherConfig | None = None) -> GatherTuning:
    """The ``GatherTuning`` of a gather launch on ``device`` (``dispatch.gather_defaults``
    for the fields ``config`` leaves None).

    Raises:
        ValueError: ``config`` not None or a ``GatherConfig``; dequant "ptx" under the
        interpreter / off CUDA / with portable=True.
    """
    cfg = check_config("config", config, GatherConfig)
    portable = portable_default(device) if portable is None else bool(portable)
    if cfg.dequant == "ptx" and (portable or interpreting()
                                 or torch.device(device).type != "cuda"):
        raise ValueError("dequant: 'ptx' needs a CUDA GPU (SM89+) with portable=False, not "
                         "the interpreter / CPU / portable mode")
    return GatherTuning(portable, *gather_defaults(
        device, portable, cfg.dequant, cfg.tok_block, cfg.num_warps, cfg.page_parts,
        cfg.streaming), cfg.pages_per_program)


class GatherLauncher:
    """The gather kernel with one resolved tuning (SPEC 7), launched through ``CachedLaunch``
    (little host work per launch; no allocation, no sync: CUDA-graph capturable).

    Args:
        device: where the launches run. portable / config: as ``resolve_tuning``.
        lengths_are_seq_lens: the ``FROM_SEQ_LENS`` constexpr (lengths are seq lens, else
            page counts).
    ``plan`` turns host shapes into launches (grid and argument views), ``run`` launches them;
    ``kernel(cache, workspace)`` is the launch a cache / workspace pair takes ("ptx" reads
    uint16 code pairs and writes uint32 words: a workspace not 4-byte aligned or a cache not
    2-byte aligned takes the byte path, "triton").
    Raises:
        ValueError: as ``resolve_tuning``.
    """

    def __init__(self, device, *, portable: bool | None = None,
                 config: GatherConfig | None = None, lengths_are_seq_lens: bool = True):
        self.tuning = tun = resolve_tuning(device, portable, config)
        self.explicit_ptx = isinstance(config, GatherConfig) and config.dequant == "ptx"
        base = dict(FROM_SEQ_LENS=lengths_are_seq_lens, PORTABLE=tun.portable,
                    TOK_BLOCK=tun.tok_block, PAGE_PARTS=tun.page_parts, STREAM=tun.streaming,
                    num_warps=tun.num_warps)
        self._kernels = {(p, d): CachedLaunch(gather_kernel, **base, PAGES=p, DEQUANT=d)
                         for p in (1, 2) for d in {tun.dequant, "triton"}}

    def kernels(self, cache: torch.Tensor, ws8: torch.Tensor) -> dict:
        """``{PAGES: CachedLaunch}`` of the launches that read ``cache`` and write ``ws8``
        (the tuning's dequant, or "triton" where "ptx" would read / write misaligned words).

        Raises:
            ValueError: misaligned views with dequant "ptx" asked for explicitly.
        """
        dequant = self.tuning.dequant
        if dequant == "ptx" and (ws8.data_ptr() % 4 or cache.data_ptr() % 2
                                 or cache.stride(0) % 2):
            if self.explicit_ptx:
                raise ValueError("dequant: 'ptx' needs a 4-byte aligned workspace and a 2-byte "
                                 "aligned cache (base and page stride)")
            dequant = "triton"
        return {1: self._kernels[1, dequant], 2: self._kernels[2, dequant]}

    def plan(self, n: int, block_table: torch.Tensor, lengths: torch.Tensor,
             page_offsets: torch.Tensor, max_pages: int, width: int, device=None,
             sms: int | None = None, max_reqs: int = MAX_GRID_Y) -> tuple[int, list]:
        """``(PAGES, launches)`` of a gather of requests ``0 .. n-1`` (rows of
        ``block_table`` / ``lengths`` / ``page_offsets``, which may be longer) whose page
        counts are at most ``max_pages`` (host int) over block-table rows ``width`` wide:
        ``launches`` lists ``((grid x, grid y), (block table, its row stride, lengths, page
        offsets))`` per ``dispatch.gather_request_ranges`` range (views of the arguments, the
        first unsliced; ``max_reqs`` requests per launch at most). ``device`` / ``sms``: the
        device or its SM count (host time)."""
        pages = self.tuning.pages_for(n, max_pages, width, device, sms)
        x = gather_grid(max_pages, width, self.tuning.page_parts, pages)
        bts = block_table.stride(0)
        launches = []
        for r0, r1 in gather_request_ranges(n, max_reqs):
            if r0 == 0:
                launches.append(((x, r1), (block_table, bts, lengths, page_offsets)))
            else:
                launches.append(((x, r1 - r0), (block_table[r0:], bts, lengths[r0:],
                                                page_offsets[r0:])))
        return pages, launches

    @staticmethod
    def run(kernel, launches: list, cache: torch.Tensor, ws8: torch.Tensor, width: int) -> None:
        """Launch ``plan``'s ``launches`` with ``kernel`` (one of ``kernels()``'s): pages
        ``j < min(n_r, width)`` of each request into ``ws8`` (uint8 ``[P, 128, 128]``)."""
        cs, n_cache, ws_pages = cache.stride(0), cache.shape[0], ws8.shape[0]
        for grid, (bt, bts, lengths, offsets) in launches:
            kernel(grid, cache, cs, bt, bts, lengths, offsets, ws8, ws_pages, width, n_cache)


def gather_launcher(device, *, portable: bool | None = None, config: GatherConfig | None = None,
                    lengths_are_seq_lens: bool = True) -> GatherLauncher:
    """A ``GatherLauncher`` (cached per device, portable, config and ``lengths_are_seq_lens``:
    host time). Raises as ``resolve_tuning``."""
    if config is not None and not isinstance(config, GatherConfig):
        check_config("config", config, GatherConfig)  # raises the ValueError
    return _cached_launcher(torch.device(device), portable, config, lengths_are_seq_lens)


@functools.lru_cache(maxsize=64)
def _cached_launcher(device, portable, config, lengths_are_seq_lens) -> GatherLauncher:
    return GatherLauncher(device, portable=portable, config=config,
                          lengths_are_seq_lens=lengths_are_seq_lens)


def gather_into(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                page_offsets: torch.Tensor, workspace: torch.Tensor, max_pages: int, *,
                lengths_are_seq_lens: bool = True, portable: bool | None = None,
                config: GatherConfig | None = None) -> None:
    """Launch the gather without host syncs (SPEC 7): request r's logical pages
    j < n_r go to ``workspace[page_offsets[r] + j]``. Capturable in a CUDA graph.

    Args:
        cache: ``uint8 [num_blocks, 128, 72]`` with strides ``(S, 72, 1)``.
        block_table: int32 ``[R, W]``, unit stride in the last dim; entries [r, j] for
            j < n_r must be valid block ids (others are never read; ids outside the cache
            are clamped into it, n_r to W: SPEC 10).
        lengths: int32/int64 ``[R]`` on the device: seq_lens (n_r = (seq_len - 1) // 128, 0 for
            empty requests) when ``lengths_are_seq_lens``, else the page counts n_r themselves.
        page_offsets: int32/int64 ``[>= R]`` destination page of each request's page 0.
        workspace: ``float8_e4m3fn`` (or uint8) ``[P, 128, 128]``, contiguous; pages outside
            ``[0, P)`` are skipped, pages not gathered are left untouched.
        max_pages: host int >= every n_r. The grid is ``(ceil(min(max_pages, W) /
            pages_per_program) * page_parts, R)``, R split over launches of at most
            ``dispatch.MAX_GRID_Y`` requests, pages past n_r exit; pages ``>= min(max_pages,
            W)`` are never written, whatever the n_r.
        portable: force the PORTABLE constexpr (tests); default True under the interpreter /
            off CUDA.
        config: tuning (``config.GatherConfig``: dequant, tok_block, num_warps, page_parts,
            streaming, pages_per_program); None = defaults (``dispatch.gather_defaults``).
            Every setting writes the same bytes.
    Raises:
        ValueError: a bad ``config`` or ``max_pages`` (not an integer), or dequant "ptx"
            under the interpreter / off CUDA / with portable=True (checked before any early
            return), or "ptx" with a workspace not 4-byte aligned / a cache not 2-byte
            aligned (the default then takes "triton").
    """
    launcher = gather_launcher(cache.device, portable=portable, config=config,
                               lengths_are_seq_lens=lengths_are_seq_lens)
    max_pages = check_int("max_pages", max_pages)  # a kernel argument: a Python int
    r, width = block_table.shape
    if r == 0 or max_pages <= 0 or workspace.shape[0] == 0 or width == 0 \
            or cache.shape[0] == 0:  # nothing readable
        return
    assert workspace.is_contiguous() and tuple(workspace.shape[1:]) == (PAGE_SIZE, HEAD_DIM)
    assert block_table.stride(-1) == 1
    ws = workspace.view(torch.uint8)
    kernels = launcher.kernels(cache, ws)
    lengths, page_offsets = lengths.contiguous(), page_offsets.contiguous()
    # page counts clamped to min(max_pages, W): a 2-page program's second page may be page
    # max_pages
    bound = min(width, max_pages)
    pages, launches = launcher.plan(r, block_table, lengths, page_offsets, max_pages, width,
                                    cache.device)
    with device_guard(cache.device):
        launcher.run(kernels[pages], launches, cache, ws, bound)


def gather_index_k_fp8(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       *, portable: bool | None = None):
    """Dequantize every request's history pages into a compact FP8 workspace (SPEC 7).

    Args:
        cache: the paged cache. block_table: int32 ``[R, W]`` (unit stride in the last dim).
        seq_lens: int32 ``[R]``; request r contributes (seq_len - 1) // 128 pages.
        portable: force the PORTABLE constexpr (tests).
    Returns:
        ``(workspace float8_e4m3fn [P, 128, 128], page_offsets int32 [R+1])``, P = total pages.
    One host sync (to size the workspace). Inputs are validated by ``nvfp4_indexer.api``.
    """
    dev = block_table.device
    r = block_table.shape[0]
    pages = history_pages(seq_lens)  # int64 [R], on the device
    page_offsets = torch.zeros(r + 1, dtype=torch.int32, device=dev)
    if r:
        page_offsets[1:] = torch.cumsum(pages, 0)
        total, max_pages = torch.stack((page_offsets[-1].to(torch.int64), pages.max())).tolist()
    else:
        total = max_pages = 0
    workspace = torch.empty((total, PAGE_SIZE, HEAD_DIM), dtype=torch.float8_e4m3fn, device=dev)
    gather_into(cache, block_table, pages, page_offsets, workspace, max_pages,
                lengths_are_seq_lens=False, portable=portable)
    return workspace, page_offsets
