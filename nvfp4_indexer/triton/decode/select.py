"""Plain-Triton select kernels of the page-score decode paths (SPEC 5): the output of each row
from its fp32 page scores ``scores[b, n, j]`` (scratch ``[B, N, W]``, row n = i*H + h), entries
``j < L`` read (L the row's local page). GPU and interpreter; ``dispatch.select_plan`` picks
these or the Gluon ``redux`` selects. Short rows (L <= 15) and padding rows by formula.

- ``select_wide_kernel``: the row's L <= CHUNK scores as packed int64 candidates
  (``topk.pack_candidate``) in registers on up to 8 warps, 15 ``tl.max`` rounds (few rows:
  the rounds stay in registers);
- ``select_classes_kernel``: one pass keeps the largest packed candidate of each residue class
  ``j % 16``; then 15 rounds each take the largest class maximum and replace it by the next
  candidate of that class (a reload of ~L/16 scores, L1-hot; any width, one warp per row).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..layout import HISTORY, local_page
from ..scan import clamped_seq_len
from ..topk import EMPTY, candidate_id, pack_candidate


@triton.jit
def _class_max(row_scores, g, local, below, r0, GROUP: tl.constexpr):
    """Largest packed candidate < ``below`` among pages ``j = g + 16 r``, r in
    ``[r0, r0 + GROUP)``, ``j < local`` (EMPTY if none): ``row_scores`` is the row's fp32
    page-score row."""
    jj = g + 16 * (r0 + tl.arange(0, GROUP))
    ok = jj < local
    s = tl.load(row_scores + jj, mask=ok, other=0.0)
    key = pack_candidate(s, jj)
    return tl.max(tl.where(ok & (key < below), key, EMPTY), 0)


@triton.jit
def _row_start(scores_ptr, seq_lens_ptr, width, Q: tl.constexpr, H: tl.constexpr,
               N: tl.constexpr):
    """Program (b, m): row m = i*H + h of request b. Returns ``(b, i, h, local, row_scores,
    slot, res)``: L (``local``), the row's score pointer, the 16 output slots and their
    short-row output (``slot`` where ``slot <= L``, else -1)."""
    b = tl.program_id(0)
    m = tl.program_id(1)
    i = m // H
    h = m % H
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)
    local = local_page(seq_len - Q + i)  # padding rows (p < 0) select like L = 0
    row_scores = scores_ptr + (b.to(tl.int64) * N + m) * width
    slot = tl.arange(0, 16)  # output slots; also the 16 residue classes of the classes kernel
    res = tl.where(slot <= local, slot, -1)  # L <= 15 (padding rows: L = 0), per SPEC 5
    return b, i, h, local, row_scores, slot, res


@triton.jit
def _store_row(out_ptr, b, i, h, slot, res, Q: tl.constexpr, H: tl.constexpr):
    """Slots ``slot`` of ``res`` into row i*H + h of request b of ``out [B*Q, H, 16]``."""
    row = (b * Q + i).to(tl.int64)
    tl.store(out_ptr + (row * H + h) * 16 + slot, res)


@triton.jit(do_not_specialize_on_alignment=["scores_ptr", "seq_lens_ptr", "out_ptr"])
def select_classes_kernel(scores_ptr, seq_lens_ptr, width, out_ptr, Q: tl.constexpr,
                          H: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                          GROUP: tl.constexpr):
    # The row's history pages in 16 residue classes j % 16, each class's largest candidate
    # in cmax (one pass over the row). A round takes the largest class maximum (the best
    # page not yet taken: keys are distinct and taken in descending order) and replaces it
    # by the largest candidate of that class below it (a reload of ~L/16 scores, L1-hot).
    b, i, h, local, row_scores, slot, res = _row_start(scores_ptr, seq_lens_ptr, width, Q, H, N)
    if local > HISTORY:
        cmax = tl.full([16], EMPTY, tl.int64)
        for c0 in range(0, local, CHUNK):
            jj = c0 + tl.arange(0, CHUNK)
            ok = jj < local
            s = tl.load(row_scores + jj, mask=ok, other=0.0)
            keys = tl.where(ok, pack_candidate(s, jj), EMPTY)
            cmax = tl.maximum(cmax, tl.max(tl.reshape(keys, [CHUNK // 16, 16]), 0))
        per_class = (local + 15) // 16
        for k in range(HISTORY):
            best = tl.max(cmax, 0)
            page = candidate_id(best)
            res = tl.where(slot == k, page, res)
            g = page % 16
            nxt = tl.full([], EMPTY, tl.int64)
            for r0 in range(0, per_class, GROUP):
                nxt = tl.maximum(nxt, _class_max(row_scores, g, local, best, r0, GROUP))
            cmax = tl.where(slot == g, nxt, cmax)
        res = tl.where(slot == HISTORY, local, res)
    _store_row(out_ptr, b, i, h, slot, res, Q, H)


@triton.jit(do_not_specialize_on_alignment=["scores_ptr", "seq_lens_ptr", "out_ptr"])
def select_wide_kernel(scores_ptr, seq_lens_ptr, width, out_ptr, Q: tl.constexpr,
                       H: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr):
    # The row's L <= CHUNK page scores as packed candidates in registers (all warps of the
    # program); each of the 15 rounds takes the largest and removes it (keys are distinct).
    b, i, h, local, row_scores, slot, res = _row_start(scores_ptr, seq_lens_ptr, width, Q, H, N)
    if local > HISTORY:
        jj = tl.arange(0, CHUNK)
        ok = jj < local
        keys = tl.where(ok, pack_candidate(tl.load(row_scores + jj, mask=ok, other=0.0), jj),
                        EMPTY)
        for k in tl.static_range(HISTORY):
            best = tl.max(keys, 0)
            res = tl.where(slot == k, candidate_id(best), res)
            keys = tl.where(keys == best, EMPTY, keys)
        res = tl.where(slot == HISTORY, local, res)
    _store_row(out_ptr, b, i, h, slot, res, Q, H)
