"""Gluon selection kernels (SPEC 5), GPU only: one warp per row, the row's candidates in
registers, 15 rounds of two warp reductions (``redux.sync``). Launch shapes (K, ROWS, S):
``dispatch.redux_shape`` / ``dispatch.split_shape``.

- ``redux_select_kernel``: the select of the page-score decode paths (``page_scores``), from
  fp32 page scores.
- ``redux_select_split_kernel``: the same select for wide rows on S warps per row (its
  docstring).
- ``redux_merge_kernel``: the merge of the one-launch decode kernel's split candidates
  (``split_kernel``), from packed int64 candidates (its docstring).

Select: row n = i*H + h of request b reads ``scores[b, n, j]`` for its history pages j < L
(L its local page, SPEC 4) with L <= 32 * K (K pages per lane: page j = lane * K + k, K
contiguous scores per lane). A page's key is the monotone int32 ``score_key`` of its score
(``topk.score_key``:
larger score -> larger key, -0.0 = +0.0) with NaN one above INT32_MIN; pages j >= L (and
taken pages) hold INT32_MIN. Each of the 15 rounds:

1. per lane, the largest key and the smallest page id holding it (in registers);
2. ``redux.sync.max.s32`` over the warp: the row's largest key;
3. ``redux.sync.min.s32`` over the ids of the lanes holding it: the smallest such page id,
   i.e. SPEC 5's order (score descending, equal scores by smaller id, NaN below numbers and
   among themselves by id);
4. lane k records the page of round k; the page's key becomes INT32_MIN.

A row with L >= 16 has at least 16 live keys, so a page j >= L (or one already taken) is
never chosen. Short rows (L <= 15) and padding rows (p < 0: L = 0) are written by formula.
``ROWS`` rows per program (one per warp); rows >= Q*H are masked. Both kernels write slot 15
= L for every row of a program in which some row has L > 15; that is exact because a
program's rows are consecutive rows of one request, whose local pages differ by at most 1
(an L = 15 row wants 15 there too). A reuse with another row-to-position mapping must apply
the slot-15 rule per row (as ``topk.write_selection`` does).

The twin with the same output everywhere (the interpreter included) is
``select.select_wide_kernel`` (int64 packed candidates, ``tl.max`` rounds); the GPU tests
compare the two bit for bit; the merge's twin is ``split_kernel.decode_merge_kernel``. Why: the
int64 butterfly of ``tl.max`` costs ~60 instructions per round against ~5K + 5 here.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..layout import HISTORY, PAGE

_INT32_MIN = gl.constexpr(-(2 ** 31))
_NAN_KEY = gl.constexpr(-(2 ** 31) + 1)  # NaN pages: below every number, above "no page"
_NO_ID = gl.constexpr(2 ** 31 - 1)
_MAX_ASM = gl.constexpr("redux.sync.max.s32 $0, $1, 0xffffffff;")
_MIN_ASM = gl.constexpr("redux.sync.min.s32 $0, $1, 0xffffffff;")


@gluon.jit
def _warp_reduce(x, ASM: gl.constexpr):
    """Warp-wide reduction ``ASM`` (a ``redux.sync``) of int32 ``x`` (one element per thread),
    in every lane."""
    return gl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _warp_max(x):
    return _warp_reduce(x, _MAX_ASM)


@gluon.jit
def _warp_min(x):
    return _warp_reduce(x, _MIN_ASM)


@gluon.jit
def _row_setup(seq_lens_ptr, width, Q: gl.constexpr, H: gl.constexpr, K: gl.constexpr,
               ROWS: gl.constexpr):
    """Program (b, y)'s rows m = y*ROWS .. (one per warp, ``[ROWS, 32, K]`` tiles: K columns
    per lane): ``(b, m, row mask, local pages L [ROWS, 1], slot = lane [1, 32], the short-row
    output (L <= 15, padding rows: L = 0; SPEC 5) [ROWS, 32], lanes [32], k [K], whether some
    row has L > 15)``; seq_len clamped to ``[0, W * 128]`` (SPEC 10)."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, K], [1, 32, 1], [ROWS, 1, 1], [2, 1, 0])
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [ROWS, 32]: one element per thread
    b, m, row_ok, _, local, loc2, slot, res, lane = _rows(seq_lens_ptr, width, Q, H, ROWS, L2)
    kk = gl.arange(0, K, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    return b, m, row_ok, loc2, slot, res, lane, kk, _any_long(row_ok, local)


@gluon.jit
def _columns(lane, kk, K: gl.constexpr):
    """Columns lane * K + k ``[1, 32, K]`` of ``_row_setup``'s lanes and per-lane indices."""
    return gl.expand_dims(gl.expand_dims(lane, 0), 2) * K + gl.expand_dims(gl.expand_dims(kk, 0), 1)


@gluon.jit
def _any_long(row_ok, local):
    """Whether some row of the program has L > 15 (then the rounds run)."""
    return gl.max(gl.where(row_ok, local, 0), 0) > HISTORY


@gluon.jit
def _rows(seq_lens_ptr, width, Q: gl.constexpr, H: gl.constexpr, ROWS: gl.constexpr,
          L2: gl.constexpr):
    """Program (b, y)'s rows m = y*ROWS .. in the ``[ROWS, 32]`` layout ``L2``: ``(b, m, row
    mask, seq_len, L [ROWS], L [ROWS, 1], slot = lane [1, 32], the short-row output [ROWS,
    32], lanes [32])``; seq_len clamped to ``[0, W * 128]`` (SPEC 10)."""
    b = gl.program_id(0)
    m = gl.program_id(1) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L2))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, L2))
    seq_len = gl.minimum(gl.maximum(gl.load(seq_lens_ptr + b), 0), width * PAGE)
    pos = seq_len - Q + m // H
    local = gl.where(pos >= 0, pos // PAGE, 0)
    loc2 = gl.expand_dims(local, 1)
    slot = gl.expand_dims(lane, 0)
    return (b, m, m < Q * H, seq_len, local, loc2, slot, gl.where(slot <= loc2, slot, -1),
            lane)


@gluon.jit
def _store_rows(out_ptr, b, m, row_ok, slot, res, Q: gl.constexpr, H: gl.constexpr):
    """Slots 0..15 of ``res [ROWS, 32]`` into ``out [B*Q, H, 16]`` at rows m of request b."""
    row = (b * Q + m // H).to(gl.int64) * H + m % H
    gl.store(out_ptr + gl.expand_dims(row * 16, 1) + slot, res,
             mask=gl.expand_dims(row_ok, 1) & (slot < 16))


@gluon.jit
def _score_keys(s, ok):
    """Round keys of fp32 page scores ``s``: the monotone int32 key (-0.0 = +0.0: equal
    scores tie by id), ``_NAN_KEY`` for NaN, INT32_MIN where not ``ok``."""
    s = gl.where(s == 0.0, 0.0, s)
    bits = s.to(gl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = gl.where(s != s, _NAN_KEY, key)
    return gl.where(ok, key, _INT32_MIN)


@gluon.jit
def _take(key, ids, AXIS: gl.constexpr):
    """One round over a warp: the largest key of ``key`` (a lane's entries along ``AXIS``)
    and the smallest id holding it, ``(best key, page id)`` in every lane."""
    lane_key = gl.max(key, AXIS)  # in registers
    lane_id = gl.min(gl.where(key == gl.expand_dims(lane_key, AXIS), ids, _NO_ID), AXIS)
    best = _warp_max(lane_key)
    return best, _warp_min(gl.where(lane_key == best, lane_id, _NO_ID))


@gluon.jit
def _select_rounds(key, ids, slot, res, loc2, AXIS: gl.constexpr):
    """The 15 rounds over ``key`` / ``ids`` (a lane's entries along ``AXIS``): round k's page
    into slot k of ``res`` and out of ``key``; returns the rows' output (``_row_output``)."""
    for k in gl.static_range(HISTORY):
        _, page = _take(key, ids, AXIS)
        res = gl.where(slot == k, page, res)
        key = gl.where(ids == gl.expand_dims(page, AXIS), _INT32_MIN, key)
    return _row_output(res, slot, loc2)


@gluon.jit
def _row_output(res, slot, loc2):
    """Slot 15 = L and the short-row formula (L <= 15) around the rounds' slots ``res``."""
    return gl.where(slot == HISTORY, loc2, gl.where(loc2 > HISTORY, res,
                                                    gl.where(slot <= loc2, slot, -1)))


# Like their plain-Triton twins, no launch specializes on pointer alignment or the width's
# value: the runner's warm-up compiles what every real launch runs (CUDA-graph capture never
# compiles), whatever the alignment of the caller's seq_lens / out views.
_SELECT_JIT = dict(do_not_specialize=["width"],
                   do_not_specialize_on_alignment=["scores_ptr", "seq_lens_ptr", "out_ptr"])


@gluon.jit(**_SELECT_JIT)
def redux_select_kernel(scores_ptr, seq_lens_ptr, width, out_ptr, Q: gl.constexpr,
                        H: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                        ROWS: gl.constexpr):
    """Program (b, y): rows y*ROWS .. y*ROWS + ROWS - 1 of request b (module doc); ``out``
    ``int32 [B*Q, H, 16]``; ``scores`` fp32 ``[B, N, W]``; W <= 32 * K."""
    b, m, row_ok, loc2, slot, res, lane, kk, long = _row_setup(seq_lens_ptr, width, Q, H, K, ROWS)
    if long:
        jj = _columns(lane, kk, K)  # [1, 32, K]: page ids / candidate columns
        loc3 = gl.expand_dims(loc2, 2)
        ok = (jj < loc3) & gl.expand_dims(gl.expand_dims(row_ok, 1), 2)
        rows = gl.expand_dims(gl.expand_dims((b * N + m).to(gl.int64) * width, 1), 2)
        key = _score_keys(gl.load(scores_ptr + rows + jj, mask=ok, other=0.0), ok)
        ids = jj + gl.zeros_like(key)
        res = _select_rounds(key, ids, slot, res, loc2, 2)  # lane's K pages: [ROWS, 32]
    _store_rows(out_ptr, b, m, row_ok, slot, res, Q, H)


@gluon.jit(do_not_specialize=["width"],
           do_not_specialize_on_alignment=["cand_ptr", "seq_lens_ptr", "out_ptr"])
def redux_merge_kernel(cand_ptr, seq_lens_ptr, out_ptr, width, Q: gl.constexpr,
                       H: gl.constexpr, BLOCK_M: gl.constexpr, C: gl.constexpr,
                       K: gl.constexpr, ROWS: gl.constexpr):
    """The one-launch decode kernel's merge (``split_kernel``, with splits) with the same rounds: program (b, y) merges rows y*ROWS .. of request b from the
    candidate scratch ``int64 [B * BLOCK_M, C]`` (C = NUM_SPLITS * KEEP packed candidates per
    row, ``topk.pack_candidate``; ``EMPTY`` where none) into ``out``; C <= 32 * K.

    A packed candidate is (int32 score key, unsigned 0xFFFFFFFF - id); its low word is
    compared signed after flipping bit 31, so a round is the largest high word over the warp,
    then the largest flipped low word among the lanes holding it (``EMPTY`` = both words
    INT32_MIN, below every real candidate, NaN pages included). Page ids in one row's
    candidates are distinct (splits partition the pages), so a taken candidate is removed by
    setting it to ``EMPTY``; a row with L >= 16 has at least 15 real candidates."""
    b, m, row_ok, loc2, slot, res, lane, kk, long = _row_setup(seq_lens_ptr, width, Q, H, K, ROWS)
    if long:
        jj = _columns(lane, kk, K)  # [1, 32, K]: page ids / candidate columns
        ok = (jj < C) & gl.expand_dims(gl.expand_dims(row_ok, 1), 2)
        rows = gl.expand_dims(gl.expand_dims((b * BLOCK_M + m).to(gl.int64) * C, 1), 2)
        cand = gl.load(cand_ptr + rows + jj, mask=ok, other=-(2 ** 63))
        hi = (cand >> 32).to(gl.int32)
        lo = (cand & 0xFFFFFFFF).to(gl.int32) ^ _INT32_MIN  # unsigned order as signed
        for k in gl.static_range(HISTORY):
            lane_hi = gl.max(hi, 2)
            lane_lo = gl.max(gl.where(hi == gl.expand_dims(lane_hi, 2), lo, _INT32_MIN), 2)
            best_hi = _warp_max(lane_hi)
            best_lo = _warp_max(gl.where(lane_hi == best_hi, lane_lo, _INT32_MIN))
            taken = (hi == gl.expand_dims(best_hi, 2)) & (lo == gl.expand_dims(best_lo, 2))
            hi = gl.where(taken, _INT32_MIN, hi)
            lo = gl.where(taken, _INT32_MIN, lo)
            res = gl.where(slot == k, best_lo ^ 0x7FFFFFFF, res)  # id = ~(low word)
        res = _row_output(res, slot, loc2)
    _store_rows(out_ptr, b, m, row_ok, slot, res, Q, H)


@gluon.jit(**_SELECT_JIT)
def redux_select_split_kernel(scores_ptr, seq_lens_ptr, width, out_ptr, Q: gl.constexpr,
                              H: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                              S: gl.constexpr, ROWS: gl.constexpr):
    """``redux_select_kernel``'s output for wide rows (W <= 32 * K * S) on S warps per row:
    warp s of a row runs the 15 rounds on its pages j = s * 32K + lane * K + k, keeping its
    slice's best 15 (key, page id) in lanes 0..14 (INT32_MIN elsewhere); the lists go through
    shared memory, then every warp of the row runs the 15 rounds on the row's S * 32 entries
    (S per lane) and the row's first warp stores. Exact: the row's best 15 by (key desc, id
    asc) are among the slices' best 15, a slice's list is in that order, and the slices'
    pages are disjoint; a row with L >= 16 has at least 15 live entries in all (a slice with
    fewer live pages pads its list with INT32_MIN keys, never chosen). Program (b, y): rows
    y*ROWS .. of request b, ``num_warps`` = ROWS * S."""
    P1: gl.constexpr = gl.BlockedLayout([1, 1, 1, K], [1, 1, 32, 1], [ROWS, S, 1, 1],
                                        [3, 2, 1, 0])
    R1: gl.constexpr = gl.SliceLayout(3, P1)  # [ROWS, S, 32]: one entry per thread
    # [ROWS, S, 32] with a lane's S entries in its registers, copied in each warp of the row
    P2: gl.constexpr = gl.BlockedLayout([1, S, 1], [1, 1, 32], [ROWS, S, 1], [2, 1, 0])
    O2: gl.constexpr = gl.SliceLayout(1, P2)  # [ROWS, 32]: output slots
    SM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    b, m, row_ok, seq_len, local, loc2, slot, res, _ = _rows(seq_lens_ptr, width, Q, H, ROWS,
                                                             O2)
    if _any_long(row_ok, local):
        # phase 1: each warp's slice of the row
        m1 = gl.program_id(1) * ROWS + gl.arange(
            0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, P1))))
        s1 = gl.arange(0, S, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, P1))))
        l1 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, P1))))
        k1 = gl.arange(0, K, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, P1))))
        m4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(m1, 1), 2), 3)
        s4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(s1, 0), 2), 3)
        l4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(l1, 0), 1), 3)
        k4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(k1, 0), 1), 2)
        jj = s4 * (32 * K) + l4 * K + k4  # [1, S, 32, K] page ids
        pos4 = seq_len - Q + m4 // H
        loc4 = gl.where(pos4 >= 0, pos4 // PAGE, 0)
        ok = (jj < loc4) & (m4 < Q * H)
        key = _score_keys(gl.load(scores_ptr + (b * N + m4).to(gl.int64) * width + jj, mask=ok,
                                  other=0.0), ok)
        ids = jj + gl.zeros_like(key)
        lane1 = gl.expand_dims(gl.expand_dims(l1, 0), 1)  # [1, 1, 32]
        top_key = gl.full([ROWS, S, 32], _INT32_MIN, gl.int32, layout=R1)
        top_id = gl.full([ROWS, S, 32], _NO_ID, gl.int32, layout=R1)
        for k in gl.static_range(HISTORY):
            best, page = _take(key, ids, 3)  # [ROWS, S, 32]
            top_key = gl.where(lane1 == k, best, top_key)
            top_id = gl.where(lane1 == k, page, top_id)
            key = gl.where(ids == gl.expand_dims(page, 3), _INT32_MIN, key)
        # phase 2: the row's S lists, S entries per lane, in every warp of the row
        key_smem = gl.allocate_shared_memory(gl.int32, [ROWS, S, 32], SM, top_key)
        id_smem = gl.allocate_shared_memory(gl.int32, [ROWS, S, 32], SM, top_id)
        gl.thread_barrier()  # belt and braces: the compiler puts a BAR here by itself
        key2 = key_smem.load(P2)
        id2 = id_smem.load(P2)
        res = _select_rounds(key2, id2, slot, res, loc2, 1)  # lane's S entries: [ROWS, 32]
    _store_rows(out_ptr, b, m, row_ok, slot, res, Q, H)
