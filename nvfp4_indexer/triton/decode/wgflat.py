"""Gluon score kernel of the page-score decode family, dequant "wgflat" (CUDA SM90 only; the
default at 32 query rows from ``dispatch.WGFLAT_MIN_PAGES`` pages, and with dot "fp8").

One warpgroup per program on the flat grid of "mma" (``fragments.flat_work``: program p scores
flat pages [p*T//P, (p+1)*T//P) of the batch, request by request). Per request segment the
query rows sit in shared memory as the wgmma B operand (fp16, two K=64 halves, dims in
``fragments.phys_dim`` order); the segment's pages go in groups of four, **one page per
warp**: warp w owns rows 16w .. 16w+15 of every [64 tokens, 128] A tile, filled with 16 tokens
of page g + w. So the four warps' MMAs share one ``warpgroup_mma`` (m64nNk16: the full-rate
tensor path, 16 instructions per page against 256 ``mma.sync``) while the max over a page's
tokens stays inside its warp (a running per-thread max over the page's 8 chunks, one
cross-lane reduction per page; no cross-warp reduction).

- Chunks (16 tokens of each warp's page: 4 KB of codes + 512 scale bytes per CTA) stream
  through a shared-memory ring of ``STAGES`` slots filled by ``cp.async`` (``STAGES - 1`` in
  flight); each thread copies the 16-byte code runs it reads back, in the layout ``CL`` whose
  lane and warp bases are those of the wgmma A operand.
- Per chunk and K half: ``lut.LUT_ASM`` (bit-exact SPEC 1.4) into a trivially converted A
  operand, ``warpgroup_mma [64, 64] x [64, N]`` (fp16 operands, fp32 accumulation: SPEC 9
  b = 15); the low half's MMA runs asynchronously while the high half is looked up.
- ``FP8``: E4M3 operands (``lut.LUT_E4M3_ASM``, the query in E4M3, K-major; fp8 wgmma with
  ~13 accumulated fraction bits: dot mode "fp8", SPEC 9 b = 5), synchronous wgmma.
- The last group of a segment may have fewer than four pages: the idle warps rescore the
  segment's last page (in cache, never a page outside the row: SPEC 10) and store nothing.

Same scratch, select kernel and SPEC 10 clamps as the other scorers; the "lut" twin covers
its semantics on the CPU.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..layout import PAGE, SCALES_OFFSET
from .fragments import (chunk_layouts, dequant_half, flat_work, half_operands, load_q,
                        load_q_bytes, request_segment)
from .lut import LUT_E4M3_ASM, LUT_E4M3_CONSTRAINTS

_E4M3_ASM = gl.constexpr(LUT_E4M3_ASM)
_E4M3_CONSTRAINTS = gl.constexpr(LUT_E4M3_CONSTRAINTS)
_SPLIT4_ASM = gl.constexpr("mov.b32 $0, $1;")  # E4M3x4 word -> its four bytes

CHUNK = gl.constexpr(16)  # tokens of one warp's page per A tile (its 16 rows)
WARPS = gl.constexpr(4)  # one warpgroup: four pages per group


@gluon.jit
def _block_ids(bt_row, g, end, num_blocks, L: gl.constexpr):
    """Block ids of pages ``min(g + r // 16, end - 1)`` for the 64 tile rows r (layout L),
    clamped to the cache (SPEC 10): each warp's rows name its page."""
    r = gl.arange(0, WARPS * CHUNK, layout=L)
    blk = gl.load(bt_row + gl.minimum(g + r // CHUNK, end - 1))
    return gl.minimum(gl.maximum(blk, 0), num_blocks - 1)


@gluon.jit
def _issue_chunk(ring_c, ring_s, cache64, cache8, ids_c, ids_s, page_stride16, off64, soff,
                 k: gl.constexpr, STAGES: gl.constexpr):
    """cp.async of chunk k % 8 of each warp's page (block ids ``ids_c`` in the code layout,
    ``ids_s`` in the scale layout) into ring slot k % STAGES, one commit group."""
    c: gl.constexpr = k % 8
    base_c = ids_c.to(gl.int64) * page_stride16 * 2  # int64 elements: 16-byte aligned
    base_c = gl.expand_dims(gl.expand_dims(base_c, 1), 2)
    async_copy.async_copy_global_to_shared(ring_c.index(k % STAGES),
                                           cache64 + base_c + off64 + c * CHUNK * 8)
    base_s = gl.expand_dims(ids_s.to(gl.int64) * page_stride16 * 16, 1)  # bytes
    async_copy.async_copy_global_to_shared(ring_s.index(k % STAGES),
                                           cache8 + base_s + soff + c * CHUNK * 8)
    async_copy.commit_group()


def phys_dim_e4m3(c: int) -> int:
    """Physical dim of column c of the E4M3 A tile (``FP8``): with c = 64g' + 32w + 16h + 4j + i,
    dim 16(2j + g') + 8w + 4h + i (group 2j + g', word w, nibble 4h + i of that word)."""
    i, j, h, w, gp = c & 3, (c >> 2) & 3, (c >> 4) & 1, (c >> 5) & 1, (c >> 6) & 1
    return 16 * (2 * j + gp) + 8 * w + 4 * h + i


@gluon.jit
def _load_q8(q_ptr, b, q_row_stride, q_head_stride, GP: gl.constexpr, Q: gl.constexpr,
             H: gl.constexpr, N: gl.constexpr, QL: gl.constexpr):
    """Query rows of request b as E4M3 ``[N, 64]`` (``FP8``: the K-major wgmma B operand of
    K half ``GP``): column c holds dim ``phys_dim_e4m3(64 GP + c)`` of row n = i*H + h (rows
    >= Q*H are zero)."""
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, QL))
    dim = (16 * (2 * ((c >> 2) & 3) + GP) + 8 * ((c >> 5) & 1) + 4 * ((c >> 4) & 1) + (c & 3))
    qb = load_q_bytes(q_ptr, b, q_row_stride, q_head_stride, dim, Q, H, N, QL, 0)
    return qb.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _e4m3_tile(o0, o1, o2, o3, A_L: gl.constexpr, M: gl.constexpr):
    """E4M3 A operand [M, 64] of four E4M3x4 words per (row, j) (word w, half h: ``o{2w+h}``);
    column 32w + 16h + 4j + i holds byte i of word (w, h) of group j."""
    x = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [m, j, h, w]
    y = gl.join(gl.join(x, x), gl.join(x, x))  # [m, j, h, w, a, b]
    f = gl.inline_asm_elementwise(_SPLIT4_ASM, "=r,r,r,r,r", [y], dtype=gl.float8e4nv,
                                  is_pure=True, pack=4)  # byte 2a + b
    f = gl.permute(f, [0, 3, 2, 1, 4, 5])  # [m, w, h, j, a, b]
    return gl.convert_layout(gl.reshape(f, [M, 64]), A_L, assert_trivial=True)


@gluon.jit
def _dequant_half_e4m3(codes, row, A_L: gl.constexpr, M: gl.constexpr):
    """E4M3 A operand [M tokens, 64] of one half page (``FP8``): the groups 2j + g' of one g'
    (``codes`` int64 [M, 4], ``row`` their ``lut.lut_table_e4m3`` entries) through
    ``lut.LUT_E4M3_ASM``; column c holds dim ``phys_dim_e4m3(64 g' + c)``."""
    o0, o1, o2, o3 = gl.inline_asm_elementwise(
        _E4M3_ASM, _E4M3_CONSTRAINTS, [codes, row],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    return _e4m3_tile(o0, o1, o2, o3, A_L, M)


@gluon.jit
def _chunk_scores_e4m3(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L: gl.constexpr):
    """``_chunk_scores`` with E4M3 operands (``FP8``; ``q_lo`` / ``q_hi`` the K-major [64, N]
    views): SM90 fp8 wgmma, fp32 accumulation of ~13 fraction bits (dot mode "fp8", b = 5).
    Synchronous: Triton 3.6 cannot lower 8-bit wgmma deps, and ptxas serializes an async
    wgmma whose A registers it cannot keep intact."""
    c_lo, s_lo, r_lo, c_hi, s_hi, r_hi = half_operands(codes, sb, tbl_ptr)
    acc = warpgroup_mma(_dequant_half_e4m3(c_lo, r_lo, A_L, WARPS * CHUNK), q_lo, zero,
                        use_acc=False)
    return warpgroup_mma(_dequant_half_e4m3(c_hi, r_hi, A_L, WARPS * CHUNK), q_hi, acc)


@gluon.jit
def _chunk_scores(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L: gl.constexpr):
    """[64 rows, N] fp32 dot products of one A tile (both K halves): the low half's wgmma
    runs while the high half is looked up."""
    c_lo, s_lo, r_lo, c_hi, s_hi, r_hi = half_operands(codes, sb, tbl_ptr)
    a_lo = dequant_half(c_lo, s_lo, r_lo, A_L, WARPS * CHUNK)
    tok = warpgroup_mma(a_lo, q_lo, zero, use_acc=False, is_async=True)
    a_hi = dequant_half(c_hi, s_hi, r_hi, A_L, WARPS * CHUNK)
    tok = warpgroup_mma(a_hi, q_hi, tok, is_async=True)
    acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=0, deps=[tok, a_lo, a_hi])
    return acc


@gluon.jit
def _tile_max(x, N: gl.constexpr):
    """Max over the two token rows (g, g + 8) each thread holds of each warp's 16:
    [64, N] -> [4 warps, 8, N]."""
    return gl.max(gl.reshape(x, [WARPS, 2, 8, N]), axis=1)


# The launcher's warmup (a 1-block cache, a contiguous q) must compile the variant real
# launches use (CUDA-graph capture must not compile): no value specialization of these ints.
@gluon.jit(do_not_specialize=["q_row_stride", "q_head_stride", "page_stride16", "num_blocks",
                              "bt_stride", "width", "num_reqs", "num_programs"])
def wgflat_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride16,
                        num_blocks, bt_ptr, bt_stride, width, seq_lens_ptr, tbl_ptr,
                        scores_ptr, num_reqs, num_programs, Q: gl.constexpr, H: gl.constexpr,
                        N: gl.constexpr, BB: gl.constexpr, CL: gl.constexpr,
                        MMA: gl.constexpr, QL: gl.constexpr, SCL: gl.constexpr,
                        B_SL: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr = 0):
    # the flat partition's request vector: contiguous per thread, as in the mma scorer
    VL: gl.constexpr = gl.BlockedLayout([max(1, BB // 128)], [32], [4], [0])
    NCH: gl.constexpr = PAGE // CHUNK
    gl.static_assert(NCH % STAGES == 0, "STAGES divides the chunks of a page")
    s, e, b0, b1, eb = flat_work(seq_lens_ptr, num_reqs, width, gl.program_id(0),
                                 num_programs, BB, VL)
    ring_c = gl.allocate_shared_memory(gl.int64, [STAGES, WARPS * CHUNK, 4, 2],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    ring_s = gl.allocate_shared_memory(gl.uint8, [STAGES, WARPS * CHUNK, 8],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    if FP8:  # E4M3 [N, 64] per K half, K-major (fp8 wgmma reads B K-major only)
        q_lo = gl.allocate_shared_memory(gl.float8e4nv, [N, 64], B_SL)
        q_hi = gl.allocate_shared_memory(gl.float8e4nv, [N, 64], B_SL)
    else:
        q_lo = gl.allocate_shared_memory(gl.float16, [64, N], B_SL)
        q_hi = gl.allocate_shared_memory(gl.float16, [64, N], B_SL)
    cache64 = cache_ptr.to(gl.pointer_type(gl.int64), bitcast=True)
    for b in range(b0, b1):  # each request the flat range touches: its pages [start, end)
        start, end, eb = request_segment(seq_lens_ptr, b, width, s, e, eb)
        if start < end:
            gl.thread_barrier()  # every warp is done with the previous request's query
            if FP8:
                q_lo.store(_load_q8(q_ptr, b, q_row_stride, q_head_stride, 0, Q, H, N, QL))
                q_hi.store(_load_q8(q_ptr, b, q_row_stride, q_head_stride, 1, Q, H, N, QL))
            else:
                q_lo.store(load_q(q_ptr, b, q_row_stride, q_head_stride, 0, Q, H, N, QL))
                q_hi.store(load_q(q_ptr, b, q_row_stride, q_head_stride, 64, Q, H, N, QL))
            fence_async_shared()
            gl.thread_barrier()
            if FP8:
                _score_pages(cache64, cache_ptr, page_stride16, num_blocks,
                             bt_ptr + b.to(gl.int64) * bt_stride, tbl_ptr,
                             scores_ptr + b.to(gl.int64) * N * width, width, start, end,
                             ring_c, ring_s, q_lo.permute((1, 0)), q_hi.permute((1, 0)), N, CL,
                             MMA, SCL, STAGES, FP8)
            else:
                _score_pages(cache64, cache_ptr, page_stride16, num_blocks,
                             bt_ptr + b.to(gl.int64) * bt_stride, tbl_ptr,
                             scores_ptr + b.to(gl.int64) * N * width, width, start, end,
                             ring_c, ring_s, q_lo, q_hi, N, CL, MMA, SCL, STAGES, FP8)


@gluon.jit
def _score_pages(cache64, cache8, page_stride16, num_blocks, bt_row, tbl_ptr, out_base, width,
                 start, end, ring_c, ring_s, q_lo, q_hi, N: gl.constexpr, CL: gl.constexpr,
                 MMA: gl.constexpr, SCL: gl.constexpr, STAGES: gl.constexpr,
                 FP8: gl.constexpr):
    """Pages ``[start, end)`` of one request (non-empty), four per group (warp w: page g + w);
    row n's max of page j stored at ``out_base + n * width + j``."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA,
                                            k_width=4 if FP8 else 2)
    NCH: gl.constexpr = PAGE // CHUNK
    ROWS: gl.constexpr = WARPS * CHUNK
    IDC: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, CL))
    IDS: gl.constexpr = gl.SliceLayout(1, SCL)
    # a chunk's code (int64) offsets within its page in CL: row r = token r % 16, group 2j + g'
    m = gl.arange(0, ROWS, layout=IDC)
    jj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    gp = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
    off64 = gl.expand_dims(gl.expand_dims((m % CHUNK) * 8, 1), 2) \
        + gl.expand_dims(gl.expand_dims(jj, 0), 2) * 2 + gl.expand_dims(gl.expand_dims(gp, 0), 1)
    st = gl.arange(0, ROWS, layout=IDS)
    sb8 = gl.arange(0, 8, layout=gl.SliceLayout(0, SCL))
    soff = SCALES_OFFSET + gl.expand_dims((st % CHUNK) * 8, 1) + gl.expand_dims(sb8, 0)
    zero = gl.zeros([ROWS, N], gl.float32, layout=MMA)
    # each warp's page and row n's score offset in the layout of a page max
    rr = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA)), 1) \
        + gl.zeros([ROWS, N], gl.int32, layout=MMA)
    col = gl.expand_dims(gl.arange(0, N, layout=gl.SliceLayout(0, MMA)), 0) \
        + gl.zeros([ROWS, N], gl.int32, layout=MMA)
    wpage = gl.max(_tile_max(rr // CHUNK, N), axis=1)  # [4, N]: the warp index
    rown = gl.max(_tile_max(col, N), axis=1)
    out_off = rown * width + wpage
    ids_c = _block_ids(bt_row, start, end, num_blocks, IDC)
    ids_s = _block_ids(bt_row, start, end, num_blocks, IDS)
    nids_c = _block_ids(bt_row, start + WARPS, end, num_blocks, IDC)
    nids_s = _block_ids(bt_row, start + WARPS, end, num_blocks, IDS)
    for k in gl.static_range(STAGES - 1):  # chunks 0 .. STAGES-2 of the first group
        _issue_chunk(ring_c, ring_s, cache64, cache8, ids_c, ids_s, page_stride16, off64,
                     soff, k, STAGES)
    for g in range(start, end, WARPS):
        # pages of group g + 2 (its chunks are issued during group g + 1)
        nnids_c = _block_ids(bt_row, g + 2 * WARPS, end, num_blocks, IDC)
        nnids_s = _block_ids(bt_row, g + 2 * WARPS, end, num_blocks, IDS)
        for c in gl.static_range(NCH):
            async_copy.wait_group(STAGES - 2)  # chunk c has landed (barriers by Triton)
            codes = ring_c.index(c % STAGES).load(CL)
            sb = ring_s.index(c % STAGES).reshape([ROWS, 4, 2]).load(CL)
            if c + STAGES - 1 < NCH:  # chunk c + STAGES - 1 of this group or the next
                _issue_chunk(ring_c, ring_s, cache64, cache8, ids_c, ids_s, page_stride16,
                             off64, soff, c + STAGES - 1, STAGES)
            else:
                _issue_chunk(ring_c, ring_s, cache64, cache8, nids_c, nids_s, page_stride16,
                             off64, soff, c + STAGES - 1, STAGES)
            if FP8:
                red = _tile_max(_chunk_scores_e4m3(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L), N)
            else:
                red = _tile_max(_chunk_scores(codes, sb, tbl_ptr, q_lo, q_hi, zero, A_L), N)
            if c == 0:
                run = red
            else:
                run = gl.maximum(run, red)  # max.f32 skips NaN (SPEC 4)
        gl.store(out_base + g + out_off, gl.max(run, axis=1), mask=g + wpage < end)
        ids_c = nids_c
        ids_s = nids_s
        nids_c = nnids_c
        nids_s = nnids_s
    async_copy.wait_group(0)


@functools.lru_cache(maxsize=None)
def layouts(rows: int, fp8: bool = False):
    """Constexpr layouts of the page-per-warp wgmma scorer (4 warps) for
    N = ``rows`` query rows: ``(CL, MMA, QL, SCL, B_SL)`` -- the A-tile code / scale read
    layout ``[64, 4, 2]`` (``fragments.chunk_layouts(4)``: warp w on rows 16w .. 16w+15, the
    wgmma A operand's bases), the wgmma accumulator, the query load, the cp.async layout of a
    tile's scale bytes ``[64, 8]`` and the query's shared layout (cached). ``fp8``: the
    E4M3-operand variant (``FP8``: k = 32 per wgmma, the query E4M3 ``[N, 64]`` per K half,
    K-major)."""
    cl, scl = chunk_layouts(4)
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, rows, 32 if fp8 else 16])
    if fp8:
        ql = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        b_sl = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    else:
        ql = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        b_sl = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * rows), element_bitwidth=16,
                                    rank=2)
    return cl, mma, ql, scl, b_sl
