"""Host rules that pick the Triton launches' shapes (pure functions of static shapes and the
device; never of device values, so CUDA-graph replays stay valid).

One home for: the split count of decode / context-parallel / prefill score kernels (one
rule), the top-k window, the candidates a split keeps, the merge program shape, BLOCK_M,
scratch sizes and the default dequant mode (the prefill and gather rules:
``triton.prefill.dispatch``). Why the defaults are what they are (measurements):
docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from ..constants import TOPK

# -- decode (and context parallelism) --------------------------------------------------------
PROGRAMS_PER_SM = 16  # split target: about this many score programs per SM
MIN_PAGES_PER_SPLIT = 4  # at full block-table width, at least this many pages per split
MAX_SPLITS = 256
MAX_ROWS = 64  # Q * H rows a decode score program holds (BLOCK_M)
MIN_BLOCK_M = 16  # smallest BLOCK_M of a row-block scorer (tl.dot's smallest M)
WINDOW = 64  # pages whose scores are buffered before one top-k merge
MIN_WINDOW_PAGES = 32  # splits shorter than this insert each page's candidate directly
MAX_WINDOW_ELEMS = 4096  # window * BLOCK_M bound of the window scratch
MMA_MIN_PAGES = 2048  # B * (W - 1) from this on SM90: the page-score path (dequant "mma")
MMA_MIN_WIDTH = 16  # ... and W - 1 from this (16: any request with pages to score)
MMA_PROGRAMS_PER_SM = 12  # flat programs per SM of the mma path: its residency (one wave)
MMA_MAXNREG = 168  # its register cap: 3 one-warp programs per scheduler, no spills
MMA_STAGES = 4  # chunk slots of its cp.async ring (3 chunks of 16 tokens in flight)
WGFLAT_PROGRAMS_PER_SM = 4  # its flat programs per SM: residency at <= 128 registers
WGFLAT_MIN_PAGES = 24576  # B * (W - 1) from this on SM90 at 32 rows: dequant "wgflat"
# dot "fp8" (opt-in, SPEC 9 b = 5) on SM90: "wgflat" with E4M3 operands from these many pages
# B * (W - 1) at 32 rows / at <= 16 rows; below them the exact fp16 choice, which measured
# faster there (docs/benchmarks.md, issue 13, twelfth step)
FP8_MIN_PAGES = 2048
FP8_MIN_PAGES_NARROW = 4096
WGFLAT_MIN_ROWS = 32  # ... and BLOCK_M from this (at 16 rows it measured even with "mma")
WGFLAT_MIN_WIDTH = 64  # ... and W - 1 from this (its measured domain; shorter: "mma")
WGFLAT_MIN_GROUPS = 2  # its flat programs: at most one per this many groups of 4 pages
WGFLAT_STAGES = 4  # chunk slots of its cp.async ring
WGFLAT_ASYNC = 1  # the low K half's wgmma runs while the high half is looked up
WGFLAT_ASYNC_FP8 = 0  # E4M3 operands (dot "fp8"): synchronous wgmma
MMA_MAX_ROWS = 32  # BLOCK_M above this (Q * H = 64): the wgmma scorer instead
WGMMA_MIN_PAGES = 16384  # B * (W - 1) from this at BLOCK_M 64: the wgmma scorer
WGMMA_PROGRAMS_PER_SM = 32  # split target of the wgmma path
MAXNREG = 128  # score-kernel register cap: 4 CTAs of 4 warps per SM
SHORT_MAX_LOCAL = 15  # rows with L <= 15 need no scores (SPEC 5)

# -- merge ----------------------------------------------------------------------------------
# keys per one-warp program of the sorting merge (``merge_config``: 8 rows of 2 splits x 16, 4
# of 4 x 16). One row per program was launch-bound (~124 one-warp programs per SM at 4K new
# tokens): H200 merge alone 128x2 splits 11.6 -> 5.2 us, 512x2 41.2 -> 15.1, 32x4 4.3 -> 3.9,
# bit-equal; 512 keys (8 rows of 4 splits) 5.4 us
MERGE_SORT_KEYS_PER_WARP = 256
# the merge sorts only rows of at most this many candidate columns (``merge_sorts``; a build
# without the limit had no fewer SASS instructions at 16 splits x 16)
MERGE_SORT_MAX_COLUMNS = 64

# -- insert ----------------------------------------------------------------------------------
INSERT_BLOCK_T = 4  # tokens per program on a GPU


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (plain Python: ``triton.cdiv``'s wrapper costs host time)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block_rows(query_len: int, num_heads: int) -> int:
    """Decode BLOCK_M: the request's Q*H query rows padded to a power of two >= 16."""
    return max(MIN_BLOCK_M, next_pow2(query_len * num_heads))


def _split_rule(programs: int, target: int, cap: int) -> int:
    """The shared split rule: about ``target`` score programs over ``programs`` programs per
    split, at most ``cap`` (pages) and ``MAX_SPLITS``, at least 1."""
    return max(min(cdiv(target, max(programs, 1)), cap, MAX_SPLITS), 1)


def decode_splits(num_reqs: int, max_pages: int, num_sms: int,
                  programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """NUM_SPLITS of ``num_reqs`` requests of at most ``max_pages`` pages to score each:
    about ``programs_per_sm`` score programs per SM, 1-page splits while the grid stays
    within 4 programs per SM (small batches are latency-bound: short serial chains), 2-page
    splits up to two waves (8 per SM), at least ``MIN_PAGES_PER_SPLIT`` pages beyond."""
    b = max(num_reqs, 1)
    ns = _split_rule(b, programs_per_sm * num_sms, max_pages)
    if b * ns > 4 * num_sms:
        ns = min(ns, cdiv(max_pages, 2))
    if b * ns > 8 * num_sms:
        ns = min(ns, cdiv(max_pages, MIN_PAGES_PER_SPLIT))
    return max(ns, 1)


def choose_num_splits(num_reqs: int, width: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Decode NUM_SPLITS for block tables ``width`` wide (``decode_splits`` over the
    W - 1 pages a request can score). 1 when ``width - 1 <= 15``: every row is short (SPEC 5),
    nothing is scored and the score kernel writes the output itself (no merge launch)."""
    max_pages = max(width - 1, 1)  # history pages <= (W*128 - 1) // 128
    if max_pages <= SHORT_MAX_LOCAL:
        return 1
    return decode_splits(num_reqs, max_pages, num_sms, programs_per_sm)


def page_score_programs(num_reqs: int, width: int, num_sms: int, programs_per_sm: int,
                        num_splits: int | None = None, pages_per_program: int = 1) -> int:
    """Programs P of a flat page-score launch (``decode_wgmma.flat_partition``: the batch's
    scored pages in P equal shares, whatever the requests' lengths): ``B * num_splits``
    when given, else ``programs_per_sm * num_sms`` (the "mma" / "wgflat" default: one wave
    of its resident programs), at most one per ``pages_per_program`` pages a batch can
    score, ``B * (W - 1)`` ("wgflat": 8, two groups of four pages), at least 1."""
    if num_splits:
        return max(1, num_reqs * num_splits)
    pages = num_reqs * max(width - 1, 1)
    return max(1, min(programs_per_sm * num_sms, cdiv(pages, pages_per_program)))


def subset_pages(width: int, world: int) -> int:
    """History pages a context-parallel rank scores at most per request:
    ceil((width - 1) / world)."""
    return cdiv(max(width - 1, 1), world)


def cp_num_splits(num_reqs: int, width: int, world: int, num_sms: int,
                  programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """NUM_SPLITS of a context-parallel rank's score kernel: ``decode_splits`` over the rank's
    ``subset_pages``; 1 when ``width - 1 <= 15`` (every row short, SPEC 5)."""
    if width - 1 <= SHORT_MAX_LOCAL:
        return 1
    return decode_splits(num_reqs, subset_pages(width, world), num_sms, programs_per_sm)


def keep_for_pages(pages_per_split: int) -> int:
    """Candidates a split keeps per row: min(16, next power of two >= its page count)."""
    return min(TOPK, next_pow2(pages_per_split))


def keep_per_split(num_splits: int, width: int) -> int:
    """``keep_for_pages`` of a decode split, which scores at most
    ceil((width - 1) / num_splits) pages (static shapes only)."""
    return keep_for_pages(cdiv(max(width - 1, 1), num_splits))


def choose_window(pages_per_split: int, rows: int, window: int = WINDOW,
                  min_pages: int = MIN_WINDOW_PAGES) -> int:
    """Top-k window of a scorer: 1 (a direct insert per page) below ``min_pages`` pages per
    split, else ``window`` capped by the split's pages and by ``window * rows <= 4096``."""
    if pages_per_split < min_pages:
        return 1
    return min(window, next_pow2(pages_per_split), MAX_WINDOW_ELEMS // rows)


def decode_window(num_splits: int, width: int, block_m: int) -> int:
    """Default decode window: ``choose_window`` of a split's ceil((W - 1) / NUM_SPLITS)
    pages."""
    return choose_window(cdiv(max(width - 1, 1), num_splits), block_m)


def merge_sorts(columns: int, sort: bool) -> bool:
    """Whether a merge launched with ``SORT = sort`` over ``columns`` candidate columns per row
    (``keep * next_pow2(num_splits)``) takes the bitonic top-16: the host twin of
    ``scan.merge_splits``' test (16 to ``MERGE_SORT_MAX_COLUMNS`` columns)."""
    return bool(sort) and TOPK <= columns <= MERGE_SORT_MAX_COLUMNS


def merge_config(num_splits: int, keep: int = TOPK, sort: bool = False) -> tuple[int, int]:
    """``(rows, num_warps)`` of a merge program over ``keep * next_pow2(num_splits)`` candidate
    columns per row. ``sort`` (the prefill merge's ``SORT``, always on: H200 merge alone 1.4-1.6x
    faster than 15 rounds, bit-equal): where
    the merge takes the bitonic top-16 (``merge_sorts``), 1 warp holds
    ``MERGE_SORT_KEYS_PER_WARP`` keys (``MERGE_SORT_KEYS_PER_WARP // cols`` rows). Otherwise
    one row per program (each of the 15 selection rounds stays in-thread compares and a few
    shuffles), on 1 warp (<= 512 columns), 2 (<= 1024) or 4 (more; at most 32 per thread at
    the largest decode split count)."""
    cols = keep * next_pow2(num_splits)
    if merge_sorts(cols, sort):
        return MERGE_SORT_KEYS_PER_WARP // cols, 1
    return 1, (1 if cols <= 512 else 2 if cols <= 1024 else 4)


def candidate_elems(num_reqs: int, num_splits: int, rows: int, keep: int) -> int:
    """int64 candidate scratch elements: [B, BLOCK_M, NUM_SPLITS, KEEP], none when unsplit."""
    return 0 if num_splits == 1 else num_reqs * rows * num_splits * keep


def window_elems(num_reqs: int, num_splits: int, rows: int, window: int) -> int:
    """fp32 window-buffer elements: [B * NUM_SPLITS, 2, WINDOW, BLOCK_M] (none for WINDOW 1)."""
    return 0 if window == 1 else num_reqs * num_splits * 2 * window * rows


# -- device-dependent defaults ---------------------------------------------------------------

def default_dequant(device: torch.device, dot: str) -> str:
    """The one-launch decode score kernel's dequant mode (also the context-parallel runner's):
    "ptx" where its conversions exist (CUDA SM89+) and the dot is fp16, else "triton"."""
    from .device import portable_default
    if dot != "fp16" or portable_default(device) or device.type != "cuda":
        return "triton"
    return "ptx" if torch.cuda.get_device_capability(device) >= (8, 9) else "triton"


def choose_dequant(device: torch.device, dot: str, num_reqs: int, width: int,
                   min_pages: int | None = None, rows: int = 32) -> str:
    """The decode runner's default dequant mode for a static shape (``rows`` = BLOCK_M):
    on SM90 GPUs with dot fp16, for batches of at least ``min_pages`` pages B * (W - 1) with
    rows to score, "mma" (``decode_wgmma``'s warp-per-program scorer; default ``min_pages``
    ``MMA_MIN_PAGES``, and W - 1 >= ``MMA_MIN_WIDTH``, i.e. any width with pages to score
    since the Gluon select) at <= ``MMA_MAX_ROWS`` rows, "wgmma" at
    more rows (default ``WGMMA_MIN_PAGES``: the mma scorer spills there); at 32 rows
    (``WGFLAT_MIN_ROWS``) from ``max(min_pages, WGFLAT_MIN_PAGES)`` pages with W - 1 >=
    ``WGFLAT_MIN_WIDTH`` "wgflat" (the page-per-warp wgmma scorer) instead of "mma"; else
    ``default_dequant`` (the one-launch
    kernel: its fused top-k saves the select launch). "mma" also runs on SM89 and SM100
    (``mma.sync``; compiled offline for sm_100a) but is measured on SM90 only, so it is the
    default there only. With dot "fp8" (opt-in, SPEC 9 b = 5) on SM90 at <= ``MMA_MAX_ROWS``
    rows: "wgflat" with E4M3 operands (the only scorer with a native E4M3 MMA on SM90:
    ``mma.sync`` has none there) from ``FP8_MIN_PAGES`` pages at 32 rows,
    ``FP8_MIN_PAGES_NARROW`` at fewer (``min_pages`` replaces both when given), else the
    fp16 choice (exact, and measured faster there: ``fp8_kernel_dot`` runs it on fp16)."""
    from .device import mma_available
    wide = rows > MMA_MAX_ROWS
    explicit = min_pages is not None
    if min_pages is None:
        min_pages = WGMMA_MIN_PAGES if wide else MMA_MIN_PAGES
    pages = num_reqs * (width - 1)
    if dot == "fp8":
        fp8_min = min_pages if explicit else (
            FP8_MIN_PAGES if rows >= WGFLAT_MIN_ROWS else FP8_MIN_PAGES_NARROW)
        if not wide and pages >= fp8_min and width - 1 > SHORT_MAX_LOCAL \
                and mma_available(device) and torch.cuda.get_device_capability(device) == (9, 0):
            return "wgflat"
        return choose_dequant(device, "fp16", num_reqs, width, min_pages if explicit else None,
                              rows)
    if dot == "fp16" and pages >= min_pages and width - 1 > SHORT_MAX_LOCAL \
            and (wide or width - 1 >= MMA_MIN_WIDTH) and mma_available(device) \
            and torch.cuda.get_device_capability(device) == (9, 0):
        if wide:
            return "wgmma"
        flat = rows >= WGFLAT_MIN_ROWS and pages >= max(min_pages, WGFLAT_MIN_PAGES) \
            and width - 1 >= WGFLAT_MIN_WIDTH
        return "wgflat" if flat else "mma"
    return default_dequant(device, dot)


def fp8_kernel_dot(dot: str, dequant: str) -> str:
    """The dot mode a decode kernel runs for the runner's ``dot``: dot "fp8" is a bound
    (SPEC 9 b = 5) the runner may use, so modes without E4M3 operands run their exact form
    ("ptx", "ptx_arith", "mma", "wgmma": fp16, b = 15; "lut": fp32, b = 16; both within it);
    "wgflat" and the one-launch "triton" kernel run fp8. Other dot modes unchanged."""
    if dot == "fp8" and dequant not in ("wgflat", "triton"):
        return "fp32" if dequant == "lut" else "fp16"
    return dot


def insert_launch_shape(rotary_dim: int, n: int, block_t: int | None,
                        num_warps: int | None) -> tuple[int, int]:
    """(BLOCK_T, num_warps) of an insert launch of ``n`` tokens. ROT 64 / 128 (the fast
    path) map two threads to a token; the interpreter takes larger tiles
    (``quantize.rows_per_program``)."""
    from .device import interpreting
    from .quantize import rows_per_program
    fast = rotary_dim in (64, 128)
    if block_t is None:
        block_t = rows_per_program(n) if interpreting() else INSERT_BLOCK_T
    if num_warps is None:  # fast path: 2 * BLOCK_T threads, at least one warp
        num_warps = min(8, max(1, 2 * block_t // 32)) if fast else 1
    return block_t, num_warps
