"""Host rules that pick the Triton launches' shapes (pure functions of static shapes and the
device; never of device values, so CUDA-graph replays stay valid).

One home for the shape rules decode and prefill share (the split rule, BLOCK_M, the top-k
window, the candidates a split keeps, the merge program shape, scratch sizes) and for the
prefill chunk launch, prefill row blocks, the gather and the insert. The decode rule table
(which kernel, with which constants) is ``decode.dispatch``.
"""

from __future__ import annotations

import torch

from ..constants import PAGE_SIZE, TOPK
from ..reference.paging import history_page_count
from .device import num_sms

# -- shared by decode, context parallelism and prefill ----------------------------------------
MIN_PAGES_PER_SPLIT = 4  # at full block-table width, at least this many pages per split
MAX_SPLITS = 256
MIN_BLOCK_M = 16  # smallest BLOCK_M of a row-block scorer (tl.dot's smallest M)
WINDOW = 64  # pages whose scores are buffered before one top-k merge
MIN_WINDOW_PAGES = 32  # splits shorter than this insert each page's candidate directly
MAX_WINDOW_ELEMS = 4096  # window * BLOCK_M bound of the window scratch
SHORT_MAX_LOCAL = 15  # rows with L <= 15 need no scores (SPEC 5)

# -- prefill ---------------------------------------------------------------------------------
PREFILL_MAX_BLOCK_M = 128  # (token, head) rows per prefill score program
SCORES_MAX_BLOCK_M = 64  # (token, head) rows per page_scores program
PREFILL_PROGRAMS_PER_SM = 8  # split target of the prefill score kernel
PREFILL_DEEP_PIPELINE_PAGES = 64  # pages per split from which the score kernel takes 3 stages
TOKENS_ON_N_DOTS = ("fp16", "bf16")  # dot modes scored with page tokens on the MMA's N axis
PREFILL_WGMMA_BLOCK_M = (128,)  # BLOCK_M the Gluon prefill kernel takes (two consumers of 64)
PREFILL_WGMMA_PROGRAMS_PER_SM = 1  # its split target (one CTA per SM: one wave), at least 2
# splits (fewer only where a split would otherwise keep < 16: PREFILL_WGMMA_SHORT_SPLITS)
# ... except 1 split (no merge) from this many row blocks per SM of at most this many pages
PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM = 2
PREFILL_WGMMA_UNSPLIT_MAX_PAGES = 512
# the Gluon kernel also takes chunks whose Triton-rule splits keep < 16 candidates (few row
# blocks, e.g. 1K-token chunks: 33 splits of 8 pages) when its own split target keeps 16
PREFILL_WGMMA_SHORT_SPLITS = True
# Gluon chunks read their pages straight from the cache (``prefill_wgmma_direct_kernel``: no
# gather, no workspace) when the cache allows it (``prefill_direct_ok``). Off: on the H200 its
# converter (one warp per scheduler, ~500 instructions per page) falls behind the consumers:
# 1.22-1.24x slower kernels, far more than the gather it saves (docs/benchmarks.md, issue 15,
# eighth step)
PREFILL_DIRECT = False
# the prefill merge kernel selects by one bitonic top-16 per row (tl.topk) instead of 15 rounds
# of max-and-remove where a row has 16-64 candidates (same output; topk.write_selection(SORT=1)).
# On: H200 merge alone 1.4-1.6x faster (128x2 splits 16.2 -> 11.6 us, 512x2 58.1 -> 41.3, 32x4
# 6.8 -> 4.3), bit-equal; 256-column rows keep the rounds (docs/benchmarks.md, issue 15, tenth step)
PREFILL_MERGE_SORT = True
# keys per one-warp program of the sorting merge (``merge_config``: 8 rows of 2 splits x 16, 4
# of 4 x 16). One row per program was launch-bound (~124 one-warp programs per SM at 4K new
# tokens): H200 merge alone 128x2 splits 11.6 -> 5.2 us, 512x2 41.2 -> 15.1, 32x4 4.3 -> 3.9,
# bit-equal; 512 keys (8 rows of 4 splits) 5.4 us (docs/benchmarks.md, issue 15, twelfth step)
MERGE_SORT_KEYS_PER_WARP = 256
# the merge sorts only rows of at most this many candidate columns (``merge_sorts``; a build
# without the limit had no fewer SASS instructions at 16 splits x 16, tenth step)
MERGE_SORT_MAX_COLUMNS = 64

# -- gather ----------------------------------------------------------------------------------
GATHER_TOK_BLOCK = 16  # tokens per inner step (128 under the interpreter)
GATHER_NUM_WARPS = 1
GATHER_PAGE_PARTS = 8  # programs per page (1 under the interpreter)
GATHER_STREAMING = True  # evict-first page loads, streaming (.cs) workspace stores
GATHER_PERSISTENT = False  # grid-stride persistent kernel (one program per page part if False)
GATHER_PROGRAMS_PER_SM = 16  # persistent grid: about this many programs per SM
GATHER_PAGES_PER_PROGRAM = None  # grid kernel: pages per program (None: gather_pages_per_program)
GATHER_RESIDENT_WARPS = 64  # warps an SM holds (SM80+); at most 32 programs

# -- insert ----------------------------------------------------------------------------------
INSERT_BLOCK_T = 4  # tokens per program on a GPU


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (plain Python: ``triton.cdiv``'s wrapper costs host time)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_rows(query_len: int, num_heads: int) -> int:
    """Decode BLOCK_M: the request's Q*H query rows padded to a power of two >= 16."""
    return max(MIN_BLOCK_M, next_pow2(query_len * num_heads))


def prefill_block_m(longest_q_len: int, num_heads: int, cap: int = PREFILL_MAX_BLOCK_M) -> int:
    """BLOCK_M of a row-block scorer (prefill; ``page_scores`` with ``SCORES_MAX_BLOCK_M``):
    the longest request's (token, head) rows as a power of two in 16..``cap``."""
    return min(cap, max(MIN_BLOCK_M, next_pow2(longest_q_len * num_heads)))


def split_rule(programs: int, target: int, cap: int) -> int:
    """The shared split rule: about ``target`` score programs over ``programs`` programs per
    split, at most ``cap`` (pages) and ``MAX_SPLITS``, at least 1."""
    return max(min(cdiv(target, max(programs, 1)), cap, MAX_SPLITS), 1)


def prefill_num_splits(num_blocks: int, max_pages: int, num_sms: int) -> int:
    """NUM_SPLITS of a prefill chunk of ``num_blocks`` row blocks whose longest scores
    ``max_pages`` pages: the shared rule with ``PREFILL_PROGRAMS_PER_SM`` and at least
    ``MIN_PAGES_PER_SPLIT`` pages per split."""
    return split_rule(num_blocks, PREFILL_PROGRAMS_PER_SM * num_sms,
                      cdiv(max(max_pages, 1), MIN_PAGES_PER_SPLIT))


def keep_for_pages(pages_per_split: int) -> int:
    """Candidates a split keeps per row: min(16, next power of two >= its page count)."""
    return min(TOPK, next_pow2(pages_per_split))


def choose_window(pages_per_split: int, rows: int, window: int = WINDOW,
                  min_pages: int = MIN_WINDOW_PAGES) -> int:
    """Top-k window of a scorer: 1 (a direct insert per page) below ``min_pages`` pages per
    split, else ``window`` capped by the split's pages and by ``window * rows <= 4096``."""
    if pages_per_split < min_pages:
        return 1
    return min(window, next_pow2(pages_per_split), MAX_WINDOW_ELEMS // rows)


def merge_sorts(columns: int, sort: bool) -> bool:
    """Whether a merge launched with ``SORT = sort`` over ``columns`` candidate columns per row
    (``keep * next_pow2(num_splits)``) takes the bitonic top-16: the host twin of
    ``scan.merge_splits``' test (16 to ``MERGE_SORT_MAX_COLUMNS`` columns)."""
    return bool(sort) and TOPK <= columns <= MERGE_SORT_MAX_COLUMNS


def merge_config(num_splits: int, keep: int = TOPK, sort: bool = False) -> tuple[int, int]:
    """``(rows, num_warps)`` of a merge program over ``keep * next_pow2(num_splits)`` candidate
    columns per row. ``sort`` (the prefill merge's ``SORT``, ``PREFILL_MERGE_SORT``): where
    the merge takes the bitonic top-16 (``merge_sorts``), 1 warp holds
    ``MERGE_SORT_KEYS_PER_WARP`` keys (``MERGE_SORT_KEYS_PER_WARP // cols`` rows). Otherwise
    one row per program (each of the 15 selection rounds stays in-thread compares and a few
    shuffles), on 1 warp (<= 512 columns), 2 (<= 1024) or 4 (more; at most 32 per thread at
    the largest decode split count)."""
    cols = keep * next_pow2(num_splits)
    if merge_sorts(cols, sort):
        return MERGE_SORT_KEYS_PER_WARP // cols, 1
    return 1, (1 if cols <= 512 else 2 if cols <= 1024 else 4)


def candidate_elems(num_reqs: int, num_splits: int, rows: int, keep: int) -> int:
    """int64 candidate scratch elements: [B, BLOCK_M, NUM_SPLITS, KEEP], none when unsplit."""
    return 0 if num_splits == 1 else num_reqs * rows * num_splits * keep


def window_elems(num_reqs: int, num_splits: int, rows: int, window: int) -> int:
    """fp32 window-buffer elements: [B * NUM_SPLITS, 2, WINDOW, BLOCK_M] (none for WINDOW 1)."""
    return 0 if window == 1 else num_reqs * num_splits * 2 * window * rows


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
        score at most ``PREFILL_WGMMA_UNSPLIT_MAX_PAGES`` pages), at most the Triton kernel's;
        with ``PREFILL_WGMMA_SHORT_SPLITS`` also where the Triton rule's splits keep < 16, the
        count capped at ``(pages - 1) // 8``); it inserts
        every page's candidates directly (window 1, no window scratch: ``cap`` counts only
        its candidates).
    Returns:
        dict ``ns, keep, win, block_m, cand`` (int64 candidate elements, 0 unsplit),
        ``win_elems`` (fp32 window elements, 0 for window 1), ``scratch`` (float32 elements:
        ``2 * cand + win_elems``), ``stages`` (the score kernel's default ``num_stages``: 3
        from ``PREFILL_DEEP_PIPELINE_PAGES`` pages per split, else 2; H200: 2-7 % faster on
        long splits, up to 10 % slower on short ones, docs/benchmarks.md), ``kernel``
        ("wgmma": ``prefill_wgmma``, else "triton": ``prefill._prefill_score_kernel``).
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
            # 1151); docs/benchmarks.md, issue 15, ninth and eleventh steps
            unsplit = (num_blocks >= PREFILL_WGMMA_UNSPLIT_BLOCKS_PER_SM * num_sms
                       and score_pages <= PREFILL_WGMMA_UNSPLIT_MAX_PAGES)
            ns_g = min(ns, max(1 if unsplit else 2,
                               PREFILL_WGMMA_PROGRAMS_PER_SM * num_sms // num_blocks))
            if PREFILL_WGMMA_SHORT_SPLITS:  # fewer splits where that makes them keep 16
                ns_g = min(ns_g, max(1, (score_pages - 1) // (TOPK // 2)))
            if keep_for_pages(cdiv(score_pages, ns_g)) == TOPK and (
                    PREFILL_WGMMA_SHORT_SPLITS or keep_for_pages(cdiv(score_pages, ns)) == TOPK):
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
    from .device import wgmma_available
    return dot in ("fp16", "fp8") and bool(tokens_on_n) and wgmma_available(device)


def prefill_direct_ok(cache) -> bool:
    """Whether the Gluon prefill kernel may read ``cache`` (``uint8 [N, 128, 72]``, SPEC 2)
    directly (``prefill_wgmma_direct_kernel``, SPEC 7): a 16-byte aligned base and page stride
    (its 16-byte code loads). SPEC 2's page strides (9216, or larger multiples of 16) pass, so
    the base decides: a cache view that starts inside an allocation may fail it."""
    return cache.data_ptr() % 16 == 0 and cache.stride(0) % 16 == 0


def plan_row_blocks(query_start_loc: list[int], seq_lens: list[int], num_heads: int,
                    block_m: int, requests) -> tuple[list[int], list[int], list[int]]:
    """Split the query rows of ``requests`` into blocks of ``block_m`` (token, head) rows.

    A request's rows are numbered ``(token - q_start) * H + head`` (token-major) and a block
    never spans two requests. Returns host lists ``(request, first row, pages)`` per block,
    where ``pages`` is the local page L of the block's last row (rows are bottom-right aligned,
    so it is the block's largest L; 0 when negative).
    """
    reqs, row0s, pages = [], [], []
    for r in requests:
        q_len = query_start_loc[r + 1] - query_start_loc[r]
        rows = q_len * num_heads
        for row0 in range(0, rows, block_m):
            t_last = (min(row0 + block_m, rows) - 1) // num_heads
            p_last = seq_lens[r] - q_len + t_last
            reqs.append(r)
            row0s.append(row0)
            pages.append(max(p_last, 0) // PAGE_SIZE)
    return reqs, row0s, pages


def gather_pages_needed(seq_lens: list[int]) -> list[int]:
    """Pages each prefill request needs gathered: its last query's history pages
    (seq_len - 1) // 128, or 0 when all its rows are short (L <= 15, SPEC 5)."""
    hist = [history_page_count(s) for s in seq_lens]
    return [n if n > SHORT_MAX_LOCAL else 0 for n in hist]


# -- device-dependent defaults ---------------------------------------------------------------


def gather_defaults(device, portable: bool, dequant, tok_block, num_warps, page_parts,
                    streaming, persistent=None, programs_per_sm=None, pages_per_program=None):
    """The gather launch's ``(DEQUANT, TOK_BLOCK, num_warps, PAGE_PARTS, STREAM, PERSISTENT,
    programs_per_sm, PAGES)`` on ``device`` from a ``GatherConfig``'s fields (None = default;
    PAGES stays None by default: ``gather_pages_per_program`` picks it per launch). The
    interpreter runs whole pages in one 128-token step (fewer, vectorized programs); "ptx"
    needs CUDA SM89+ (the asm's f16x2 <-> e4m3x2 conversions). The persistent kernel moves a
    page part in one step: its TOK_BLOCK is 128 / PAGE_PARTS (``tok_block`` does not apply),
    and one item at a time (PAGES applies to the grid kernel only)."""
    from .device import interpreting
    if dequant is None:
        dev = torch.device(device)
        dequant = "triton" if (portable or dev.type != "cuda"
                               or torch.cuda.get_device_capability(dev) < (8, 9)) else "ptx"
    if tok_block is None:
        tok_block = 128 if interpreting() else GATHER_TOK_BLOCK
    if num_warps is None:
        num_warps = GATHER_NUM_WARPS
    if page_parts is None:
        page_parts = 1 if interpreting() else GATHER_PAGE_PARTS
    if streaming is None:
        streaming = GATHER_STREAMING
    if persistent is None:
        persistent = GATHER_PERSISTENT
    if programs_per_sm is None:
        programs_per_sm = GATHER_PROGRAMS_PER_SM
    if pages_per_program is None:
        pages_per_program = GATHER_PAGES_PER_PROGRAM  # None: chosen per launch
    part = PAGE_SIZE // page_parts
    tok_block = part if persistent else min(tok_block, part)
    return (dequant, tok_block, num_warps, page_parts, streaming, persistent, programs_per_sm,
            pages_per_program)


def gather_pages_per_program(num_reqs: int, max_pages: int, width: int, page_parts: int,
                             num_warps: int, device, sms: int | None = None) -> int:
    """The grid kernel's default PAGES (host shapes only): 2 when one page per program
    would take more than one and at most two waves of resident programs (a second, partial
    wave; two pages per program fit it in one: +5 % at 26 MB on the H200), else 1 (measured
    -1 % at 8 waves, and fewer programs than one wave needs parallelism). ``sms``: the
    device's SM count when the caller has it (host time)."""
    per_sm = min(32, GATHER_RESIDENT_WARPS // num_warps)
    programs = num_reqs * min(max_pages, width) * page_parts
    waves = programs / (per_sm * (sms or num_sms(device)))
    return 2 if 1 < waves <= 2 else 1


def gather_grid(num_reqs: int, max_pages: int, width: int, page_parts: int, persistent: bool,
                programs_per_sm: int, device, pages_per_program: int = 1) -> int:
    """Programs on the x axis of a gather launch (host shapes only, CUDA-graph safe): one
    per page part of each ``pages_per_program`` pages of the widest request
    (``ceil(min(max_pages, width) / pages_per_program) * page_parts``), or for the
    persistent kernel ``programs_per_sm`` per SM, at most one per possible work item
    (``num_reqs * min(max_pages, width) * page_parts``), at least 1."""
    pages = min(max_pages, width)
    if not persistent:
        return cdiv(pages, pages_per_program) * page_parts
    return max(1, min(num_reqs * pages * page_parts, programs_per_sm * num_sms(device)))


def insert_launch_shape(rotary_dim: int, n: int, block_t: int | None,
                        num_warps: int | None) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of an insert launch of ``n`` tokens. ROT 64 / 128 (the fast
    path) map two threads to a token; the interpreter takes larger tiles
    (``quantize.rows_per_program``)."""
    from .device import interpreting
    from .quantize import rows_per_program
    fast = rotary_dim in (64, 128)
    if block_t is None:
        block_t = rows_per_program(n) if interpreting() else INSERT_BLOCK_T
    if num_warps is None:  # fast path: 2 * BLOCK_T threads, at least one warp
        num_warps = min(8, max(1, 2 * block_t // 32)) if fast else 1
    return block_t, num_warps
