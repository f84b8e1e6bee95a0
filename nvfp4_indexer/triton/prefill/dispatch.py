"""The prefill and gather rule table: which score kernel, how many splits, which window and
merge shape a prefill chunk takes, how its rows are cut into blocks, and the gather's launch
shape (SPEC 7). Pure host functions of static shapes and the device; none reads device
values, so CUDA-graph replays and cached launches stay valid.

Shared shape helpers (``cdiv``, ``next_pow2``, the split rule, ``keep_for_pages``,
``choose_window``, ``merge_config``, scratch sizes) live in ``triton.heuristics``; the device
probes in ``triton.device``.
"""

from __future__ import annotations

import numpy as np
import torch

from ...constants import PAGE_SIZE, SHORT_MAX_LOCAL, TOPK
from ...reference.paging import history_page_count
from ..device import interpreting, num_sms, wgmma_available
from ..heuristics import (MIN_BLOCK_M, MIN_PAGES_PER_SPLIT, candidate_elems, cdiv,
                          choose_window, keep_for_pages, next_pow2, split_rule, window_elems)

# -- prefill score kernels -------------------------------------------------------------------
PREFILL_MAX_BLOCK_M = 128  # (token, head) rows per prefill score program
PREFILL_PROGRAMS_PER_SM = 8  # split target of the Triton score kernel
PREFILL_DEEP_PIPELINE_PAGES = 64  # pages per split from which the score kernel takes 3 stages
TOKENS_ON_N_DOTS = ("fp16", "bf16")  # dot modes scored with page tokens on the MMA's N axis
PREFILL_WGMMA_BLOCK_M = (128,)  # BLOCK_M the Gluon prefill kernel takes (two consumers of 64)
# The Gluon kernel's split target: one CTA per SM (one wave), at least 2 splits, fewer only
# where a split would otherwise keep < 16 candidates ...
PREFILL_WGMMA_PROGRAMS_PER_SM = 1
# ... except 1 split (no merge) from this many row blocks per SM of at most this many pages
PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM = 2
PREFILL_WGMMA_UNSPLIT_MAX_PAGES = 512

# -- gather ----------------------------------------------------------------------------------
GATHER_TOK_BLOCK = 16  # tokens per inner step (128 under the interpreter)
GATHER_NUM_WARPS = 1
GATHER_PAGE_PARTS = 8  # programs per page (1 under the interpreter)
GATHER_STREAMING = True  # evict-first page loads, streaming (.cs) workspace stores
GATHER_RESIDENT_WARPS = 64  # warps an SM holds (SM80+); at most 32 programs
MAX_GRID_Y = 65535  # CUDA's grid y limit: requests per gather launch


def prefill_block_m(longest_q_len: int, num_heads: int, cap: int = PREFILL_MAX_BLOCK_M) -> int:
    """BLOCK_M of a row-block scorer (prefill; ``scores.page_scores`` with its own ``cap``):
    the longest request's (token, head) rows as a power of two in 16..``cap``."""
    return min(cap, max(MIN_BLOCK_M, next_pow2(longest_q_len * num_heads)))


def plan_row_blocks(q_lens: np.ndarray, seq_lens: np.ndarray, num_heads: int,
                    block_m: int, pages: bool = True) -> tuple[np.ndarray, ...]:
    """Split the query rows of requests ``0 .. n-1`` into blocks of ``block_m`` (token, head)
    rows (host only, numpy).

    A request's rows are numbered ``(token - q_start) * H + head`` (token-major) and a block
    never spans two requests. Args: ``q_lens [n]`` (>= 0) and ``seq_lens [n]``, int64 arrays.
    Returns int64 arrays ``(request, first row, pages)`` per block, where ``pages`` is the local
    page L of the block's last row (rows are bottom-right aligned, so it is the block's
    largest L; 0 when negative); ``pages=False`` leaves it out.
    """
    rows = q_lens * num_heads
    if len(rows) == 1:  # one request: no per-block gathers (host time)
        nb = cdiv(int(rows[0]), block_m)
        row0s = np.arange(0, nb * block_m, block_m)
        reqs = np.zeros(nb, dtype=np.int64)
        if not pages:
            return reqs, row0s
        t_last = np.minimum(row0s + block_m, rows[0])
        t_last -= 1
        t_last //= num_heads
        t_last += seq_lens[0] - q_lens[0]
        return reqs, row0s, np.maximum(t_last, 0) // PAGE_SIZE
    nblk = -(-rows // block_m)
    reqs = np.repeat(np.arange(len(rows)), nblk)
    first = np.cumsum(nblk) - nblk  # each request's first block
    row0s = (np.arange(len(reqs)) - first[reqs]) * block_m
    if not pages:
        return reqs, row0s
    t_last = (np.minimum(row0s + block_m, rows[reqs]) - 1) // num_heads
    return reqs, row0s, np.maximum(seq_lens[reqs] - q_lens[reqs] + t_last, 0) // PAGE_SIZE


def gather_pages_needed(seq_lens: list[int]) -> list[int]:
    """Pages each prefill request needs gathered: its last query's history pages
    (seq_len - 1) // 128, or 0 when all its rows are short (L <= 15, SPEC 5)."""
    hist = [history_page_count(s) for s in seq_lens]
    return [n if n > SHORT_MAX_LOCAL else 0 for n in hist]


def prefill_num_splits(num_blocks: int, max_pages: int, num_sms: int) -> int:
    """NUM_SPLITS of a prefill chunk of ``num_blocks`` row blocks whose longest scores
    ``max_pages`` pages: the shared rule with ``PREFILL_PROGRAMS_PER_SM`` and at least
    ``MIN_PAGES_PER_SPLIT`` pages per split."""
    return split_rule(num_blocks, PREFILL_PROGRAMS_PER_SM * num_sms,
                       cdiv(max(max_pages, 1), MIN_PAGES_PER_SPLIT))


def prefill_launch(num_blocks: int, score_pages: int, block_m: int, num_sms: int, *,
                   num_splits: int | None = None, window: int | None = None,
                   cap: int | None = None, wgmma: bool = False) -> dict:
    """Splits / keep / window of one prefill chunk's score launch and its scratch.

    Args:
        num_blocks: row blocks of the chunk. score_pages: pages its longest block scores (0
        when every row is short). block_m: BLOCK_M. num_sms: the GPU's SMs.
        num_splits / window: overrides (``PrefillConfig``). cap: float32 elements the scratch
        may take; fewer splits (then window 1) until it fits (engine's shared buffer).
        wgmma: the Gluon kernel may run (``prefill_wgmma_ok``): a chunk with BLOCK_M in
        ``PREFILL_WGMMA_BLOCK_M`` takes it when its splits keep 16 candidates (> 8 pages),
        with its own default split count (``PREFILL_WGMMA_PROGRAMS_PER_SM`` per SM, at least
        2 (1 from ``PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM`` row blocks per SM when the blocks
        score at most ``PREFILL_WGMMA_UNSPLIT_MAX_PAGES`` pages), at most the Triton kernel's,
        capped at ``(pages - 1) // 8`` so that every split keeps 16, also where the Triton
        rule's splits keep fewer); it inserts every page's candidates directly (window 1, no
        window scratch: ``cap`` counts only its candidates).
    Returns:
        dict ``ns, keep, win, block_m, cand`` (int64 candidate elements, 0 unsplit),
        ``win_elems`` (fp32 window elements, 0 for window 1), ``scratch`` (float32 elements:
        ``2 * cand + win_elems``), ``stages`` (the Triton score kernel's default
        ``num_stages``: 3 from ``PREFILL_DEEP_PIPELINE_PAGES`` pages per split, else 2; H200:
        2-7 % faster on long splits, up to 10 % slower on short ones), ``kernel`` ("wgmma":
        ``prefill_wgmma``, else "triton": ``prefill.prefill_score_kernel``).
    """
    if score_pages == 0:
        ns = 1
    else:
        ns = num_splits or prefill_num_splits(num_blocks, score_pages, num_sms)
        if num_splits is None and wgmma and block_m in PREFILL_WGMMA_BLOCK_M:
            # one CTA of 12 warps per SM: one wave up to SMs / 2 row blocks (H200: 8 / 32 row
            # blocks at 16 / 4 splits 1.05-1.4x faster than at 2 waves, 1.33x than at 2.2
            # waves), else the floor of 2 splits (128 row blocks of 287 pages: 290 us + an
            # 11.5 us merge against 312 us unsplit), except for >= 2 waves of row blocks of
            # <= 512 pages: 1 split, no merge launch (each request's longest row blocks start
            # first; 512 blocks: 1.15x / 1.04x faster at 127 / 383 pages, 1.4 % slower at
            # 1151)
            unsplit = (num_blocks >= PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM * num_sms
                       and score_pages <= PREFILL_WGMMA_UNSPLIT_MAX_PAGES)
            ns_g = min(ns, max(1 if unsplit else 2,
                               PREFILL_WGMMA_PROGRAMS_PER_SM * num_sms // num_blocks))
            ns_g = min(ns_g, max(1, (score_pages - 1) // (TOPK // 2)))  # splits that keep 16
            if keep_for_pages(cdiv(score_pages, ns_g)) == TOPK:
                ns = ns_g
    force_win1 = False
    while True:
        per = cdiv(max(score_pages, 1), ns)  # pages of the longest split
        keep = keep_for_pages(per)
        gluon = wgmma and keep == TOPK and block_m in PREFILL_WGMMA_BLOCK_M
        # the Gluon kernel inserts per page: no window scratch to fit (nor splits to drop)
        win = 1 if force_win1 or gluon else window if window is not None else \
            choose_window(per, block_m)
        cand = candidate_elems(num_blocks, ns, block_m, keep)
        win_elems = window_elems(num_blocks, ns, block_m, win)
        need = 2 * cand + win_elems
        if cap is None or need <= cap:
            break
        if ns > 1:
            ns = max(1, ns // 2)
        else:
            force_win1 = True
    kernel = "wgmma" if gluon else "triton"
    return {"ns": ns, "keep": keep, "win": win, "block_m": block_m, "cand": cand,
            "win_elems": win_elems, "scratch": need, "kernel": kernel,
            "stages": 3 if per >= PREFILL_DEEP_PIPELINE_PAGES else 2}


def prefill_wgmma_ok(device, dot: str, tokens_on_n: bool) -> bool:
    """Whether prefill chunks on ``device`` may take the Gluon score kernel
    (``prefill_wgmma``): tokens on N on a CUDA SM90 GPU with Gluon
    (``device.wgmma_available``), dot "fp16" (its twin's semantics, bit for bit) or
    "fp8" (its E4M3 form, ``launch_options(fp8=True)``: inexact, SPEC 9 b = 5; the Triton
    kernel's fp8 lists, tokens on M, are valid within the same bound but not its bit-twin)."""
    return dot in ("fp16", "fp8") and bool(tokens_on_n) and wgmma_available(device)


# -- gather ----------------------------------------------------------------------------------

# (GPU, interpreter) defaults of the gather's TOK_BLOCK, num_warps, PAGE_PARTS, STREAM
_GATHER_DEFAULTS = ((GATHER_TOK_BLOCK, 128), (GATHER_NUM_WARPS, GATHER_NUM_WARPS),
                    (GATHER_PAGE_PARTS, 1), (GATHER_STREAMING, GATHER_STREAMING))


def gather_defaults(device, portable: bool, dequant, tok_block, num_warps, page_parts,
                    streaming) -> tuple:
    """The gather launch's ``(DEQUANT, TOK_BLOCK, num_warps, PAGE_PARTS, STREAM)`` on
    ``device`` from a ``GatherConfig``'s fields (None = default). The interpreter runs whole
    pages in one 128-token step (fewer, vectorized programs); "ptx" needs CUDA SM89+ (the
    asm's f16x2 <-> e4m3x2 conversions); TOK_BLOCK is capped at a page part's tokens."""
    if dequant is None:
        dev = torch.device(device)
        dequant = "triton" if (portable or dev.type != "cuda"
                               or torch.cuda.get_device_capability(dev) < (8, 9)) else "ptx"
    column = 1 if interpreting() else 0  # of _GATHER_DEFAULTS
    tok_block, num_warps, page_parts, streaming = (
        default[column] if value is None else value for value, default in zip(
            (tok_block, num_warps, page_parts, streaming), _GATHER_DEFAULTS))
    return dequant, min(tok_block, PAGE_SIZE // page_parts), num_warps, page_parts, streaming


def gather_pages_per_program(num_reqs: int, max_pages: int, width: int, page_parts: int,
                             num_warps: int, device, sms: int | None = None) -> int:
    """The gather kernel's default PAGES (host shapes only): 2 when one page per program
    would take more than one and at most two waves of resident programs (a second, partial
    wave; two pages per program fit it in one: +5 % at 26 MB on the H200), else 1 (measured
    -1 % at 8 waves, and fewer programs than one wave needs parallelism). ``sms``: the
    device's SM count when the caller has it (host time)."""
    per_sm = min(32, GATHER_RESIDENT_WARPS // num_warps)
    programs = num_reqs * min(max_pages, width) * page_parts
    waves = programs / (per_sm * (sms or num_sms(device)))
    return 2 if 1 < waves <= 2 else 1


def gather_grid(max_pages: int, width: int, page_parts: int, pages_per_program: int = 1) -> int:
    """Programs on the x axis of a gather launch (host shapes only, CUDA-graph safe): one
    per page part of each ``pages_per_program`` pages of the widest request,
    ``ceil(min(max_pages, width) / pages_per_program) * page_parts``."""
    return cdiv(min(max_pages, width), pages_per_program) * page_parts


def gather_request_ranges(num_reqs: int, max_reqs: int = MAX_GRID_Y) -> list[tuple[int, int]]:
    """``[r0, r1)`` request ranges of the launches of one gather: at most ``max_reqs``
    requests each (default ``MAX_GRID_Y``, the grid's y axis)."""
    return [(r0, min(num_reqs, r0 + max_reqs)) for r0 in range(0, num_reqs, max_reqs)]

