"""Gluon score kernel of the page-score decode family, dequant "wgmma" (SPEC 4; CUDA SM90
only; the default at 64 query rows for large batches).

Program (b, split) of grid ``(B, NUM_SPLITS)``: the query rows of request b as fp16 in shared
memory (the wgmma B operand, dims in ``fragments.phys_dim`` order, two K=64 halves), then per
history page of its split: the page's code and scale bytes loaded straight into the layout
``CL`` whose lane and warp bases are those of the wgmma A operand (each thread loads the 16-byte
code runs of its own fragment; the next page is loaded before the current one is used), per
K=64 half (groups 2j + g' of one g'): ``lut.LUT_ASM`` dequantization, a trivial
(register-renaming) conversion to the A operand layout and one ``warpgroup_mma
[128, 64] x [64, N]`` (halves keep fewer registers live: 120 instead of 142 at N = 32), then the
max over tokens, stored to ``scores[b, n, j]``. Layouts: ``layouts``.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from ..layout import HISTORY, PAGE, SCALES_OFFSET
from .fragments import dequant_half, group_offsets, half_operands, load_q


@functools.lru_cache(maxsize=None)
def layouts(rows: int, num_warps: int = 4):
    """Constexpr layouts of the Gluon kernel for N = ``rows`` query rows and 4 warps:
    ``(CL, MMA, QL, B_SL)`` -- the code-load layout whose lane / warp bases are those of the
    wgmma A operand, the MMA accumulator, the query load and the query's shared layout
    (cached: building them costs ~0.1 ms of host time)."""
    if num_warps != 4:
        raise ValueError(f"num_warps: the wgmma scorer runs one warpgroup (4), got {num_warps}")
    from triton.experimental.gluon import language as gl
    cl = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0], [64, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[128, 4, 2])
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, rows, 16])
    ql = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
    b_sl = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * rows), element_bitwidth=16,
                                rank=2)
    return cl, mma, ql, b_sl


@gluon.jit
def _load_page(cache64, cache8, bt_row, j, num_blocks, page_stride16, off64, sc_off):
    """Code groups (int64) and scale bytes of logical page j, block id clamped to the cache."""
    blk = gl.load(bt_row + j)
    blk = gl.minimum(gl.maximum(blk, 0), num_blocks - 1).to(gl.int64)
    base = blk * page_stride16 * 2  # int64 elements (page stride / 8, a multiple of 2)
    codes = gl.load(cache64 + base + off64)  # int64 [128 tok, 4 j, 2 g']
    sb = gl.load(cache8 + base * 8 + sc_off)  # uint8, same layout
    return codes, sb


@gluon.jit
def _split_pages(seq_lens_ptr, b, split, width, NUM_SPLITS: gl.constexpr):
    """``(start, end)``: pages of request b that program ``split`` scores (the Triton twins'
    ``scan.clamped_seq_len`` / ``scored_pages`` / ``split_range`` rule; SPEC 10 clamp)."""
    seq_len = gl.minimum(gl.maximum(gl.load(seq_lens_ptr + b), 0), width * PAGE)
    n_pages = gl.maximum(seq_len - 1, 0) // PAGE
    n_pages = gl.where(n_pages > HISTORY, n_pages, 0)  # only short rows: nothing to score
    per = gl.cdiv(n_pages, NUM_SPLITS)
    start = split * per
    return start, gl.minimum(start + per, n_pages)


# no value specialization of these ints: the launcher's warmup compiles what real launches run
@gluon.jit(do_not_specialize=["q_row_stride", "q_head_stride", "page_stride16", "num_blocks",
                              "bt_stride", "width"])
def wgmma_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride16,
                       num_blocks, bt_ptr, bt_stride, width, seq_lens_ptr, tbl_ptr, scores_ptr,
                       Q: gl.constexpr, H: gl.constexpr, N: gl.constexpr,
                       NUM_SPLITS: gl.constexpr, CL: gl.constexpr, MMA: gl.constexpr,
                       QL: gl.constexpr, B_SL: gl.constexpr):
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    b = gl.program_id(0)
    start, end = _split_pages(seq_lens_ptr, b, gl.program_id(1), width, NUM_SPLITS)
    if start < end:
        q_lo = gl.allocate_shared_memory(gl.float16, [64, N], B_SL, load_q(
            q_ptr, b, q_row_stride, q_head_stride, 0, Q, H, N, QL))
        q_hi = gl.allocate_shared_memory(gl.float16, [64, N], B_SL, load_q(
            q_ptr, b, q_row_stride, q_head_stride, 64, Q, H, N, QL))
        fence_async_shared()

        m8, grp = group_offsets(128, CL)  # a page's codes / scales in CL
        off64 = m8 + grp
        sc_off = SCALES_OFFSET + m8 + grp
        cache64 = cache_ptr.to(gl.pointer_type(gl.int64), bitcast=True)
        bt_row = bt_ptr + b.to(gl.int64) * bt_stride
        zero = gl.zeros([128, N], gl.float32, layout=MMA)
        # page j's score of row n: scores[b, n, j] (int32 offsets from one base)
        out_base = scores_ptr + b.to(gl.int64) * N * width
        out_off = gl.arange(0, N, layout=gl.SliceLayout(0, MMA)) * width

        codes_n, sb_n = _load_page(cache64, cache_ptr, bt_row, start, num_blocks, page_stride16,
                                   off64, sc_off)
        for j in range(start, end):
            codes = codes_n
            sb = sb_n
            codes_n, sb_n = _load_page(cache64, cache_ptr, bt_row, gl.minimum(j + 1, end - 1),
                                       num_blocks, page_stride16, off64, sc_off)
            _score_page(codes, sb, tbl_ptr, q_lo, q_hi, zero, out_base + j + out_off, A_L)


@gluon.jit
def _score_page(codes, sb, tbl_ptr, q_lo, q_hi, zero, out_ptrs, A_L: gl.constexpr):
    """One page: both K halves' lookup and MMA, the max over tokens stored at ``out_ptrs``."""
    c_lo, s_lo, r_lo, c_hi, s_hi, r_hi = half_operands(codes, sb, tbl_ptr)
    acc = warpgroup_mma(dequant_half(c_lo, s_lo, r_lo, A_L, 128), q_lo, zero, use_acc=False)
    acc = warpgroup_mma(dequant_half(c_hi, s_hi, r_hi, A_L, 128), q_hi, acc)
    gl.store(out_ptrs, gl.max(acc, axis=0))  # max.f32 skips NaN (SPEC 4)
