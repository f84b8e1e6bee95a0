"""Tuning configs of the Triton launchers: frozen dataclasses, validated once at construction.

A launcher takes ``config=`` (None = the defaults); labs and tests build variants with
``dataclasses.replace(DecodeConfig(), window=1)``. A field left ``None`` is picked for the
launch's static shape and device (``decode.dispatch``, ``heuristics``). Fields are checked here for type and
range (SPEC 10, 11: Python or numpy integers, never bool; a clear ``ValueError`` naming the
field); what depends on the device or the shape (a ptx mode off CUDA, ``window * BLOCK_M``) is
checked by the launcher before it writes anything. No field changes a result: every setting
selects the same pages (SPEC 5, 9).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..validation import check_int, fail, is_int
from . import heuristics as hz
from .ptx import DEQUANT_MODES as KERNEL_DEQUANT_MODES  # the one-launch score kernel
from .dot_modes import DOT_MODES

# Mode names (the kernels' DEQUANT constexprs).
# the page-score family (``decode.page_scores``): page scores to a scratch, then select
PAGE_SCORE_MODES = ("wgmma", "mma", "wgflat", "lut")
DECODE_DEQUANT_MODES = KERNEL_DEQUANT_MODES + PAGE_SCORE_MODES
GATHER_DEQUANT_MODES = ("triton", "ptx")
POW2_WINDOWS = (1, 2, 4, 8, 16, 32, 64)
RING_STAGES = (2, 4, 8)  # cp.async ring slots of "mma" / "wgflat": divide a page's 8 chunks


def _choice(name: str, value, choices) -> None:
    if value is not None and value not in choices:
        fail(name, f"None or one of {choices}", repr(value))


def _opt_bool(name: str, value) -> None:
    if value is not None and type(value) is not bool:
        fail(name, "None or a bool", repr(value))


def _ints(cfg, **rules) -> None:
    """``check_int`` each named field (kwargs of check_int per field); store ``int(x)``."""
    for name, kw in rules.items():
        object.__setattr__(cfg, name, check_int(name, getattr(cfg, name), **kw))


class _Config:
    def overrides(self) -> dict:
        """The fields that differ from the defaults (for logs)."""
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclass(frozen=True)
class DecodeConfig(_Config):
    """Tuning of ``decode.DecodeRunner`` / ``decode_indexer`` (SPEC 6) and, where the fields
    apply, ``decode.ContextParallelRunner``; ``decode.dispatch.plan_decode`` turns it into the
    launches.

    Fields:
        dot: dot mode, one of ``DOT_MODES`` (default "fp16" on a GPU, "fp32" under the
            interpreter; "bf16" for comparison; "fp8": E4M3 operands on SM90's FP8 tensor cores
            where ``dispatch.choose_dequant`` picks "wgflat" for them, the exact kernels
            elsewhere (``dispatch.fp8_kernel_dot``; SPEC 9 b = 5, the public
            ``allow_fp8_mma``); see ``dot_modes.SCORE_ERROR_BITS``).
        dequant: one of ``DECODE_DEQUANT_MODES`` (default ``dispatch.choose_dequant``):
            "mma" (one warp per program, CUDA SM89+, dot fp16) / "wgflat" (one page per
            warp of a wgmma warpgroup, SM90, dot fp16, or fp8: E4M3 operands) / "wgmma"
            (SM90, dot fp16) /
            "lut" (their plain-Triton twin, dot fp32; the interpreter runs it) score pages
            to a scratch then select (``decode.page_scores``); "triton" / "ptx" (SM89+) /
            "ptx_arith" (SM90+: dequantization without conversion instructions) run the
            one-launch kernel (``decode.split_kernel``; ptx modes: CUDA and dot fp16).
        num_splits: NUM_SPLITS, an int in 1..``MAX_SPLITS`` (default
            ``dispatch.choose_num_splits``); for "mma" / "wgflat" / "lut", whose grid is flat
            (``page_scores.flat_partition``), it sets the grid to ``B * num_splits``
            programs.
        window: pages scored between two top-k merges, a power of two with
            ``window * BLOCK_M <= 4096`` (at most 256 here, BLOCK_M being >= 16; the
            launch's BLOCK_M is checked by the runner; default
            ``dispatch.decode_window``); 1 inserts each page's candidate at once.
        num_warps: score-kernel warps, one of 1, 2, 4, 8, 16. num_stages: its pipeline
            stages, >= 1.
        programs_per_sm: split target (default ``PROGRAMS_PER_SM``; ``WGMMA_PROGRAMS_PER_SM``
            for "wgmma"; for "mma" / "wgflat" the flat grid's programs per SM, default
            ``MMA_PROGRAMS_PER_SM`` / ``WGFLAT_PROGRAMS_PER_SM``: one wave; ignored when
            ``num_splits`` is given), >= 1.
        maxnreg: score-kernel register cap in 24..255, or None for the mode's default
            (``MAXNREG`` for the one-launch kernel, ``MMA_MAXNREG`` for "mma", none for
            "wgflat"; "wgmma" and "lut" take no cap and ignore it; the interpreter has none).
        pdl: launch the merge kernel with programmatic dependent launch (SM90+ only).
        page_score_min_pages: B * (W - 1) from which the default dequant on an SM90 GPU is
            a page-score mode rather than the one-launch "ptx": "mma" at <= ``MMA_MAX_ROWS``
            rows (and W - 1 >= ``MMA_MIN_WIDTH``; "wgflat" at 32 rows from
            ``max(page_score_min_pages, WGFLAT_MIN_PAGES)``),
            "wgmma" above (default ``MMA_MIN_PAGES`` / ``WGMMA_MIN_PAGES``;
            ``dispatch.choose_dequant``), >= 0.
        ring_stages: chunk slots of the cp.async ring of "mma" / "wgflat" (``STAGES - 1``
            chunks of 16 tokens in flight), one of ``RING_STAGES`` (2, 4, 8; default
            ``MMA_STAGES`` / ``WGFLAT_STAGES``, 4); the other modes ignore it.
    Raises:
        ValueError: a field of the wrong type or out of range.
    """

    dot: str | None = None
    dequant: str | None = None
    num_splits: int | None = None
    window: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int | None = None
    maxnreg: int | None = None
    pdl: bool = False
    page_score_min_pages: int | None = None
    ring_stages: int | None = None

    def __post_init__(self):
        _choice("dot", self.dot, DOT_MODES)
        _choice("dequant", self.dequant, DECODE_DEQUANT_MODES)
        _ints(self, num_splits=dict(lo=1, hi=hz.MAX_SPLITS, optional=True),
              num_warps=dict(choices=(1, 2, 4, 8, 16)), num_stages=dict(lo=1),
              programs_per_sm=dict(lo=1, optional=True),
              maxnreg=dict(lo=24, hi=255, optional=True),
              page_score_min_pages=dict(lo=0, optional=True),
              ring_stages=dict(choices=RING_STAGES, optional=True))
        if self.window is not None:  # BLOCK_M >= MIN_BLOCK_M: the runner checks the rest
            w = self.window
            if not is_int(w) or w < 1 or int(w) & (int(w) - 1) \
                    or w > hz.MAX_WINDOW_ELEMS // hz.MIN_BLOCK_M:
                fail("window", f"None or a power of two with window * BLOCK_M <= "
                               f"{hz.MAX_WINDOW_ELEMS}", repr(w))
            object.__setattr__(self, "window", int(w))
        if type(self.pdl) is not bool:
            fail("pdl", "a bool (True only on SM90+ CUDA GPUs)", repr(self.pdl))


@dataclass(frozen=True)
class GatherConfig(_Config):
    """Tuning of ``gather.gather_into`` (SPEC 7); every setting writes the same bytes.

    Fields:
        dequant: "ptx" (default on a CUDA SM89+ GPU unless portable) or "triton" (the only
            mode under the interpreter / portable).
        tok_block: tokens per inner step, one of 8, 16, 32, 64, 128 (default
            ``prefill.dispatch.GATHER_TOK_BLOCK``, 128 under the interpreter; capped at
            128 / page_parts).
        num_warps: warps per program, one of 1, 2, 4, 8, 16 (default ``GATHER_NUM_WARPS``).
        page_parts: programs per page, one of 1, 2, 4, 8 (default ``GATHER_PAGE_PARTS``, 1
            under the interpreter).
        streaming: evict-first page loads and streaming (``.cs``) workspace stores in the
            "ptx" mode (default ``GATHER_STREAMING``).
        pages_per_program: pages each program moves (its part of each), 1 or 2, every
            page's loads issued before any store (default
            ``prefill.dispatch.gather_pages_per_program`` per launch).
    Raises:
        ValueError: a field outside its set.
    """

    dequant: str | None = None
    tok_block: int | None = None
    num_warps: int | None = None
    page_parts: int | None = None
    streaming: bool | None = None
    pages_per_program: int | None = None

    TOK_BLOCKS = (8, 16, 32, 64, 128)
    NUM_WARPS = (1, 2, 4, 8, 16)
    PAGE_PARTS = (1, 2, 4, 8)
    PAGES_PER_PROGRAM = (1, 2)

    def __post_init__(self):
        _choice("dequant", self.dequant, GATHER_DEQUANT_MODES)
        _ints(self, tok_block=dict(choices=self.TOK_BLOCKS, optional=True),
              num_warps=dict(choices=self.NUM_WARPS, optional=True),
              page_parts=dict(choices=self.PAGE_PARTS, optional=True),
              pages_per_program=dict(choices=self.PAGES_PER_PROGRAM, optional=True))
        _opt_bool("streaming", self.streaming)


@dataclass(frozen=True)
class PrefillConfig(_Config):
    """Tuning of ``prefill.prefill_indexer`` (SPEC 7; rules: ``prefill.dispatch``).

    Fields:
        dot: dot mode, one of ``DOT_MODES`` (default fp16 on a GPU, fp32 under the
            interpreter). "fp8" (inexact, SPEC 9 b = 5) where the Gluon kernel may run
            (``kernel`` None or "wgmma", ``tokens_on_n`` not False, CUDA SM90): chunks on the
            Gluon kernel run its E4M3 form, the others score exactly (fp16, tokens on N);
            otherwise (``kernel="triton"``, ``window`` / ``num_stages`` given, tokens on M,
            other GPUs) every chunk runs the Triton kernel's fp8.
        num_splits: NUM_SPLITS, an int in 1..``MAX_SPLITS`` (default
            ``prefill_num_splits``).
        window: top-k window, one of 1, 2, ..., 64 with window * BLOCK_M <= 4096 (checked at
            launch; default ``heuristics.choose_window``: 1 below 32 pages per split).
        block_m: (token, head) rows per score program, one of 16..256 (powers of two;
            default ``prefill_block_m``).
        num_warps: score-kernel warps, one of 1, 2, 4, 8. num_stages: 1..4 (default: per
            chunk, ``prefill_launch``'s ``stages``, as the Indexer's).
        tokens_on_n: page tokens on the MMA's N axis (the max over tokens stays in
            registers) rather than M (default: True for the 16-bit GPU dot modes,
            ``TOKENS_ON_N_DOTS``).
        gather: the workspace gather's ``GatherConfig``.
        kernel: score kernel, "triton" (``prefill.prefill_score_kernel``) or "wgmma" (the
            Gluon ``prefill_wgmma``, CUDA SM90 with dot fp16 or fp8 and tokens on N; chunks it does
            not take -- at most 8 pages per split, BLOCK_M other than 128 -- run the Triton
            kernel; it takes no window, num_warps or num_stages); default: "wgmma" where it
            can run (``prefill_wgmma_ok``) unless ``window`` or ``num_stages`` is given
            (Triton-kernel knobs: then "triton").
    Raises:
        ValueError: a field of the wrong type or out of range.
    """

    dot: str | None = None
    num_splits: int | None = None
    window: int | None = None
    block_m: int | None = None
    num_warps: int = 4
    num_stages: int | None = None
    tokens_on_n: bool | None = None
    gather: GatherConfig = field(default_factory=GatherConfig)
    kernel: str | None = None

    def __post_init__(self):
        _choice("dot", self.dot, DOT_MODES)
        _choice("kernel", self.kernel, ("triton", "wgmma"))
        _ints(self, num_splits=dict(lo=1, hi=hz.MAX_SPLITS, optional=True),
              window=dict(choices=POW2_WINDOWS, optional=True),
              block_m=dict(choices=(16, 32, 64, 128, 256), optional=True),
              num_warps=dict(choices=(1, 2, 4, 8)), num_stages=dict(lo=1, hi=4, optional=True))
        _opt_bool("tokens_on_n", self.tokens_on_n)
        if not isinstance(self.gather, GatherConfig):
            fail("gather", "a GatherConfig", repr(self.gather))


@dataclass(frozen=True)
class InsertConfig(_Config):
    """Tuning of ``insert.insert_index_k`` (SPEC 3).

    Fields:
        block_t: tokens per program, one of 1, 2, ..., 128 (default
            ``heuristics.insert_launch_shape``). num_warps: one of 1, 2, 4, 8 (default: two
            threads per token on the fast path, else 1).
    Raises:
        ValueError: a field outside its set.
    """

    block_t: int | None = None
    num_warps: int | None = None

    def __post_init__(self):
        _ints(self, block_t=dict(choices=(1, 2, 4, 8, 16, 32, 64, 128), optional=True),
              num_warps=dict(choices=(1, 2, 4, 8), optional=True))


def check_config(name: str, config, kind: type):
    """``config`` itself, or ``kind()`` for None; a ``ValueError`` naming ``name`` otherwise."""
    if config is None:
        return kind()
    if not isinstance(config, kind):
        fail(name, f"None or a {kind.__name__}", repr(config))
    return config
