"""Gluon score kernel of the page-score decode family, dequant "mma" (SM89+; the default on
SM90 at <= 32 query rows from ``dispatch.MMA_MIN_PAGES`` pages).

One warp per program and nothing shared between warps, so no warp waits on another: the
hardware interleaves the ~12 resident programs of an SM (168 registers: 3 warps per
scheduler). Grid ``(P,)``, the flat partition (``fragments.flat_work``: program p scores flat
pages [p*T//P, (p+1)*T//P) of the batch's T scored pages, request by request); per request
segment:

- the query rows of request b as fp16 ``mma.sync`` B fragments, held in registers for all
  pages (two K=64 halves, dims in ``fragments.phys_dim`` order);
- the segment's history pages streamed in chunks of 16 tokens (1 KB of codes + 128 scale bytes)
  through a shared-memory ring of ``STAGES`` chunk slots filled by ``cp.async``
  (``STAGES - 1`` chunks in flight; the block id of page j + 2 is read during page j);
- per chunk: its code and scale bytes read from the ring in the layout ``CL`` whose lane bases
  are those of the m16n8k16 A fragment (each thread its own 16-byte code runs), per K=64 half
  ``lut.LUT_ASM`` dequantization (bit-exact SPEC 1.4), a trivial (register-renaming) conversion
  to the A operand and ``mma_v2 [16, 64] x [64, N]`` (fp16 operands, fp32 accumulation: SPEC 9
  b = 15); the max over the two token rows each thread holds goes into a running per-thread
  max;
- per page: one cross-lane max (three shuffle rounds) over its 128 tokens, NaN-skipping
  (SPEC 4), stored to ``scores[b, n, j]``.

Same scratch, select kernel and SPEC 10 clamps as the other page scorers; the wgmma scorer's
cross-warp max and register prefetch measured slower in this one-warp shape.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..layout import PAGE, SCALES_OFFSET
from .fragments import (chunk_layouts, dequant_half, flat_work, group_offsets, half_operands,
                        load_q, request_segment)

CHUNK = gl.constexpr(16)  # tokens per MMA (the m16n8k16 A fragment's rows)


@gluon.jit
def _block_base(bt_row, j, num_blocks, page_stride16):
    """int64 element offset (cache viewed as int64) of logical page j's block, id clamped;
    a multiple of 2 (16 bytes) whatever the stride's value: 16-byte copies."""
    blk = gl.load(bt_row + j)
    return gl.minimum(gl.maximum(blk, 0), num_blocks - 1).to(gl.int64) * page_stride16 * 2


@gluon.jit
def _issue_chunk(ring_c, ring_s, cache64, cache8, base, off64, soff, k: gl.constexpr,
                 STAGES: gl.constexpr):
    """cp.async of chunk k % 8 of the page at ``base`` into ring slot k % STAGES (codes: each
    thread copies the 16-byte runs it reads; scales: 4 bytes per lane), one commit group."""
    c: gl.constexpr = k % 8
    async_copy.async_copy_global_to_shared(ring_c.index(k % STAGES),
                                           cache64 + base + off64 + c * CHUNK * 8)
    async_copy.async_copy_global_to_shared(ring_s.index(k % STAGES),
                                           cache8 + base * 8 + soff + c * CHUNK * 8)
    async_copy.commit_group()


@gluon.jit
def _score_chunk(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L: gl.constexpr):
    """[16 tokens, N] fp32 dot products of one chunk (both K halves)."""
    c_lo, s_lo, r_lo, c_hi, s_hi, r_hi = half_operands(codes, sb, tbl_ptr)
    acc = mma_v2(dequant_half(c_lo, s_lo, r_lo, A_L, CHUNK), q_lo, zero)
    return mma_v2(dequant_half(c_hi, s_hi, r_hi, A_L, CHUNK), q_hi, acc)


@gluon.jit
def _row_max(acc, N: gl.constexpr):
    """Max over the two token rows (g, g + 8) each thread holds: [16, N] -> [8, N]."""
    return gl.max(gl.reshape(acc, [2, 8, N]), axis=0)


# The launcher's warmup (a 1-block cache, a contiguous q) must compile the variant real
# launches use (CUDA-graph capture must not compile): no value specialization of these ints.
@gluon.jit(do_not_specialize=["q_row_stride", "q_head_stride", "page_stride16", "num_blocks",
                              "bt_stride", "width", "num_reqs", "num_programs"])
def mma_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride16, num_blocks,
                     bt_ptr, bt_stride, width, seq_lens_ptr, tbl_ptr, scores_ptr, num_reqs,
                     num_programs, Q: gl.constexpr, H: gl.constexpr, N: gl.constexpr,
                     BB: gl.constexpr, CL: gl.constexpr, MMA: gl.constexpr, QL: gl.constexpr,
                     SCL: gl.constexpr, STAGES: gl.constexpr):
    VL: gl.constexpr = gl.BlockedLayout([BB // 32], [32], [1], [0])
    NCH: gl.constexpr = PAGE // CHUNK
    gl.static_assert(NCH % STAGES == 0, "STAGES divides the chunks of a page")
    s, e, b0, b1, eb = flat_work(seq_lens_ptr, num_reqs, width, gl.program_id(0),
                                 num_programs, BB, VL)
    ring_c = gl.allocate_shared_memory(gl.int64, [STAGES, CHUNK, 4, 2],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    ring_s = gl.allocate_shared_memory(gl.uint8, [STAGES, CHUNK, 8],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    cache64 = cache_ptr.to(gl.pointer_type(gl.int64), bitcast=True)
    for b in range(b0, b1):  # each request the flat range touches: its pages [start, end)
        start, end, eb = request_segment(seq_lens_ptr, b, width, s, e, eb)
        if start < end:
            _score_pages(q_ptr, q_row_stride, q_head_stride, b, cache64, cache_ptr,
                         page_stride16, num_blocks, bt_ptr + b.to(gl.int64) * bt_stride,
                         tbl_ptr, scores_ptr + b.to(gl.int64) * N * width, width, start, end,
                         ring_c, ring_s, Q, H, N, CL, MMA, QL, SCL, STAGES)


@gluon.jit
def _score_pages(q_ptr, q_row_stride, q_head_stride, b, cache64, cache8, page_stride16,
                 num_blocks, bt_row, tbl_ptr, out_base, width, start, end, ring_c, ring_s,
                 Q: gl.constexpr, H: gl.constexpr, N: gl.constexpr, CL: gl.constexpr,
                 MMA: gl.constexpr, QL: gl.constexpr, SCL: gl.constexpr,
                 STAGES: gl.constexpr):
    """Pages ``[start, end)`` of request b (non-empty): the query as B fragments, the chunks
    through the ring, row n's max of page j stored at ``out_base + n * width + j``."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    NCH: gl.constexpr = PAGE // CHUNK
    m8, grp = group_offsets(CHUNK, CL)  # a chunk's codes in CL
    off64 = m8 + grp
    st = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, SCL))
    sb8 = gl.arange(0, 8, layout=gl.SliceLayout(0, SCL))
    soff = SCALES_OFFSET + gl.expand_dims(st, 1) * 8 + gl.expand_dims(sb8, 0)
    zero = gl.zeros([CHUNK, N], gl.float32, layout=MMA)
    # row n's score offsets in the layout of a page max (the same reductions on ints)
    col = gl.expand_dims(gl.arange(0, N, layout=gl.SliceLayout(0, MMA)), 0) \
        + gl.zeros([CHUNK, N], gl.int32, layout=MMA)
    rown = gl.max(_row_max(col, N), axis=0)
    out_ptrs = out_base + rown * width
    q_lo = gl.convert_layout(load_q(q_ptr, b, q_row_stride, q_head_stride, 0, Q, H, N, QL),
                             B_L)
    q_hi = gl.convert_layout(load_q(q_ptr, b, q_row_stride, q_head_stride, 64, Q, H, N, QL),
                             B_L)
    base = _block_base(bt_row, start, num_blocks, page_stride16)
    nbase = _block_base(bt_row, gl.minimum(start + 1, end - 1), num_blocks, page_stride16)
    for k in gl.static_range(STAGES - 1):  # chunks 0 .. STAGES-2 of the first page
        _issue_chunk(ring_c, ring_s, cache64, cache8, base, off64, soff, k, STAGES)
    for j in range(start, end):
        # block of page j + 2 (its chunks are issued during page j + 1); past the range's
        # end the last page is re-read (L2-hot), never a page outside the row (SPEC 10)
        nnbase = _block_base(bt_row, gl.minimum(j + 2, end - 1), num_blocks, page_stride16)
        for c in gl.static_range(NCH):
            # chunk c has landed; Triton's barrier analysis adds the barriers that make
            # every lane's copies visible (scales cross lanes) and free slot c - 1
            async_copy.wait_group(STAGES - 2)
            codes = ring_c.index(c % STAGES).load(CL)
            sb = ring_s.index(c % STAGES).reshape([CHUNK, 4, 2]).load(CL)
            if c + STAGES - 1 < NCH:  # chunk c + STAGES - 1 of this page or the next
                _issue_chunk(ring_c, ring_s, cache64, cache8, base, off64, soff,
                             c + STAGES - 1, STAGES)
            else:
                _issue_chunk(ring_c, ring_s, cache64, cache8, nbase, off64, soff,
                             c + STAGES - 1, STAGES)
            red = _row_max(_score_chunk(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L), N)
            if c == 0:
                run = red
            else:
                run = gl.maximum(run, red)  # max.f32 skips NaN (SPEC 4)
        gl.store(out_ptrs + j, gl.max(run, axis=0))
        base = nbase
        nbase = nnbase
    async_copy.wait_group(0)


@functools.lru_cache(maxsize=None)
def layouts(rows: int):
    """Constexpr layouts of the warp-per-split Gluon scorer (one warp) for
    N = ``rows`` query rows: ``(CL, MMA, QL, SCL)`` -- the chunk code / scale read layout and
    the cp.async layout of its scale bytes (``fragments.chunk_layouts(1)``: 16 tokens), the
    MMA accumulator and the query load. Cached: building them costs ~0.1 ms of host time,
    once per eager launch otherwise."""
    cl, scl = chunk_layouts(1)
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    ql = gl.BlockedLayout([2, 1], [32, 1], [1, 1], [0, 1])
    return cl, mma, ql, scl
