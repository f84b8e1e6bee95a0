"""Gluon device functions the page scorers share (``mma``, ``wgflat``, ``wgmma``).

- The query as fp16 MMA operand columns in the scorers' dim order (``phys_dim``, ``load_q``).
- A tile's code groups through the table lookup (``lut.LUT_ASM``) into a trivially converted
  fp16 A operand (``group_offsets``, ``half_operands``, ``dequant_half``).
- The flat partition of "mma" / "wgflat" (``flat_work``, ``request_segment``: program p
  scores flat pages ``[p*T//P, (p+1)*T//P)`` of the batch's T scored pages).

Dim order: any permutation of the 128 dims applied to both q and K leaves every dot product
unchanged. The A tile's column c holds physical dim ``phys_dim(c)``, the order in which the
lookup's outputs land in the MMA fragment; the query is loaded in the same order.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..layout import HISTORY, PAGE
from .lut import LUT_ASM, LUT_CONSTRAINTS

_ASM = gl.constexpr(LUT_ASM)
_CONSTRAINTS = gl.constexpr(LUT_CONSTRAINTS)
_SPLIT_ASM = gl.constexpr("mov.b32 $0, $1;")  # f16x2 word -> its two halves


def chunk_layouts(warps: int) -> tuple:
    """Host side: ``(CL, SCL)`` of a code chunk on ``warps`` warps (1, 2 or 4), warp w on
    tokens 16w .. 16w + 15: the code / scale read layout ``[16 * warps, 4, 2]`` whose lane
    bases are those of the m16n8k16 A fragment (element (m, j, g'): group 2j + g' of token m;
    lanes: j, then m mod 8; registers: g', m // 8) and the cp.async layout of the scale bytes
    ``[16 * warps, 8]`` (4 bytes per lane)."""
    rows = [16 << k for k in range(warps.bit_length() - 1)]
    cl = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[r, 0, 0] for r in rows], block_bases=[], shape=[16 * warps, 4, 2])
    scl = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]],
                                     lane_bases=[[0, 4], [1, 0], [2, 0], [4, 0], [8, 0]],
                                     warp_bases=[[r, 0] for r in rows], block_bases=[],
                                     shape=[16 * warps, 8])
    return cl, scl


def phys_dim(c: int) -> int:
    """Physical dim of the A tile's column c (module doc): with c = 64g' + 32pl + 16ph + 8w +
    2j + e, dim 32j + 16g' + 8w + pl + 4ph + 2e (group 2j + g', word w, nibble
    ``lut.PAIR_NIBBLES[2ph + pl][e]``)."""
    e, j, w = c & 1, (c >> 1) & 3, (c >> 3) & 1
    ph, pl, gp = (c >> 4) & 1, (c >> 5) & 1, (c >> 6) & 1
    return 32 * j + 16 * gp + 8 * w + pl + 4 * ph + 2 * e


@gluon.jit
def load_q(q_ptr, b, q_row_stride, q_head_stride, C0: gl.constexpr, Q: gl.constexpr,
           H: gl.constexpr, N: gl.constexpr, QL: gl.constexpr):
    """Query^T columns C0 .. C0+63 of request b as fp16 (exact) ``[64, N]``: column c holds
    dim ``phys_dim(c)`` of row n = i*H + h (rows >= Q*H are zero)."""
    c = C0 + gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
    dim = (32 * ((c >> 1) & 3) + 16 * ((c >> 6) & 1) + 8 * ((c >> 3) & 1)
           + ((c >> 5) & 1) + 4 * ((c >> 4) & 1) + 2 * (c & 1))
    qb = load_q_bytes(q_ptr, b, q_row_stride, q_head_stride, dim, Q, H, N, QL, 1)
    return qb.to(gl.float8e4nv, bitcast=True).to(gl.float16)


@gluon.jit
def load_q_bytes(q_ptr, b, q_row_stride, q_head_stride, dim, Q: gl.constexpr, H: gl.constexpr,
                 N: gl.constexpr, QL: gl.constexpr, ROW_AXIS: gl.constexpr):
    """E4M3 bytes (uint8) of dims ``dim`` (along axis 1 - ROW_AXIS of ``QL``) of query rows
    n = i*H + h < N (along ``ROW_AXIS``) of request b; rows >= Q*H load zeros."""
    DIM_AXIS: gl.constexpr = 1 - ROW_AXIS
    n = gl.arange(0, N, layout=gl.SliceLayout(DIM_AXIS, QL))
    row = (b * Q + n // H).to(gl.int64)
    q_off = row * q_row_stride + (n % H) * q_head_stride
    ok = gl.expand_dims(n < Q * H, DIM_AXIS) & gl.expand_dims(dim >= 0, ROW_AXIS)
    return gl.load(q_ptr + gl.expand_dims(q_off, DIM_AXIS) + gl.expand_dims(dim, ROW_AXIS),
                   mask=ok, other=0)


@gluon.jit
def group_offsets(M: gl.constexpr, CL: gl.constexpr):
    """``(tok * 8, grp)`` [M, 4, 2] in ``CL``: element (m, j, g') is group 2j + g' of token m;
    ``tok * 8 + grp`` indexes its 8 code bytes as int64 and its scale byte past the codes."""
    m = gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
    jj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    gp = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
    m8 = gl.expand_dims(gl.expand_dims(m, 1), 2) * 8
    grp = gl.expand_dims(gl.expand_dims(jj, 0), 2) * 2 + gl.expand_dims(gl.expand_dims(gp, 0), 1)
    return m8, grp


@gluon.jit
def dequant_half(codes, s, row, A_L: gl.constexpr, M: gl.constexpr):
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


@gluon.jit
def half_operands(codes, sb, tbl_ptr):
    """Both K halves' (codes, scale bytes as int32, table entries) of a tile of groups
    ``[M, 4, 2]``; both halves' table entries (L1-resident 2 KB table) are loaded before the
    first lookup."""
    c_lo, c_hi = gl.split(codes)
    s_lo, s_hi = gl.split(sb)
    s_lo = s_lo.to(gl.int32)
    s_hi = s_hi.to(gl.int32)
    return c_lo, s_lo, gl.load(tbl_ptr + s_lo), c_hi, s_hi, gl.load(tbl_ptr + s_hi)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def scored_page_count(sl, width):
    """Scored pages of a request of seq_len ``sl`` (``wgmma``'s split count; SPEC 10 clamp):
    the last query's history pages, 0 when every row is short."""
    sl = gl.minimum(gl.maximum(sl, 0), width * PAGE)
    n = gl.maximum(sl - 1, 0) // PAGE
    return gl.where(n > HISTORY, n, 0)


@gluon.jit
def flat_work(seq_lens_ptr, num_reqs, width, pid, num_programs, BB: gl.constexpr,
              VL: gl.constexpr):
    """Program ``pid``'s share of the batch's scored pages (the flat partition,
    ``page_scores.flat_partition``): the requests' scored page counts n_b laid end to end,
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
