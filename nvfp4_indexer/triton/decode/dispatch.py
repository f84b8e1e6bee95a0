"""The decode rule table: which kernels a decode call runs, with which launch parameters.

One function per runner turns a static shape (B, W, Q, H), a ``DecodeConfig`` and what the
device is (its compute capability, SM count and whether Gluon imports) into a frozen plan that
names every kernel and its constexprs; the runners (``runner.DecodeRunner``,
``context_parallel.ContextParallelRunner``) only execute plans. Pure host functions: no kernel
is imported and no tensor is read, so a plan depends on static shapes only (CUDA-graph replays
stay valid) and the whole table is testable on a CPU with a simulated device.

Kernel names in a plan (``KernelLaunch.kernel``):

- score: "split" (``split_kernel.decode_score_kernel``: the one-launch kernel, split-K over
  pages, fused top-k; its ``DEQUANT`` "triton" / "ptx" / "ptx_arith"), and the page-score
  family writing fp32 page scores ``[B, N, W]``: "mma" (``mma``, one warp per program,
  ``mma.sync``), "wgflat" (``wgflat``, one warpgroup per program, one page per warp, wgmma),
  "wgmma" (``wgmma``, grid ``(B, NUM_SPLITS)``) and "lut" (``page_scores``' plain-Triton twin);
- merge of the one-launch kernel's split candidates: "redux_merge" (Gluon, ``redux``) or
  "split_merge" (``split_kernel.decode_merge_kernel``);
- select of the page-score family: "redux_select" / "redux_select_split" (Gluon, ``redux``),
  "select_wide" / "select_classes" (plain Triton, ``select``).

Default rule (``choose_dequant``), measured on the H200 (SM90): the one-launch kernel ("ptx"
on SM89+ with dot fp16, else "triton") below ``MMA_MIN_PAGES`` pages B * (W - 1); from there
"mma" at <= ``MMA_MAX_ROWS`` query rows (BLOCK_M), "wgflat" at 32 rows from
``WGFLAT_MIN_PAGES`` pages and W - 1 >= ``WGFLAT_MIN_WIDTH``, "wgmma" at 64 rows from
``WGMMA_MIN_PAGES``; the page-score modes only on SM90. With dot "fp8" (opt-in, SPEC 9 b = 5)
on SM90 "wgflat" with E4M3 operands from ``FP8_MIN_PAGES`` pages at 32 rows
(``FP8_MIN_PAGES_NARROW`` at fewer), else the exact fp16 choice (``fp8_kernel_dot``), which
measured faster there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...constants import SHORT_MAX_LOCAL, TOPK
from ..config import KERNEL_DEQUANT_MODES, PAGE_SCORE_MODES, DecodeConfig, check_config
from ..dot_modes import pick_dot
from ..heuristics import (MAX_WINDOW_ELEMS, MIN_PAGES_PER_SPLIT, block_rows,
                          candidate_elems, cdiv, choose_window, keep_for_pages, merge_config,
                          next_pow2, split_rule, window_elems)

# -- one-launch kernel (and context parallelism) ---------------------------------------------
PROGRAMS_PER_SM = 16  # split target: about this many score programs per SM
MAX_ROWS = 64  # Q * H rows a decode score program holds (BLOCK_M)
MAXNREG = 128  # its register cap: 4 CTAs of 4 warps per SM
# its split candidates merge on the Gluon ``redux_merge`` (one row per warp, two warp
# reductions per round) up to this many candidates per row (SM80+, no pdl), else on the
# Triton merge
REDUX_MERGE_MAX_CANDIDATES = 512

# -- page-score family (SM90 defaults) --------------------------------------------------------
MMA_MIN_PAGES = 2048  # B * (W - 1) from this on SM90: the page-score path ("mma")
MMA_MIN_WIDTH = 16  # ... and W - 1 from this (16: any request with pages to score)
MMA_MAX_ROWS = 32  # BLOCK_M above this (Q * H = 64): "wgmma" instead
MMA_PROGRAMS_PER_SM = 12  # flat programs per SM of "mma": its residency (one wave)
MMA_MAXNREG = 168  # its register cap: 3 one-warp programs per scheduler, no spills
MMA_STAGES = 4  # chunk slots of its cp.async ring (3 chunks of 16 tokens in flight)
WGFLAT_MIN_PAGES = 24576  # B * (W - 1) from this at 32 rows: "wgflat"
WGFLAT_MIN_ROWS = 32  # ... and BLOCK_M from this (at 16 rows it measured even with "mma")
WGFLAT_MIN_WIDTH = 64  # ... and W - 1 from this (its measured domain; shorter: "mma")
WGFLAT_PROGRAMS_PER_SM = 4  # its flat programs per SM: residency at <= 128 registers
WGFLAT_MIN_GROUPS = 2  # its flat programs: at most one per this many groups of 4 pages
WGFLAT_STAGES = 4  # chunk slots of its cp.async ring
# dot "fp8" on SM90: "wgflat" with E4M3 operands from these many pages B * (W - 1) at 32 rows
# / at <= 16 rows; below them the exact fp16 choice
FP8_MIN_PAGES = 2048
FP8_MIN_PAGES_NARROW = 4096
WGMMA_MIN_PAGES = 16384  # B * (W - 1) from this at BLOCK_M 64: "wgmma"
WGMMA_PROGRAMS_PER_SM = 32  # split target of "wgmma"

# -- select of the page-score family ----------------------------------------------------------
SELECT_CHUNK = 1024  # pages per step of the residue-class select's first pass
SELECT_GROUP = 128  # pages of one residue class a select round reloads per step
SELECT_WARPS = 1  # one warp per row: each selection round stays inside the warp
# the wide select (a row's keys in registers on several warps, 15 register-only rounds) for
# batches of at most this many rows B * Q * H, W up to SELECT_WIDE_MAX_WIDTH: few rows do not
# fill the GPU with one-warp programs, whose rounds each wait on a reload
SELECT_WIDE_MAX_ROWS = 512
SELECT_WIDE_MAX_WIDTH = 8192
# the Gluon select (a row's keys in one warp's registers, two warp reductions per round) on
# the GPU page-score paths for block tables up to this width
SELECT_REDUX_MAX_WIDTH = 512
# wider block tables up to this width, for at most SELECT_SPLIT_MAX_ROWS rows: its split form
# (S warps per row, each the 15 rounds on its slice of <= 32 * K pages, then the 15 rounds on
# the row's S * 32 kept entries; more rows fill the GPU with the one-warp residue-class
# select, which measured faster from 2048 rows)
SELECT_SPLIT_MAX_WIDTH = 8192  # at most 8 * 32 * 32: S = 8 warps of K <= 32 keys per lane
SELECT_SPLIT_MAX_ROWS = 1024
SELECT_SPLIT_KEYS = 16  # keys per lane of a split warp while S = 4 (W <= 2048; then S = 8)
REDUX_ROWS_PER_PROGRAM = 4  # rows (warps) per program of the Gluon select and merge

SEND_KEEP = TOPK  # candidates a context-parallel rank sends per row (>= the 15 history slots)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel of a plan: its name (module doc), constexprs (Gluon layouts excepted: the
    runner builds them from N), launch options (``num_warps``, ``num_stages``, ``maxnreg``,
    ``launch_pdl``) and the query rows each program takes on grid axis 1 (merge / select:
    grid ``(B, cdiv(Q * H, rows))``)."""

    kernel: str
    constexprs: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    rows: int = 1


@dataclass(frozen=True)
class DecodePlan:
    """What ``runner.DecodeRunner`` runs for one static shape (``plan_decode``).

    Fields: the shape (``num_reqs`` B, ``width`` W, ``query_len`` Q, ``num_heads`` H,
    ``block_m`` = N, the padded Q * H rows); ``dot`` (the resolved dot mode of the config),
    ``dequant`` (the score kernel's mode), ``kernel_dot`` (the dot mode the kernels run: with
    dot "fp8" the exact form of a mode without E4M3 operands); ``num_splits``, ``programs``
    (score grid: ``(B, num_splits)`` or the flat ``(programs,)`` of "mma" / "wgflat" / "lut"),
    ``window`` / ``keep`` (the one-launch kernel's top-k window and candidates per split);
    ``score`` and either ``merge`` (the one-launch kernel with more than one split) or
    ``select`` (page-score modes) as ``KernelLaunch``; ``cand_elems`` (int64 candidate
    scratch elements) and ``win_elems`` (fp32 window buffer elements, or the page-score
    scratch ``[B, N, W]``)."""

    num_reqs: int
    width: int
    query_len: int
    num_heads: int
    block_m: int
    dot: str
    dequant: str
    kernel_dot: str
    num_splits: int
    programs: int
    window: int
    keep: int
    score: KernelLaunch
    merge: KernelLaunch | None
    select: KernelLaunch | None
    cand_elems: int
    win_elems: int

    @property
    def page_scores(self) -> bool:
        """True for the page-score family (score kernel, then select)."""
        return self.dequant in PAGE_SCORE_MODES

    @property
    def scratch_elems(self) -> int:
        """float32 elements of scratch the plan needs: the int64 candidates, then the fp32
        window buffer or page scores (``runner.score_buffer_size``)."""
        return 2 * self.cand_elems + self.win_elems


@dataclass(frozen=True)
class ContextParallelPlan:
    """What ``context_parallel.ContextParallelRunner`` runs (``plan_context_parallel``): the
    one-launch score kernel over every rank's ``heads`` in page-subset mode (``score``), the
    reduce of its split candidates to ``SEND_KEEP`` per row (``reduce``) and the merge of the
    received candidates (``merge``), with the shape's ``block_m``, ``dot``, ``dequant``,
    ``num_splits``, ``keep``, ``window`` and the scratch sizes ``cand_elems`` (int64, always
    written) / ``win_elems`` (fp32)."""

    block_m: int
    dot: str
    dequant: str
    num_splits: int
    keep: int
    window: int
    score: KernelLaunch
    reduce: KernelLaunch
    merge: KernelLaunch
    cand_elems: int
    win_elems: int


# -- split counts, windows, grids -------------------------------------------------------------

def decode_splits(num_reqs: int, max_pages: int, num_sms: int,
                  programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """NUM_SPLITS of ``num_reqs`` requests of at most ``max_pages`` pages to score each:
    about ``programs_per_sm`` score programs per SM, 1-page splits while the grid stays
    within 4 programs per SM (small batches are latency-bound: short serial chains), 2-page
    splits up to two waves (8 per SM), at least ``MIN_PAGES_PER_SPLIT`` pages beyond."""
    b = max(num_reqs, 1)
    ns = split_rule(b, programs_per_sm * num_sms, max_pages)
    if b * ns > 4 * num_sms:
        ns = min(ns, cdiv(max_pages, 2))
    if b * ns > 8 * num_sms:
        ns = min(ns, cdiv(max_pages, MIN_PAGES_PER_SPLIT))
    return max(ns, 1)


def choose_num_splits(num_reqs: int, width: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Decode NUM_SPLITS for block tables ``width`` wide (``decode_splits`` over the W - 1
    pages a request can score). 1 when ``width - 1 <= 15``: every row is short (SPEC 5),
    nothing is scored and the score kernel writes the output itself (no merge launch)."""
    max_pages = max(width - 1, 1)  # history pages <= (W*128 - 1) // 128
    if max_pages <= SHORT_MAX_LOCAL:
        return 1
    return decode_splits(num_reqs, max_pages, num_sms, programs_per_sm)


def page_score_programs(num_reqs: int, width: int, num_sms: int, programs_per_sm: int,
                        num_splits: int | None = None, pages_per_program: int = 1) -> int:
    """Programs P of a flat page-score launch (``page_scores.flat_partition``: the batch's
    scored pages in P equal shares, whatever the requests' lengths): ``B * num_splits`` when
    given, else ``programs_per_sm * num_sms`` (one wave of resident programs), at most one
    per ``pages_per_program`` pages a batch can score, ``B * (W - 1)``, at least 1."""
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


def keep_per_split(num_splits: int, width: int) -> int:
    """``keep_for_pages`` of a decode split, which scores at most ceil((width - 1) /
    num_splits) pages (static shapes only)."""
    return keep_for_pages(cdiv(max(width - 1, 1), num_splits))


def decode_window(num_splits: int, width: int, block_m: int) -> int:
    """Default decode window: ``choose_window`` of a split's ceil((W - 1) / NUM_SPLITS)
    pages."""
    return choose_window(cdiv(max(width - 1, 1), num_splits), block_m)


def redux_shape(num_keys: int, rows: int) -> tuple[int, int]:
    """``(K, ROWS)`` of a Gluon select / merge launch over rows of at most ``num_keys`` keys
    (a block-table width or a candidate count), ``rows`` = Q*H rows per request: K = next
    power of two >= num_keys / 32 keys per lane, ROWS = min(``REDUX_ROWS_PER_PROGRAM``, next
    power of two >= rows) rows per program (one per warp: ``num_warps`` = ROWS)."""
    return next_pow2(cdiv(num_keys, 32)), min(REDUX_ROWS_PER_PROGRAM, next_pow2(rows))


def split_shape(num_keys: int, keys_per_lane: int = SELECT_SPLIT_KEYS) -> tuple[int, int]:
    """``(K, S)`` of a ``redux_select_split`` launch over rows of at most ``num_keys`` keys:
    S = 4 warps per row while 4 * 32 * ``keys_per_lane`` keys fit, else 8; K = next power of
    two >= num_keys / (32 S) keys per lane (at least 1). K <= 32 needs num_keys <= 8192."""
    s = 4 if num_keys <= 4 * 32 * keys_per_lane else 8
    return next_pow2(cdiv(num_keys, 32 * s)), s


# -- dequant mode -------------------------------------------------------------------------------

def _mma_ok(capability, gluon: bool) -> bool:
    """``device.mma_available`` of a device of this capability (None: interpreter / CPU)."""
    return capability is not None and tuple(capability) >= (8, 9) and gluon


def _wgmma_ok(capability, gluon: bool) -> bool:
    """``device.wgmma_available`` of a device of this capability."""
    return capability is not None and tuple(capability) == (9, 0) and gluon


def default_dequant(capability, dot: str) -> str:
    """The one-launch kernel's dequant mode (also the context-parallel runner's): "ptx" where
    its conversions exist (CUDA SM89+; ``capability`` None: the interpreter / CPU) and the dot
    is fp16, else "triton"."""
    if dot != "fp16" or capability is None:
        return "triton"
    return "ptx" if tuple(capability) >= (8, 9) else "triton"


def choose_dequant(capability, dot: str, num_reqs: int, width: int,
                   min_pages: int | None = None, rows: int = 32, gluon: bool = True) -> str:
    """The decode runner's default dequant mode for a static shape (module doc; ``rows`` =
    BLOCK_M, ``min_pages`` = ``DecodeConfig.page_score_min_pages``, replacing
    ``MMA_MIN_PAGES`` / ``WGMMA_MIN_PAGES`` and, with dot "fp8", both fp8 thresholds)."""
    wide = rows > MMA_MAX_ROWS
    explicit = min_pages is not None
    if min_pages is None:
        min_pages = WGMMA_MIN_PAGES if wide else MMA_MIN_PAGES
    pages = num_reqs * (width - 1)
    sm90 = _mma_ok(capability, gluon) and tuple(capability) == (9, 0)
    if dot == "fp8":
        fp8_min = min_pages if explicit else (
            FP8_MIN_PAGES if rows >= WGFLAT_MIN_ROWS else FP8_MIN_PAGES_NARROW)
        if not wide and pages >= fp8_min and width - 1 > SHORT_MAX_LOCAL and sm90:
            return "wgflat"
        return choose_dequant(capability, "fp16", num_reqs, width,
                              min_pages if explicit else None, rows, gluon)
    if dot == "fp16" and pages >= min_pages and width - 1 > SHORT_MAX_LOCAL \
            and (wide or width - 1 >= MMA_MIN_WIDTH) and sm90:
        if wide:
            return "wgmma"
        flat = rows >= WGFLAT_MIN_ROWS and pages >= max(min_pages, WGFLAT_MIN_PAGES) \
            and width - 1 >= WGFLAT_MIN_WIDTH
        return "wgflat" if flat else "mma"
    return default_dequant(capability, dot)


def fp8_kernel_dot(dot: str, dequant: str) -> str:
    """The dot mode a decode kernel runs for the runner's ``dot``: dot "fp8" is a bound
    (SPEC 9 b = 5) the runner may use, so modes without E4M3 operands run their exact form
    ("ptx", "ptx_arith", "mma", "wgmma": fp16, b = 15; "lut": fp32, b = 16; both within it);
    "wgflat" and the one-launch "triton" kernel run fp8. Other dot modes unchanged."""
    if dot == "fp8" and dequant not in ("wgflat", "triton"):
        return "fp32" if dequant == "lut" else "fp16"
    return dot


def _where(capability) -> str:
    return "the interpreter / CPU" if capability is None else \
        f"an SM{capability[0]}{capability[1]} GPU"


def check_dequant(dequant: str, dot: str, block_m: int, capability, gluon: bool = True) -> None:
    """The device- and shape-dependent half of a decode dequant mode's check
    (``DecodeConfig`` checks the name). Raises ``ValueError`` naming the mode."""
    where = _where(capability)
    if dequant == "wgflat" and block_m > MMA_MAX_ROWS:
        raise ValueError(f"dequant: 'wgflat' scores at most {MMA_MAX_ROWS} query rows "
                         f"(Q * H padded to BLOCK_M), got BLOCK_M {block_m}: use 'wgmma'")
    if dequant == "lut" and dot != "fp32":
        raise ValueError(f"dequant: 'lut' scores with dot 'fp32', got dot {dot!r}")
    if dequant == "mma" and (dot != "fp16" or not _mma_ok(capability, gluon)):
        raise ValueError(f"dequant: 'mma' needs a CUDA SM89+ GPU and dot 'fp16', got dot "
                         f"{dot!r} on {where}")
    if dequant == "wgmma" and (dot != "fp16" or not _wgmma_ok(capability, gluon)):
        raise ValueError(f"dequant: 'wgmma' needs a CUDA SM90 GPU and dot 'fp16', got dot "
                         f"{dot!r} on {where}")
    if dequant == "wgflat" and (dot not in ("fp16", "fp8") or not _wgmma_ok(capability, gluon)):
        raise ValueError(f"dequant: 'wgflat' needs a CUDA SM90 GPU and dot 'fp16' or 'fp8', "
                         f"got dot {dot!r} on {where}")
    if dequant in KERNEL_DEQUANT_MODES and dequant != "triton" and (
            dot != "fp16" or capability is None):
        raise ValueError(f"dequant: {dequant!r} needs a CUDA GPU and dot 'fp16', got dot "
                         f"{dot!r} on {where}")


def _check_window(window: int, block_m: int) -> None:
    if window * block_m > MAX_WINDOW_ELEMS:
        raise ValueError(f"window: expected a power of two with window * BLOCK_M <= "
                         f"{MAX_WINDOW_ELEMS}, got {window} (BLOCK_M {block_m})")


# -- plans ------------------------------------------------------------------------------------

def select_plan(num_reqs: int, width: int, query_len: int, num_heads: int, *,
                gluon: bool, wide: bool | None = None) -> KernelLaunch:
    """The select launch of a page-score run (its ``constexprs`` without Q, H, N):

    - with ``gluon`` (a GPU page-score path) and W <= ``SELECT_REDUX_MAX_WIDTH``:
      "redux_select", K keys per lane and ROWS rows (warps) per program (``redux_shape``);
    - with ``gluon``, W <= ``SELECT_SPLIT_MAX_WIDTH`` and at most ``SELECT_SPLIT_MAX_ROWS``
      rows B * Q * H: "redux_select_split", one row per program on S warps (``split_shape``);
    - else "select_wide" for at most ``SELECT_WIDE_MAX_ROWS`` rows and W <=
      ``SELECT_WIDE_MAX_WIDTH`` (``wide`` forces it on or off, and the Gluon kernels off), its
      CHUNK = next power of two >= W on up to 8 warps (256 keys per warp);
    - else "select_classes", the residue-class select on one warp per row."""
    rows = num_reqs * query_len * num_heads
    if gluon and wide is None and width <= SELECT_REDUX_MAX_WIDTH:
        k, per = redux_shape(width, query_len * num_heads)
        return KernelLaunch("redux_select", dict(K=k, ROWS=per), dict(num_warps=per), per)
    if gluon and wide is None and width <= SELECT_SPLIT_MAX_WIDTH \
            and rows <= SELECT_SPLIT_MAX_ROWS:
        k, s = split_shape(width)
        return KernelLaunch("redux_select_split", dict(K=k, S=s, ROWS=1), dict(num_warps=s))
    if wide is None:
        wide = rows <= SELECT_WIDE_MAX_ROWS and width <= SELECT_WIDE_MAX_WIDTH
    chunk = next_pow2(max(width, 16))
    if wide:
        return KernelLaunch("select_wide", dict(CHUNK=chunk),
                            dict(num_warps=max(1, min(8, chunk // 256))))
    group = min(SELECT_GROUP, max(32, next_pow2(cdiv(width, 16))))
    return KernelLaunch("select_classes", dict(CHUNK=min(SELECT_CHUNK, chunk), GROUP=group),
                        dict(num_warps=SELECT_WARPS))


def _page_score_launch(dequant: str, q: int, h: int, rows: int, num_reqs: int, num_splits: int,
                       maxnreg: int | None, fp8: bool, ring_stages: int | None) -> KernelLaunch:
    """The page-score kernel's launch (its constexprs without the Gluon layouts)."""
    base = dict(Q=q, H=h, N=rows)
    bb = max(32, next_pow2(num_reqs))  # the flat partition's request vector
    if dequant == "wgmma":
        return KernelLaunch("wgmma", dict(base, NUM_SPLITS=num_splits), dict(num_warps=4))
    if dequant == "mma":
        return KernelLaunch("mma", dict(base, BB=bb, STAGES=ring_stages or MMA_STAGES),
                            dict(num_warps=1,
                                 maxnreg=MMA_MAXNREG if maxnreg is None else maxnreg))
    if dequant == "wgflat":
        return KernelLaunch("wgflat", dict(base, BB=bb, STAGES=ring_stages or WGFLAT_STAGES,
                                           FP8=int(fp8)),
                            dict(num_warps=4, **({} if maxnreg is None else {"maxnreg": maxnreg})))
    return KernelLaunch("lut", dict(base, BB=bb), dict(num_warps=4))


def plan_decode(num_heads: int, num_reqs: int, width: int, query_len: int,
                config: DecodeConfig | None = None, *, capability, num_sms: int,
                gluon: bool = True, validate: bool = True) -> DecodePlan:
    """The decode plan of one static shape (SPEC 6) on a device (module doc).

    Args:
        num_heads, num_reqs, width, query_len: H, B, W, Q (Python ints >= 1, Q * H <= 64;
            the runner checks them).
        config: ``DecodeConfig`` (None: defaults).
        capability: the CUDA device's compute capability ``(major, minor)``, or None under the
            interpreter / off CUDA (``device.capability``). num_sms: its SM count.
        gluon: whether Gluon imports (``device.gluon_available``).
        validate: check the config against the device and shape (False: sizes only, as
            ``score_buffer_size`` needs them for configs a runner would refuse).
    Returns:
        a ``DecodePlan``.
    Raises:
        ValueError: (``validate``) a dequant mode the device or dot cannot run, "wgflat" above
        32 rows, a window with window * BLOCK_M > 4096, pdl off SM90+, or a dot mode other
        than "fp32" under the interpreter / off CUDA.
    """
    cfg = check_config("config", config, DecodeConfig)
    portable = capability is None
    rows = block_rows(query_len, num_heads)
    if validate or cfg.dequant is None:
        dot = pick_dot(cfg.dot, portable)
    else:
        dot = cfg.dot or ("fp32" if portable else "fp16")
    dequant = cfg.dequant or choose_dequant(capability, dot, num_reqs, width,
                                            cfg.page_score_min_pages, rows, gluon)
    kernel_dot = fp8_kernel_dot(dot, dequant)
    if validate:
        check_dequant(dequant, kernel_dot, rows, capability, gluon)
    pps = cfg.programs_per_sm or {"wgmma": WGMMA_PROGRAMS_PER_SM, "mma": MMA_PROGRAMS_PER_SM,
                                  "wgflat": WGFLAT_PROGRAMS_PER_SM}.get(dequant, PROGRAMS_PER_SM)
    ns = cfg.num_splits or choose_num_splits(num_reqs, width, num_sms, pps)
    # the flat page-score grid ("mma" / "wgflat": one wave of equal shares, "wgflat" at most
    # one program per WGFLAT_MIN_GROUPS groups of 4 pages; "lut": B * NUM_SPLITS)
    programs = page_score_programs(
        num_reqs, width, num_sms, pps,
        cfg.num_splits or (None if dequant in ("mma", "wgflat") else ns),
        pages_per_program=4 * WGFLAT_MIN_GROUPS if dequant == "wgflat" else 1)
    window = cfg.window or decode_window(ns, width, rows)
    if validate:
        _check_window(window, rows)
        if cfg.pdl and (portable or tuple(capability) < (9, 0)):
            raise ValueError(f"pdl: expected a bool, True only on SM90+ CUDA GPUs, got True "
                             f"on {_where(capability)}")
    keep = keep_per_split(ns, width)
    q, h = query_len, num_heads
    shape = dict(num_reqs=num_reqs, width=width, query_len=q, num_heads=h, block_m=rows,
                 dot=dot, dequant=dequant, kernel_dot=kernel_dot, num_splits=ns,
                 programs=programs, window=window, keep=keep)
    if dequant in PAGE_SCORE_MODES:
        score = _page_score_launch(dequant, q, h, rows, num_reqs, ns, cfg.maxnreg,
                                   kernel_dot == "fp8", cfg.ring_stages)
        select = select_plan(num_reqs, width, q, h, gluon=dequant != "lut")
        return DecodePlan(**shape, score=score, merge=None, select=select, cand_elems=0,
                          win_elems=num_reqs * rows * width)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not portable:  # the register cap is a GPU compile option (the interpreter has none)
        opts["maxnreg"] = MAXNREG if cfg.maxnreg is None else cfg.maxnreg
    score = KernelLaunch("split", dict(Q=q, H=h, BLOCK_M=rows, NUM_SPLITS=ns, DOT=kernel_dot,
                                       DEQUANT=dequant, WINDOW=window, KEEP=keep, PDL=cfg.pdl),
                         opts)
    merge = None
    if ns > 1:
        cands = ns * keep
        if not cfg.pdl and cands <= REDUX_MERGE_MAX_CANDIDATES and not portable \
                and tuple(capability) >= (8, 0):
            k, per = redux_shape(cands, q * h)
            merge = KernelLaunch("redux_merge", dict(Q=q, H=h, BLOCK_M=rows, C=cands, K=k,
                                                     ROWS=per), dict(num_warps=per), per)
        else:
            per, warps = merge_config(ns, keep)
            merge = KernelLaunch("split_merge",
                                 dict(Q=q, H=h, BLOCK_M=rows, NUM_SPLITS=ns,
                                      SPLITS_PAD=next_pow2(ns), ROWS=per, KEEP=keep,
                                      PDL=cfg.pdl),
                                 dict(num_warps=warps, **({"launch_pdl": True} if cfg.pdl
                                                          else {})), per)
    return DecodePlan(**shape, score=score, merge=merge, select=None,
                      cand_elems=candidate_elems(num_reqs, ns, rows, keep),
                      win_elems=window_elems(num_reqs, ns, rows, window))


def plan_context_parallel(num_heads: int, world: int, num_reqs: int, width: int,
                          query_len: int, config: DecodeConfig | None = None, *, capability,
                          num_sms: int, rows_per_program: int | None = None
                          ) -> ContextParallelPlan:
    """One context-parallel rank's plan (SPEC 8.2): ``num_heads`` H_r per rank, ``world``
    ranks, B, W', Q; ``config`` as ``plan_decode`` (its dequant a one-launch mode, pdl False,
    page_score_min_pages unused); ``capability`` / ``num_sms`` as ``plan_decode``;
    ``rows_per_program``: rows per program of the reduce and merge kernels (default
    ``heuristics.merge_config``'s on a GPU, all of a request's rows under the interpreter).

    Raises:
        ValueError: a dequant mode other than the one-launch kernel's, a ptx mode off CUDA or
        with a dot other than fp16, pdl, a window with window * BLOCK_M > 4096, a dot other
        than "fp32" under the interpreter / off CUDA."""
    cfg = check_config("config", config, DecodeConfig)
    portable = capability is None
    heads = world * num_heads
    rows = block_rows(query_len, heads)
    dot = pick_dot(cfg.dot, portable)
    dequant = cfg.dequant or default_dequant(capability, dot)
    if dequant not in KERNEL_DEQUANT_MODES:
        raise ValueError(f"dequant: expected one of {KERNEL_DEQUANT_MODES}, got {dequant!r}")
    if dequant != "triton" and (dot != "fp16" or portable):
        raise ValueError(f"dequant: {dequant!r} needs a CUDA GPU and dot 'fp16', got dot "
                         f"{dot!r} on {_where(capability)}")
    if cfg.pdl:
        raise ValueError("pdl: expected False (the context-parallel runner has no merge "
                         "launch to overlap), got True")
    ns = cfg.num_splits or cp_num_splits(num_reqs, width, world, num_sms,
                                         cfg.programs_per_sm or PROGRAMS_PER_SM)
    per = cdiv(subset_pages(width, world), ns)
    keep = keep_for_pages(per)
    window = cfg.window or choose_window(per, rows)
    _check_window(window, rows)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not portable:
        opts["maxnreg"] = MAXNREG if cfg.maxnreg is None else cfg.maxnreg
    reduce_rows, reduce_warps = merge_config(ns, keep)
    merge_rows, merge_warps = merge_config(world, SEND_KEEP)
    if rows_per_program is not None:
        reduce_rows = merge_rows = rows_per_program
    elif portable:  # interpreter: one program per request
        reduce_rows = next_pow2(query_len * heads)
        merge_rows = next_pow2(query_len * num_heads)
    q = query_len
    score = KernelLaunch("split", dict(Q=q, H=heads, BLOCK_M=rows, NUM_SPLITS=ns, DOT=dot,
                                       DEQUANT=dequant, WINDOW=window, KEEP=keep,
                                       CANDIDATES=True), opts)
    reduce = KernelLaunch("cp_reduce", dict(Q=q, H_R=num_heads, WORLD=world, BLOCK_M=rows,
                                            NUM_SPLITS=ns, SPLITS_PAD=next_pow2(ns),
                                            ROWS=reduce_rows, KEEP=keep),
                          dict(num_warps=reduce_warps), reduce_rows)
    merge = KernelLaunch("cp_merge", dict(Q=q, H_R=num_heads, WORLD=world,
                                          WORLD_PAD=next_pow2(world), ROWS=merge_rows),
                         dict(num_warps=merge_warps), merge_rows)
    return ContextParallelPlan(block_m=rows, dot=dot, dequant=dequant, num_splits=ns, keep=keep,
                               window=window, score=score, reduce=reduce, merge=merge,
                               cand_elems=num_reqs * rows * ns * keep,
                               win_elems=window_elems(num_reqs, ns, rows, window))
