"""Gather of requests' history pages into a compact FP8 workspace (SPEC 7).

Workspace page ``page_offsets[r] + j`` holds request r's logical page j, token-major
``[128 tokens, 128 dims]``, as dequant_e4m3 bytes (SPEC 1.4), bit-exact.

Dequantization modes (the ``DEQUANT`` constexpr, ``GatherConfig(dequant=...)``):

- "ptx" (GPU default, SM89+): code bytes read as uint16 pairs, one inline-PTX call
  (``ptx.dequant_e4m3_bytes``) turns 2 pairs (8 dims) into two uint32 words of
  E4M3 bytes with f16x2 arithmetic and native conversions, stored through a uint32 view.
- "triton": fp32 per value from Triton ops (``dequantize.dequant_code_tile``); the only mode
  under the interpreter / with ``PORTABLE`` (integer-bit E4M3 encoder).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import HEAD_DIM, PAGE_SIZE
from ..reference.paging import history_pages
from . import heuristics as hz
from .config import GatherConfig, check_config
from .dequantize import dequant_code_tile
from .numerics import device_guard, interpreting, portable_default
from .layout import (CODE_BYTES, GROUPS, HEAD, PAGE, SCALES_OFFSET, WS_PAGE,
                     num_history_pages)
from .ptx import dequant_e4m3_bytes

MAX_GRID_Y = 65535  # CUDA's grid y limit: requests per launch


@triton.jit
def _gather_kernel(cache_ptr, page_stride, bt_ptr, bt_row_stride, len_ptr, off_ptr, ws_ptr,
                   ws_pages, width, num_blocks, FROM_SEQ_LENS: tl.constexpr, PORTABLE: tl.constexpr,
                   TOK_BLOCK: tl.constexpr, DEQUANT: tl.constexpr = "triton",
                   PAGE_PARTS: tl.constexpr = 1, STREAM: tl.constexpr = False):
    """Program (j * PAGE_PARTS + part, r): part ``part`` (128 / PAGE_PARTS tokens) of request
    r's logical page j, if j < its page count, into workspace page ``off_ptr[r] + j``
    (skipped when that lies outside ``[0, ws_pages)``), ``TOK_BLOCK`` tokens per step,
    dequantized per ``DEQUANT`` (module docstring). ``STREAM``: evict-first page loads and
    streaming (``.cs``) workspace stores (ptx mode)."""
    PART: tl.constexpr = PAGE // PAGE_PARTS
    r = tl.program_id(1)
    j = tl.program_id(0) // PAGE_PARTS
    tok0 = (tl.program_id(0) % PAGE_PARTS) * PART
    length = tl.load(len_ptr + r).to(tl.int64)
    if FROM_SEQ_LENS:
        num_pages = num_history_pages(length)  # SPEC 4, 7
    else:
        num_pages = length
    num_pages = tl.minimum(num_pages, width)  # SPEC 10: never past the block-table row
    dst = tl.load(off_ptr + r).to(tl.int64) + j
    if (j < num_pages) & (dst >= 0) & (dst < ws_pages):
        block = tl.load(bt_ptr + r.to(tl.int64) * bt_row_stride + j)
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)  # inside the cache
        page = cache_ptr + block * page_stride
        out_page = ws_ptr + dst * WS_PAGE
        if DEQUANT == "ptx":
            # [tokens, group g, pair k]: uint16 code pair 4g + k = dims 16g + 4k .. + 3. The
            # group axis lets the [TOK_BLOCK, 8, 1] scales broadcast in registers; their load
            # is told contiguity 1 so it takes the codes' layout (vectorized, it would get
            # another layout and a shared-memory conversion every step: SM90 SASS).
            g = tl.arange(0, GROUPS)[None, :, None]
            k = tl.arange(0, 4)[None, None, :]  # code pairs per group
            for t0 in tl.static_range(0, PART, TOK_BLOCK):
                tok = (tok0 + t0 + tl.arange(0, TOK_BLOCK))[:, None, None]
                cptr = (page + tok * CODE_BYTES).to(tl.pointer_type(tl.uint16), bitcast=True) \
                    + g * 4 + k
                sptr = page + SCALES_OFFSET + tok * GROUPS + tl.max_contiguous(g, [1, 1, 1])
                optr = (out_page + tok * HEAD).to(tl.pointer_type(tl.uint32), bitcast=True) \
                    + g * 4 + k
                if STREAM:
                    codes = tl.load(cptr, eviction_policy="evict_first")
                    sbytes = tl.load(sptr, eviction_policy="evict_first")
                else:
                    codes = tl.load(cptr)
                    sbytes = tl.load(sptr)
                s = sbytes.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact
                out = dequant_e4m3_bytes(codes, s)  # uint32: 4 E4M3 bytes, dim order
                if STREAM:
                    tl.store(optr, out, cache_modifier=".cs")
                else:
                    tl.store(optr, out)
        else:
            i = tl.arange(0, CODE_BYTES)[None, :]
            d = tl.arange(0, HEAD)[None, :]
            for t0 in tl.static_range(0, PART, TOK_BLOCK):
                tok = (tok0 + t0 + tl.arange(0, TOK_BLOCK))[:, None]
                code_bytes = tl.load(page + tok * CODE_BYTES + i)
                scale_bytes = tl.load(page + SCALES_OFFSET + tok * GROUPS + i // 8)
                out = dequant_code_tile(code_bytes, scale_bytes, PORTABLE, False)
                tl.store(out_page + tok * HEAD + d, out)


def resolve_tuning(device, portable: bool | None = None,
                   config: GatherConfig | None = None):
    """``(PORTABLE, DEQUANT, TOK_BLOCK, num_warps, PAGE_PARTS, STREAM)`` of a gather launch on
    ``device`` (``heuristics.gather_defaults`` for the fields ``config`` leaves None).

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
    return (portable,) + hz.gather_defaults(device, portable, cfg.dequant, cfg.tok_block,
                                            cfg.num_warps, cfg.page_parts, cfg.streaming)


def gather_into(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                page_offsets: torch.Tensor, workspace: torch.Tensor, max_pages: int, *,
                lengths_are_seq_lens: bool = True, portable: bool | None = None,
                config: GatherConfig | None = None) -> None:
    """Launch the gather without host syncs (SPEC 7): request r's logical pages
    j < n_r go to ``workspace[page_offsets[r] + j]``. Capturable in a CUDA graph.

    Args:
        cache: ``uint8 [num_blocks, 128, 72]`` with strides ``(S, 72, 1)``.
        block_table: int32 ``[R, W]``, unit stride in the last dim; entries [r, j] for
            j < n_r must be valid block ids (others are never read).
        lengths: int32/int64 ``[R]`` on the device: seq_lens (n_r = (seq_len - 1) // 128, 0 for
            empty requests) when ``lengths_are_seq_lens``, else the page counts n_r themselves.
        page_offsets: int32/int64 ``[>= R]`` destination page of each request's page 0.
        workspace: ``float8_e4m3fn`` (or uint8) ``[P, 128, 128]``, contiguous; pages outside
            ``[0, P)`` are skipped, pages not gathered are left untouched.
        max_pages: host int >= every n_r (the grid is ``(max_pages * page_parts, R)``, R split
            over launches of at most ``MAX_GRID_Y`` requests; pages past n_r exit).
        portable: force the PORTABLE constexpr (tests); default True under the interpreter /
            off CUDA.
        config: tuning (``config.GatherConfig``: dequant, tok_block, num_warps, page_parts,
            streaming); None = defaults (``heuristics.gather_defaults``). Every setting
            writes the same bytes.
    Raises:
        ValueError: a bad ``config``, or dequant "ptx" under the interpreter / off CUDA / with
            portable=True (checked before any early return), or "ptx" with a workspace not
            4-byte aligned / a cache not 2-byte aligned (the default then takes "triton").
    """
    explicit = config.dequant if isinstance(config, GatherConfig) else None
    portable, dequant, tok_block, num_warps, page_parts, streaming = resolve_tuning(
        cache.device, portable, config)
    r = block_table.shape[0]
    if r == 0 or max_pages <= 0 or workspace.shape[0] == 0 or block_table.shape[1] == 0 \
            or cache.shape[0] == 0:  # nothing readable
        return
    assert workspace.is_contiguous() and tuple(workspace.shape[1:]) == (PAGE_SIZE, HEAD_DIM)
    assert block_table.stride(-1) == 1
    ws = workspace.view(torch.uint8)
    if dequant == "ptx" and (ws.data_ptr() % 4 or cache.data_ptr() % 2 or cache.stride(0) % 2):
        # "ptx" reads uint16 code pairs and writes uint32 words: misaligned views (never made
        # by this library) take the byte path, or are refused when "ptx" was asked for
        if explicit == "ptx":
            raise ValueError("dequant: 'ptx' needs a 4-byte aligned workspace and a 2-byte "
                             "aligned cache (base and page stride)")
        dequant = "triton"
    lengths, page_offsets = lengths.contiguous(), page_offsets.contiguous()
    with device_guard(cache.device):
        # pages on the grid's x axis (up to 2^31 - 1 programs), requests on y: at most
        # MAX_GRID_Y per launch
        for r0 in range(0, r, MAX_GRID_Y):
            r1 = min(r, r0 + MAX_GRID_Y)
            _gather_kernel[(max_pages * page_parts, r1 - r0)](
                cache, cache.stride(0), block_table[r0:r1], block_table.stride(0),
                lengths[r0:r1], page_offsets[r0:r1], ws, ws.shape[0], block_table.shape[1],
                cache.shape[0], FROM_SEQ_LENS=lengths_are_seq_lens, PORTABLE=portable, TOK_BLOCK=tok_block,
                DEQUANT=dequant, PAGE_PARTS=page_parts, STREAM=streaming,
                num_warps=num_warps)


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
