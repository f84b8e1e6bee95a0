"""Triton "Q8KV8" prefill indexer: gather history pages into the FP8 workspace, score the
workspace, select top-k, chunk by chunk (SPEC 4, 5, 7).

Design
------
Requests are grouped into chunks whose gathered pages fit ``max_gather_pages``
(``reference.prefill.plan_chunks``). A request whose last query's local page is <= 15 has only
short rows (SPEC 5 gives their output by formula), so its pages are not gathered: a chunk
gathers the pages of the other requests (``gather.gather_into``, one launch) into a workspace
``float8_e4m3fn [P, 128, 128]`` (token-major).

Score kernel, grid ``(row blocks, NUM_SPLITS)``: a row block is ``BLOCK_M`` (token, head) rows
of one request (``heuristics.plan_row_blocks``); its pages are those below the local page of its
last row (rows are bottom-right aligned, so that is the block's largest L), 0 when that is
<= 15. Split s takes the s-th of NUM_SPLITS equal ranges of those pages; per page: a
``[128 tokens, 128 dims]`` E4M3 tile from the workspace, the token scores in one K=128 MMA
(16-bit dot modes: ``[BLOCK_M, 128 tokens]``, the page as the shared-memory operand, so the
max over tokens stays in registers; "fp8" / "fp32": ``[128 tokens, BLOCK_M]``), the NaN-skipping
max, and the page's candidate for rows with j < L, kept in each
row's running top-KEEP list (KEEP = min(16, next power of two >= pages per split); updated per
page, or once per window of buffered page scores for splits of >= 32 pages, as in ``decode``).
No ``[tokens, heads, pages]`` score tensor exists: each program writes its lists to the
candidate scratch ``int64 [blocks * BLOCK_M, NUM_SPLITS, KEEP]``; the merge kernel (grid
``(blocks, BLOCK_M / rows)``, ``heuristics.merge_config``'s rows per program) selects the
final 15 and writes SPEC 5's output. With one split the score kernel writes the output itself.

On CUDA SM90 with dot fp16 a chunk whose splits have > 8 pages (KEEP 16), with BLOCK_M 128, is
scored by the Gluon twin ``prefill_wgmma.prefill_wgmma_kernel`` instead (same arguments and
results; warp-specialized: a converter partition widens the pages into a shared-memory ring
while two consumer partitions overlap their page MMAs with the epilogues, and it inserts each
page's candidates directly, without the window scratch; ``heuristics.prefill_launch``'s
``kernel`` and split rule, ``PrefillConfig.kernel``). With dot "fp8" there (opt-in:
``prefill_indexer(allow_fp8_mma=True)``) those chunks run its E4M3 form (``FP8``: FP8 wgmma,
SPEC 9 b = 5) and the other chunks score exactly (fp16), as without it.

Both kernels read request r's seq len as ``max(min(seq_lens[r], caps[r]), 0)``
(``scan.block_rows_info``): ``caps`` are the seq lens the host planned with (the engine's
staged copies of ``seq_lens_cpu``, SPEC 8.1), so no row scores past a planned page and no
clamp op runs before the launch; ``prefill_indexer`` planned from the device values
themselves and passes ``seq_lens`` twice.

Dot modes and their error bounds are those of ``decode`` (``SCORE_ERROR_BITS``). Host syncs
are allowed in prefill (SPEC 7): the plan reads ``cu_seqlens_q`` and ``seq_lens`` once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import HEAD_DIM, PAGE_SIZE
from ..reference.prefill import plan_chunks
from ..validation import check_int
from . import heuristics as hz
from .config import PrefillConfig, check_config
from .dot_modes import resolve_dot
from .gather import gather_into
from .heuristics import TOKENS_ON_N_DOTS, plan_row_blocks
from .dequantize import dequant_code_tile
from .layout import (CODE_BYTES, GROUPS, PAGE, SCALES_OFFSET, WS_PAGE, scored_pages,
                     split_range, ws_page_offset)
from .device import device_guard, num_sms, portable_default
from .operands import load_q_rows, load_q_t
from .scan import (block_rows_info, finish_split, merge_splits, out_offsets, scan_pages,
                   score_row_block)
from .scoring import fp8_page_scores, fp8_page_scores_n, fp8_tile_scores, fp8_tile_scores_n


# seq_lens_ptr is a view at the step's first prefill request (Indexer): its alignment varies
# with the decode count, and its loads are scalar, so it takes no alignment specialization
# (no second compile mid-serving); nor does caps_ptr.
_SEQ_PTRS = ["seq_lens_ptr", "caps_ptr"]


@triton.jit
def _score_prologue(q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                    num_blocks, H: tl.constexpr, BLOCK_M: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, DOT: tl.constexpr, TOKENS_N: tl.constexpr):
    """What both prefill score kernels start with, for program (row block, split): ``(blk,
    split, rows, token, h, local, row_ok, start, end, q_op, r)`` -- the block's rows, its
    split's page range, the query operand (``[BLOCK_M, 128]`` A with tokens on N, else
    ``[128, BLOCK_M]`` B) and the block's request r."""
    blk = score_row_block()
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                              num_blocks, blk, rows, H)
    n = scored_pages(tl.max(tl.where(row_ok, local, 0), 0))  # the block's largest L
    start, end = split_range(n, split, NUM_SPLITS)
    q_off = token * q_tok_stride + h * q_head_stride
    if TOKENS_N:
        q_op = load_q_rows(q_ptr, q_off, row_ok, DOT)
    else:
        q_op = load_q_t(q_ptr, q_off, row_ok, DOT)
    return blk, split, rows, token, h, local, row_ok, start, end, q_op, tl.load(blk_ptr + blk)


@triton.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "req_base", "num_blocks"],
            do_not_specialize_on_alignment=_SEQ_PTRS)
def _prefill_score_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base,
                          qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                          win_ptr, out_ptr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, DOT: tl.constexpr, WINDOW: tl.constexpr = 1,
                          KEEP: tl.constexpr = 16, TOKENS_N: tl.constexpr = False):
    blk, split, rows, token, h, local, row_ok, start, end, q_op, r = _score_prologue(
        q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
        num_blocks, H, BLOCK_M, NUM_SPLITS, DOT, TOKENS_N)
    ws_page0 = ws_ptr + tl.load(ws_off_ptr + (r - req_base)).to(tl.int64) * WS_PAGE
    top = scan_pages(start, end, local, (ws_page0,), (q_op,), win_ptr,
                     blk * NUM_SPLITS + split, 0, 1, _ws_page_scores, DOT, TOKENS_N, BLOCK_M,
                     KEEP, WINDOW)
    finish_split(top, local, out_ptr + out_offsets(token, h, H), row_ok, cand_ptr,
                 (blk * BLOCK_M + rows).to(tl.int64), split, NUM_SPLITS, False)


@triton.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "page_stride", "cache_blocks",
                              "bt_row_stride", "req_base", "num_blocks"],
            do_not_specialize_on_alignment=_SEQ_PTRS + ["bt_ptr"])
def _prefill_direct_score_kernel(q_ptr, q_tok_stride, q_head_stride, cache_ptr, page_stride,
                                 cache_blocks, bt_ptr, bt_row_stride, tbl_ptr, req_base, qsl_ptr,
                                 seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                                 out_ptr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                                 NUM_SPLITS: tl.constexpr, DOT: tl.constexpr,
                                 WINDOW: tl.constexpr = 1, KEEP: tl.constexpr = 16,
                                 TOKENS_N: tl.constexpr = False):
    """``_prefill_score_kernel`` reading request r's page j straight from the paged cache
    (block ``bt_ptr[(r - req_base) * bt_row_stride + j]``, clamped to ``[0, cache_blocks)``:
    SPEC 10), dequantized to E4M3 (SPEC 1.4) in the page loop: the workspace's bytes, so the
    same scores and lists as gather + score. The Triton twin of
    ``prefill_wgmma.prefill_wgmma_direct_kernel`` (same runtime arguments; ``tbl_ptr`` is not
    read; window scratch: none, so WINDOW must be 1), for CPU tests (the interpreter); no
    launch path of the library takes it."""
    tl.static_assert(WINDOW == 1, "the direct score kernel has no window scratch")
    blk, split, rows, token, h, local, row_ok, start, end, q_op, r = _score_prologue(
        q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
        num_blocks, H, BLOCK_M, NUM_SPLITS, DOT, TOKENS_N)
    bt_row = bt_ptr + (r - req_base).to(tl.int64) * bt_row_stride
    # no window: win_ptr (cand_ptr here) is not read
    top = scan_pages(start, end, local, (cache_ptr, page_stride, cache_blocks, bt_row), (q_op,),
                     cand_ptr, 0, 0, 1, _cache_page_scores, DOT, TOKENS_N, BLOCK_M, KEEP,
                     WINDOW)
    finish_split(top, local, out_ptr + out_offsets(token, h, H), row_ok, cand_ptr,
                 (blk * BLOCK_M + rows).to(tl.int64), split, NUM_SPLITS, False)


@triton.jit
def _cache_page_scores(page_src, j, q_ops, DOT: tl.constexpr, TOKENS_N: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of request page j read from the cache (``page_src = (cache,
    page stride, cache blocks, the request's block-table row)``; the block id clamped into the
    cache), dequantized to E4M3 bytes first (the integer-bit encoder: the interpreter's fp8
    casts are not trusted)."""
    cache_ptr, page_stride, cache_blocks, bt_row = page_src
    q_op, = q_ops
    block = tl.minimum(tl.maximum(tl.load(bt_row + j), 0), cache_blocks - 1)
    page = cache_ptr + block.to(tl.int64) * page_stride
    i = tl.arange(0, CODE_BYTES)[None, :]
    t = tl.arange(0, PAGE)[:, None]
    codes = tl.load(page + t * CODE_BYTES + i)
    scales = tl.load(page + SCALES_OFFSET + t * GROUPS + i // 8)
    kb = dequant_code_tile(codes, scales, True, False)
    if TOKENS_N:
        return fp8_tile_scores_n(kb, q_op, DOT)
    else:
        return fp8_tile_scores(kb, q_op, DOT)


@triton.jit
def _ws_page_scores(page_src, j, q_ops, DOT: tl.constexpr, TOKENS_N: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of workspace page j (``page_src = (request's first
    workspace page,)``), tokens on the MMA's N or M axis."""
    ws_page0, = page_src
    q_op, = q_ops
    if TOKENS_N:
        return fp8_page_scores_n(ws_page0 + ws_page_offset(j), q_op, DOT)
    else:
        return fp8_page_scores(ws_page0 + ws_page_offset(j), q_op, DOT)


@triton.jit(do_not_specialize=["num_blocks"], do_not_specialize_on_alignment=_SEQ_PTRS)
def _prefill_merge_kernel(cand_ptr, qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks,
                          out_ptr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, ROWS: tl.constexpr,
                          KEEP: tl.constexpr = 16, SORT: tl.constexpr = 0):
    blk = tl.program_id(0)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                              num_blocks, blk, rows, H)
    row_ok = row_ok & (rows < BLOCK_M)
    merge_splits(cand_ptr, (blk * BLOCK_M + rows).to(tl.int64), row_ok, local,
                 out_ptr + out_offsets(token, h, H), NUM_SPLITS, SPLITS_PAD, KEEP, SORT)


def prefill_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_gather_pages: int,
                    out: torch.Tensor, *, config: PrefillConfig | None = None) -> torch.Tensor:
    """Selected pages of prefill requests into ``out`` (SPEC 5, 7).

    Args:
        index_q: ``float8_e4m3fn [Tp, H, 128]`` (unit last stride). cache: ``uint8 [N, 128, 72]``
        paged cache. block_table: int32 ``[R, W]`` (unit last stride). cu_seqlens_q: int32
        ``[R+1]`` (each q_len >= 1). seq_lens: int32 ``[R]`` (q_len <= seq_len <= W*128).
        max_gather_pages: workspace budget in pages per chunk (>= any request's history).
        out: int32 ``[Tp, H, 16]`` contiguous.
        config: tuning (``config.PrefillConfig``: dot, num_splits, window, block_m, num_warps,
        num_stages, tokens_on_n, kernel, direct, the gather's ``GatherConfig``); None =
        defaults (``heuristics``). The workspace is allocated when a chunk gathers (with
        ``direct``, chunks on the Gluon kernel read the cache and gather nothing).
    Inputs are assumed validated (``nvfp4_indexer.api.prefill_indexer``). Syncs the host.
    Returns ``out``.
    Raises:
        ValueError: ``config`` not None or a ``PrefillConfig``; its window with
        window * BLOCK_M > 4096; a bad ``max_gather_pages``; kernel "wgmma" where it cannot
        run (``heuristics.prefill_wgmma_ok``).
    """
    cfg = check_config("config", config, PrefillConfig)
    max_gather_pages = check_int("max_gather_pages", max_gather_pages, lo=0)
    t, h, _ = index_q.shape
    num_reqs = block_table.shape[0]
    dev = index_q.device
    dot = resolve_dot(cfg.dot, dev)
    # kernel None: the Gluon kernel where it runs, unless a Triton-kernel knob is given
    auto = cfg.kernel is None and cfg.window is None and cfg.num_stages is None
    # dot "fp8" on SM90: the Gluon kernel's E4M3 form; the chunks it does not take score
    # exactly (fp16, tokens on N), as without it (no faster fp8 path there)
    gluon_fp8 = dot == "fp8" and (cfg.kernel == "wgmma" or auto) \
        and cfg.tokens_on_n is not False and hz.prefill_wgmma_ok(dev, "fp8", True)
    if gluon_fp8:
        dot = "fp16"
    tokens_on_n = dot in TOKENS_ON_N_DOTS if cfg.tokens_on_n is None else cfg.tokens_on_n
    wgmma = (cfg.kernel == "wgmma" or auto) and hz.prefill_wgmma_ok(dev, dot, tokens_on_n)
    if cfg.kernel == "wgmma" and not wgmma:
        raise ValueError("kernel: 'wgmma' needs a CUDA SM90 GPU with Gluon, dot 'fp16' or "
                         f"'fp8', and tokens on N, got device {dev}, dot {dot!r}, "
                         f"tokens_on_n {tokens_on_n}")
    if t == 0 or num_reqs == 0:
        return out
    qsl = cu_seqlens_q.tolist()
    sl = seq_lens.tolist()
    portable = portable_default(dev)
    need = hz.gather_pages_needed(sl)
    chunks = plan_chunks(need, max(max_gather_pages, max(need)))
    ws_pages = max(sum(need[a:b]) for a, b in chunks)
    direct = wgmma and not gluon_fp8 \
        and (hz.PREFILL_DIRECT if cfg.direct is None else cfg.direct) \
        and hz.prefill_direct_ok(cache)
    workspace = None  # allocated for the first chunk that gathers
    longest = max(qsl[i + 1] - qsl[i] for i in range(num_reqs))
    block_m = cfg.block_m or hz.prefill_block_m(longest, h)
    if cfg.window is not None and cfg.window * block_m > hz.MAX_WINDOW_ELEMS:
        raise ValueError(f"window: expected window * BLOCK_M <= {hz.MAX_WINDOW_ELEMS}, got "
                         f"{cfg.window} * {block_m}")
    q8 = index_q.view(torch.uint8)
    sms = num_sms(dev)
    for a, b in chunks:
        reqs, row0s, pages = plan_row_blocks(qsl, sl, h, block_m, range(a, b))
        nb = len(reqs)
        offsets = [0]
        for n in need[a:b]:
            offsets.append(offsets[-1] + n)
        meta = torch.tensor(reqs + row0s + offsets, dtype=torch.int32).to(dev)
        blocks, ws_off = meta[:2 * nb], meta[2 * nb:]
        score_pages = max(p if p > hz.SHORT_MAX_LOCAL else 0 for p in pages)
        launch = hz.prefill_launch(nb, score_pages, block_m, sms,
                                   num_splits=cfg.num_splits, window=cfg.window, wgmma=wgmma)
        from_cache = direct and launch["kernel"] == "wgmma"  # no gather, no workspace
        if not from_cache and workspace is None:
            workspace = torch.empty((max(ws_pages, 1), PAGE_SIZE, HEAD_DIM),
                                    dtype=torch.float8_e4m3fn, device=dev)
        if offsets[-1] and not from_cache:
            gather_into(cache, block_table[a:b], ws_off[1:] - ws_off[:-1], ws_off, workspace,
                        max(need[a:b]), lengths_are_seq_lens=False, portable=portable,
                        config=cfg.gather)
        ns, keep, win = launch["ns"], launch["keep"], launch["win"]
        cand = torch.empty((max(launch["cand"], 1),), dtype=torch.int64, device=dev)
        scratch = torch.empty((max(launch["win_elems"], 1),), dtype=torch.float32, device=dev)
        ws8 = None if workspace is None else workspace.view(torch.uint8)
        args = (q8, q8.stride(0), q8.stride(1), ws8, ws_off, a, cu_seqlens_q, seq_lens,
                seq_lens, blocks, nb, cand, scratch, out)
        with device_guard(dev):
            if from_cache:
                from .decode_wgmma import _device_table
                from .prefill_wgmma import launch_options, prefill_wgmma_direct_kernel
                bt = block_table[a:b]  # rows of requests a..b-1: the kernel reads r - a
                prefill_wgmma_direct_kernel[(nb, ns)](
                    q8, q8.stride(0), q8.stride(1), cache, cache.stride(0), cache.shape[0], bt,
                    bt.stride(0), _device_table(dev), a, cu_seqlens_q, seq_lens, seq_lens,
                    blocks, nb, cand, out, H=h, BLOCK_M=block_m, NUM_SPLITS=ns, **launch_options())
            elif launch["kernel"] == "wgmma":
                from .prefill_wgmma import launch_options, prefill_wgmma_kernel
                prefill_wgmma_kernel[(nb, ns)](*args, H=h, BLOCK_M=block_m, NUM_SPLITS=ns,
                                               **launch_options(gluon_fp8))
            else:
                _prefill_score_kernel[(nb, ns)](
                    *args, H=h, BLOCK_M=block_m, NUM_SPLITS=ns, DOT=dot, WINDOW=win, KEEP=keep,
                    TOKENS_N=tokens_on_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages or launch["stages"])
            if ns > 1:
                rows, warps = hz.merge_config(ns, keep, sort=hz.PREFILL_MERGE_SORT)
                _prefill_merge_kernel[(nb, triton.cdiv(block_m, rows))](
                    cand, cu_seqlens_q, seq_lens, seq_lens, blocks, nb, out, H=h,
                    BLOCK_M=block_m, NUM_SPLITS=ns, SPLITS_PAD=hz.next_pow2(ns), ROWS=rows,
                    KEEP=keep, SORT=int(hz.PREFILL_MERGE_SORT), num_warps=warps)
    return out
