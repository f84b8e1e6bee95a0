"""Gluon prefill score kernel with the page MMAs overlapped (SPEC 4, 5, 7; CUDA SM90 only).

Same grid, arguments, scratch and results as the Triton ``prefill._prefill_score_kernel`` with
tokens on N and dot "fp16", for splits that keep 16 candidates (more than 8 pages, ``KEEP == 16``); that kernel is
this one's twin on the CPU interpreter and on other GPUs, and the GPU tests check the two
against each other row for row. The window scratch is not used (each page's candidates go
straight into the lists, below); the candidate scratch and the output are written as the
twin writes them (the lists' slot order may differ; the selection does not).

Why it exists: in the Triton kernel every page's wgmma is waited on before that page's max
and top-k (``tl.dot`` is synchronous there), so the tensor cores idle during each epilogue.
Here a program (``BLOCK_M`` rows, one warpgroup per 64) runs, per page k of its split:

1. ``warpgroup_mma`` ``[BLOCK_M, 128 dims] x [128 dims, 128 tokens]`` of page k, issued
   asynchronously on shared-memory buffer k % 3 (the query rows resident as the A operand);
2. page k + 1's E4M3 bytes (loaded into registers a page ahead) widened to fp16 (exact) into
   buffer (k + 1) % 3, page k + 2's bytes loaded;
3. a wait for page k - 1's MMA only (``num_outstanding=1``), then its epilogue: the
   NaN-skipping max over tokens and one insert per row into the running top-16 list
   (``topk.topk_insert``; the lists use a layout whose rows sit on the accumulator's threads,
   so the page scores need no data movement);
4. a shared-memory fence and one CTA barrier (page k + 1's buffer complete for both
   warpgroups).

So from the end of page k - 1's MMA to the issue of page k + 1's only the epilogue and the
barriers stand, while page k's MMA runs. Three buffers: step k writes buffer (k + 1) % 3, last
read by page k - 2's MMA, which both warpgroups waited for before step k - 1's barrier.
(The compiled step has a second CTA barrier, before step 2's stores: Triton's shared-memory
barrier analysis sees the three buffers as one allocation, read by the MMA just issued.)
Products are exact and accumulate in fp32 in the same wgmma K order as the twin's ``tl.dot``.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                              warpgroup_mma,
                                                              warpgroup_mma_wait)

from .layout import HEAD, HISTORY, PAGE, TOPK, WS_PAGE, scored_pages, split_range
from .scan import block_rows_info, out_offsets
from .topk import EMPTY, candidate_id, pack_candidate

NUM_BUFFERS = gl.constexpr(3)  # fp16 page buffers (see the module doc)
LAYOUT_BLOCK_M = (64, 128)  # BLOCK_M prefill_layouts builds (the launchers take 128 only)


@functools.lru_cache(maxsize=None)
def prefill_layouts(block_m: int):
    """Constexpr layouts for ``BLOCK_M`` rows (64 or 128) on ``block_m // 16`` warps (the
    launchers take 128 only, ``heuristics.PREFILL_WGMMA_BLOCK_M``: at 64 rows on 4 warps a
    thread holds twice the page bytes and the kernel spills, ``benchmarks.sass_stats
    --prefill-wgmma``):
    ``dict(MMA, LD, TL, Q_SL, K_SL)`` -- the accumulator (instruction N = 128 tokens), the
    page / query byte loads (16 bytes per thread), the top-k lists (a 16-column accumulator
    layout: a row's entries on the threads that hold its scores, 4 per thread), and the
    shared layouts of the query and of a page. Cached (host time per launch)."""
    if block_m not in LAYOUT_BLOCK_M:
        raise ValueError(f"block_m: the Gluon prefill kernel takes 64 or 128 rows, got {block_m}")
    warps = block_m // 16
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                    instr_shape=[16, PAGE.value, 16])
    ld = gl.BlockedLayout([1, 16], [4, 8], [warps, 1], [1, 0])
    tl_ = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                    instr_shape=[16, TOPK.value, 16])
    q_sl = gl.NVMMASharedLayout.get_default_for([block_m, HEAD.value], gl.float16)
    k_sl = gl.NVMMASharedLayout.get_default_for([PAGE.value, HEAD.value], gl.float16)
    return dict(MMA=mma, LD=ld, TL=tl_, Q_SL=q_sl, K_SL=k_sl)


@gluon.jit
def _load_tile(base, row_off, row_ok, LD: gl.constexpr):
    """E4M3 bytes ``[R, 128]`` (uint8) at byte offsets ``row_off [R]`` (int64, SliceLayout(1,
    LD)) of ``base``; rows not ``row_ok`` load zeros."""
    d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, LD))
    ptrs = base + gl.expand_dims(row_off, 1) + gl.expand_dims(d, 0)
    return gl.load(ptrs, mask=gl.expand_dims(row_ok, 1), other=0)


@gluon.jit
def _as_f16(raw):
    return raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)  # exact


@gluon.jit
def _fill(k_smem, k, raw, ws_page0, end, tok_off, all_tok, LD: gl.constexpr):
    """Page k + 1's bytes ``raw`` widened into buffer (k + 1) % 3; returns page k + 2's bytes
    (clamped to the split's last page, ``end - 1``: re-read, never scored)."""
    k_smem.index((k + 1) % NUM_BUFFERS).store(_as_f16(raw))
    return _load_tile(ws_page0 + gl.minimum(k + 2, end - 1) * WS_PAGE, tok_off, all_tok, LD)


@gluon.jit
def _topk_insert(top, cand, TL: gl.constexpr):
    """``topk.topk_insert`` in layout TL: one candidate per row (``cand [R]``, SliceLayout(1,
    TL)) replaces the row's smallest entry of ``top [R, K]`` when larger."""
    K: gl.constexpr = top.shape[1]
    col = gl.expand_dims(gl.arange(0, K, layout=gl.SliceLayout(0, TL)), 0)
    low = gl.min(top, 1)
    first = gl.min(gl.where(top == gl.expand_dims(low, 1), col, K), 1)
    take = (col == gl.expand_dims(first, 1)) & gl.expand_dims(cand > low, 1)
    return gl.where(take, gl.expand_dims(cand, 1), top)


@gluon.jit
def _epilogue(acc, j, top, local, TL: gl.constexpr, SOL: gl.constexpr):
    """Page j's candidates into ``top``: the max over the tokens of ``acc`` (NaN-skipping:
    ``max.f32``; NaN when all are NaN, SPEC 4), a candidate of the rows whose local page lies
    past j. ``SOL`` 1 (the lab's speed-of-light variant) replaces the insert by an
    elementwise max (wrong lists, the same MMAs and maxima)."""
    score = gl.convert_layout(gl.max(acc, axis=1), gl.SliceLayout(1, TL), assert_trivial=True)
    cand = gl.where(j < local, pack_candidate(score, j + 0 * local), EMPTY)
    if SOL == 0:
        top = _topk_insert(top, cand, TL)
    else:
        top = gl.maximum(top, gl.expand_dims(cand, 1))
    return top


@gluon.jit
def _step(k, raw, dead, pending, k_smem, q_op, ws_page0, tok_off, all_tok, end, top, local,
          LD: gl.constexpr, TL: gl.constexpr, SOL: gl.constexpr):
    """Page k's MMA issued on buffer k % 3 into the registers of ``dead`` (an accumulator whose
    epilogue ran); page k + 1's bytes ``raw`` widened into buffer (k + 1) % 3 and page k + 2's
    loaded (``_fill``); page k - 1's MMA (``pending``) waited for and its epilogue run; fence,
    barrier. Returns ``(raw,
    page k's accumulator in flight, page k - 1's, top)``."""
    issued = warpgroup_mma(q_op, k_smem.index(k % NUM_BUFFERS).permute((1, 0)), dead,
                           use_acc=False, is_async=True)
    raw = _fill(k_smem, k, raw, ws_page0, end, tok_off, all_tok, LD)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))
    top = _epilogue(done, k - 1, top, local, TL, SOL)
    fence_async_shared()
    gl.thread_barrier()
    return raw, issued, done, top


@gluon.jit
def _last_pages(raw, dead, pending, k_smem, q_op, ws_page0, tok_off, all_tok, end, top, local,
                LD: gl.constexpr, TL: gl.constexpr, SOL: gl.constexpr):
    """The step of page end - 1, then its own wait and epilogue. Returns ``top``."""
    raw, last, _, top = _step(end - 1, raw, dead, pending, k_smem, q_op, ws_page0, tok_off,
                              all_tok, end, top, local, LD, TL, SOL)
    return _epilogue(warpgroup_mma_wait(num_outstanding=0, deps=(last,)), end - 1, top, local,
                     TL, SOL)


# the same runtime arguments (and value specializations) as the Triton twin
@gluon.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "req_base", "num_blocks"],
           do_not_specialize_on_alignment=["seq_lens_ptr", "caps_ptr"])
def prefill_wgmma_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base,
                         qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                         win_ptr, out_ptr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                         NUM_SPLITS: gl.constexpr, MMA: gl.constexpr,
                         LD: gl.constexpr, TL: gl.constexpr, Q_SL: gl.constexpr,
                         K_SL: gl.constexpr, Q_IN_REGS: gl.constexpr = True,
                         SOL: gl.constexpr = 0):
    """Prefill score program ``(row block, split)`` of grid ``(num_blocks, NUM_SPLITS)``
    (SPEC 4, 5, 7), launched with ``num_warps = BLOCK_M // 16`` and ``prefill_layouts``.

    Arguments as ``prefill._prefill_score_kernel``'s: ``q_ptr`` E4M3 query bytes (uint8) with
    token / head strides in bytes; ``ws_ptr`` the FP8 workspace ``[P, 128, 128]`` (bytes) and
    ``ws_off_ptr`` int32 each request's first workspace page (indexed by request - req_base);
    ``qsl_ptr`` int32 cu_seqlens_q, ``seq_lens_ptr`` / ``caps_ptr`` int32 device / planned seq
    lens; ``blk_ptr`` int32 ``[2, num_blocks]`` (request, first row); ``cand_ptr`` int64
    candidates ``[num_blocks * BLOCK_M, NUM_SPLITS, 16]`` (NUM_SPLITS > 1), ``out_ptr`` int32
    ``[Tp, H, 16]`` (NUM_SPLITS == 1); ``win_ptr`` is not read (no window). The caller
    guarantees KEEP == 16 (more than 8 pages per split), dot fp16 with tokens on N, and a
    CUDA SM90 device (``heuristics.prefill_launch``). Lab knobs: ``Q_IN_REGS`` (the query as
    the register A operand, default) and ``SOL`` (1: no top-k inserts, wrong lists)."""
    blk = gl.program_id(0)
    split = gl.program_id(1)
    # rows in the top-k layout: the split's range, the lists and the output
    rows_t = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TL))
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                              num_blocks, blk, rows_t, H)
    n = scored_pages(gl.max(gl.where(row_ok, local, 0), 0))  # the block's largest L
    start, end = split_range(n, split, NUM_SPLITS)
    top = gl.full([BLOCK_M, TOPK], EMPTY, gl.int64, layout=TL)
    if start < end:
        rows_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
        tq, hq, _, ok_q = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                          num_blocks, blk, rows_q, H)
        q16 = _as_f16(_load_tile(q_ptr, tq * q_tok_stride + hq * q_head_stride, ok_q, LD))
        q_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_M, HEAD], Q_SL, q16)
        k_smem = gl.allocate_shared_memory(gl.float16, [NUM_BUFFERS, PAGE, HEAD], K_SL)
        r = gl.load(blk_ptr + blk)
        ws_page0 = ws_ptr + gl.load(ws_off_ptr + (r - req_base)).to(gl.int64) * WS_PAGE
        tok_off = gl.arange(0, PAGE, layout=gl.SliceLayout(1, LD)).to(gl.int64) * HEAD
        all_tok = tok_off >= 0
        fence_async_shared()
        if Q_IN_REGS:
            q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
        else:
            q_op = q_smem

        # page `start` converted, page start + 1's bytes in flight; then the first step
        # without a pending MMA; then two steps per iteration, so that the two accumulators
        # swap roles without copies
        raw = _load_tile(ws_page0 + start * WS_PAGE, tok_off, all_tok, LD)
        raw = _fill(k_smem, start - 1, raw, ws_page0, end, tok_off, all_tok, LD)
        fence_async_shared()
        gl.thread_barrier()
        b = gl.zeros([BLOCK_M, PAGE], gl.float32, MMA)
        a = warpgroup_mma(q_op, k_smem.index(start % NUM_BUFFERS).permute((1, 0)), b,
                          use_acc=False, is_async=True)
        raw = _fill(k_smem, start, raw, ws_page0, end, tok_off, all_tok, LD)
        fence_async_shared()
        gl.thread_barrier()
        for k in range(start + 1, end - 1, 2):
            raw, b, a, top = _step(k, raw, b, a, k_smem, q_op, ws_page0, tok_off, all_tok, end,
                                   top, local, LD, TL, SOL)
            raw, a, b, top = _step(k + 1, raw, a, b, k_smem, q_op, ws_page0, tok_off, all_tok,
                                   end, top, local, LD, TL, SOL)
        if (end - start) % 2 == 0:  # page end - 1 is left
            top = _last_pages(raw, b, a, k_smem, q_op, ws_page0, tok_off, all_tok, end, top,
                              local, LD, TL, SOL)
        else:
            top = _epilogue(warpgroup_mma_wait(num_outstanding=0, deps=(a,)), end - 1, top,
                            local, TL, SOL)

    cand_rows = (blk * BLOCK_M + rows_t).to(gl.int64)
    slot = gl.expand_dims(gl.arange(0, TOPK, layout=gl.SliceLayout(0, TL)), 0)
    if NUM_SPLITS == 1:
        _write_selection(top, local, out_offsets(token, h, H), out_ptr, row_ok, slot)
    else:  # topk.store_candidates (KEEP == 16)
        ptrs = cand_ptr + gl.expand_dims(cand_rows, 1) * (NUM_SPLITS * TOPK) + split * TOPK
        gl.store(ptrs + slot, top)


@gluon.jit
def _write_selection(keys, local, out_off, out_ptr, row_ok, slot):
    """``topk.write_selection`` of the rows' lists ``keys [R, 16]`` (layout of ``slot``)."""
    res = gl.full(keys.shape, -1, gl.int32, layout=keys.type.layout)
    if gl.max(gl.where(row_ok, local, 0), 0) > HISTORY:
        for k in gl.static_range(HISTORY):
            best = gl.max(keys, 1)
            res = gl.where(slot == k, gl.expand_dims(candidate_id(best), 1), res)
            keys = gl.where(keys == gl.expand_dims(best, 1), EMPTY, keys)
    lp = gl.expand_dims(local, 1)
    res = gl.where(slot == HISTORY, lp, res)  # slot 15: the local page
    res = gl.where(lp <= HISTORY, gl.where(slot <= lp, slot, -1), res)
    gl.store(out_ptr + gl.expand_dims(out_off, 1) + slot, res, mask=gl.expand_dims(row_ok, 1))
