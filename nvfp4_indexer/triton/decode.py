"""Triton "Q8KV4" decode indexer: NVFP4 pages scored in place, split-K over pages, top-k
merge (SPEC 4-6).

Design
------
Score kernel, grid ``(B, NUM_SPLITS)``. Program (b, s) loads request b's ``Q*H`` query rows
(row m = i*H + h, padded to ``BLOCK_M`` = 16 or 32 or 64) once, then walks its share of the
request's history pages ``j < n = (seq_len - 1) // 128`` (the last query's L; n = 0 when
n <= 15: every row is then a short row, SPEC 5 gives it by formula): split s takes pages
``[s*c, min((s+1)*c, n))`` with ``c = ceil(n / NUM_SPLITS)``. Per page (one iteration = 128
tokens): the block id from the block table, the page's 8192 code bytes and 1024 scale bytes
from ``cache + block * page_stride`` (read in place; Triton's pipeliner turns the loads into
``cp.async`` copies), dequantization in registers (SPEC 1.4), ``[128 tokens, BLOCK_M]`` token
scores on tensor cores, and the NaN-skipping max over tokens. The page's candidate (score, j)
counts only for rows with j < their local page L_i = (seq_len - Q + i) // 128. Each program
keeps a running top-KEEP per row, KEEP = min(16, next power of two >= its page count)
(``heuristics.keep_per_split``: a split never needs more), updated either per page
(``topk_insert``, WINDOW = 1) or, for splits of >= ``MIN_WINDOW_PAGES`` pages, once per
window of WINDOW pages whose scores were buffered in a per-program scratch
(``topk_merge``: only as many rounds as candidates beat the kept entries). Each program then
writes its lists to the candidate scratch ``int64 [B, BLOCK_M, NUM_SPLITS, KEEP]``.

Dequantization (the ``DEQUANT`` constexpr, ``DecodeConfig(dequant=...)``): "triton" is
``scoring.nvfp4_page_scores`` (two K=64 MMAs; one K=128 fp32 dot in the interpreter); "ptx" /
"ptx_arith" (GPU, dot "fp16") are ``scoring.nvfp4_page_scores_ptx``: code bytes read as uint16
pairs, inline-PTX dequantization (bit-exact SPEC 1.4, "ptx_arith" without conversion
instructions) and four K=32 fp16 MMAs over dims 4i + j. "ptx" is the one-launch default on
SM89+ GPUs; large batches on SM90 take a page-score mode instead (``decode_wgmma``: "mma",
"wgflat", "wgmma"; ``heuristics.choose_dequant``).
These and window / num_warps / num_stages / programs_per_sm / maxnreg are the tuning fields
of ``config.DecodeConfig`` (``benchmarks/labs/dequant_lab.py`` varies them; measurements:
docs/benchmarks.md).

Merge kernel: loads each row's ``NUM_SPLITS * KEEP`` candidates and writes the final SPEC 5
output (15 rounds of max-and-remove, skipped when the row is short; slot 15 = L; padding rows
by formula). On a CUDA GPU (SM80+, no ``pdl``) with at most ``REDUX_MERGE_MAX_CANDIDATES``
candidates per row it is the Gluon ``redux_select.redux_merge_kernel`` (one row per warp,
``redux_select.launch_shape`` rows per program, two warp reductions per round); else
``_decode_merge_kernel``, grid ``(B, Q*H)``, one row per program
(``heuristics.merge_config``; 1-4 warps by the candidate count), which the interpreter runs.
With ``NUM_SPLITS == 1`` the score kernel writes the output itself and there is no merge
launch and no candidate scratch.

Nothing depends on host values of ``seq_lens`` / ``block_table``: the grid and all constexprs
are a function of (B, W, Q, H, SM count), every program writes all of its outputs every run
(no state carried between runs; the window scratch is rewritten before it is read), so a
CUDA-graph replay after in-place changes of the buffers computes fresh results. Block-table
entries at or past a request's history page count are never read.

``NUM_SPLITS`` (``heuristics.choose_num_splits``): 1 when W - 1 <= 15 (every row is short,
SPEC 5: no page is scored, one launch); else
min(ceil(PROGRAMS_PER_SM * num_sms / B), W - 1, MAX_SPLITS) (1-page splits), lowered to ceil((W - 1) / 2) once B * NUM_SPLITS exceeds 4 programs per SM
and to ceil((W - 1) / MIN_PAGES_PER_SPLIT) beyond two waves (8 per SM): long contexts fill
the GPU at small batch, small batches keep short serial chains.

Error bound (SPEC 9)
--------------------
A scorer's page score differs from the exact one by at most ``e = 2^-b * max_t sum_d |q_d K_d|``
(max over the row's history tokens); ``SCORE_ERROR_BITS[dot]`` is b. Every product of two
E4M3 values is exact in fp32 and inside 16-bit MMAs, so only the accumulation of a token's
128 products rounds; the max over tokens is 1-Lipschitz, so a per-token bound carries over.

- "fp32" (interpreter / PORTABLE, IEEE fp32 dot): recursive summation of 128 terms errs by at
  most gamma_127 * sum|x_i| < 2^-16.99 * sum|x_i| in any order: b = 16.
- "fp16" (GPU default) / "bf16" (16-bit MMA, fp32 accumulation): tensor cores align the
  addends of one MMA step to the largest exponent and truncate (not round) to the fp32
  significand (Fasi et al. 2021 for V100/A100; Hopper assumed no worse). Each addend then errs
  by < 2^-23 * M (M <= sum|x_i| bounds every partial sum and addend); with k = 8 products per
  step: 128 products + 16 accumulator terms + 16 normalizations = 160 error terms
  < 2^-15.68 * sum|x_i|: b = 15 (one bit below the brief's 16, which assumed rounding).
- "fp8" (SM90 fp8 MMA): the accumulator keeps 13 fraction bits (e8m13, truncating; reported by
  the DeepSeek-V3 paper and public measurements). Worst-case model: every one of the 128
  products plus 4 accumulator steps truncated at 13 fraction bits relative to the running
  maximum: 132 * 2^-13 < 2^-5.95: b = 5. Typical errors are far smaller (about 2^-12); the
  GPU tests print the observed worst error in bits. Not measured on hardware here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..constants import HEAD_DIM, TOPK
from ..validation import check_int
from . import decode_wgmma
from . import heuristics as hz
from .config import KERNEL_DEQUANT_MODES, PAGE_SCORE_MODES, DecodeConfig, check_config
from .dot_modes import resolve_dot
from .heuristics import MAX_ROWS, block_rows, choose_num_splits
from .layout import num_history_pages, scored_pages, split_range
from .device import device_guard, mma_available, num_sms, portable_default, wgmma_available
from .operands import load_q_pairs_t, load_q_quads_t
from .scan import (clamped_seq_len, decode_rows, finish_split, merge_splits, out_offsets,
                   scan_pages)
from .scoring import nvfp4_page_scores, nvfp4_page_scores_ptx

# the merge of split candidates on a GPU: the Gluon ``redux_merge_kernel`` (one row per warp,
# two warp reductions per round) up to this many candidates per row, else ``_decode_merge_kernel``
REDUX_MERGE_MAX_CANDIDATES = 512
# b of SPEC 9's tie tolerance e = 2^-b * max_t sum_d |q_d K_d|, per dot mode (see module doc).
SCORE_ERROR_BITS = {"fp16": 15, "bf16": 15, "fp8": 5, "fp32": 16}



def score_buffer_size(num_reqs: int, num_pages: int, num_heads: int, query_len: int = 8, *,
                      num_sms: int | None = None, config: DecodeConfig | None = None,
                      device=None) -> int:
    """float32 elements of scratch a ``DecodeRunner`` needs (SPEC 6): its int64 candidate
    scratch and its fp32 page-score window buffer.

    Args:
        num_reqs: padded batch size B. num_pages: block-table width W (pages per request).
        num_heads: index heads H. query_len: Q (1..8).
        num_sms: SMs of the GPU the runner will use; default: the current CUDA device's, or
            132 without CUDA.
        config: the runner's ``DecodeConfig`` (its window / num_splits / programs_per_sm /
            dequant / page_score_min_pages shape the scratch; default ``DecodeConfig()``).
        device: the runner's device (default: the current CUDA device, or the CPU).
    Returns:
        Number of float32 elements: the int64 candidate scratch (none when the runner does not
        split) followed by the window buffer (none for window 1). A buffer this size can back
        the runner of these shapes and config on such a GPU (wrappers that never run at
        once may share one: pass the largest size).
    Raises:
        ValueError: ``config`` not None or a ``DecodeConfig``. Bad sizes are refused by
        ``DecodeRunner``.
    """
    cfg = check_config("config", config, DecodeConfig)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    dequant = cfg.dequant
    rows = block_rows(query_len, num_heads)
    if dequant is None:
        dequant = hz.choose_dequant(device, resolve_dot(cfg.dot, device), num_reqs, num_pages,
                                    cfg.page_score_min_pages, rows)
    if dequant in PAGE_SCORE_MODES:
        return decode_wgmma.scratch_elems(num_reqs, num_pages, rows)
    if num_sms is None:
        num_sms = num_sms(device)
    pps = cfg.programs_per_sm or hz.PROGRAMS_PER_SM
    ns = cfg.num_splits or choose_num_splits(num_reqs, num_pages, num_sms, pps)
    window = cfg.window or hz.decode_window(ns, num_pages, rows)
    keep = hz.keep_per_split(ns, num_pages)
    return 2 * hz.candidate_elems(num_reqs, ns, rows, keep) + hz.window_elems(num_reqs, ns,
                                                                              rows, window)


@triton.jit(do_not_specialize=["q_row_stride", "q_head_stride", "bt_stride", "width",
                               "num_blocks"],
            do_not_specialize_on_alignment=["q_ptr", "bt_ptr", "seq_lens_ptr", "cand_ptr",
                                            "win_ptr", "out_ptr"])
def _decode_score_kernel(q_ptr, q_row_stride, q_head_stride, cache_ptr, page_stride,
                         bt_ptr, bt_stride, seq_lens_ptr, cand_ptr, win_ptr, out_ptr,
                         width, num_blocks, page_offset, page_step,
                         Q: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, DOT: tl.constexpr,
                         DEQUANT: tl.constexpr = "triton", WINDOW: tl.constexpr = 64,
                         KEEP: tl.constexpr = 16, PDL: tl.constexpr = False,
                         CANDIDATES: tl.constexpr = False):
    # Page subset (context parallelism, SPEC 8.2): the program walks pages
    # j = page_offset + k * page_step (0 and 1 for a single device), splits over k.
    # CANDIDATES: always write the candidate scratch, even with one split.
    b = tl.program_id(0)
    split = tl.program_id(1)
    # SPEC 10: pages clamped to the block-table width, block ids into the cache
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)
    n_pages = scored_pages(num_history_pages(seq_len))  # history of the last query
    n_sub = tl.maximum(n_pages - page_offset + page_step - 1, 0) // page_step
    start, end = split_range(n_sub, split, NUM_SPLITS)

    m = tl.arange(0, BLOCK_M)
    h, row_ok, local, row = decode_rows(b, m, seq_len, Q, H)
    q_off = row * q_row_stride + h * q_head_stride
    if DEQUANT != "triton":
        q_ops = load_q_quads_t(q_ptr, q_off, row_ok)
    else:
        q_ops = load_q_pairs_t(q_ptr, q_off, row_ok, DOT)
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride
    top = scan_pages(start, end, local, (cache_ptr, page_stride, bt_row, num_blocks), q_ops,
                     win_ptr, b * NUM_SPLITS + split, page_offset, page_step,
                     _cache_page_scores, DOT, DEQUANT, BLOCK_M, KEEP, WINDOW)

    if PDL:  # pages done: the merge grid may launch (it waits for this grid to finish)
        gdc_launch_dependents()
    finish_split(top, local, out_ptr + out_offsets(row, h, H), row_ok, cand_ptr,
                 (b * BLOCK_M + m).to(tl.int64), split, NUM_SPLITS, CANDIDATES)


@triton.jit
def _cache_page_scores(page_src, j, q_ops, DOT: tl.constexpr, DEQUANT: tl.constexpr):
    """fp32 ``[BLOCK_M]`` scores of logical page j read in place from the paged cache
    (``page_src = (cache_ptr, page_stride, block-table row, num_blocks)``; the block id is
    clamped into the cache, SPEC 10) with the query operands ``q_ops`` of ``DEQUANT``."""
    cache_ptr, page_stride, bt_row, num_blocks = page_src
    block = tl.minimum(tl.maximum(tl.load(bt_row + j), 0), num_blocks - 1).to(tl.int64)
    page_ptr = cache_ptr + block * page_stride
    if DEQUANT != "triton":
        q0, q1, q2, q3 = q_ops
        return nvfp4_page_scores_ptx(page_ptr, q0, q1, q2, q3, DEQUANT)
    else:
        q_even, q_odd = q_ops
        return nvfp4_page_scores(page_ptr, q_even, q_odd, DOT)


@triton.jit(do_not_specialize=["width"],
            do_not_specialize_on_alignment=["seq_lens_ptr", "cand_ptr", "out_ptr"])
def _decode_merge_kernel(cand_ptr, seq_lens_ptr, out_ptr, width, Q: tl.constexpr,
                         H: tl.constexpr,
                         BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, ROWS: tl.constexpr, KEEP: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # launched early (programmatic dependent launch): wait for the score grid
        gdc_wait()
    b = tl.program_id(0)
    m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)  # as the score kernel
    h, row_ok, local, row = decode_rows(b, m, seq_len, Q, H)
    merge_splits(cand_ptr, (b * BLOCK_M + m).to(tl.int64), row_ok, local,
                 out_ptr + out_offsets(row, h, H), NUM_SPLITS, SPLITS_PAD, KEEP)


class DecodeRunner:
    """Capturable decode indexer for one static shape (B, W, Q, H) (SPEC 6).

    Args:
        num_heads: H (Q*H <= 64). num_reqs: padded batch B. width: block-table width W.
        query_len: Q (1..8). device: the CUDA device (or CPU under the interpreter).
        score_buffer: optional float32 scratch of at least
            ``score_buffer_size(B, W, H, Q, config=config)`` elements (8-byte aligned),
            shared with runners that never run concurrently.
        config: tuning (``config.DecodeConfig``: dot, dequant, num_splits, window, num_warps,
            num_stages, programs_per_sm, maxnreg, pdl, page_score_min_pages); None = defaults
            (``heuristics``). Every config selects the same pages up to SPEC 9's ties.
        warmup: compile both kernels now by one launch on an all-padding batch (default on
            CUDA), so that capturing ``run`` never compiles.
    Raises:
        ValueError: bad sizes, score buffer or config (a ptx / mma / wgflat / wgmma dequant
            mode off CUDA / under the interpreter or with a dot mode other than "fp16"
            ("wgflat" also takes "fp8"; with dot "fp8" the others run their fp16 form,
            ``heuristics.fp8_kernel_dot``);
            "wgflat" above 32 rows; a window with window * BLOCK_M > 4096; pdl off SM90+).
            NotImplementedError: Q*H > 64.
    """

    def __init__(self, num_heads: int, num_reqs: int, width: int, query_len: int, device,
                 score_buffer: torch.Tensor | None = None, *,
                 config: DecodeConfig | None = None, warmup: bool | None = None):
        # Python or numpy integers, never bool (SPEC 11): one check with the API's
        num_heads, num_reqs, width, query_len = (
            check_int(name, val, lo=1) for name, val in (
                ("num_heads", num_heads), ("num_reqs", num_reqs), ("width", width),
                ("query_len", query_len)))
        if query_len * num_heads > MAX_ROWS:
            raise NotImplementedError(f"query_len * num_heads: the Triton decode kernel holds "
                                      f"at most {MAX_ROWS} rows per request, got "
                                      f"{query_len} * {num_heads}")
        cfg = self.config = check_config("config", config, DecodeConfig)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_heads, self.num_reqs, self.width, self.query_len = (num_heads, num_reqs,
                                                                     width, query_len)
        self.block_m = block_rows(query_len, num_heads)
        self.dot = resolve_dot(cfg.dot, self.device)
        dequant = cfg.dequant or hz.choose_dequant(self.device, self.dot, num_reqs, width,
                                                   cfg.page_score_min_pages, self.block_m)
        # what the kernels run: dot "fp8" is a bound, met exactly by modes without E4M3 operands
        self.kernel_dot = hz.fp8_kernel_dot(self.dot, dequant)
        _check_dequant(dequant, self.kernel_dot, self.device, self.block_m)
        pps = cfg.programs_per_sm or {"wgmma": hz.WGMMA_PROGRAMS_PER_SM,
                                      "mma": hz.MMA_PROGRAMS_PER_SM,
                                      "wgflat": hz.WGFLAT_PROGRAMS_PER_SM}.get(
                                          dequant, hz.PROGRAMS_PER_SM)
        self.num_splits = cfg.num_splits or choose_num_splits(
            num_reqs, width, num_sms(self.device), pps)
        # the flat page-score grid ("mma" / "wgflat": one wave of equal shares, "wgflat" at
        # most one program per WGFLAT_MIN_GROUPS groups of 4 pages; "lut": B * NUM_SPLITS)
        self.programs = hz.page_score_programs(
            num_reqs, width, num_sms(self.device), pps,
            cfg.num_splits or (None if dequant in ("mma", "wgflat") else self.num_splits),
            pages_per_program=4 * hz.WGFLAT_MIN_GROUPS if dequant == "wgflat" else 1)
        window = cfg.window or hz.decode_window(self.num_splits, width, self.block_m)
        if window * self.block_m > hz.MAX_WINDOW_ELEMS:
            raise ValueError(f"window: expected a power of two with window * BLOCK_M <= "
                             f"{hz.MAX_WINDOW_ELEMS}, got {window} (BLOCK_M {self.block_m})")
        if cfg.pdl and (portable_default(self.device)
                        or torch.cuda.get_device_capability(self.device) < (9, 0)):
            raise ValueError(f"pdl: expected a bool, True only on SM90+ CUDA GPUs, got True "
                             f"on {self.device}")
        self.dequant, self.window, self.maxnreg = dequant, window, cfg.maxnreg
        # the register cap is a GPU compile option (the interpreter has none)
        cap = hz.MAXNREG if cfg.maxnreg is None else cfg.maxnreg  # the one-launch kernel's
        self._reg_cap = {} if portable_default(self.device) else {"maxnreg": cap}
        self.num_warps, self.num_stages, self.pdl = cfg.num_warps, cfg.num_stages, cfg.pdl
        self._pdl_launch = {"launch_pdl": True} if cfg.pdl else {}
        self.splits_pad = hz.next_pow2(self.num_splits)
        self.keep = hz.keep_per_split(self.num_splits, width)
        self.merge_rows, self.merge_warps = hz.merge_config(self.num_splits, self.keep)
        if dequant in PAGE_SCORE_MODES:  # one fp32 page-score scratch [B, N, W]
            n, nw = 0, decode_wgmma.scratch_elems(num_reqs, width, self.block_m)
        else:
            n = hz.candidate_elems(num_reqs, self.num_splits, self.block_m, self.keep)
            nw = hz.window_elems(num_reqs, self.num_splits, self.block_m, window)
        if score_buffer is None:
            score_buffer = torch.empty(2 * max(n, 1) + nw, dtype=torch.float32,
                                       device=self.device)
        self.scratch, self.win = self._scratch_view(score_buffer, n, nw)
        self._prepare_launches()
        if warmup is None:
            warmup = self.device.type == "cuda"
        if warmup:
            self._warmup()

    def _prepare_launches(self) -> None:
        """The run's kernels with their constexprs fixed (``launcher.CachedLaunch``: an eager
        launch costs little host time; issue 14)."""
        from .launcher import CachedLaunch
        q, h = self.query_len, self.num_heads
        if self.dequant in PAGE_SCORE_MODES:
            self._page_score = decode_wgmma.PageScoreLaunch(
                self.dequant, width=self.width, query_len=q, num_heads=h, rows=self.block_m,
                num_splits=self.num_splits, num_reqs=self.num_reqs, programs=self.programs,
                maxnreg=self.maxnreg, fp8=self.kernel_dot == "fp8")
            return
        self._score = CachedLaunch(
            _decode_score_kernel, Q=q, H=h, BLOCK_M=self.block_m, NUM_SPLITS=self.num_splits,
            DOT=self.kernel_dot, DEQUANT=self.dequant, WINDOW=self.window, KEEP=self.keep,
            PDL=self.pdl, num_warps=self.num_warps, num_stages=self.num_stages,
            **self._reg_cap)
        cands = self.num_splits * self.keep
        if self.num_splits > 1 and not self.pdl and cands <= REDUX_MERGE_MAX_CANDIDATES \
                and not portable_default(self.device) \
                and torch.cuda.get_device_capability(self.device) >= (8, 0):
            # the Gluon merge (``redux_select.redux_merge_kernel``): one row per warp
            from .redux_select import launch_shape, redux_merge_kernel
            k, self.merge_rows = launch_shape(cands, q * h)
            self.merge_warps = self.merge_rows
            self._merge = CachedLaunch(
                redux_merge_kernel, Q=q, H=h, BLOCK_M=self.block_m, C=cands, K=k,
                ROWS=self.merge_rows, num_warps=self.merge_warps)
            return
        self._merge = CachedLaunch(
            _decode_merge_kernel, Q=q, H=h, BLOCK_M=self.block_m, NUM_SPLITS=self.num_splits,
            SPLITS_PAD=self.splits_pad, ROWS=self.merge_rows, KEEP=self.keep, PDL=self.pdl,
            num_warps=self.merge_warps, **self._pdl_launch)

    @property
    def error_bits(self) -> int:
        """SPEC 9's b of what this runner's kernels compute (``kernel_dot``: with dot "fp8",
        15 where the chosen scorer has no E4M3 operands)."""
        return SCORE_ERROR_BITS[self.kernel_dot]

    def _scratch_view(self, buf: torch.Tensor, n: int, nw: int):
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.float32 or buf.dim() != 1 \
                or not buf.is_contiguous():
            raise ValueError("score_buffer: expected a contiguous 1-d float32 tensor, got "
                             f"{getattr(buf, 'dtype', type(buf))} shape "
                             f"{tuple(getattr(buf, 'shape', ()))}")
        if buf.device != self.device:
            raise ValueError(f"score_buffer: expected a tensor on {self.device}, got {buf.device}")
        need = 2 * n + nw
        if buf.numel() < need:
            raise ValueError(f"score_buffer: expected at least {need} float32 elements "
                             f"(score_buffer_size), got {buf.numel()}")
        if buf.data_ptr() % 8:
            raise ValueError("score_buffer: expected an 8-byte aligned start, got data_ptr "
                             f"{buf.data_ptr():#x}")
        cand = buf[:2 * n].view(torch.int64) if n else buf[:0].view(torch.int64)
        return cand, buf[2 * n:need]

    def _warmup(self) -> None:
        b, w, q, h = self.num_reqs, self.width, self.query_len, self.num_heads
        dev = self.device
        index_q = torch.zeros((b * q, h, HEAD_DIM), dtype=torch.float8_e4m3fn, device=dev)
        from ..reference.paging import new_index_cache
        cache = new_index_cache(1, device=dev)
        block_table = torch.zeros((b, w), dtype=torch.int32, device=dev)
        seq_lens = torch.zeros((b,), dtype=torch.int32, device=dev)
        out = torch.empty((b * q, h, TOPK), dtype=torch.int32, device=dev)
        self.run(index_q, cache, block_table, seq_lens, out)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def run(self, index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Select pages into ``out`` (SPEC 5, 6): no allocation, no sync, capturable.

        Args:
            index_q: ``float8_e4m3fn [B*Q, H, 128]`` (unit last stride). cache: ``uint8
            [N, 128, 72]`` paged cache view (page stride = ``cache.stride(0)``).
            block_table: int32 ``[B, W]`` (unit last stride). seq_lens: int32 ``[B]``.
            out: int32 ``[B*Q, H, 16]`` contiguous.
        Values are trusted (validated by the caller's ``plan()``); shapes are checked. Even
        so the kernels clamp seq_lens to ``W * 128`` and block ids into
        ``[0, cache.shape[0])``: edited buffers never make them read outside the block-table
        row or the cache (SPEC 10). Returns ``out``.

        Raises:
            ValueError: wrong shapes, an empty cache, or (dequant "mma" / "wgmma") a cache
                whose base or page stride the Gluon scorer cannot read
                (``decode_wgmma.launch``).
        """
        b, q, h = self.num_reqs, self.query_len, self.num_heads
        if cache.shape[0] == 0:  # block ids are clamped into the cache: it needs a block
            raise ValueError("cache: expected at least one block, got an empty cache")
        if tuple(index_q.shape) != (b * q, h, HEAD_DIM) or tuple(out.shape) != (b * q, h, TOPK) \
                or tuple(block_table.shape) != (b, self.width) or seq_lens.shape[0] != b:
            raise ValueError(
                f"DecodeRunner(B={b}, W={self.width}, Q={q}, H={h}).run: expected index_q "
                f"[{b * q}, {h}, {HEAD_DIM}], block_table [{b}, {self.width}], seq_lens [{b}], "
                f"out [{b * q}, {h}, {TOPK}]; got {tuple(index_q.shape)}, "
                f"{tuple(block_table.shape)}, {tuple(seq_lens.shape)}, {tuple(out.shape)}")
        if self.dequant in PAGE_SCORE_MODES:
            with device_guard(self.device):
                self._page_score(index_q, cache, block_table, seq_lens, out, self.win,
                                 num_blocks=cache.shape[0])
            return out
        q8 = index_q.view(torch.uint8)
        with device_guard(self.device):
            self._score((b, self.num_splits), q8, q8.stride(0), q8.stride(1), cache,
                        cache.stride(0), block_table, block_table.stride(0), seq_lens,
                        self.scratch, self.win, out, self.width, cache.shape[0], 0, 1)
            if self.num_splits > 1:
                self._merge((b, triton.cdiv(q * h, self.merge_rows)), self.scratch, seq_lens,
                            out, self.width)
        return out


def _check_dequant(dequant: str, dot: str, device: torch.device, block_m: int) -> None:
    """The device- and shape-dependent half of a decode dequant mode's check
    (``DecodeConfig`` checks the name)."""
    if dequant == "wgflat" and block_m > hz.MMA_MAX_ROWS:
        raise ValueError(f"dequant: 'wgflat' scores at most {hz.MMA_MAX_ROWS} query rows "
                         f"(Q * H padded to BLOCK_M), got BLOCK_M {block_m}: use 'wgmma'")
    if dequant == "lut" and dot != "fp32":
        raise ValueError(f"dequant: 'lut' scores with dot 'fp32', got dot {dot!r}")
    if dequant == "mma" and (dot != "fp16" or not mma_available(device)):
        raise ValueError(f"dequant: 'mma' needs a CUDA SM89+ GPU and dot 'fp16', got dot "
                         f"{dot!r} on {device}")
    if dequant == "wgmma" and (dot != "fp16" or not wgmma_available(device)):
        raise ValueError(f"dequant: 'wgmma' needs a CUDA SM90 GPU and dot 'fp16', got dot "
                         f"{dot!r} on {device}")
    if dequant == "wgflat" and (dot not in ("fp16", "fp8")
                                or not wgmma_available(device)):
        raise ValueError(f"dequant: 'wgflat' needs a CUDA SM90 GPU and dot 'fp16' or 'fp8', "
                         f"got dot {dot!r} on {device}")
    if dequant in KERNEL_DEQUANT_MODES and dequant != "triton" and (
            dot != "fp16" or portable_default(device)):
        raise ValueError(f"dequant: {dequant!r} needs a CUDA GPU and dot 'fp16', got dot "
                         f"{dot!r} on {device}")


def decode_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, query_len: int, out: torch.Tensor, *,
                   config: DecodeConfig | None = None) -> torch.Tensor:
    """Eager decode indexer (SPEC 5, 6): selected pages of a uniform decode batch into ``out``.

    Args:
        index_q: ``float8_e4m3fn [B*Q, H, 128]``, request-major (row = b*Q + i).
        cache: ``uint8 [N, 128, 72]`` paged cache. block_table: int32 ``[B, W]``.
        seq_lens: int32 ``[B]`` (Q <= seq_len <= W*128, or 0 for padding).
        query_len: Q in 1..8. out: int32 ``[B*Q, H, 16]`` contiguous.
        config: tuning, see ``DecodeRunner``.
    Inputs are assumed validated (``nvfp4_indexer.api.decode_indexer`` does it). Returns ``out``.
    """
    b, w = block_table.shape
    runner = DecodeRunner(index_q.shape[1], b, w, query_len, index_q.device, config=config,
                          warmup=False)
    return runner.run(index_q, cache, block_table, seq_lens, out)
