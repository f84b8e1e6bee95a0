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
(``topk.keep_per_split``: a split never needs more), updated either per page
(``topk_insert``, WINDOW = 1) or, for splits of >= ``MIN_WINDOW_PAGES`` pages, once per
window of WINDOW pages whose scores were buffered in a per-program scratch
(``topk_merge``: only as many rounds as candidates beat the kept entries). Each program then
writes its lists to the candidate scratch ``int64 [B, BLOCK_M, NUM_SPLITS, KEEP]``.

Dequantization (the ``DEQUANT`` constexpr, ``DecodeRunner(dequant=...)``): "triton" is
``scoring.nvfp4_page_scores`` (two K=64 MMAs; one K=128 fp32 dot in the interpreter); "ptx" /
"ptx_arith" (GPU, dot "fp16") are ``scoring.nvfp4_page_scores_ptx``: code bytes read as uint16
pairs, inline-PTX dequantization (bit-exact SPEC 1.4, "ptx_arith" without conversion
instructions) and four K=32 fp16 MMAs over dims 4i + j. "ptx" is the default on SM89+ GPUs.
These and window / num_warps / num_stages / programs_per_sm / maxnreg are tuning knobs for
``benchmarks/dequant_lab.py``; the defaults are what the H200 lab measured best
(docs/benchmarks.md).

Merge kernel, grid ``(B, Q*H)``: one row per program (``topk.merge_config``; 1-4 warps by
the candidate count) loads the row's ``NUM_SPLITS * KEEP`` candidates and writes the final
SPEC 5 output (15 rounds of max-and-remove, skipped when the row is short; slot 15 = L;
padding rows by formula). With ``NUM_SPLITS == 1`` the score kernel writes the output itself
and there is no merge launch and no candidate scratch.

Nothing depends on host values of ``seq_lens`` / ``block_table``: the grid and all constexprs
are a function of (B, W, Q, H, SM count), every program writes all of its outputs every run
(no state carried between runs; the window scratch is rewritten before it is read), so a
CUDA-graph replay after in-place changes of the buffers computes fresh results. Block-table
entries at or past a request's history page count are never read.

``NUM_SPLITS`` (``choose_num_splits``): 1 when W - 1 <= 15 (every row is short, SPEC 5: no
page is scored, one launch); else min(ceil(PROGRAMS_PER_SM * num_sms / B), W - 1, MAX_SPLITS)
(1-page splits), lowered to ceil((W - 1) / 2) once B * NUM_SPLITS exceeds 4 programs per SM
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
from ..validation import check_int, is_int
from . import decode_wgmma
from .dot_modes import resolve_dot
from .layout import num_history_pages, scored_pages, split_range
from .numerics import device_guard, portable_default
from .operands import load_q_pairs_t, load_q_quads_t
from .ptx import DEQUANT_MODES
from .scan import (clamped_seq_len, decode_rows, finish_split, merge_splits, out_offsets,
                   scan_pages)
from .scoring import nvfp4_page_scores, nvfp4_page_scores_ptx
from .topk import choose_window as topk_choose_window
from .topk import keep_per_split, merge_config

# Page-score modes (``decode_wgmma``): scores to a [B, N, W] scratch, then a select kernel.
PAGE_SCORE_MODES = ("wgmma", "lut")
DECODE_DEQUANT_MODES = DEQUANT_MODES + PAGE_SCORE_MODES

# b of SPEC 9's tie tolerance e = 2^-b * max_t sum_d |q_d K_d|, per dot mode (see module doc).
SCORE_ERROR_BITS = {"fp16": 15, "bf16": 15, "fp8": 5, "fp32": 16}

PROGRAMS_PER_SM = 16  # split target: about this many score programs per SM (H200 lab)
MIN_PAGES_PER_SPLIT = 4  # at full block-table width, at least this many pages per split
MAX_SPLITS = 256
MAX_ROWS = 64  # Q * H rows a score program holds (BLOCK_M)
WINDOW = 64  # pages whose scores are buffered before one top-k merge
MIN_WINDOW_PAGES = 32  # splits shorter than this insert each page's candidate directly
WGMMA_MIN_PAGES = 24576  # B * (W - 1) below this: the one-launch kernel (dequant "ptx")
WGMMA_PROGRAMS_PER_SM = 32  # split target of the wgmma path
MAXNREG = 128  # score-kernel register cap: 4 CTAs of 4 warps per SM (H200 lab: +6-8 %)
_DEFAULT_NUM_SMS = 132  # used off CUDA (interpreter) and by score_buffer_size without a GPU


def block_rows(query_len: int, num_heads: int) -> int:
    """BLOCK_M: the request's Q*H query rows padded to a power of two >= 16."""
    return max(16, triton.next_power_of_2(query_len * num_heads))


def _num_sms(device=None) -> int:
    if device is not None and torch.device(device).type != "cuda":
        return _DEFAULT_NUM_SMS
    if not torch.cuda.is_available():
        return _DEFAULT_NUM_SMS
    idx = torch.device(device).index if device is not None else None
    if idx is None:
        idx = torch.cuda.current_device()
    return torch.cuda.get_device_properties(idx).multi_processor_count


def choose_num_splits(num_reqs: int, width: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """NUM_SPLITS for a batch of ``num_reqs`` requests with block tables ``width`` wide on a GPU
    with ``num_sms`` SMs (static shape only: never the sequence lengths): about
    ``programs_per_sm`` score programs per SM, at least ``MIN_PAGES_PER_SPLIT`` pages per split
    once the grid exceeds two waves of 4 programs per SM; below that, splits as short as 2
    pages, and 1 page while the grid stays within 4 programs per SM (a small batch is
    latency-bound: shorter serial chains; H200 lab: b1 x 32K 9.5 -> 8.4 us, b8 x 4K 9.3 ->
    8.4 us with 1-page splits). 1 when ``width - 1 <= 15``: every row is short (SPEC 5),
    nothing is scored and the score kernel writes the output itself (no merge launch)."""
    max_pages = max(width - 1, 1)  # history pages <= (W*128 - 1) // 128
    if max_pages <= 15:  # every row has L <= 15: SPEC 5's formula, nothing to split
        return 1
    b = max(num_reqs, 1)
    ns = min(triton.cdiv(programs_per_sm * num_sms, b), max_pages, MAX_SPLITS)
    if b * ns > 4 * num_sms:
        ns = min(ns, triton.cdiv(max_pages, 2))
    if b * ns > 8 * num_sms:
        ns = min(ns, triton.cdiv(max_pages, MIN_PAGES_PER_SPLIT))
    return max(ns, 1)


def choose_window(num_splits: int, width: int, block_m: int) -> int:
    """Default top-k window (``topk.choose_window``): 1 (a direct insert per page) when a
    split holds fewer than ``MIN_WINDOW_PAGES`` pages, else ``WINDOW`` capped by the split's
    pages and by ``window * BLOCK_M <= 4096`` (static shapes only)."""
    per = triton.cdiv(max(width - 1, 1), num_splits)
    return topk_choose_window(per, block_m, WINDOW, MIN_WINDOW_PAGES)


def _scratch_elems(num_reqs: int, num_splits: int, rows: int, keep: int) -> int:
    """int64 candidate scratch elements: [B, BLOCK_M, NUM_SPLITS, KEEP], none when unsplit."""
    return 0 if num_splits == 1 else num_reqs * rows * num_splits * keep


def _window_elems(num_reqs: int, num_splits: int, rows: int, window: int) -> int:
    """fp32 window-buffer elements: [B * NUM_SPLITS, 2, WINDOW, BLOCK_M] (none for WINDOW 1)."""
    return 0 if window == 1 else num_reqs * num_splits * 2 * window * rows


def score_buffer_size(num_reqs: int, num_pages: int, num_heads: int, query_len: int = 8, *,
                      num_sms: int | None = None, window: int | None = None,
                      num_splits: int | None = None,
                      programs_per_sm: int = PROGRAMS_PER_SM, dequant: str | None = None,
                      device=None, wgmma_min_pages: int | None = None) -> int:
    """float32 elements of scratch a ``DecodeRunner`` needs (SPEC 6): its int64 candidate
    scratch and its fp32 page-score window buffer.

    Args:
        num_reqs: padded batch size B. num_pages: block-table width W (pages per request).
        num_heads: index heads H. query_len: Q (1..8).
        num_sms: SMs of the GPU the runner will use; default: the current CUDA device's, or
            132 without CUDA.
        window / num_splits / programs_per_sm / dequant / wgmma_min_pages: the runner's
            overrides, if it was given any (defaults: ``choose_window`` / ``choose_num_splits`` /
            ``PROGRAMS_PER_SM`` / ``choose_dequant`` on ``device``).
        device: the runner's device (default: the current CUDA device, or the CPU).
    Returns:
        Number of float32 elements: the int64 candidate scratch (none when the runner does not
        split) followed by the window buffer (none for window 1). A buffer this size can back
        the runner of these shapes and overrides on such a GPU (wrappers that never run at
        once may share one: pass the largest size).
    No errors are raised here; bad sizes are refused by ``DecodeRunner``.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if dequant is None:
        dequant = choose_dequant(device, "fp32" if portable_default(device) else "fp16",
                                 num_reqs, num_pages, wgmma_min_pages)
    rows = block_rows(query_len, num_heads)
    if dequant in PAGE_SCORE_MODES:
        return decode_wgmma.scratch_elems(num_reqs, num_pages, rows)
    if num_sms is None:
        num_sms = _num_sms(device)
    ns = num_splits or choose_num_splits(num_reqs, num_pages, num_sms, programs_per_sm)
    window = window or choose_window(ns, num_pages, rows)
    keep = keep_per_split(ns, num_pages)
    return 2 * _scratch_elems(num_reqs, ns, rows, keep) + _window_elems(num_reqs, ns, rows,
                                                                        window)


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
        score_buffer: optional float32 scratch of at least ``score_buffer_size(B, W, H, Q)``
            elements (with the same ``window`` / ``num_splits`` / ``programs_per_sm``
            overrides, if any; 8-byte aligned), shared with runners that never run
            concurrently.
        dot: dot mode (``dot_modes.DOT_MODES``): default "fp16" on a GPU, "fp32" under the
            interpreter; "bf16" and "fp8" for comparison (see SCORE_ERROR_BITS).
        num_splits: override NUM_SPLITS (tests / tuning): an int in 1..MAX_SPLITS.
        dequant: how a page is dequantized and scored (``DECODE_DEQUANT_MODES``; default
            ``choose_dequant``: "wgmma" on SM90 GPUs for large batches, else "ptx" on SM89+
            GPUs with dot "fp16", else "triton"). "wgmma": register-operand wgmma over
            table-lookup dequantized keys, page scores to a scratch, then a select kernel
            (``decode_wgmma``; SM90, dot "fp16"); "lut": its plain-Triton twin (dot "fp32",
            any device, the interpreter included); "triton"
            (Triton ops, every dot mode), "ptx" (inline PTX with native E4M3 conversions) or
            "ptx_arith" (inline PTX, rounding by fp16 arithmetic, no conversion
            instructions); both ptx modes are bit-exact SPEC 1.4, need a CUDA GPU ("ptx" SM89+,
            "ptx_arith" SM90+: max.u16x2)
            and dot "fp16", and score with four K=32 MMAs (same error bound as "fp16").
        window: pages scored between two top-k merges (a power of two; default
            ``choose_window``): page scores go to a small per-program buffer and are merged
            into the running top-KEEP once per window (``topk.topk_merge``); 1 inserts every
            page's candidate at once (``topk.topk_insert``).
        num_warps / num_stages: score-kernel launch options (tuning; default 4 / 2).
        maxnreg: register cap of the score kernel (tuning; default ``MAXNREG``, None: no cap).
        programs_per_sm: split target used by ``choose_num_splits`` (default
            ``PROGRAMS_PER_SM``; ignored when ``num_splits`` is given).
        wgmma_min_pages: the B * (W - 1) below which the default dequant is "ptx" rather
            than "wgmma" (``choose_dequant``).
        pdl: launch the merge kernel with programmatic dependent launch (SM90+): it may start
            once every score program has scored its pages (``griddepcontrol``), and waits for
            the score grid's writes before reading them.
        warmup: compile both kernels now by one launch on an all-padding batch (default on
            CUDA), so that capturing ``run`` never compiles.
    Raises:
        ValueError: bad sizes, score buffer or tuning knob (a ptx dequant mode off CUDA / under
            the interpreter or with a dot mode other than "fp16"). NotImplementedError:
            Q*H > 64.
    """

    def __init__(self, num_heads: int, num_reqs: int, width: int, query_len: int, device,
                 score_buffer: torch.Tensor | None = None, *, dot: str | None = None,
                 num_splits: int | None = None, warmup: bool | None = None,
                 dequant: str | None = None, window: int | None = None, num_warps: int = 4,
                 num_stages: int = 2, programs_per_sm: int | None = None,
                 maxnreg: int | None = MAXNREG, pdl: bool = False,
                 wgmma_min_pages: int | None = None):
        # Python or numpy integers, never bool (SPEC 11): one check with the API's
        num_heads, num_reqs, width, query_len = (
            check_int(name, val, lo=1) for name, val in (
                ("num_heads", num_heads), ("num_reqs", num_reqs), ("width", width),
                ("query_len", query_len)))
        if query_len * num_heads > MAX_ROWS:
            raise NotImplementedError(f"query_len * num_heads: the Triton decode kernel holds "
                                      f"at most {MAX_ROWS} rows per request, got "
                                      f"{query_len} * {num_heads}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_heads, self.num_reqs, self.width, self.query_len = (num_heads, num_reqs,
                                                                     width, query_len)
        self.block_m = block_rows(query_len, num_heads)
        self.dot = resolve_dot(dot, self.device)
        if dequant is None:
            dequant = choose_dequant(self.device, self.dot, num_reqs, width, wgmma_min_pages)
        if dequant not in DECODE_DEQUANT_MODES:
            raise ValueError(f"dequant: expected one of {DECODE_DEQUANT_MODES}, got "
                             f"{dequant!r}")
        if dequant == "lut" and self.dot != "fp32":
            raise ValueError(f"dequant: 'lut' scores with dot 'fp32', got dot {self.dot!r}")
        if dequant == "wgmma" and (self.dot != "fp16"
                                   or not decode_wgmma.wgmma_available(self.device)):
            raise ValueError(f"dequant: 'wgmma' needs a CUDA SM90 GPU and dot 'fp16', got dot "
                             f"{self.dot!r} on {self.device}")
        if dequant in DEQUANT_MODES and dequant != "triton" and (
                self.dot != "fp16" or portable_default(self.device)):
            raise ValueError(f"dequant: {dequant!r} needs a CUDA GPU and dot 'fp16', got dot "
                             f"{self.dot!r} on {self.device}")
        if programs_per_sm is None:
            programs_per_sm = WGMMA_PROGRAMS_PER_SM if dequant == "wgmma" else PROGRAMS_PER_SM
        num_warps = check_int("num_warps", num_warps, choices=(1, 2, 4, 8, 16))
        num_stages = check_int("num_stages", num_stages, lo=1)
        programs_per_sm = check_int("programs_per_sm", programs_per_sm, lo=1)
        num_splits = check_int("num_splits", num_splits, lo=1, hi=MAX_SPLITS, optional=True)
        self.num_splits = num_splits or choose_num_splits(num_reqs, width,
                                                          _num_sms(self.device),
                                                          programs_per_sm)
        if window is None:
            window = choose_window(self.num_splits, width, self.block_m)
        if not is_int(window) or window < 1 or window & (window - 1) \
                or window * block_rows(query_len, num_heads) > 4096:
            raise ValueError(f"window: expected a power of two with window * BLOCK_M <= 4096, "
                             f"got {window!r}")
        window = int(window)
        maxnreg = check_int("maxnreg", maxnreg, lo=24, hi=255, optional=True)
        self.dequant, self.window, self.maxnreg = dequant, window, maxnreg
        # the register cap is a GPU compile option (the interpreter has none)
        self._reg_cap = ({} if maxnreg is None or portable_default(self.device)
                         else {"maxnreg": maxnreg})
        self.num_warps, self.num_stages = num_warps, num_stages
        if not isinstance(pdl, bool) or (pdl and (portable_default(self.device) or
                                                  torch.cuda.get_device_capability(
                                                      self.device) < (9, 0))):
            raise ValueError(f"pdl: expected a bool, True only on SM90+ CUDA GPUs, got {pdl!r} "
                             f"on {self.device}")
        self.pdl = pdl
        self._pdl_launch = {"launch_pdl": True} if pdl else {}
        self.splits_pad = triton.next_power_of_2(self.num_splits)
        self.keep = keep_per_split(self.num_splits, width)
        self.merge_rows, self.merge_warps = merge_config(self.num_splits, self.keep)
        if dequant in PAGE_SCORE_MODES:  # one fp32 page-score scratch [B, N, W]
            n, nw = 0, decode_wgmma.scratch_elems(num_reqs, width, self.block_m)
        else:
            n = _scratch_elems(num_reqs, self.num_splits, self.block_m, self.keep)
            nw = _window_elems(num_reqs, self.num_splits, self.block_m, window)
        if score_buffer is None:
            score_buffer = torch.empty(2 * max(n, 1) + nw, dtype=torch.float32,
                                       device=self.device)
        self.scratch, self.win = self._scratch_view(score_buffer, n, nw)
        if warmup is None:
            warmup = self.device.type == "cuda"
        if warmup:
            self._warmup()

    @property
    def error_bits(self) -> int:
        """SPEC 9's b for this runner's dot mode."""
        return SCORE_ERROR_BITS[self.dot]

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
                decode_wgmma.launch(self.dequant, index_q, cache, block_table, seq_lens, out,
                                    self.win, num_blocks=cache.shape[0], query_len=q,
                                    num_heads=h, rows=self.block_m,
                                    num_splits=self.num_splits)
            return out
        q8 = index_q.view(torch.uint8)
        with device_guard(self.device):
            _decode_score_kernel[(b, self.num_splits)](
                q8, q8.stride(0), q8.stride(1), cache, cache.stride(0),
                block_table, block_table.stride(0), seq_lens, self.scratch, self.win, out,
                self.width, cache.shape[0], 0, 1, Q=q, H=h, BLOCK_M=self.block_m,
                NUM_SPLITS=self.num_splits,
                DOT=self.dot, DEQUANT=self.dequant, WINDOW=self.window, KEEP=self.keep,
                PDL=self.pdl, num_warps=self.num_warps, num_stages=self.num_stages,
                **self._reg_cap)
            if self.num_splits > 1:
                _decode_merge_kernel[(b, triton.cdiv(q * h, self.merge_rows))](
                    self.scratch, seq_lens, out, self.width, Q=q, H=h, BLOCK_M=self.block_m,
                    NUM_SPLITS=self.num_splits, SPLITS_PAD=self.splits_pad,
                    ROWS=self.merge_rows, KEEP=self.keep, PDL=self.pdl,
                    num_warps=self.merge_warps, **self._pdl_launch)
        return out


def choose_dequant(device: torch.device, dot: str, num_reqs: int, width: int,
                   min_pages: int | None = None) -> str:
    """The runner's default dequant mode for a static shape: "wgmma" on SM90 GPUs with dot
    fp16 (``decode_wgmma``) for batches of at least ``min_pages`` (default
    ``WGMMA_MIN_PAGES``) pages, B * (W - 1), with rows to score; else the one-launch kernel's
    ``default_dequant`` (its fused top-k saves the select launch)."""
    min_pages = WGMMA_MIN_PAGES if min_pages is None else min_pages
    if dot == "fp16" and decode_wgmma.wgmma_available(device) \
            and num_reqs * (width - 1) >= min_pages and width - 1 > 15:
        return "wgmma"
    return default_dequant(device, dot)


def default_dequant(device: torch.device, dot: str) -> str:
    """The one-launch score kernel's dequant mode (``_decode_score_kernel``, also used by the
    context-parallel runner): "ptx" where its conversions exist (CUDA SM89+) and the dot is
    fp16, else "triton"."""
    if dot != "fp16" or portable_default(device) or device.type != "cuda":
        return "triton"
    return "ptx" if torch.cuda.get_device_capability(device) >= (8, 9) else "triton"


def decode_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, query_len: int, out: torch.Tensor, *,
                   dot: str | None = None, num_splits: int | None = None,
                   **tuning) -> torch.Tensor:
    """Eager decode indexer (SPEC 5, 6): selected pages of a uniform decode batch into ``out``.

    Args:
        index_q: ``float8_e4m3fn [B*Q, H, 128]``, request-major (row = b*Q + i).
        cache: ``uint8 [N, 128, 72]`` paged cache. block_table: int32 ``[B, W]``.
        seq_lens: int32 ``[B]`` (Q <= seq_len <= W*128, or 0 for padding).
        query_len: Q in 1..8. out: int32 ``[B*Q, H, 16]`` contiguous.
        dot / num_splits / tuning (dequant, window, num_warps, num_stages,
        programs_per_sm, maxnreg): see ``DecodeRunner``.
    Inputs are assumed validated (``nvfp4_indexer.api.decode_indexer`` does it). Returns ``out``.
    """
    b, w = block_table.shape
    runner = DecodeRunner(index_q.shape[1], b, w, query_len, index_q.device, dot=dot,
                          num_splits=num_splits, warmup=False, **tuning)
    return runner.run(index_q, cache, block_table, seq_lens, out)
