"""Gluon prefill score kernel, warp-specialized (SPEC 4, 5, 7; CUDA SM90 only).

Same grid, arguments, scratch and results as the Triton ``prefill.prefill_score_kernel`` with
tokens on N and dot "fp16", for splits that keep 16 candidates (more than 8 pages,
``KEEP == 16``) at BLOCK_M 128; that kernel is this one's twin on the CPU interpreter and on
other GPUs, and the GPU tests check the two against each other row for row. The window
scratch is not used (each page's candidates go straight into the lists); the candidate
scratch and the output are written as the twin writes them (the lists' slot order may
differ; the selection does not).

A program (128 query rows of one request, one split of its pages) runs three partitions of 4
warps each (``gl.warp_specialize``), which share a ring of ``NB`` fp16 page buffers in shared
memory and two mbarriers per buffer (``full``: converted, ``empty``: released by both
consumers):

- the converter (``_converter``): loads page k's E4M3 bytes (half a page ahead), waits for
  buffer k % NB to be empty, widens them to fp16 (exact) into it, fences, arrives on full;
- two consumers (``_consumer``, rows 0-63 and 64-127; the first is the default partition):
  the query rows resident as the register A operand; per page k: wait for full, issue the
  ``warpgroup_mma`` ``[64 rows, 128 dims] x [128 dims, 128 tokens]`` asynchronously, wait for
  page k - 1's MMA only (``num_outstanding=1``), release its buffer, then its epilogue: the
  NaN-skipping max over tokens and one insert per row into the running top-16 list (the
  lists use a layout whose rows sit on the accumulator's threads, so the page scores need no
  data movement). Two pages per loop iteration, so the two accumulators swap roles without
  copies.

So the tensor cores see one consumer's MMAs while the other runs its epilogue, and the
conversion runs on its own warps: no CTA barrier per page. The lists start with distinct
sentinels ``EMPTY + column`` (below every real candidate: page ids < 2^32 - 16), so every
list's entries stay distinct and an insert replaces the one entry equal to the row's minimum
(no first-column search); the sentinels become ``EMPTY`` before the lists are written.
Products are exact and accumulate in fp32 in the same wgmma K order as the twin's ``tl.dot``.
Registers: the consumers 200 each, the converter 104 (launched with 4 warps, 12 in all:
``launch_options``); no spills in the page loops (a few in the one-split final selection;
``python -m benchmarks.sass_stats --prefill-wgmma``).

``FP8`` (with ``launch_options(fp8=True)``; dot "fp8", the opt-in ``allow_fp8_mma``): the ring
holds the workspace's E4M3 bytes (16 KB per buffer; the converter copies, it does not widen),
the consumers' query is an E4M3 register A operand and each page one m64n128k32 FP8 wgmma:
inexact (SPEC 9 b = 5), 1.2-1.3x faster on long chunks (H200). Its wait deps are the
accumulator tokens only (Triton 3.6 cannot lower 8-bit deps; ptxas keeps an in-flight wgmma's
register operands intact).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..layout import (HEAD, HISTORY, PAGE, TOPK, WS_PAGE, scored_pages, split_range,
                      ws_page_offset)
from ..scan import block_rows_info, out_offsets, score_row_block
from ..topk import EMPTY, candidate_id, pack_candidate

NUM_BUFFERS = 6  # fp16 page buffers of the ring (H200: 6 as fast as 4, faster than 3)
# registers per thread of a consumer / the converter: 2 x 200 + 104 = 504 = 3 x 168 (12 warps)
CONSUMER_REGS = gl.constexpr(200)
CONVERTER_REGS = gl.constexpr(104)
HALF = gl.constexpr(PAGE.value // 2)  # rows per consumer; tokens per converter load / store


@functools.lru_cache(maxsize=None)
def launch_options(fp8: bool = False) -> dict:
    """Constexpr layouts and ``num_warps`` of a launch (cached: host time per launch):
    ``dict(MMA, LD, TL, K_SL, num_warps=4)`` -- the accumulator of one consumer (64 rows, 4
    warps, instruction N = 128 tokens), the converter's byte loads (16 bytes per thread), the
    top-k lists (a 16-column accumulator layout: a row's entries on the threads that hold its
    scores, 4 per thread), and the shared layout of a page; ``fp8``: with ``FP8=1`` (E4M3
    operands: instruction K = 32, an E4M3 page buffer), for dot "fp8"."""
    if fp8:
        return dict(launch_options(False), FP8=1, **_fp8_layouts())
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, PAGE.value, 16])
    ld = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    tl_ = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, TOPK.value, 16])
    k_sl = gl.NVMMASharedLayout.get_default_for([PAGE.value, HEAD.value], gl.float16)
    return dict(MMA=mma, LD=ld, TL=tl_, K_SL=k_sl, num_warps=4)


def _fp8_layouts() -> dict:
    """``MMA`` / ``K_SL`` of the E4M3-operand launch (FP8 wgmma: K = 32 per instruction, the
    page's 128-byte token rows K-major in shared memory)."""
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, PAGE.value, 32])
    k_sl = gl.NVMMASharedLayout.get_default_for([PAGE.value, HEAD.value], gl.float8e4nv)
    return dict(MMA=mma, K_SL=k_sl)


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


@gluon.jit
def _staged(raw, FP8: gl.constexpr):
    """A page half as the ring holds it: fp16 of the E4M3 bytes ``raw``, or (``FP8``: an E4M3
    ring) the bytes themselves."""
    if FP8:
        return raw.to(gl.float8e4nv, bitcast=True)
    else:
        return _as_f16(raw)


@gluon.jit
def _converter(ws_page0, start, end, k_smem, full, empty, LD: gl.constexpr,
               NB: gl.constexpr, FP8: gl.constexpr):
    """Converter partition (4 warps): page ``start + kk``'s E4M3 bytes widened to fp16 (FP8:
    copied as they are, an E4M3 ring) into buffer kk % NB once both consumers released it
    (``empty``), then ``full`` arrived."""
    if end > start:
        tok = gl.arange(0, HALF, layout=gl.SliceLayout(1, LD)).to(gl.int64) * HEAD
        all_tok = tok >= 0
        lo = _load_tile(ws_page0 + ws_page_offset(start), tok, all_tok, LD)
        for kk in range(0, end - start):
            i = kk % NB
            page = ws_page0 + ws_page_offset(start + kk)
            hi = _load_tile(page + HALF * HEAD, tok, all_tok, LD)
            mbarrier.wait(empty.index(i), ((kk // NB) & 1) ^ 1)
            buf = k_smem.index(i)
            buf.slice(0, HALF).store(_staged(lo, FP8))
            nxt = ws_page0 + ws_page_offset(gl.minimum(start + kk + 1, end - 1))
            lo = _load_tile(nxt, tok, all_tok, LD)
            buf.slice(HALF, HALF).store(_staged(hi, FP8))
            fence_async_shared()
            mbarrier.arrive(full.index(i))


@gluon.jit
def _insert_distinct(top, cand):
    """``topk.topk_insert`` in layout TL for lists whose entries are distinct (real
    candidates and the sentinels ``EMPTY + column``): one candidate per row (``cand [R]``)
    replaces the row's smallest entry, the one column equal to its minimum, when larger."""
    low = gl.min(top, 1)
    take = (top == gl.expand_dims(low, 1)) & gl.expand_dims(cand > low, 1)
    return gl.where(take, gl.expand_dims(cand, 1), top)


@gluon.jit
def _epilogue(acc, j, top, local, TL: gl.constexpr):
    """Page j's candidates into ``top``: the max over the tokens of ``acc`` (NaN-skipping:
    ``max.f32``; NaN when all are NaN, SPEC 4), a candidate of the rows whose local page lies
    past j."""
    score = gl.convert_layout(gl.max(acc, axis=1), gl.SliceLayout(1, TL), assert_trivial=True)
    cand = gl.where(j < local, pack_candidate(score, j + 0 * local), EMPTY)
    return _insert_distinct(top, cand)


@gluon.jit
def _step(kk, dead, pending, q_op, k_smem, full, empty, start, top, local,
          TL: gl.constexpr, NB: gl.constexpr):
    """Consumer step kk: wait for buffer kk % NB, issue page start + kk's MMA into ``dead``,
    wait for page kk - 1's (``pending``), release its buffer, run its epilogue."""
    i = kk % NB
    mbarrier.wait(full.index(i), (kk // NB) & 1)
    issued = warpgroup_mma(q_op, k_smem.index(i).permute((1, 0)), dead, use_acc=False,
                           is_async=True)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))
    mbarrier.arrive(empty.index((kk - 1) % NB))
    top = _epilogue(done, start + kk - 1, top, local, TL)
    return issued, done, top


@gluon.jit
def _consumer(c: gl.constexpr, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr,
              caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem, full,
              empty, H: gl.constexpr, NUM_SPLITS: gl.constexpr, MMA: gl.constexpr,
              TL: gl.constexpr, NB: gl.constexpr, FP8: gl.constexpr):
    """Consumer partition c (4 warps): rows [64 c, 64 c + 64) of the block; page MMAs with
    the query as the register A operand (fp16, or E4M3 with ``FP8``), epilogues one page
    behind; its rows' output."""
    blk = score_row_block()
    split = gl.program_id(1)
    rows_t = gl.arange(0, HALF, layout=gl.SliceLayout(1, TL)) + c * HALF
    token, h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                              num_blocks, blk, rows_t, H)
    slot = gl.expand_dims(gl.arange(0, TOPK, layout=gl.SliceLayout(0, TL)), 0)
    # distinct sentinels below every real candidate (page ids < 2^32 - 16), EMPTY at the end
    top = gl.full([HALF, TOPK], EMPTY, gl.int64, layout=TL) + slot
    npg = end - start
    if npg > 0:
        QL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA,
                                               k_width=4 if FP8 else 2)
        rows_q = gl.arange(0, HALF, layout=gl.SliceLayout(1, QL)) + c * HALF
        tq, hq, _lq, ok_q = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                            num_blocks, blk, rows_q, H)
        q_op = _staged(_load_tile(q_ptr, tq * q_tok_stride + hq * q_head_stride, ok_q, QL),
                       FP8)
        b = gl.zeros([HALF, PAGE], gl.float32, MMA)
        mbarrier.wait(full.index(0), 0)
        a = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), b, use_acc=False,
                          is_async=True)
        for kk in range(1, npg - 1, 2):
            b, a, top = _step(kk, b, a, q_op, k_smem, full, empty, start, top, local, TL, NB)
            a, b, top = _step(kk + 1, a, b, q_op, k_smem, full, empty, start, top, local, TL,
                              NB)
        # the last page's epilogue reads the accumulator its wait returns: copying an
        # in-flight accumulator (``a = last``) made ptxas serialize every wgmma (C7514)
        if npg % 2 == 0:  # page end - 1 is left
            last, _d, top = _step(npg - 1, b, a, q_op, k_smem, full, empty, start, top, local,
                                  TL, NB)
            top = _epilogue(warpgroup_mma_wait(num_outstanding=0, deps=(last,)), end - 1, top,
                            local, TL)
        else:
            top = _epilogue(warpgroup_mma_wait(num_outstanding=0, deps=(a,)), end - 1, top,
                            local, TL)
    top = gl.where(top < EMPTY + TOPK, EMPTY, top)
    if NUM_SPLITS == 1:
        _write_selection(top, local, out_offsets(token, h, H), out_ptr, row_ok, slot)
    else:
        cand_rows = (blk * (2 * HALF) + rows_t).to(gl.int64)
        ptrs = cand_ptr + gl.expand_dims(cand_rows, 1) * (NUM_SPLITS * TOPK) + split * TOPK
        gl.store(ptrs + slot, top)


# the same runtime arguments (and value specializations) as the Triton twin
@gluon.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "req_base", "num_blocks"],
           do_not_specialize_on_alignment=["seq_lens_ptr", "caps_ptr"])
def prefill_wgmma_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base,
                         qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                         win_ptr, out_ptr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                         NUM_SPLITS: gl.constexpr, MMA: gl.constexpr, LD: gl.constexpr,
                         TL: gl.constexpr, K_SL: gl.constexpr,
                         NB: gl.constexpr = NUM_BUFFERS, FP8: gl.constexpr = 0):
    """Prefill score program ``(x, split)`` of grid ``(num_blocks, NUM_SPLITS)``: row block
    ``num_blocks - 1 - x`` (``scan.score_row_block``; SPEC 4, 5, 7), BLOCK_M 128, launched
    with ``launch_options()`` (4 warps; the partitions add 8).

    Arguments as ``prefill.prefill_score_kernel``'s: ``q_ptr`` E4M3 query bytes (uint8) with
    token / head strides in bytes; ``ws_ptr`` the FP8 workspace ``[P, 128, 128]`` (bytes) and
    ``ws_off_ptr`` int32 each request's first workspace page (indexed by request - req_base);
    ``qsl_ptr`` int32 cu_seqlens_q, ``seq_lens_ptr`` / ``caps_ptr`` int32 device / planned seq
    lens; ``blk_ptr`` int32 ``[2, num_blocks]`` (request, first row); ``cand_ptr`` int64
    candidates ``[num_blocks * BLOCK_M, NUM_SPLITS, 16]`` (NUM_SPLITS > 1), ``out_ptr`` int32
    ``[Tp, H, 16]`` (NUM_SPLITS == 1); ``win_ptr`` is not read (no window). The caller
    guarantees KEEP == 16 (more than 8 pages per split), dot fp16 (or, with ``FP8`` and
    ``launch_options(fp8=True)``, dot "fp8": E4M3 operands on the FP8 tensor cores, SPEC 9
    b = 5) with tokens on N, and a CUDA SM90 device (``dispatch.prefill_launch``). ``NB``: ring
    buffers, >= 2 (default ``NUM_BUFFERS``)."""
    gl.static_assert(BLOCK_M == 2 * HALF, "the Gluon prefill kernel takes BLOCK_M 128")
    # one buffer deadlocks: page k - 1's buffer is released only after page k's full wait
    gl.static_assert(NB >= 2, "the Gluon prefill kernel needs NB >= 2 ring buffers")
    blk = score_row_block()
    split = gl.program_id(1)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TL))
    _t, _h, local, row_ok = block_rows_info(qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr,
                                            num_blocks, blk, rows, H)
    n = scored_pages(gl.max(gl.where(row_ok, local, 0), 0))
    start, end = split_range(n, split, NUM_SPLITS)
    r = gl.load(blk_ptr + blk)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv if FP8 else gl.float16, [NB, PAGE, HEAD],
                                       K_SL)
    full = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NB):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    ws_page0 = ws_ptr + gl.load(ws_off_ptr + (r - req_base)).to(gl.int64) * WS_PAGE
    # partitions get scalars and shared memory only (tensors stay in the default partition)
    gl.warp_specialize([
        (_consumer, (0, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr, caps_ptr,
                     blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem, full, empty,
                     H, NUM_SPLITS, MMA, TL, NB, FP8)),
        (_consumer, (1, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr, caps_ptr,
                     blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem, full, empty,
                     H, NUM_SPLITS, MMA, TL, NB, FP8)),
        (_converter, (ws_page0, start, end, k_smem, full, empty, LD, NB, FP8))],
        [4, 4], [CONSUMER_REGS, CONVERTER_REGS])
