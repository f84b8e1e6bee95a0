"""Top-k page selection on the GPU: packed candidate keys, running top-K lists, final write
(SPEC 5).

A candidate (page score, logical page id) is packed into one int64 whose signed order is the
selection order of SPEC 5, so a selection step is one ``tl.max``:

- high 32 bits: a monotone int32 key of the fp32 score (``score_key``): larger score -> larger
  key; -0.0 and +0.0 give the same key (equal scores tie by id); NaN gives INT32_MIN, below
  every number (-inf included);
- low 32 bits: ``0xFFFFFFFF - id`` (unsigned), so that at equal keys the smaller id is larger.

``EMPTY`` (INT64_MIN) marks "no candidate" (a page that is not the row's history, an unused
slot); it sorts below every real candidate, NaN pages included (their low half is never 0).

Scorers keep a running top-KEEP list per query row in registers, KEEP = min(16, next power of
two >= the pages a split can score) (``heuristics.keep_for_pages``): a split with at most
KEEP pages keeps all of them, and 16 >= 15 history slots otherwise, so the 15 best pages of a
row are always among the union of the per-split lists. A list is updated per page
(``topk_insert``) or, for long splits, once per window of buffered page scores
(``window_buffer`` / ``merge_window`` / ``topk_merge``; the window size from
``heuristics.choose_window``). ``write_selection`` (used by the merge kernels and by
single-split scorers directly) picks the final 15 by 15 rounds of max-and-remove, skipped when
every row is short, or with ``SORT=1`` by one bitonic top-16 (the prefill merge's default
where a row has 16-64 candidates: ``prefill.launch.plan_prefill_chunk``).

Candidate scratch layout used by the scorers: int64 ``[rows, NUM_SPLITS, KEEP]`` (a row's
candidates contiguous), written completely by every split program, so no initialization is
needed between runs (CUDA-graph replays). Merge kernels take one row per program, or
several for the prefill merge's bitonic top-16 (``merge_config``). The host rules
``keep_for_pages``, ``choose_window`` and ``merge_config`` live in ``heuristics``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout import HISTORY, TOPK

TOPK_SLOTS = 16  # per-row candidate list length (power of two >= 15 history slots)

EMPTY = tl.constexpr(-(2 ** 63))  # "no candidate"
_INT32_MIN = tl.constexpr(-(2 ** 31))
_LOW_MASK = tl.constexpr(2 ** 32 - 1)


@triton.jit
def score_key(score):
    """Monotone int32 key of fp32 page scores (SPEC 5 order): x < y => key(x) < key(y),
    -0.0 and +0.0 share key 0, NaN gets INT32_MIN (below -inf's key)."""
    s = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0 (equal scores must tie by id)
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip magnitude bits
    return tl.where(score != score, _INT32_MIN, key)


@triton.jit
def pack_candidate(score, page_id):
    """int64 candidate of fp32 ``score`` and int32 logical ``page_id >= 0`` (same shapes)."""
    return (score_key(score).to(tl.int64) << 32) | (page_id.to(tl.int64) ^ _LOW_MASK)


@triton.jit
def candidate_id(packed):
    """Logical page id (int32) of packed candidates (meaningless for ``EMPTY``)."""
    return ((packed & _LOW_MASK) ^ _LOW_MASK).to(tl.int32)


@triton.jit
def empty_topk(ROWS: tl.constexpr, KEEP: tl.constexpr = 16):
    """A running top-KEEP ``int64 [ROWS, KEEP]`` with no candidates (KEEP: a power of two;
    16 keeps every possible selection, fewer suffice for a scorer that sees at most KEEP
    pages)."""
    return tl.full([ROWS, KEEP], EMPTY, tl.int64)


@triton.jit
def topk_insert(top, cand):
    """Insert one candidate per row: ``top`` int64 ``[R, K]``, ``cand`` int64 ``[R]``.

    Replaces the row's smallest entry when ``cand`` is larger (EMPTY never displaces
    anything). Keys of real candidates are distinct, so the kept set is exactly the K largest.
    """
    K: tl.constexpr = top.shape[1]
    col = tl.arange(0, K)[None, :]
    low = tl.min(top, 1)
    first = tl.min(tl.where(top == low[:, None], col, K), 1)  # one column even among EMPTYs
    take = (col == first[:, None]) & (cand > low)[:, None]
    return tl.where(take, cand[:, None], top)


@triton.jit
def insert_page(top, score, page, local_page):
    """Insert page ``page`` (scalar logical id) with fp32 ``score [R]`` into the running lists
    ``top [R, K]`` of the rows whose local page ``local_page [R]`` lies past it (SPEC 4: only
    history pages are candidates)."""
    cand = pack_candidate(score, page + tl.zeros_like(local_page))
    return topk_insert(top, tl.where(page < local_page, cand, EMPTY))


@triton.jit
def topk_merge(top, keys):
    """Merge a block of candidates into running top-K lists: ``top`` int64 ``[R, K]``,
    ``keys`` int64 ``[R, C]`` (``EMPTY`` where none). Returns the K largest of each row's union.

    Runs only as many rounds as the largest number of a row's candidates that beat that row's
    current smallest entry (at most K); a round inserts each row's best remaining candidate
    (``topk_insert``, descending order) and removes it. Once deep into a long context few
    candidates beat the kept 16, so most blocks cost a comparison and a few rounds.
    """
    low = tl.min(top, 1)
    beat = tl.sum((keys > low[:, None]).to(tl.int32), 1)
    rounds = tl.minimum(tl.max(beat, 0), top.shape[1])
    for _ in range(rounds):
        best = tl.max(keys, 1)
        top = topk_insert(top, best)
        keys = tl.where(keys == best[:, None], EMPTY, keys)
    return top


@triton.jit
def window_buffer(win_ptr, prog, window_index, ROWS: tl.constexpr, WINDOW: tl.constexpr):
    """fp32 pointer to the half of program ``prog``'s window scratch (``[2, WINDOW, ROWS]`` per
    program; consecutive windows alternate halves) that window ``window_index`` writes."""
    base = win_ptr + prog.to(tl.int64) * (2 * WINDOW * ROWS)
    return base + (window_index % 2) * (WINDOW * ROWS)


@triton.jit
def merge_window(top, buf, w0, w_end, local_page, WINDOW: tl.constexpr):
    """Merge a window of page scores into the running top lists ``top [R, K]``.

    ``buf`` (``window_buffer``) holds fp32 scores ``[WINDOW, R]`` of pages ``w0 .. w_end - 1``
    (slot ``j - w0``), stored by every thread of the program; one barrier makes them visible.
    Pages at or past a row's local page ``local_page [R]`` are not candidates of that row.
    The other half of the scratch is written next, so no second barrier is needed before it.
    """
    return merge_window_strided(top, buf, w0, w_end, local_page, WINDOW, 0, 1)


@triton.jit
def merge_window_strided(top, buf, w0, w_end, local_page, WINDOW: tl.constexpr, page_offset,
                         page_step):
    """``merge_window`` over a page subset (context parallelism, SPEC 8.2): slot ``k - w0``
    of ``buf`` holds the score of logical page ``page_offset + k * page_step`` for
    ``k = w0 .. w_end - 1``."""
    R: tl.constexpr = top.shape[0]
    m = tl.arange(0, R)
    col = tl.arange(0, WINDOW)
    tl.debug_barrier()
    kk = w0 + col[None, :]
    jj = page_offset + kk * page_step
    ok = (kk < w_end) & (jj < local_page[:, None])
    s = tl.load(buf + col[None, :] * R + m[:, None], mask=ok, other=0.0, cache_modifier=".cg")
    return topk_merge(top, tl.where(ok, pack_candidate(s, jj + 0 * m[:, None]), EMPTY))


@triton.jit
def write_selection(keys, local_page, out_row_ptr, row_mask, SORT: tl.constexpr = 0):
    """Select and store the SPEC 5 output of ``R`` query rows.

    Args:
        keys: int64 ``[R, C]`` candidates of each row (``EMPTY`` where none); every history
            page of a row with L >= 16 must be present or dominated by 15 present ones.
        local_page: int32 ``[R]``: L = p // 128, or 0 for padding rows (p < 0).
        out_row_ptr: ``[R]`` pointers to each row's 16 int32 output slots.
        row_mask: ``[R]`` bool, rows to store.
        SORT: 1 selects by one bitonic top-16 of each row (``tl.topk``, descending; C a power
            of two >= 16) instead of 15 rounds of max-and-remove: the same output, since real
            candidates are distinct (their low halves are distinct ids) and only ``EMPTY``
            repeats, which both forms emit as often as it is reached. Requires that: a row
            with a repeated non-EMPTY key (no scorer writes one) would get it twice.
    Output per row: L <= 15 -> ``[0, 1, ..., L, -1, ...]`` (padding rows use L = 0 and get
    ``[0, -1 x 15]``); L >= 16 -> the 15 largest candidates by key, then L. The selection
    runs only when some stored row has L >= 16.
    """
    slot = tl.arange(0, TOPK)[None, :]
    res = tl.full([keys.shape[0], TOPK], -1, tl.int32)
    if tl.max(tl.where(row_mask, local_page, 0), 0) > HISTORY:
        if SORT:
            res = candidate_id(tl.topk(keys, TOPK, dim=1))
        else:
            for k in tl.static_range(HISTORY):
                best = tl.max(keys, 1)
                res = tl.where(slot == k, candidate_id(best)[:, None], res)
                keys = tl.where(keys == best[:, None], EMPTY, keys)
    lp = local_page[:, None]
    res = tl.where(slot == HISTORY, lp, res)  # slot 15: the local page
    res = tl.where(lp <= HISTORY, tl.where(slot <= lp, slot, -1), res)
    tl.store(out_row_ptr[:, None] + slot, res, mask=row_mask[:, None])


@triton.jit
def load_candidates(scratch_ptr, rows, row_mask, NUM_SPLITS: tl.constexpr,
                    SPLITS_PAD: tl.constexpr, KEEP: tl.constexpr = 16):
    """Candidates ``int64 [R, SPLITS_PAD * KEEP]`` of scratch rows ``rows [R]`` (int64 row
    indices into scratch ``[*, NUM_SPLITS, KEEP]``), EMPTY in the padding columns."""
    c = tl.arange(0, SPLITS_PAD * KEEP)[None, :]
    ptr = scratch_ptr + rows[:, None] * (NUM_SPLITS * KEEP) + c
    ok = row_mask[:, None] & (c < NUM_SPLITS * KEEP)
    return tl.load(ptr, mask=ok, other=EMPTY)


@triton.jit
def store_candidates(scratch_ptr, rows, top, split, NUM_SPLITS: tl.constexpr):
    """Store running top-KEEP lists ``top [R, KEEP]`` of scratch rows ``rows [R]`` (int64) as
    split ``split``'s slice of scratch ``[*, NUM_SPLITS, KEEP]``."""
    KEEP: tl.constexpr = top.shape[1]
    c = tl.arange(0, KEEP)[None, :]
    tl.store(scratch_ptr + rows[:, None] * (NUM_SPLITS * KEEP) + split * KEEP + c, top)
