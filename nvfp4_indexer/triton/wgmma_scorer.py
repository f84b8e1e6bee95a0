"""Gluon score kernel of the wgmma decode path (``decode_wgmma``, SPEC 4; CUDA SM90 only).

Program (b, split) of grid ``(B, NUM_SPLITS)``: the query rows of request b as fp16 in shared
memory (the wgmma B operand, dims in ``decode_wgmma.phys_dim`` order, two K=64 halves), then per
history page of its split: the page's code and scale bytes loaded straight into the layout
``CL`` whose lane and warp bases are those of the wgmma A operand (each thread loads the 16-byte
code runs of its own fragment; the next page is loaded before the current one is used), per
K=64 half (groups 2j + g' of one g'): ``lut.LUT_ASM`` dequantization, a trivial
(register-renaming) conversion to the A operand layout and one ``warpgroup_mma
[128, 64] x [64, N]`` (halves keep fewer registers live: 120 instead of 142 at N = 32), then the
max over tokens, stored to ``scores[b, n, j]``. Layouts come from ``decode_wgmma.gluon_layouts``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .layout import HISTORY, PAGE, SCALES_OFFSET
from .lut import LUT_ASM, LUT_CONSTRAINTS

_ASM = gl.constexpr(LUT_ASM)
_CONSTRAINTS = gl.constexpr(LUT_CONSTRAINTS)
_SPLIT_ASM = gl.constexpr("mov.b32 $0, $1;")  # f16x2 word -> its two halves


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
def _load_q(q_ptr, b, q_row_stride, q_head_stride, C0: gl.constexpr, Q: gl.constexpr,
            H: gl.constexpr, N: gl.constexpr, QL: gl.constexpr):
    """Query^T columns C0 .. C0+63 of request b as fp16 (exact) ``[64, N]``: column c holds
    dim ``phys_dim(c)`` of row n = i*H + h (rows >= Q*H are zero)."""
    c = C0 + gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
    dim = (32 * ((c >> 1) & 3) + 16 * ((c >> 6) & 1) + 8 * ((c >> 3) & 1)
           + ((c >> 5) & 1) + 4 * ((c >> 4) & 1) + 2 * (c & 1))
    n = gl.arange(0, N, layout=gl.SliceLayout(0, QL))
    row = (b * Q + n // H).to(gl.int64)
    q_off = row * q_row_stride + (n % H) * q_head_stride
    ok = gl.expand_dims(n < Q * H, 0) & gl.expand_dims(dim >= 0, 1)
    qb = gl.load(q_ptr + gl.expand_dims(q_off, 0) + gl.expand_dims(dim, 1), mask=ok, other=0)
    return qb.to(gl.float8e4nv, bitcast=True).to(gl.float16)


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


@gluon.jit
def _group_offsets(M: gl.constexpr, CL: gl.constexpr):
    """``(tok * 8, grp)`` [M, 4, 2] in ``CL``: element (m, j, g') is group 2j + g' of token m;
    ``tok * 8 + grp`` indexes its 8 code bytes as int64 and its scale byte past the codes."""
    m = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
    jj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    gp = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
    m8 = gl.expand_dims(gl.expand_dims(m, 1), 2) * 8
    grp = gl.expand_dims(gl.expand_dims(jj, 0), 2) * 2 + gl.expand_dims(gl.expand_dims(gp, 0), 1)
    return m8, grp


@gluon.jit
def _dequant_half(codes, s, row, A_L: gl.constexpr, M: gl.constexpr):
    """fp16 A operand [M tokens, 64 columns] of one half page: the groups 2j + g' of one g'
    (``codes`` int64 [M, 4], ``s`` their scale bytes as int32, ``row`` their table entries);
    column c' = 32pl + 16ph + 8w + 2j + e holds dim ``phys_dim(64 g' + c')`` (output pair
    p = 2ph + pl of word w, half e)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
        _ASM, _CONSTRAINTS, [codes, row, s],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True, pack=1)
    x = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)),
                gl.join(gl.join(o4, o5), gl.join(o6, o7)))  # [m, j, pl, ph, w]
    y = gl.join(x, x)
    f = gl.inline_asm_elementwise(_SPLIT_ASM, "=r,r,r", [y], dtype=gl.float16, is_pure=True,
                                  pack=2)  # [m, j, pl, ph, w, e]
    f = gl.permute(f, [0, 2, 3, 4, 1, 5])  # [m, pl, ph, w, j, e]
    tile = gl.reshape(f, [M, 64])
    return gl.convert_layout(tile, A_L, assert_trivial=True)  # register renaming only


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
        q_lo = gl.allocate_shared_memory(gl.float16, [64, N], B_SL, _load_q(
            q_ptr, b, q_row_stride, q_head_stride, 0, Q, H, N, QL))
        q_hi = gl.allocate_shared_memory(gl.float16, [64, N], B_SL, _load_q(
            q_ptr, b, q_row_stride, q_head_stride, 64, Q, H, N, QL))
        fence_async_shared()

        m8, grp = _group_offsets(128, CL)  # a page's codes / scales in CL
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
def _half_operands(codes, sb, tbl_ptr):
    """Both K halves' (codes, scale bytes as int32, table entries) of a tile of groups
    ``[M, 4, 2]``; both halves' table entries (L1-resident 2 KB table) are loaded before the
    first lookup."""
    c_lo, c_hi = gl.split(codes)
    s_lo, s_hi = gl.split(sb)
    s_lo = s_lo.to(gl.int32)
    s_hi = s_hi.to(gl.int32)
    return c_lo, s_lo, gl.load(tbl_ptr + s_lo), c_hi, s_hi, gl.load(tbl_ptr + s_hi)


@gluon.jit
def _score_page(codes, sb, tbl_ptr, q_lo, q_hi, zero, out_ptrs, A_L: gl.constexpr):
    """One page: both K halves' lookup and MMA, the max over tokens stored at ``out_ptrs``."""
    c_lo, s_lo, r_lo, c_hi, s_hi, r_hi = _half_operands(codes, sb, tbl_ptr)
    acc = warpgroup_mma(_dequant_half(c_lo, s_lo, r_lo, A_L, 128), q_lo, zero, use_acc=False)
    acc = warpgroup_mma(_dequant_half(c_hi, s_hi, r_hi, A_L, 128), q_hi, acc)
    gl.store(out_ptrs, gl.max(acc, axis=0))  # max.f32 skips NaN (SPEC 4)
