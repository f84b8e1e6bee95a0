"""Gluon prefill score kernel, warp-specialized (SPEC 4, 5, 7; CUDA SM90 only).

Same grid, arguments, scratch and results as the Triton ``prefill._prefill_score_kernel`` with
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
inexact (SPEC 9 b = 5), 1.2-1.3x faster on long chunks (docs/benchmarks.md, issue 15,
thirteenth step). Its wait deps are the accumulator tokens only (Triton 3.6 cannot lower
8-bit deps; ptxas keeps an in-flight wgmma's register operands intact).

``prefill_wgmma_direct_kernel`` (opt-in: ``PrefillConfig(direct=True)``, off by default,
``heuristics.PREFILL_DIRECT``) is the same program with another converter
(``_converter_direct``): it reads each page's NVFP4 codes and scales straight from the paged
cache through the block table and writes the fp16 of dequant_e4m3 (a table lookup,
``lut.lut_table``'s formula, or the arithmetic of ``ptx.DEQUANT_E4M3_BYTES_PTX``): the
workspace's values, so the same products and lists, with no gather and no workspace. Its
converter loop is 507 (lookup) / 686 (arithmetic) SASS instructions per page against 275; on
the H200 that converter (one warp per scheduler) falls behind the consumers: the kernel is
1.22-1.24x (lookup) / 1.33-1.37x (arithmetic) slower, while removing the workspace kernel's
conversion altogether gains 0-7 % (docs/benchmarks.md, issue 15, eighth step). Its
plain-Triton twin is ``prefill._prefill_direct_score_kernel``.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma,
                                                              warpgroup_mma_wait)

from .layout import (CODE_BYTES, GROUPS, HEAD, HISTORY, PAGE, SCALES_OFFSET, TOPK, WS_PAGE,
                     scored_pages, split_range, ws_page_offset)
from .scan import block_rows_info, out_offsets, score_row_block
from .topk import EMPTY, candidate_id, pack_candidate

NUM_BUFFERS = 6  # fp16 page buffers of the ring (docs/benchmarks.md: 6 >= 4 > 3)
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
def _staged(raw, WS16: gl.constexpr, FP8: gl.constexpr):
    """A page half as the ring holds it: fp16 of the E4M3 bytes ``raw``; the bytes themselves
    (``FP8``: an E4M3 ring) or (``WS16``) fp16 values already."""
    if WS16:
        return raw
    elif FP8:
        return raw.to(gl.float8e4nv, bitcast=True)
    else:
        return _as_f16(raw)


@gluon.jit
def _converter(ws_page0, start, end, k_smem, full, empty, LD: gl.constexpr,
               NB: gl.constexpr, WS16: gl.constexpr, FP8: gl.constexpr):
    """Converter partition (4 warps): page ``start + kk``'s E4M3 bytes widened to fp16 into
    buffer kk % NB once both consumers released it (``empty``), then ``full`` arrived.
    WS16 (lab): the workspace holds fp16 values already (copied, not converted). FP8: the
    bytes are copied as they are (an E4M3 ring)."""
    if end > start:
        if WS16:
            L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        else:
            L: gl.constexpr = LD
        tok = gl.arange(0, HALF, layout=gl.SliceLayout(1, L)).to(gl.int64) * HEAD
        all_tok = tok >= 0
        lo = _load_tile(ws_page0 + ws_page_offset(start), tok, all_tok, L)
        for kk in range(0, end - start):
            i = kk % NB
            page = ws_page0 + ws_page_offset(start + kk)
            hi = _load_tile(page + HALF * HEAD, tok, all_tok, L)
            mbarrier.wait(empty.index(i), ((kk // NB) & 1) ^ 1)
            buf = k_smem.index(i)
            buf.slice(0, HALF).store(_staged(lo, WS16, FP8))
            nxt = ws_page0 + ws_page_offset(gl.minimum(start + kk + 1, end - 1))
            lo = _load_tile(nxt, tok, all_tok, L)
            buf.slice(HALF, HALF).store(_staged(hi, WS16, FP8))
            fence_async_shared()
            mbarrier.arrive(full.index(i))


# Direct converter (``prefill_wgmma_direct_kernel``): one asm call per uint32 word of 4 code
# bytes (8 dims) of a group; outputs $0..$3: f16x2 of (low nibble, high nibble) of code byte
# 0..3, i.e. dims 2b, 2b + 1 in memory order, the fp16 of dequant_e4m3 (SPEC 1.4).
#
# "arith": ``ptx.DEQUANT_E4M3_BYTES_PTX``'s steps up to its NaN fix, then each E4M3 byte pair
# widened back to f16x2. $4: the code word, $5: the group's scale byte in bits 0..7 and 8..15.
_F16X2_ARITH_PTX = gl.constexpr("""{
.reg .b32 w4, x0, x1, x2, x3, k14, s, r0, r1, n0, n1;
.reg .b16 e0, e1, e2, e3, sb;
mov.b32 k14, 0x74007400;
shl.b32 w4, $4, 4;
prmt.b32 x0, w4, $4, 0xC480;
prmt.b32 x1, w4, $4, 0xD591;
prmt.b32 x2, w4, $4, 0xE6A2;
prmt.b32 x3, w4, $4, 0xF7B3;
shl.b32 x0, x0, 5;
shl.b32 x1, x1, 5;
shl.b32 x2, x2, 5;
shl.b32 x3, x3, 5;
and.b32 x0, x0, 0x8E008E00;
and.b32 x1, x1, 0x8E008E00;
and.b32 x2, x2, 0x8E008E00;
and.b32 x3, x3, 0x8E008E00;
mul.rn.f16x2 x0, x0, k14;
mul.rn.f16x2 x1, x1, k14;
mul.rn.f16x2 x2, x2, k14;
mul.rn.f16x2 x3, x3, k14;
cvt.u16.u32 sb, $5;
cvt.rn.f16x2.e4m3x2 s, sb;
mul.rn.f16x2 x0, x0, s;
mul.rn.f16x2 x1, x1, s;
mul.rn.f16x2 x2, x2, s;
mul.rn.f16x2 x3, x3, s;
cvt.rn.satfinite.e4m3x2.f16x2 e0, x0;
cvt.rn.satfinite.e4m3x2.f16x2 e1, x1;
cvt.rn.satfinite.e4m3x2.f16x2 e2, x2;
cvt.rn.satfinite.e4m3x2.f16x2 e3, x3;
mov.b32 r0, {e0, e1};
mov.b32 r1, {e2, e3};
and.b32 n0, r0, 0x7F7F7F7F;
and.b32 n1, r1, 0x7F7F7F7F;
add.u32 n0, n0, 0x01010101;
add.u32 n1, n1, 0x01010101;
lop3.b32 r0, r0, n0, 0x80808080, 0x70;
lop3.b32 r1, r1, n1, 0x80808080, 0x70;
mov.b32 {e0, e1}, r0;
mov.b32 {e2, e3}, r1;
cvt.rn.f16x2.e4m3x2 $0, e0;
cvt.rn.f16x2.e4m3x2 $1, e1;
cvt.rn.f16x2.e4m3x2 $2, e2;
cvt.rn.f16x2.e4m3x2 $3, e3;
}""")

# "lut": ``lut.lut_table``'s formula, fp16 bits = (T[s][c & 7] << 7) | (sign(c) ^ sign(s)) << 15.
# $4: the code word, $5 / $6: the low / high word of the table row of the group's scale byte,
# $7: 0x88888888 for a negative scale (flips the code signs), else 0. Two byte permutes look
# up the 8 magnitudes; per output pair one permute spreads two of them to bytes 0 and 2, a
# shift moves them to fp16 bits 7..14, and one permute + lop3 put the two signs on bits 15, 31
# (the low nibble's sign is bit 7 of the code byte shifted left by 4).
_LUT_PAIR = """prmt.b32 t, {mags}, z, {spread};
shl.b32 t, t, 7;
prmt.b32 g, v, v4, {signs};
lop3.b32 ${out}, t, g, 0x80008000, 0xF8;
"""
_F16X2_LUT_PTX = gl.constexpr("""{
.reg .b32 v, v4, m, ma, mb, z, t, g;
xor.b32 v, $4, $7;
shl.b32 v4, v, 4;
and.b32 m, v, 0x77777777;
prmt.b32 ma, $5, $6, m;
shr.u32 m, m, 16;
prmt.b32 mb, $5, $6, m;
mov.b32 z, 0;
""" + "".join(_LUT_PAIR.format(out=b, mags="ma" if b < 2 else "mb",
                               spread="0x5140" if b % 2 == 0 else "0x5342",
                               signs=f"0x{b}{b}{b + 4}{b}" if b else "0x0040")
              for b in range(4)) + "}")


@gluon.jit
def _load_nvfp4_half(page, code_off, scale_off):
    """Code words ``[64, 8, 2]`` (uint32) and scale bytes ``[64, 8]`` of one half page."""
    return gl.load(page.to(gl.pointer_type(gl.uint32), bitcast=True) + code_off), \
        gl.load(page + scale_off)


@gluon.jit
def _f16x2_words(words, scales, tbl_ptr, CONV: gl.constexpr):
    """int32 ``[64, 64]``: f16x2 of dims (2b, 2b + 1) of code byte b of each token."""
    if CONV == "lut":
        row = gl.load(tbl_ptr + scales)  # int64 table row of each (token, group)
        lo = gl.expand_dims(row.to(gl.uint32), 2) + gl.zeros_like(words)
        hi = gl.expand_dims((row >> 32).to(gl.uint32), 2) + gl.zeros_like(words)
        neg = gl.expand_dims((scales.to(gl.uint32) >> 7) * 0x88888888, 2) + gl.zeros_like(words)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _F16X2_LUT_PTX, "=r,=r,=r,=r,r,r,r,r", [words, lo, hi, neg],
            dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True, pack=1)
    else:
        s = gl.expand_dims(scales.to(gl.uint32) * 0x101, 2) + gl.zeros_like(words)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _F16X2_ARITH_PTX, "=r,=r,=r,=r,r,r", [words, s],
            dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True, pack=1)
    # [64, 8 groups, 2 words, 4 bytes] -> [64, 64]: byte j = 2 i + k of join(join(o0, o2),
    # join(o1, o3))[..., i, k]
    x = gl.join(gl.join(o0, o2), gl.join(o1, o3))
    return gl.reshape(x, [HALF, HEAD // 2]).to(gl.int32, bitcast=True)


@gluon.jit
def _converter_direct(cache_ptr, page_stride, cache_blocks, bt_row, tbl_ptr, start, end,
                      k_smem, full, empty, NB: gl.constexpr, CONV: gl.constexpr):
    """The converter of ``prefill_wgmma_direct_kernel``: page ``start + kk`` read from the
    cache (block ``bt_row[start + kk]``, clamped to ``[0, cache_blocks)``: SPEC 10),
    dequantized to fp16 into buffer kk % NB."""
    if end > start:
        # 16 code bytes (two groups, four words) and their two scale bytes per thread and token
        CL: gl.constexpr = gl.BlockedLayout([1, 2, 2], [8, 4, 1], [4, 1, 1], [2, 1, 0])
        SL: gl.constexpr = gl.SliceLayout(2, CL)
        W_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32,
                                                  rank=2)
        t = gl.arange(0, HALF, layout=gl.SliceLayout(1, SL))
        g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, SL))
        w = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
        scale_off = SCALES_OFFSET + gl.expand_dims(t, 1) * GROUPS + gl.expand_dims(g, 0)
        code_off = gl.expand_dims(gl.expand_dims(t, 1) * (CODE_BYTES // 4) +
                                  gl.expand_dims(g, 0) * 2, 2) + \
            gl.expand_dims(gl.expand_dims(w, 0), 1)  # in words
        hi_c_off = code_off + HALF * (CODE_BYTES // 4)
        hi_s_off = scale_off + HALF * GROUPS
        blk = gl.minimum(gl.maximum(gl.load(bt_row + start), 0), cache_blocks - 1)
        page = cache_ptr + gl.multiple_of(blk.to(gl.int64) * page_stride, 16)
        lo_c, lo_s = _load_nvfp4_half(page, code_off, scale_off)
        for kk in range(0, end - start):
            i = kk % NB
            hi_c, hi_s = _load_nvfp4_half(page, hi_c_off, hi_s_off)
            nxt = gl.load(bt_row + gl.minimum(start + kk + 1, end - 1))
            nxt = gl.minimum(gl.maximum(nxt, 0), cache_blocks - 1).to(gl.int64)
            mbarrier.wait(empty.index(i), ((kk // NB) & 1) ^ 1)
            buf = k_smem.index(i)._reinterpret(gl.int32, [PAGE, HEAD // 2], W_SL)
            buf.slice(0, HALF).store(_f16x2_words(lo_c, lo_s, tbl_ptr, CONV))
            page = cache_ptr + gl.multiple_of(nxt * page_stride, 16)
            lo_c, lo_s = _load_nvfp4_half(page, code_off, scale_off)
            buf.slice(HALF, HALF).store(_f16x2_words(hi_c, hi_s, tbl_ptr, CONV))
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
def _epilogue(acc, j, top, local, TL: gl.constexpr, SOL: gl.constexpr):
    """Page j's candidates into ``top``: the max over the tokens of ``acc`` (NaN-skipping:
    ``max.f32``; NaN when all are NaN, SPEC 4), a candidate of the rows whose local page lies
    past j. ``SOL`` 1 (the lab's speed-of-light variant) replaces the insert by an
    elementwise max (wrong lists, the same MMAs and maxima)."""
    score = gl.convert_layout(gl.max(acc, axis=1), gl.SliceLayout(1, TL), assert_trivial=True)
    cand = gl.where(j < local, pack_candidate(score, j + 0 * local), EMPTY)
    if SOL == 0:
        top = _insert_distinct(top, cand)
    else:
        top = gl.maximum(top, gl.expand_dims(cand, 1))
    return top


@gluon.jit
def _step(kk, dead, pending, q_op, k_smem, full, empty, start, top, local,
          TL: gl.constexpr, SOL: gl.constexpr, NB: gl.constexpr):
    """Consumer step kk: wait for buffer kk % NB, issue page start + kk's MMA into ``dead``,
    wait for page kk - 1's (``pending``), release its buffer, run its epilogue."""
    i = kk % NB
    mbarrier.wait(full.index(i), (kk // NB) & 1)
    issued = warpgroup_mma(q_op, k_smem.index(i).permute((1, 0)), dead, use_acc=False,
                           is_async=True)
    done = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))
    mbarrier.arrive(empty.index((kk - 1) % NB))
    top = _epilogue(done, start + kk - 1, top, local, TL, SOL)
    return issued, done, top


@gluon.jit
def _consumer(c: gl.constexpr, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr,
              caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem, full,
              empty, H: gl.constexpr, NUM_SPLITS: gl.constexpr, MMA: gl.constexpr,
              TL: gl.constexpr, SOL: gl.constexpr, NB: gl.constexpr, FP8: gl.constexpr):
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
                       0, FP8)
        b = gl.zeros([HALF, PAGE], gl.float32, MMA)
        mbarrier.wait(full.index(0), 0)
        a = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), b, use_acc=False,
                          is_async=True)
        for kk in range(1, npg - 1, 2):
            b, a, top = _step(kk, b, a, q_op, k_smem, full, empty, start, top, local, TL,
                              SOL, NB)
            a, b, top = _step(kk + 1, a, b, q_op, k_smem, full, empty, start, top, local, TL,
                              SOL, NB)
        # the last page's epilogue reads the accumulator its wait returns: copying an
        # in-flight accumulator (``a = last``) made ptxas serialize every wgmma (C7514)
        if npg % 2 == 0:  # page end - 1 is left
            last, _d, top = _step(npg - 1, b, a, q_op, k_smem, full, empty, start, top, local,
                                  TL, SOL, NB)
            top = _epilogue(warpgroup_mma_wait(num_outstanding=0, deps=(last,)), end - 1, top,
                            local, TL, SOL)
        else:
            top = _epilogue(warpgroup_mma_wait(num_outstanding=0, deps=(a,)), end - 1, top,
                            local, TL, SOL)
    top = gl.where(top < EMPTY + TOPK, EMPTY, top)
    if NUM_SPLITS == 1:
        _write_selection(top, local, out_offsets(token, h, H), out_ptr, row_ok, slot)
    else:
        cand_rows = (blk * (2 * HALF) + rows_t).to(gl.int64)
        ptrs = cand_ptr + gl.expand_dims(cand_rows, 1) * (NUM_SPLITS * TOPK) + split * TOPK
        gl.store(ptrs + slot, top)


@gluon.jit
def _program(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base, qsl_ptr,
             seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, cache_ptr,
             page_stride, cache_blocks, bt_ptr, bt_row_stride, tbl_ptr, H: gl.constexpr,
             BLOCK_M: gl.constexpr, NUM_SPLITS: gl.constexpr, MMA: gl.constexpr, LD: gl.constexpr,
             TL: gl.constexpr, K_SL: gl.constexpr, NB: gl.constexpr, SOL: gl.constexpr,
             DIRECT: gl.constexpr, CONV: gl.constexpr, WS16: gl.constexpr,
             FP8: gl.constexpr):
    """One program of either kernel: pages from the FP8 workspace (DIRECT 0) or straight from
    the paged NVFP4 cache through the block table (DIRECT 1)."""
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
    # partitions get scalars and shared memory only (tensors stay in the default partition;
    # a partition's function, or a tuple holding its layout arguments, cannot be bound to a
    # variable in Gluon 3.6: one call per converter)
    if DIRECT:
        bt_row = bt_ptr + (r - req_base).to(gl.int64) * bt_row_stride
        gl.warp_specialize([
            (_consumer, (0, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr,
                         caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem,
                         full, empty, H, NUM_SPLITS, MMA, TL, SOL, NB, FP8)),
            (_consumer, (1, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr,
                         caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem,
                         full, empty, H, NUM_SPLITS, MMA, TL, SOL, NB, FP8)),
            (_converter_direct, (cache_ptr, page_stride, cache_blocks, bt_row, tbl_ptr, start,
                                 end, k_smem, full, empty, NB, CONV))],
            [4, 4], [CONSUMER_REGS, CONVERTER_REGS])
    else:
        ws_page0 = ws_ptr + gl.load(ws_off_ptr + (r - req_base)).to(gl.int64) * WS_PAGE
        gl.warp_specialize([
            (_consumer, (0, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr,
                         caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem,
                         full, empty, H, NUM_SPLITS, MMA, TL, SOL, NB, FP8)),
            (_consumer, (1, q_ptr, q_tok_stride, q_head_stride, qsl_ptr, seq_lens_ptr,
                         caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, start, end, k_smem,
                         full, empty, H, NUM_SPLITS, MMA, TL, SOL, NB, FP8)),
            (_converter, (ws_page0, start, end, k_smem, full, empty, LD, NB, WS16, FP8))],
            [4, 4], [CONSUMER_REGS, CONVERTER_REGS])


# the same runtime arguments (and value specializations) as the Triton twin
@gluon.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "req_base", "num_blocks"],
           do_not_specialize_on_alignment=["seq_lens_ptr", "caps_ptr"])
def prefill_wgmma_kernel(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base,
                         qsl_ptr, seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr,
                         win_ptr, out_ptr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                         NUM_SPLITS: gl.constexpr, MMA: gl.constexpr, LD: gl.constexpr,
                         TL: gl.constexpr, K_SL: gl.constexpr,
                         NB: gl.constexpr = NUM_BUFFERS, SOL: gl.constexpr = 0,
                         WS16: gl.constexpr = 0, FP8: gl.constexpr = 0):
    """Prefill score program ``(x, split)`` of grid ``(num_blocks, NUM_SPLITS)``: row block
    ``num_blocks - 1 - x`` (``scan.score_row_block``; SPEC 4, 5, 7), BLOCK_M 128, launched
    with ``launch_options()`` (4 warps; the partitions add 8).

    Arguments as ``prefill._prefill_score_kernel``'s: ``q_ptr`` E4M3 query bytes (uint8) with
    token / head strides in bytes; ``ws_ptr`` the FP8 workspace ``[P, 128, 128]`` (bytes) and
    ``ws_off_ptr`` int32 each request's first workspace page (indexed by request - req_base);
    ``qsl_ptr`` int32 cu_seqlens_q, ``seq_lens_ptr`` / ``caps_ptr`` int32 device / planned seq
    lens; ``blk_ptr`` int32 ``[2, num_blocks]`` (request, first row); ``cand_ptr`` int64
    candidates ``[num_blocks * BLOCK_M, NUM_SPLITS, 16]`` (NUM_SPLITS > 1), ``out_ptr`` int32
    ``[Tp, H, 16]`` (NUM_SPLITS == 1); ``win_ptr`` is not read (no window). The caller
    guarantees KEEP == 16 (more than 8 pages per split), dot fp16 (or, with ``FP8`` and
    ``launch_options(fp8=True)``, dot "fp8": E4M3 operands on the FP8 tensor cores, SPEC 9
    b = 5) with tokens on N, and a CUDA SM90 device (``heuristics.prefill_launch``). Lab knobs:
    ``NB`` (ring buffers, >= 2),
    ``SOL`` (1: no top-k inserts, wrong lists) and ``WS16`` (1: ``ws_ptr`` is an fp16 copy of
    the workspace, moved to shared memory without conversion: the converter's ALU cost)."""
    gl.static_assert(BLOCK_M == 2 * HALF, "the Gluon prefill kernel takes BLOCK_M 128")
    # one buffer deadlocks: page k - 1's buffer is released only after page k's full wait
    gl.static_assert(NB >= 2, "the Gluon prefill kernel needs NB >= 2 ring buffers")
    gl.static_assert((WS16 == 0) or (FP8 == 0), "WS16 is a lab knob of the fp16 kernel")
    _program(q_ptr, q_tok_stride, q_head_stride, ws_ptr, ws_off_ptr, req_base, qsl_ptr,
             seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, None, 0, 0, None,
             0, None, H, BLOCK_M, NUM_SPLITS, MMA, LD, TL, K_SL, NB, SOL, 0, "", WS16, FP8)


@gluon.jit(do_not_specialize=["q_tok_stride", "q_head_stride", "req_base", "num_blocks",
                              "page_stride", "cache_blocks", "bt_row_stride"],
           do_not_specialize_on_alignment=["seq_lens_ptr", "caps_ptr", "bt_ptr"])
def prefill_wgmma_direct_kernel(q_ptr, q_tok_stride, q_head_stride, cache_ptr, page_stride,
                                cache_blocks, bt_ptr, bt_row_stride, tbl_ptr, req_base, qsl_ptr,
                                seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr,
                                H: gl.constexpr, BLOCK_M: gl.constexpr,
                                NUM_SPLITS: gl.constexpr, MMA: gl.constexpr,
                                LD: gl.constexpr, TL: gl.constexpr, K_SL: gl.constexpr,
                                NB: gl.constexpr = NUM_BUFFERS, SOL: gl.constexpr = 0,
                                CONV: gl.constexpr = "lut"):
    """``prefill_wgmma_kernel`` without the workspace (SPEC 4, 5, 7, 10; opt-in:
    ``PrefillConfig(direct=True)`` in ``prefill_indexer``, ``heuristics.PREFILL_DIRECT`` for
    the Indexer): the converter reads request r's page j straight from the paged cache
    ``cache_ptr`` (uint8 ``[cache_blocks, 128, 72]``, page stride ``page_stride`` bytes, SPEC 2
    layout: 64 code bytes per token, then 8 scale bytes per token from byte 8192), block
    ``bt_ptr[(r - req_base) * bt_row_stride + j]`` (int32 block table rows of the launch's
    requests, row stride in elements; ids clamped to ``[0, cache_blocks)``, SPEC 10), and
    writes the fp16 of dequant_e4m3 (SPEC 1.4): the workspace's values widened, so the same
    products, scores and lists as gather + ``prefill_wgmma_kernel``. The other arguments
    (query, row blocks, seq lens, ``cand_ptr`` / ``out_ptr``) as that kernel's. ``CONV``:
    "lut" (the table ``tbl_ptr``, int64 ``lut.lut_table()``, the library's) or "arith" (a lab
    knob: ``tbl_ptr`` not read). The cache base and ``page_stride`` must be 16-byte aligned
    (``heuristics.prefill_direct_ok``: the callers check). Twin:
    ``prefill._prefill_direct_score_kernel``."""
    gl.static_assert(BLOCK_M == 2 * HALF, "the Gluon prefill kernel takes BLOCK_M 128")
    gl.static_assert(NB >= 2, "the Gluon prefill kernel needs NB >= 2 ring buffers")
    _program(q_ptr, q_tok_stride, q_head_stride, None, None, req_base, qsl_ptr,
             seq_lens_ptr, caps_ptr, blk_ptr, num_blocks, cand_ptr, out_ptr, cache_ptr,
             page_stride, cache_blocks, bt_ptr, bt_row_stride, tbl_ptr, H, BLOCK_M, NUM_SPLITS,
             MMA, LD, TL, K_SL, NB, SOL, 1, CONV, 0, 0)
