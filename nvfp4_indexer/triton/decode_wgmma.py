"""Decode indexer with Gluon page scoring (SPEC 4-6): the Hopper fast path.

Two launches per run:

1. Score kernel: "wgmma" on grid ``(B, NUM_SPLITS)`` (``heuristics.choose_num_splits``);
   "mma", "wgflat" and the "lut" twin on a flat grid of P programs (``flat_partition``: the batch's
   scored pages end to end, equal shares; ``heuristics.page_score_programs``).
   A program scores its share of request b's history pages ``j < n`` for the request's
   ``N`` query rows (row n = i*H + h; N = ``heuristics.block_rows``) and writes the fp32 page
   scores to ``scores[b, n, j]`` (scratch ``[B, N, W]``). Three Gluon scorers, all with
   table-lookup dequantization in registers (``lut.LUT_ASM``, bit-exact SPEC 1.4) feeding
   fp16 MMA operands directly (fp32 accumulation: the error bound of dot mode "fp16", SPEC 9
   b = 15) and a NaN-skipping max over tokens:

   - "mma" (``mma_scorer``, the default at <= 32 rows): one warp per program, raw 16-token
     chunks streamed through a shared-memory ring by cp.async, ``mma.sync`` m16n8k16 against
     the query held in registers, no barrier between warps.
   - "wgflat" (``wgflat_scorer``, the default at 32 rows for large batches): one
     warpgroup per program on the same flat grid, one page per warp: each warp fills its 16
     rows of a [64 tokens, 128] wgmma A tile from its own page (chunks through a cp.async
     ring), one ``warpgroup_mma`` per K half against the query in shared memory, the max
     over a page's tokens inside its warp.
   - "wgmma" (``wgmma_scorer``, 64 rows): one warpgroup per program, 9 KB of raw bytes per
     page loaded straight into the wgmma A-operand layout (one page ahead), one
     ``warpgroup_mma [128 tokens, 128] x [128, N]`` against the query in shared memory.
2. Select kernel (``select_launch``): SPEC 5's output from each row's page scores ``j < L``.
   Three kernels, the same output:

   - on the Gluon paths ("mma", "wgflat", "wgmma") with W <= ``SELECT_REDUX_MAX_WIDTH``,
     ``redux_select`` (Gluon): the row's scores in one warp's registers as int32 keys, each of
     the 15 rounds two warp reductions (``redux.sync``: the largest key, then the smallest
     page id holding it); up to ``SELECT_SPLIT_MAX_WIDTH``, for at most
     ``SELECT_SPLIT_MAX_ROWS`` rows, its split form (S warps per row, each keeps its slice's
     best 15, then the rounds again on the kept entries);
   - else, for at most ``SELECT_WIDE_MAX_ROWS`` rows and W <= ``SELECT_WIDE_MAX_WIDTH``,
     ``_select_wide_kernel`` (plain Triton, the interpreter too): the row's packed int64
     candidates (``topk.pack_candidate``) in registers on up to 8 warps, 15 ``tl.max``
     rounds;
   - else ``_select_kernel`` (plain Triton): one pass keeps the largest packed candidate of
     each residue class ``j % 16``; then 15 rounds each take the largest class maximum and
     replace it by the next candidate of that class (a reload of ~L/16 scores).

   Short rows by formula, padding rows per SPEC 5.

Dim order: any permutation of the 128 dims applied to both q and K leaves every dot product
unchanged. The A tile's column c holds physical dim ``phys_dim(c)``, the order in which the
lookup's outputs land in the MMA fragment; the query is loaded in the same order.

The plain-Triton twin of both scorers (``DEQUANT="lut"``: ``_portable_score_kernel``, the
interpreter and any GPU) has the same grid, scratch and select kernel; it dequantizes with
``lut.lut_dequant_portable`` and scores with an fp32 dot (dot mode "fp32", b = 16). The CPU tests run it; the GPU tests
compare the Gluon kernels against the reference.

SPEC 10: every score kernel clamps ``seq_len`` to ``[0, W * 128]`` (no page past the block-table row is
read, no id >= W is written) and block ids to ``[0, num_blocks)``. Nothing depends on host
values of the metadata; every scratch element a select program reads was written by the same
run, so CUDA-graph replays after in-place metadata changes give fresh results.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .layout import (CODE_BYTES, GROUPS, HEAD, HISTORY, PAGE, SCALES_OFFSET, local_page,
                     num_history_pages, scored_pages)
from .lut import lut_dequant_portable, lut_table, lut_table_e4m3
from .numerics import e4m3_decode
from .scan import clamped_seq_len
from .scoring import page_max
from .topk import EMPTY, candidate_id, pack_candidate

SELECT_CHUNK = 1024  # pages per step of a select program's first pass
SELECT_GROUP = 128  # pages of one residue class a select round reloads per step
SELECT_WARPS = 1  # one warp per row: each selection round stays inside the warp
WGFLAT_LAB_STAGES = None  # labs only: the wgflat scorer's ring slots / ASYNC (None: defaults)
WGFLAT_LAB_ASYNC = None
MMA_LAB = 0  # labs only: the "mma" scorer's speed-of-light variant (``mma_scorer`` LAB)
# the wide select (a row's keys in registers on several warps, 15 register-only rounds) for
# batches of at most this many rows B * Q * H, W up to SELECT_WIDE_MAX_WIDTH: few rows do not
# fill the GPU with one-warp programs, whose rounds each wait on a reload
SELECT_WIDE_MAX_ROWS = 512
SELECT_WIDE_MAX_WIDTH = 8192
# the Gluon select (``redux_select``: a row's keys in one warp's registers, two warp
# reductions per round) on the GPU page-score paths for block tables up to this width
SELECT_REDUX_MAX_WIDTH = 512
# wider block tables up to this width, for at most SELECT_SPLIT_MAX_ROWS rows: its split form
# (``redux_select_split_kernel``: S warps per row, each the 15 rounds on its slice of
# <= 32 * K pages, then the 15 rounds on the row's S * 32 kept entries; more rows fill the
# GPU with the one-warp residue-class select, which measured faster from 2048 rows)
SELECT_SPLIT_MAX_WIDTH = 8192  # at most 8 * 32 * 32: S = 8 warps of K <= 32 keys per lane
SELECT_SPLIT_MAX_ROWS = 1024
SELECT_SPLIT_KEYS = 16  # keys per lane of a split warp while S = 4 (W <= 2048; then S = 8)


def phys_dim(c: int) -> int:
    """Physical dim of the A tile's column c (see module doc): with c = 64g' + 32pl + 16ph +
    8w + 2j + e, dim 32j + 16g' + 8w + pl + 4ph + 2e (group 2j + g', word w, nibble
    ``lut.PAIR_NIBBLES[2ph + pl][e]``)."""
    e, j, w = c & 1, (c >> 1) & 3, (c >> 3) & 1
    ph, pl, gp = (c >> 4) & 1, (c >> 5) & 1, (c >> 6) & 1
    return 32 * j + 16 * gp + 8 * w + pl + 4 * ph + 2 * e


@functools.lru_cache(maxsize=None)
def _device_table(device: torch.device, fp8: bool = False) -> torch.Tensor:
    """``lut_table`` (``fp8``: ``lut_table_e4m3``) on ``device``, allocated once per device and
    kept alive (CUDA graphs capture its address)."""
    return lut_table_e4m3(device) if fp8 else lut_table(device)


def scratch_elems(num_reqs: int, width: int, rows: int) -> int:
    """float32 elements of page-score scratch: ``[B, N, W]``."""
    return num_reqs * rows * width


# --------------------------------------------------------------------------------------------
# Select kernel (plain Triton: GPU and interpreter)
# --------------------------------------------------------------------------------------------

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


@triton.jit(do_not_specialize_on_alignment=["scores_ptr", "seq_lens_ptr", "out_ptr"])
def _select_kernel(scores_ptr, seq_lens_ptr, width, out_ptr, Q: tl.constexpr,
                   H: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                   GROUP: tl.constexpr):
    # The row's history pages in 16 residue classes j % 16, each class's largest candidate
    # in cmax (one pass over the row). A round takes the largest class maximum (the best
    # page not yet taken: keys are distinct and taken in descending order) and replaces it
    # by the largest candidate of that class below it (a reload of ~L/16 scores, L1-hot).
    b = tl.program_id(0)
    m = tl.program_id(1)  # row i*H + h of request b
    i = m // H
    h = m % H
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)
    p = seq_len - Q + i
    local = local_page(p)  # padding rows (p < 0) select like L = 0
    row_scores = scores_ptr + (b.to(tl.int64) * N + m) * width
    slot = tl.arange(0, 16)  # output slots; also the 16 residue classes
    res = tl.where(slot <= local, slot, -1)  # L <= 15 (padding rows: L = 0), per SPEC 5
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
    row = (b * Q + i).to(tl.int64)
    tl.store(out_ptr + (row * H + h) * 16 + slot, res)


@triton.jit(do_not_specialize_on_alignment=["scores_ptr", "seq_lens_ptr", "out_ptr"])
def _select_wide_kernel(scores_ptr, seq_lens_ptr, width, out_ptr, Q: tl.constexpr,
                        H: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr):
    # The row's L <= CHUNK page scores as packed candidates in registers (all warps of the
    # program); each of the 15 rounds takes the largest and removes it (keys are distinct).
    b = tl.program_id(0)
    m = tl.program_id(1)  # row i*H + h of request b
    i = m // H
    h = m % H
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)
    local = local_page(seq_len - Q + i)  # padding rows (p < 0) select like L = 0
    row_scores = scores_ptr + (b.to(tl.int64) * N + m) * width
    slot = tl.arange(0, 16)
    res = tl.where(slot <= local, slot, -1)  # L <= 15 (padding rows: L = 0), per SPEC 5
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
    row = (b * Q + i).to(tl.int64)
    tl.store(out_ptr + (row * H + h) * 16 + slot, res)


# --------------------------------------------------------------------------------------------
# Plain-Triton twin of the score kernel (DEQUANT="lut": interpreter and any GPU)
# --------------------------------------------------------------------------------------------

def flat_partition(page_counts: list[int], num_programs: int) -> list[list[tuple]]:
    """Host twin of the flat partition the "mma" scorer and the "lut" twin run on the device
    (``mma_scorer.flat_work`` / ``_flat_work``), for tests and documentation: the scored page
    counts n_b laid end to end (T pages), program p takes flat pages
    ``[p * T // P, (p + 1) * T // P)``. Returns per program its ``(request, start, end)``
    segments (request-local pages, non-empty). Every page is scored by exactly one program
    and the programs' page counts differ by at most one."""
    total = sum(page_counts)
    excl = [sum(page_counts[:b]) for b in range(len(page_counts))]
    out = []
    for p in range(num_programs):
        s, e = p * total // num_programs, (p + 1) * total // num_programs
        segs = []
        for b, (eb, nb) in enumerate(zip(excl, page_counts)):
            lo, hi = max(s, eb) - eb, min(e, eb + nb) - eb
            if lo < hi:
                segs.append((b, lo, hi))
        out.append(segs)
    return out


@triton.jit
def _flat_work(seq_lens_ptr, num_reqs, width, pid, num_programs, BB: tl.constexpr):
    """Triton twin of ``mma_scorer.flat_work``: ``(idx, excl, incl, s, e, b0, b1)``."""
    idx = tl.arange(0, BB)
    sl = tl.load(seq_lens_ptr + idx, mask=idx < num_reqs, other=0)
    sl = tl.minimum(tl.maximum(sl, 0), width * PAGE)  # SPEC 10 (scan.clamped_seq_len)
    n = scored_pages(num_history_pages(sl))
    incl = tl.cumsum(n, 0)
    excl = incl - n
    total = tl.sum(n, 0).to(tl.int64)
    s = ((pid.to(tl.int64) * total) // num_programs).to(tl.int32)
    e = (((pid + 1).to(tl.int64) * total) // num_programs).to(tl.int32)
    b0 = tl.sum((incl <= s).to(tl.int32), 0)
    b1 = tl.sum((excl < e).to(tl.int32), 0)
    return idx, excl, incl, s, e, b0, b1


@triton.jit(do_not_specialize=["q_row_stride", "q_head_stride", "bt_stride", "num_reqs",
                               "num_programs"])
def _portable_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride,
                           num_blocks, bt_ptr, bt_stride, width, seq_lens_ptr, tbl_ptr,
                           scores_ptr, num_reqs, num_programs, Q: tl.constexpr,
                           H: tl.constexpr, N: tl.constexpr, BB: tl.constexpr):
    idx, excl, incl, s, e, b0, b1 = _flat_work(seq_lens_ptr, num_reqs, width,
                                               tl.program_id(0), num_programs, BB)
    n = tl.arange(0, N)
    row_ok = n < Q * H
    d = tl.arange(0, HEAD)[:, None]
    t = tl.arange(0, PAGE)[:, None]
    dims = tl.arange(0, HEAD)[None, :]
    for b in range(b0, b1):  # each request the flat range touches: its pages [start, end)
        eb = tl.sum(tl.where(idx == b, excl, 0), 0)
        ib = tl.sum(tl.where(idx == b, incl, 0), 0)
        start = tl.maximum(s, eb) - eb
        end = tl.minimum(e, ib) - eb
        b64 = tl.cast(b, tl.int64)  # a Python int under the interpreter
        row = b64 * Q + n // H
        q_off = row * q_row_stride + (n % H) * q_head_stride
        qb = tl.load(q_ptr + q_off[None, :] + d, mask=row_ok[None, :], other=0)
        q_t = e4m3_decode(qb)  # [128, N] fp32, exact
        out_row = scores_ptr + (b64 * N + n) * width
        bt_row = bt_ptr + b64 * bt_stride
        for j in range(start, end):
            blk = tl.minimum(tl.maximum(tl.load(bt_row + j), 0), num_blocks - 1).to(tl.int64)
            page = cache_ptr + blk * page_stride
            cb = tl.load(page + t * CODE_BYTES + dims // 2).to(tl.int32)  # byte of dim d
            codes = (cb >> ((dims % 2) * 4)) & 15
            sb = tl.load(page + SCALES_OFFSET + t * GROUPS + dims // 16).to(tl.int32)
            k = lut_dequant_portable(codes, sb, tbl_ptr).to(tl.float32)
            acc = tl.dot(k, q_t, input_precision="ieee", out_dtype=tl.float32)
            tl.store(out_row + j, page_max(acc))


@functools.lru_cache(maxsize=None)
def gluon_layouts(rows: int, num_warps: int = 4):
    """Constexpr layouts of the Gluon kernel for N = ``rows`` query rows and 4 warps:
    ``(CL, MMA, QL, B_SL)`` -- the code-load layout whose lane / warp bases are those of the
    wgmma A operand, the MMA accumulator, the query load and the query's shared layout
    (cached, like ``mma_layouts``)."""
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


@functools.lru_cache(maxsize=None)
def mma_layouts(rows: int):
    """Constexpr layouts of the warp-per-split Gluon scorer (``mma_scorer``, one warp) for
    N = ``rows`` query rows: ``(CL, MMA, QL, SCL)`` -- the chunk code / scale read layout whose
    lane bases are those of the m16n8k16 A fragment (element (m, j, g'): group 2j + g' of token
    m; lanes: j, then m mod 8; registers: g', m // 8), the MMA accumulator, the query load and
    the cp.async layout of a chunk's scale bytes ``[16 tokens, 8]`` (4 bytes per lane).
    Cached: building them costs ~0.1 ms of host time, once per eager launch otherwise."""
    from triton.experimental.gluon import language as gl
    cl = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[], block_bases=[], shape=[16, 4, 2])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    ql = gl.BlockedLayout([2, 1], [32, 1], [1, 1], [0, 1])
    scl = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]],
                                     lane_bases=[[0, 4], [1, 0], [2, 0], [4, 0], [8, 0]],
                                     warp_bases=[], block_bases=[], shape=[16, 8])
    return cl, mma, ql, scl


@functools.lru_cache(maxsize=None)
def wgflat_layouts(rows: int, fp8: bool = False):
    """Constexpr layouts of the page-per-warp wgmma scorer (``wgflat_scorer``, 4 warps) for
    N = ``rows`` query rows: ``(CL, MMA, QL, SCL, B_SL)`` -- the A-tile code / scale read
    layout ``[64, 4, 2]`` (``mma_layouts``' CL with warp w on rows 16w .. 16w+15: the wgmma A
    operand's bases), the wgmma accumulator, the query load, the cp.async layout of a tile's
    scale bytes ``[64, 8]`` and the query's shared layout (cached). ``fp8``: the E4M3-operand
    variant (``FP8``: k = 32 per wgmma, the query E4M3 ``[N, 64]`` per K half, K-major)."""
    from triton.experimental.gluon import language as gl
    cl = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 2])
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, rows, 32 if fp8 else 16])
    scl = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]],
                                     lane_bases=[[0, 4], [1, 0], [2, 0], [4, 0], [8, 0]],
                                     warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                     shape=[64, 8])
    if fp8:
        ql = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
        b_sl = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    else:
        ql = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
        b_sl = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * rows), element_bitwidth=16,
                                    rank=2)
    return cl, mma, ql, scl, b_sl


# byte alignment of the cache base each Gluon scorer's copies need (and of the page stride:
# 16, SPEC 2, passed in 16-byte units)
GLUON_CACHE_ALIGN = {"mma": 16, "wgflat": 16, "wgmma": 8}


def select_launch(num_reqs: int, width: int, query_len: int, num_heads: int,
                  wide: bool | None = None, gluon: bool = False) -> tuple:
    """``(kernel, constexprs, num_warps, rows per program)`` of the select launch (grid
    ``(B, cdiv(Q*H, rows per program))``):

    - with ``gluon`` (a GPU page-score path) and W <= ``SELECT_REDUX_MAX_WIDTH``: the Gluon
      ``redux_select`` kernel, K = next power of two >= W / 32 keys per lane, one row per warp,
      ``redux_select.launch_shape`` rows (warps) per program;
    - with ``gluon``, W <= ``SELECT_SPLIT_MAX_WIDTH`` and at most ``SELECT_SPLIT_MAX_ROWS``
      rows B * Q * H: its split form, one row per program on S warps
      (``redux_select.split_shape`` with ``SELECT_SPLIT_KEYS``; K <= 32 keys per lane);
    - else the wide select for at most ``SELECT_WIDE_MAX_ROWS`` rows and W <=
      ``SELECT_WIDE_MAX_WIDTH`` (``wide`` forces it on or off), its CHUNK = next power of two
      >= W on up to 8 warps (256 keys per warp);
    - else the residue-class select on one warp per row.
    ``wide`` True / False also turns the Gluon kernel off (tests, labs)."""
    if gluon and wide is None and width <= SELECT_REDUX_MAX_WIDTH:
        from .redux_select import launch_shape, redux_select_kernel
        k, rows = launch_shape(width, query_len * num_heads)
        return redux_select_kernel, dict(K=k, ROWS=rows), rows, rows
    if gluon and wide is None and width <= SELECT_SPLIT_MAX_WIDTH \
            and num_reqs * query_len * num_heads <= SELECT_SPLIT_MAX_ROWS:
        from .redux_select import redux_select_split_kernel, split_shape
        k, s = split_shape(width, SELECT_SPLIT_KEYS)
        assert k <= 32, (width, k, s)  # registers: SELECT_SPLIT_MAX_WIDTH <= 8 * 32 * 32
        return redux_select_split_kernel, dict(K=k, S=s, ROWS=1), s, 1
    if wide is None:
        wide = (num_reqs * query_len * num_heads <= SELECT_WIDE_MAX_ROWS
                and width <= SELECT_WIDE_MAX_WIDTH)
    if wide:
        chunk = triton.next_power_of_2(max(width, 16))
        return _select_wide_kernel, dict(CHUNK=chunk), max(1, min(8, chunk // 256)), 1
    chunk, group = _select_blocks(width)
    return _select_kernel, dict(CHUNK=chunk, GROUP=group), SELECT_WARPS, 1


def _select_blocks(width: int) -> tuple[int, int]:
    """The select kernel's ``(CHUNK, GROUP)`` for block-table width ``width``."""
    chunk = min(SELECT_CHUNK, triton.next_power_of_2(max(width, 16)))
    return chunk, min(SELECT_GROUP, max(32, triton.next_power_of_2(triton.cdiv(width, 16))))


class PageScoreLaunch:
    """The two launches of a page-score decode run (score kernel, then select) with their
    constexprs and options fixed once (``launcher.CachedLaunch``: little host work per eager
    launch). What ``decode.DecodeRunner`` keeps; ``launch`` builds one per call.

    Args:
        dequant: "mma" (Gluon, one warp per program, SM89+), "wgflat" (Gluon, one warpgroup
            per program, one page per warp, SM90), "wgmma" (Gluon, SM90) or "lut" (the
            plain-Triton twin). width: block-table width W. query_len, num_heads: Q, H.
            num_reqs: B (the block table's rows).
        rows: N = ``heuristics.block_rows(Q, H)``. num_splits: programs per request of the
            "wgmma" grid ``(B, NUM_SPLITS)``. programs: P, the flat grid of "mma" / "wgflat"
            / "lut" (``flat_partition``; default ``B * num_splits``).
        maxnreg: the register cap of "mma" (default ``MMA_MAXNREG``) or "wgflat" (default
            none: 106 registers at 32 rows); the other modes ignore it.
        fp8: "wgflat" only: E4M3 operands (``lut.LUT_E4M3_ASM``, fp8 wgmma: dot mode "fp8",
            SPEC 9 b = 5) instead of fp16 ones (dot "fp16", b = 15).
    Raises:
        ValueError: ``fp8`` with a mode other than "wgflat".
    """

    def __init__(self, dequant: str, *, width: int, query_len: int, num_heads: int, rows: int,
                 num_splits: int, num_reqs: int, programs: int | None = None,
                 maxnreg: int | None = None, fp8: bool = False):
        from .launcher import CachedLaunch
        if fp8 and dequant != "wgflat":
            raise ValueError(f"fp8: only the 'wgflat' scorer has E4M3 operands, got dequant "
                             f"{dequant!r}")
        self.dequant, self.num_splits, self.fp8 = dequant, num_splits, fp8
        self.programs = programs or num_reqs * num_splits
        self.q_len, self.heads, self.num_reqs = query_len, num_heads, num_reqs
        bb = max(32, triton.next_power_of_2(num_reqs))  # the flat partition's request vector
        if dequant == "wgmma":
            from .wgmma_scorer import wgmma_score_kernel
            cl, mma, ql, b_sl = gluon_layouts(rows)
            self.score = CachedLaunch(wgmma_score_kernel, Q=query_len, H=num_heads, N=rows,
                                      NUM_SPLITS=num_splits, CL=cl, MMA=mma, QL=ql, B_SL=b_sl,
                                      num_warps=4)
        elif dequant == "mma":
            from .heuristics import MMA_MAXNREG, MMA_STAGES
            from .mma_scorer import mma_score_kernel
            cl, mma, ql, scl = mma_layouts(rows)
            self.score = CachedLaunch(mma_score_kernel, Q=query_len, H=num_heads, N=rows, BB=bb,
                                      CL=cl, MMA=mma, QL=ql, SCL=scl, STAGES=MMA_STAGES,
                                      LAB=MMA_LAB, num_warps=1,
                                      maxnreg=MMA_MAXNREG if maxnreg is None else maxnreg)
        elif dequant == "wgflat":
            from .heuristics import WGFLAT_ASYNC, WGFLAT_ASYNC_FP8, WGFLAT_STAGES
            from .wgflat_scorer import wgflat_score_kernel
            cl, mma, ql, scl, b_sl = wgflat_layouts(rows, fp8)
            opts = {} if maxnreg is None else {"maxnreg": maxnreg}
            if WGFLAT_LAB_ASYNC is not None:
                asy = WGFLAT_LAB_ASYNC
            else:
                asy = WGFLAT_ASYNC_FP8 if fp8 else WGFLAT_ASYNC
            self.score = CachedLaunch(wgflat_score_kernel, Q=query_len, H=num_heads, N=rows,
                                      BB=bb, CL=cl, MMA=mma, QL=ql, SCL=scl, B_SL=b_sl,
                                      STAGES=WGFLAT_STAGES if WGFLAT_LAB_STAGES is None
                                      else WGFLAT_LAB_STAGES, ASYNC=asy,
                                      LAB=MMA_LAB, FP8=int(fp8), num_warps=4, **opts)
        else:
            self.score = CachedLaunch(_portable_score_kernel, Q=query_len, H=num_heads, N=rows,
                                      BB=bb, num_warps=4)
        kernel, consts, warps, per_prog = select_launch(num_reqs, width, query_len, num_heads,
                                                        gluon=dequant != "lut")
        self.select = CachedLaunch(kernel, Q=query_len, H=num_heads, N=rows, **consts,
                                   num_warps=warps)
        self.select_grid_y = triton.cdiv(query_len * num_heads, per_prog)

    def __call__(self, index_q, cache, block_table, seq_lens, out, scores, *,
                 num_blocks: int) -> None:
        """Run both kernels (no allocation, no sync; capturable): ``run_score``, then the
        select into ``out``. ``scores``: fp32 scratch of at least ``scratch_elems(B, W, rows)``
        elements. Shapes are the caller's (``decode.DecodeRunner``) to check.

        Raises:
            ValueError: as ``run_score``, before any launch."""
        self.run_score(index_q, cache, block_table, seq_lens, scores, num_blocks=num_blocks)
        self.select((block_table.shape[0], self.select_grid_y), scores, seq_lens,
                    block_table.shape[1], out)

    def run_score(self, index_q, cache, block_table, seq_lens, scores, *,
                  num_blocks: int) -> None:
        """The score kernel alone (``__call__``'s first launch; labs time it on its own): page
        scores of every row into ``scores`` viewed as ``[B, N, W]``.

        Raises:
            ValueError: for "mma" / "wgflat" / "wgmma", a cache whose page stride is not a
                multiple of 16 bytes or whose base address is not one of
                ``GLUON_CACHE_ALIGN[dequant]`` bytes (16: the 16-byte cp.async copies of
                "mma" / "wgflat" do not compile otherwise; 8: "wgmma"'s int64 loads fault),
                before any launch (SPEC 2, 10).
        """
        dequant = self.dequant
        align = GLUON_CACHE_ALIGN.get(dequant)
        if align and (cache.data_ptr() % align or cache.stride(0) % 16):
            raise ValueError(f"cache: the {dequant!r} decode scorer needs a {align}-byte "
                             f"aligned base and page stride, got data_ptr "
                             f"{cache.data_ptr():#x} and page stride {cache.stride(0)}")
        b, width = block_table.shape
        q8 = index_q.view(torch.uint8)
        table = _device_table(cache.device, self.fp8)
        if dequant == "wgmma":
            self.score((b, self.num_splits), q8, q8.stride(0), q8.stride(1), cache,
                       cache.stride(0) // 16, num_blocks, block_table, block_table.stride(0),
                       width, seq_lens, table, scores)
        elif dequant in ("mma", "wgflat"):  # the page stride in 16-byte units
            self.score((self.programs,), q8, q8.stride(0), q8.stride(1), cache,
                       cache.stride(0) // 16, num_blocks, block_table, block_table.stride(0),
                       width, seq_lens, table, scores, b, self.programs)
        else:
            self.score((self.programs,), q8, q8.stride(0), q8.stride(1), cache,
                       cache.stride(0), num_blocks, block_table, block_table.stride(0), width,
                       seq_lens, table.view(torch.uint8), scores, b, self.programs)


def launch(dequant: str, index_q, cache, block_table, seq_lens, out, scores, *, num_blocks,
           query_len: int, num_heads: int, rows: int, num_splits: int,
           programs: int | None = None, maxnreg: int | None = None, fp8: bool = False) -> None:
    """``PageScoreLaunch(...)(...)`` in one call (tests, labs; a runner keeps its
    ``PageScoreLaunch``): both kernels, no allocation, no sync. Arguments and errors as
    ``PageScoreLaunch`` (B from ``block_table``)."""
    b, width = block_table.shape
    PageScoreLaunch(dequant, width=width, query_len=query_len, num_heads=num_heads, rows=rows,
                    num_splits=num_splits, num_reqs=b, programs=programs, maxnreg=maxnreg,
                    fp8=fp8)(index_q, cache, block_table, seq_lens, out, scores,
                             num_blocks=num_blocks)


def select(scores, seq_lens, out, *, width: int, query_len: int, num_heads: int,
           rows: int, wide: bool | None = None, gluon: bool = False) -> None:
    """The select kernel alone (``launch``'s second step; tests): the SPEC 5 output ``out``
    ``[B*Q, H, 16]`` from the page scores in ``scores`` viewed as ``[B, N, W]`` (row
    n = i*H + h; entries ``j < L`` read); ``wide`` / ``gluon`` as ``select_launch``."""
    b = seq_lens.shape[0]
    kernel, consts, warps, per_prog = select_launch(b, width, query_len, num_heads, wide, gluon)
    kernel[(b, triton.cdiv(query_len * num_heads, per_prog))](
        scores, seq_lens, width, out, Q=query_len, H=num_heads, N=rows, **consts,
        num_warps=warps)
