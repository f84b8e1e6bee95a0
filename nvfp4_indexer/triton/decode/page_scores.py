"""The page-score decode family (SPEC 4-6): a score kernel writes every row's fp32 page scores
``scores[b, n, j]`` (scratch ``[B, N, W]``, row n = i*H + h, N = BLOCK_M), then a select kernel
writes SPEC 5's output from them. ``PageScoreLaunch`` runs a ``dispatch.DecodePlan`` of this
family (two launches, no allocation, capturable).

Score kernels (``dispatch.plan_decode`` picks one; all clamp ``seq_len`` to ``[0, W * 128]`` and
block ids to ``[0, num_blocks)``, SPEC 10):

- "mma" (``mma``, SM89+): one warp per program on a flat grid of P programs
  (``flat_partition``: the batch's scored pages end to end, equal shares), raw 16-token chunks
  streamed through a shared-memory ring by cp.async, ``mma.sync`` m16n8k16 against the query
  held in registers;
- "wgflat" (``wgflat``, SM90): one warpgroup per program on the same flat grid, one page per
  warp of a [64 tokens, 128] wgmma A tile; with dot "fp8" its E4M3 form (b = 5);
- "wgmma" (``wgmma``, SM90, 64 rows): grid ``(B, NUM_SPLITS)``, 9 KB of raw bytes per page
  loaded straight into the wgmma A-operand layout, one ``warpgroup_mma [128, 128] x [128, N]``;
- "lut" (``lut_score_kernel`` below): the plain-Triton twin of the three (the interpreter and
  any GPU; same flat grid, scratch and select kernels), ``lut.lut_dequant_portable`` and an
  fp32 dot (dot mode "fp32", b = 16). The CPU tests run it; the GPU tests compare the Gluon
  kernels against the reference.

The Gluon scorers dequantize with the table lookup ``lut.LUT_ASM`` (bit-exact SPEC 1.4) into
fp16 MMA operands (fp32 accumulation: dot mode "fp16", b = 15) and take a NaN-skipping max
over tokens. Select kernels: the Gluon ``redux`` selects on those paths, the plain-Triton
``select`` kernels elsewhere (``dispatch.select_plan``). Nothing depends on host values of the
metadata; every scratch element a select program reads was written by the same run, so
CUDA-graph replays after in-place metadata changes give fresh results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..heuristics import cdiv
from ..launcher import CachedLaunch
from ..layout import (CODE_BYTES, GROUPS, HEAD, PAGE, SCALES_OFFSET, num_history_pages,
                      scored_pages)
from ..numerics import e4m3_decode
from ..scoring import page_max
from .dispatch import DecodePlan, KernelLaunch
from .lut import device_table, lut_dequant_portable

# byte alignment of the cache base each Gluon scorer's copies need (and of the page stride:
# 16, SPEC 2, passed in 16-byte units)
GLUON_CACHE_ALIGN = {"mma": 16, "wgflat": 16, "wgmma": 8}


def flat_partition(page_counts: list[int], num_programs: int) -> list[list[tuple]]:
    """Host twin of the flat partition "mma", "wgflat" and the "lut" twin run on the device
    (``fragments.flat_work`` / ``_flat_work``), for tests and documentation: the scored page
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
    """Triton twin of ``fragments.flat_work``: ``(idx, excl, incl, s, e, b0, b1)``."""
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
def lut_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride, num_blocks,
                     bt_ptr, bt_stride, width, seq_lens_ptr, tbl_ptr, scores_ptr, num_reqs,
                     num_programs, Q: tl.constexpr, H: tl.constexpr, N: tl.constexpr,
                     BB: tl.constexpr):
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


def _score_launch(launch: KernelLaunch) -> CachedLaunch:
    """The score kernel of ``launch`` with its constexprs, Gluon layouts and options."""
    rows, fp8 = launch.constexprs["N"], bool(launch.constexprs.get("FP8", 0))
    if launch.kernel == "wgmma":
        from .wgmma import layouts, wgmma_score_kernel as kernel
        cl, mma, ql, b_sl = layouts(rows)
        lay = dict(CL=cl, MMA=mma, QL=ql, B_SL=b_sl)
    elif launch.kernel == "mma":
        from .mma import layouts, mma_score_kernel as kernel
        cl, mma, ql, scl = layouts(rows)
        lay = dict(CL=cl, MMA=mma, QL=ql, SCL=scl)
    elif launch.kernel == "wgflat":
        from .wgflat import layouts, wgflat_score_kernel as kernel
        cl, mma, ql, scl, b_sl = layouts(rows, fp8)
        lay = dict(CL=cl, MMA=mma, QL=ql, SCL=scl, B_SL=b_sl)
    else:
        kernel, lay = lut_score_kernel, {}
    return CachedLaunch(kernel, **launch.constexprs, **lay, **launch.options)


def select_kernel(name: str):
    """The select kernel a ``dispatch.select_plan`` launch names."""
    if name in ("redux_select", "redux_select_split"):
        from . import redux
        return redux.redux_select_kernel if name == "redux_select" \
            else redux.redux_select_split_kernel
    from .select import select_classes_kernel, select_wide_kernel
    return select_wide_kernel if name == "select_wide" else select_classes_kernel


class PageScoreLaunch:
    """The two launches of a page-score plan (score kernel, then select) with their
    constexprs and options fixed once (``launcher.CachedLaunch``: little host work per eager
    launch). What ``runner.DecodeRunner`` keeps for such a plan.

    Args:
        plan: a ``dispatch.DecodePlan`` whose dequant is "mma", "wgflat", "wgmma" or "lut".
    Raises:
        ValueError: a plan of the one-launch kernel.
    """

    def __init__(self, plan: DecodePlan):
        if not plan.page_scores:
            raise ValueError(f"plan: expected a page-score plan, got dequant {plan.dequant!r}")
        self.plan, self.dequant = plan, plan.dequant
        self.fp8 = plan.kernel_dot == "fp8"
        self.score = _score_launch(plan.score)
        sel = plan.select
        self.select = CachedLaunch(select_kernel(sel.kernel), Q=plan.query_len,
                                   H=plan.num_heads, N=plan.block_m, **sel.constexprs,
                                   **sel.options)
        self.select_grid_y = cdiv(plan.query_len * plan.num_heads, sel.rows)

    def __call__(self, index_q, cache, block_table, seq_lens, out, scores, *,
                 num_blocks: int) -> None:
        """Run both kernels (no allocation, no sync; capturable): ``run_score``, then the
        select into ``out``. ``scores``: fp32 scratch of at least ``plan.win_elems``
        elements. Shapes are the caller's (``runner.DecodeRunner``) to check.

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
        table = device_table(cache.device, self.fp8)
        programs = self.plan.programs
        if dequant == "wgmma":
            self.score((b, self.plan.num_splits), q8, q8.stride(0), q8.stride(1), cache,
                       cache.stride(0) // 16, num_blocks, block_table, block_table.stride(0),
                       width, seq_lens, table, scores)
        elif dequant in ("mma", "wgflat"):  # the page stride in 16-byte units
            self.score((programs,), q8, q8.stride(0), q8.stride(1), cache,
                       cache.stride(0) // 16, num_blocks, block_table, block_table.stride(0),
                       width, seq_lens, table, scores, b, programs)
        else:
            self.score((programs,), q8, q8.stride(0), q8.stride(1), cache,
                       cache.stride(0), num_blocks, block_table, block_table.stride(0), width,
                       seq_lens, table.view(torch.uint8), scores, b, programs)


def run_select(launch: KernelLaunch, scores, seq_lens, out, *, width: int, query_len: int,
               num_heads: int, rows: int) -> None:
    """The select kernel of ``launch`` (``dispatch.select_plan``) alone (tests, labs): SPEC 5's
    output ``out`` ``[B*Q, H, 16]`` from the page scores in ``scores`` viewed as ``[B, N, W]``
    (N = ``rows``; entries ``j < L`` read)."""
    b = seq_lens.shape[0]
    select_kernel(launch.kernel)[(b, cdiv(query_len * num_heads, launch.rows))](
        scores, seq_lens, width, out, Q=query_len, H=num_heads, N=rows, **launch.constexprs,
        **launch.options)
