"""Gluon score kernel of the warp-per-split decode path (``decode_wgmma``, dequant "mma"; SM89+).

One warp per program and nothing shared between warps, so no warp waits on another: the
hardware interleaves the ~12 resident programs of an SM (168 registers: 3 warps per
scheduler). Grid ``(P,)``, the flat partition (``flat_work``: program p scores flat pages
[p*T//P, (p+1)*T//P) of the batch's T scored pages, request by request); per request segment:

- the query rows of request b as fp16 ``mma.sync`` B fragments, held in registers for all
  pages (two K=64 halves, dims in ``decode_wgmma.phys_dim`` order);
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

Same scratch, select kernel and SPEC 10 clamps as ``wgmma_scorer``. Why this shape (the wgmma
path's cross-warp max and register prefetch measured slower): docs/benchmarks.md, "Issue 13,
fourth step".
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .layout import HISTORY, PAGE, SCALES_OFFSET
from .lut import LUT_ASM, LUT_CONSTRAINTS
from .wgmma_scorer import _dequant_half, _group_offsets, _half_operands, _load_q, _SPLIT_ASM

_ASM = gl.constexpr(LUT_ASM)
_CONSTRAINTS = gl.constexpr(LUT_CONSTRAINTS)
# LAB 2 (no dequantization): the 16 codes' two words copied into the 8 operand registers
_RAW_ASM = gl.constexpr("mov.b64 {$0, $1}, $8;\nmov.b64 {$2, $3}, $8;\n"
                        "mov.b64 {$4, $5}, $8;\nmov.b64 {$6, $7}, $8;")

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
def _score_chunk(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L: gl.constexpr, LAB: gl.constexpr):
    """[16 tokens, N] fp32 dot products of one chunk (both K halves). ``LAB`` (speed-of-light
    variants for ``benchmarks.labs.dequant_lab``; 0 in the library): 1 sums two independent
    K-half MMA chains (not bit-identical to 0), 2 feeds the raw code words to the MMA (no
    lookup, no table loads: wrong scores)."""
    if LAB == 2:
        c_lo, c_hi = gl.split(codes)
        acc = mma_v2(_raw_half(c_lo, A_L, CHUNK), q_lo, zero)
        return mma_v2(_raw_half(c_hi, A_L, CHUNK), q_hi, acc)
    c_lo, s_lo, r_lo, c_hi, s_hi, r_hi = _half_operands(codes, sb, tbl_ptr)
    if LAB == 1:
        return mma_v2(_dequant_half(c_lo, s_lo, r_lo, A_L, CHUNK), q_lo, zero) \
            + mma_v2(_dequant_half(c_hi, s_hi, r_hi, A_L, CHUNK), q_hi, zero)
    acc = mma_v2(_dequant_half(c_lo, s_lo, r_lo, A_L, CHUNK), q_lo, zero)
    return mma_v2(_dequant_half(c_hi, s_hi, r_hi, A_L, CHUNK), q_hi, acc)


@gluon.jit
def _raw_half(codes, A_L: gl.constexpr, M: gl.constexpr):
    """LAB 2: an operand of ``_dequant_half``'s shape ``[M, 64]`` from register copies of the
    codes (no lookup, no table loads)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
        _RAW_ASM, _CONSTRAINTS, [codes, codes, codes.to(gl.int32)],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=1)
    x = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)),
                gl.join(gl.join(o4, o5), gl.join(o6, o7)))
    y = gl.join(x, x)
    f = gl.inline_asm_elementwise(_SPLIT_ASM, "=r,r,r", [y], dtype=gl.float16, is_pure=True,
                                  pack=2)
    f = gl.permute(f, [0, 2, 3, 4, 1, 5])
    return gl.convert_layout(gl.reshape(f, [M, 64]), A_L, assert_trivial=True)


@gluon.jit
def _lookup_only(codes, sb, tbl_ptr):
    """LAB 3 (no MMA): both halves' lookups folded by xor into an int32 [16, 4]."""
    c_lo, s_lo, r_lo, c_hi, s_hi, r_hi = _half_operands(codes, sb, tbl_ptr)
    return _xor_lookup(c_lo, s_lo, r_lo) ^ _xor_lookup(c_hi, s_hi, r_hi)


@gluon.jit
def _xor_lookup(codes, s, row):
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
        _ASM, _CONSTRAINTS, [codes, row, s],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=1)
    return ((o0 ^ o1) ^ (o2 ^ o3)) ^ ((o4 ^ o5) ^ (o6 ^ o7))


@gluon.jit
def _row_max(acc, N: gl.constexpr):
    """Max over the two token rows (g, g + 8) each thread holds: [16, N] -> [8, N]."""
    return gl.max(gl.reshape(acc, [2, 8, N]), axis=0)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def scored_page_count(sl, width):
    """Scored pages of a request of seq_len ``sl`` (``wgmma_scorer._split_pages``'s count;
    SPEC 10 clamp): the last query's history pages, 0 when every row is short."""
    sl = gl.minimum(gl.maximum(sl, 0), width * PAGE)
    n = gl.maximum(sl - 1, 0) // PAGE
    return gl.where(n > HISTORY, n, 0)


@gluon.jit
def flat_work(seq_lens_ptr, num_reqs, width, pid, num_programs, BB: gl.constexpr,
              VL: gl.constexpr):
    """Program ``pid``'s share of the batch's scored pages (the flat partition,
    ``decode_wgmma.flat_partition``): the requests' scored page counts n_b laid end to end,
    program p takes flat pages ``[p * T // P, (p + 1) * T // P)`` of the total T. Returns
    ``(s, e, b0, b1, e0)``: that range, the requests ``[b0, b1)`` it touches and the first
    flat page of request b0."""
    idx = gl.arange(0, BB, layout=VL)
    n = scored_page_count(gl.load(seq_lens_ptr + idx, mask=idx < num_reqs, other=0), width)
    incl = gl.associative_scan(n, 0, _add)
    excl = incl - n
    total = gl.sum(n, axis=0).to(gl.int64)
    s = ((pid.to(gl.int64) * total) // num_programs).to(gl.int32)
    e = (((pid + 1).to(gl.int64) * total) // num_programs).to(gl.int32)
    b0 = gl.sum((incl <= s).to(gl.int32), axis=0)
    b1 = gl.sum((excl < e).to(gl.int32), axis=0)
    e0 = gl.sum(gl.where(idx == b0, excl, 0), axis=0)
    return s, e, b0, b1, e0


@gluon.jit
def request_segment(seq_lens_ptr, b, width, s, e, eb):
    """Request b's share of a program's flat range ``[s, e)`` (``flat_work``), request b's
    scored pages starting at flat page ``eb``: ``(start, end, eb')``, request-local pages
    ``[start, end)`` (empty when start >= end) and the next request's first flat page."""
    ib = eb + scored_page_count(gl.load(seq_lens_ptr + b), width)  # flat pages [eb, ib)
    return gl.maximum(s, eb) - eb, gl.minimum(e, ib) - eb, ib


# The launcher's warmup (a 1-block cache, a contiguous q) must compile the variant real
# launches use (CUDA-graph capture must not compile): no value specialization of these ints.
@gluon.jit(do_not_specialize=["q_row_stride", "q_head_stride", "page_stride16", "num_blocks",
                              "bt_stride", "width", "num_reqs", "num_programs"])
def mma_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride16, num_blocks,
                     bt_ptr, bt_stride, width, seq_lens_ptr, tbl_ptr, scores_ptr, num_reqs,
                     num_programs, Q: gl.constexpr, H: gl.constexpr, N: gl.constexpr,
                     BB: gl.constexpr, CL: gl.constexpr, MMA: gl.constexpr, QL: gl.constexpr,
                     SCL: gl.constexpr, STAGES: gl.constexpr, LAB: gl.constexpr = 0):
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
                         ring_c, ring_s, Q, H, N, CL, MMA, QL, SCL, STAGES, LAB)


@gluon.jit
def _score_pages(q_ptr, q_row_stride, q_head_stride, b, cache64, cache8, page_stride16,
                 num_blocks, bt_row, tbl_ptr, out_base, width, start, end, ring_c, ring_s,
                 Q: gl.constexpr, H: gl.constexpr, N: gl.constexpr, CL: gl.constexpr,
                 MMA: gl.constexpr, QL: gl.constexpr, SCL: gl.constexpr,
                 STAGES: gl.constexpr, LAB: gl.constexpr):
    """Pages ``[start, end)`` of request b (non-empty): the query as B fragments, the chunks
    through the ring, row n's max of page j stored at ``out_base + n * width + j``."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    NCH: gl.constexpr = PAGE // CHUNK
    m8, grp = _group_offsets(CHUNK, CL)  # a chunk's codes in CL
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
    q_lo = gl.convert_layout(_load_q(q_ptr, b, q_row_stride, q_head_stride, 0, Q, H, N, QL),
                             B_L)
    q_hi = gl.convert_layout(_load_q(q_ptr, b, q_row_stride, q_head_stride, 64, Q, H, N, QL),
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
            if LAB == 3:
                x = _lookup_only(codes, sb, tbl_ptr)
                if c == 0:
                    runx = x
                else:
                    runx = runx ^ x
            else:
                red = _row_max(_score_chunk(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L, LAB), N)
                if c == 0:
                    run = red
                else:
                    run = gl.maximum(run, red)  # max.f32 skips NaN (SPEC 4)
        if LAB == 3:
            v = gl.max(gl.max(runx, axis=1), axis=0)
            gl.store(out_ptrs + j, (rown * 0 + v).to(gl.float32))
        else:
            gl.store(out_ptrs + j, gl.max(run, axis=0))
        base = nbase
        nbase = nnbase
    async_copy.wait_group(0)
