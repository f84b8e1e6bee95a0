"""The benchmark workloads of WORKLOADS.md, exactly, plus the traffic and FLOP models.

Decode seq lens follow MiniMax-AI/MSA ``benchmarks/inference/msa_v1/decode/cases.py``
(``make_seq_lens``) call for call, so the same case names give the same request lengths:
a CPU ``torch.Generator`` seeded with ``1701 + batch * 1009 + nominal``, ``batch // 2`` deltas
from ``torch.randint(lo, hi + 1)`` with ``lo = max(1, nominal // 20)``, ``hi = max(lo,
nominal // 4)``, requests ``nominal - delta`` and ``nominal + delta``, one more request at the
nominal length for an odd batch, then ``torch.randperm(batch)`` with the same generator.
The mean is exactly the nominal length (asserted).

Byte counts are the *necessary* traffic (WORKLOADS.md "Bytes moved"): every history page read
once (9216 B), the E4M3 queries, the int32 outputs, and the block-table / seq-len / offset
entries actually read. Kernel-internal traffic (score scratch, workspace round trips) is not
credited. MB = 10^6 bytes, GB = 10^9 bytes throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nvfp4_indexer.constants import HEAD_DIM, PAGE_BYTES, PAGE_SIZE, TOPK

SEED = 1701
DECODE_QUERY_LEN = 8
DECODE_HEADS = 4
FULL_BATCHES = (8, 32, 64, 128)
FULL_SEQ_LENS = (1_000, 4_000, 5_000, 10_000, 50_000, 100_000, 200_000)
# Weight per nominal seq len, for batch 8 / 32 / 64 / 128 (WORKLOADS.md); they sum to 10_000.
FULL_WEIGHTS = {
    1_000: (30, 90, 180, 300),
    4_000: (40, 120, 240, 400),
    5_000: (50, 150, 300, 500),
    10_000: (140, 350, 490, 420),
    50_000: (500, 800, 500, 200),
    100_000: (1260, 980, 420, 140),
    200_000: (910, 350, 112, 28),
}
LOWLAT_BATCHES = (1, 2, 4)
LOWLAT_SEQ_LENS = (1_000, 4_000, 8_000, 32_000)
# Decode variants of WORKLOADS.md "Also report Q = 1 and H = 1, 2": (query_len, heads).
VARIANTS = ((1, 4), (8, 1), (8, 2))
# Engine-width decode: block tables as wide as an engine passes them, max_model_len = 1M
# tokens (8192 pages), for the live contexts of these (batch, nominal) cases
ENGINE_WIDTH = (1 << 20) // PAGE_SIZE
ENGINE_WIDTH_CASES = ((1, 1_000), (1, 32_000), (4, 32_000), (8, 4_000), (8, 10_000),
                      (8, 100_000), (32, 4_000), (128, 1_000), (128, 10_000), (128, 100_000))

PREFILL_NEW_TOKENS = (1_024, 4_096, 16_384)
PREFILL_CONTEXTS = (0, 32_768, 131_072)
PREFILL_REQS = (1, 4)
PREFILL_HEADS = 4
ENGINE_HEADS = 4

INSERT_TOKENS = 16_384
INSERT_CACHE_TOKENS = 1 << 20  # "a 1M-token cache": 8192 pages
INSERT_MAX_POSITION = 131_072
ROTARY_DIM = 64

WORKSPACE_PAGE_BYTES = PAGE_SIZE * HEAD_DIM  # one FP8 workspace page (SPEC 2): 16384 B
FLAG_PAGES_BYTES = 256_000_000  # decode-full cases with >= 256 MB of pages are held to 75 %
TARGET_DECODE_BIG_CASE = 0.75  # ... of copy (a target: reported, never gated)


def make_seq_lens(batch: int, nominal: int, query_len: int = DECODE_QUERY_LEN,
                  seed: int = SEED) -> list[int]:
    """Request lengths of a decode case (WORKLOADS.md; MSA ``make_seq_lens``).

    Args:
        batch: requests B >= 1. nominal: the nominal (mean) seq len in tokens.
        query_len: Q; every length must be >= Q. seed: base seed (1701).
    Returns:
        ``list[int]`` of B lengths whose mean is exactly ``nominal``.
    Raises:
        ValueError: a length below ``query_len`` (nominal too small for the batch's deltas).
    """
    gen = torch.Generator().manual_seed(seed + batch * 1009 + nominal)
    pairs = batch // 2
    lo = max(1, nominal // 20)
    hi = max(lo, nominal // 4)
    deltas = torch.randint(lo, hi + 1, (pairs,), generator=gen, dtype=torch.int64)
    parts = [nominal - deltas, nominal + deltas]
    if batch % 2:
        parts.append(torch.tensor([nominal], dtype=torch.int64))
    values = torch.cat(parts)[torch.randperm(batch, generator=gen)]
    lens = [int(v) for v in values]
    assert sum(lens) == batch * nominal, "decode seq lens: mean must be exactly nominal"
    if min(lens) < query_len:
        raise ValueError(f"nominal: expected lengths >= query_len={query_len}, "
                         f"got min {min(lens)} for batch {batch} x {nominal}")
    return lens


def history_pages(seq_len: int) -> int:
    """History pages of a request's last token, (seq_len - 1) // 128 (SPEC 6, 7)."""
    return max(seq_len - 1, 0) // PAGE_SIZE


def pages_needed(seq_len: int) -> int:
    """Block-table entries a request uses, ceil(seq_len / 128) (the local page included)."""
    return -(-seq_len // PAGE_SIZE)


class _NamedCase:
    """A case named by its class's ``NAME`` pattern filled in with its fields."""

    NAME = ""

    @property
    def name(self) -> str:
        return self.NAME.format(**vars(self))


@dataclass(frozen=True)
class DecodeCase(_NamedCase):
    """One uniform decode batch: B requests, Q queries each, H index heads; ``width``: the
    block-table width in pages (0: the case's own, ceil(max seq len / 128); else named with a
    ``_w{width}`` suffix)."""

    NAME = "b{batch}_s{nominal}_q{query_len}_h{num_heads}"

    suite: str
    batch: int
    nominal: int
    query_len: int = DECODE_QUERY_LEN
    num_heads: int = DECODE_HEADS
    weight: int = 0
    width: int = 0

    @property
    def name(self) -> str:
        base = self.NAME.format(**vars(self))
        return f"{base}_w{self.width}" if self.width else base

    def natural_width(self) -> int:
        """The block-table width the case's contexts need: ceil(max seq len / 128)."""
        return max(pages_needed(s) for s in self.seq_lens())

    def seq_lens(self) -> list[int]:
        return make_seq_lens(self.batch, self.nominal, self.query_len)


@dataclass(frozen=True)
class PrefillCase(_NamedCase):
    """Prefill: ``new_tokens`` new tokens in total, split evenly over ``num_reqs`` requests,
    each request with ``context`` cached tokens before them (WORKLOADS.md "Prefill")."""

    NAME = "n{new_tokens}_c{context}_r{num_reqs}"

    new_tokens: int
    context: int
    num_reqs: int
    num_heads: int = PREFILL_HEADS

    @property
    def q_len(self) -> int:
        assert self.new_tokens % self.num_reqs == 0
        return self.new_tokens // self.num_reqs

    def seq_lens(self) -> list[int]:
        return [self.context + self.q_len] * self.num_reqs

    def cu_seqlens_q(self) -> list[int]:
        return [r * self.q_len for r in range(self.num_reqs + 1)]


@dataclass(frozen=True)
class InsertCase(_NamedCase):
    """Insert ``tokens`` keys (bf16) at random distinct slots of a ``cache_tokens`` cache."""

    NAME = "t{tokens}_cache{cache_tokens}"

    tokens: int = INSERT_TOKENS
    cache_tokens: int = INSERT_CACHE_TOKENS
    max_position: int = INSERT_MAX_POSITION
    rotary_dim: int = ROTARY_DIM


@dataclass
class Traffic:
    """Necessary bytes and useful FLOPs of one call. ``pages_bytes`` = history pages x 9216."""

    history_pages: int
    pages_bytes: int
    bytes_moved: int
    flops: int
    parts: dict = field(default_factory=dict)


def decode_traffic(seq_lens: list[int], query_len: int, num_heads: int) -> Traffic:
    """Necessary traffic of one decode call (WORKLOADS.md): each history page once, the
    queries (B*Q*H*128 B), the outputs (B*Q*H*16*4 B), the block-table entries of the history
    pages (4 B each) and the seq lens (4 B each). FLOPs = 2 * 128 * (rows x tokens scored),
    a row being one (query, head) and its tokens scored = 128 x its history pages."""
    b = len(seq_lens)
    pages = sum(history_pages(s) for s in seq_lens)
    rows_tokens = sum((max(s - query_len + i, 0) // PAGE_SIZE) * PAGE_SIZE
                      for s in seq_lens for i in range(query_len) if s > 0)
    parts = {
        "pages": pages * PAGE_BYTES,
        "queries": b * query_len * num_heads * HEAD_DIM,
        "outputs": b * query_len * num_heads * TOPK * 4,
        "block_table": pages * 4,
        "seq_lens": b * 4,
    }
    return Traffic(pages, pages * PAGE_BYTES, sum(parts.values()),
                   2 * HEAD_DIM * num_heads * rows_tokens, parts)


def prefill_traffic(case: PrefillCase) -> Traffic:
    """Necessary traffic of one prefill call: history pages once, E4M3 queries, int32
    outputs, block-table entries, seq lens and cu_seqlens_q. The FP8 workspace round trip is
    not necessary traffic and is not counted. FLOPs as for decode (rows = query x head)."""
    pages = sum(history_pages(s) for s in case.seq_lens())
    rows_tokens = case.num_reqs * sum(((case.context + i) // PAGE_SIZE) * PAGE_SIZE
                                      for i in range(case.q_len))
    t = case.new_tokens
    parts = {
        "pages": pages * PAGE_BYTES,
        "queries": t * case.num_heads * HEAD_DIM,
        "outputs": t * case.num_heads * TOPK * 4,
        "block_table": pages * 4,
        "seq_lens": case.num_reqs * 4,
        "cu_seqlens_q": (case.num_reqs + 1) * 4,
    }
    return Traffic(pages, pages * PAGE_BYTES, sum(parts.values()),
                   2 * HEAD_DIM * case.num_heads * rows_tokens, parts)


def gather_traffic(case: PrefillCase) -> Traffic:
    """Necessary traffic of gathering a prefill case's history pages into the FP8 workspace:
    9216 B read and 16384 B written per page, block-table entries, seq lens, page offsets."""
    pages = sum(history_pages(s) for s in case.seq_lens())
    parts = {
        "pages": pages * PAGE_BYTES,
        "workspace": pages * WORKSPACE_PAGE_BYTES,
        "block_table": pages * 4,
        "seq_lens": case.num_reqs * 4,
        "page_offsets": (case.num_reqs + 1) * 4,
    }
    return Traffic(pages, pages * PAGE_BYTES, sum(parts.values()), 0, parts)


def insert_traffic(case: InsertCase, key_bytes: int = 2, cos_sin_bytes: int = 2) -> Traffic:
    """Necessary traffic of one insert: keys (bf16), positions and slots (int64), one
    cos/sin row per token (bf16), the norm weight, and 72 B written per token."""
    t = case.tokens
    parts = {
        "keys": t * HEAD_DIM * key_bytes,
        "positions": t * 8,
        "slot_mapping": t * 8,
        "cos_sin": t * case.rotary_dim * cos_sin_bytes,
        "norm_weight": HEAD_DIM * 4,
        "writes": t * (PAGE_BYTES // PAGE_SIZE),
    }
    return Traffic(0, 0, sum(parts.values()), 0, parts)


@dataclass(frozen=True)
class EngineCase:
    """One engine step: ``batch`` decodes of ``query_len`` around ``nominal`` tokens and
    ``prefills`` ((new tokens, cached tokens) per prefill request)."""

    batch: int
    query_len: int
    nominal: int
    prefills: tuple = ()
    num_heads: int = ENGINE_HEADS

    @property
    def name(self) -> str:
        s = f"b{self.batch}_q{self.query_len}_s{self.nominal}"
        for n, c in self.prefills:
            s += f"+p{n}c{c}"
        return s

    def decode_lens(self) -> list[int]:
        return make_seq_lens(self.batch, self.nominal, self.query_len)

    def seq_lens(self) -> list[int]:
        return self.decode_lens() + [n + c for n, c in self.prefills]

    def pool_pages(self) -> int:
        return sum(pages_needed(s) for s in self.seq_lens())


def engine_cases() -> list[EngineCase]:
    """WORKLOADS.md "Engine steps": 24 decode-only steps and 12 mixed steps."""
    cases = [EngineCase(b, q, s) for s in (8_000, 32_000, 128_000) for q in (1, 4)
             for b in (1, 8, 64, 256)]
    for n in (2_048, 8_192):
        for c in (0, 32_768, 131_072):
            cases.append(EngineCase(64, 1, 32_000, ((n, c),)))
            cases.append(EngineCase(64, 1, 32_000, ((n, c), (n, c))))
    return cases


def engine_smoke_cases() -> list[EngineCase]:
    """Tiny CPU-smoke stand-ins of the engine steps (same code paths)."""
    return [EngineCase(2, 2, 2_100, num_heads=2),
            EngineCase(2, 1, 2_100, ((32, 2_048),), num_heads=2)]


def engine_traffic(case: EngineCase) -> Traffic:
    """Decode traffic plus each prefill request's (WORKLOADS.md "Bytes moved")."""
    parts = [decode_traffic(case.decode_lens(), case.query_len, case.num_heads)]
    parts += [prefill_traffic(PrefillCase(n, c, 1, case.num_heads))
              for n, c in case.prefills]
    keys = {k for t in parts for k in t.parts}
    merged = {k: sum(t.parts.get(k, 0) for t in parts) for k in sorted(keys)}
    return Traffic(sum(t.history_pages for t in parts), sum(t.pages_bytes for t in parts),
                   sum(merged.values()), sum(t.flops for t in parts), merged)


# ---------------------------------------------------------------------------------------------
# Case lists

def full_cases(query_len: int = DECODE_QUERY_LEN, num_heads: int = DECODE_HEADS,
               suite: str = "decode-full") -> list[DecodeCase]:
    """The 28 weighted "full" decode cases (weights sum to 10_000), seq len major."""
    return [DecodeCase(suite, b, s, query_len, num_heads, FULL_WEIGHTS[s][i])
            for s in FULL_SEQ_LENS for i, b in enumerate(FULL_BATCHES)]


def lowlat_cases() -> list[DecodeCase]:
    """The 12 "low-latency" decode cases (batch 1, 2, 4 x 1K..32K), unweighted."""
    return [DecodeCase("decode-lowlat", b, s) for s in LOWLAT_SEQ_LENS for b in LOWLAT_BATCHES]


def variant_cases() -> list[DecodeCase]:
    """The full grid again for Q = 1 (H = 4) and H = 1, 2 (Q = 8), with the full weights."""
    return [c for q, h in VARIANTS for c in full_cases(q, h, "decode-variants")]


def engine_width_cases() -> list[DecodeCase]:
    """``ENGINE_WIDTH_CASES`` (Q = 8, H = 4) with block tables ``ENGINE_WIDTH`` pages wide."""
    return [DecodeCase("decode-engine-width", b, s, width=ENGINE_WIDTH)
            for b, s in ENGINE_WIDTH_CASES]


def prefill_cases() -> list[PrefillCase]:
    """18 prefill cases: new tokens x cached context x (1 or 4 requests), H = 4."""
    return [PrefillCase(n, c, r) for n in PREFILL_NEW_TOKENS for c in PREFILL_CONTEXTS
            for r in PREFILL_REQS]


def insert_cases() -> list[InsertCase]:
    return [InsertCase()]


# A representative subset for --quick (< 2 min on an H200): the MSA smoke grid plus the
# low-latency target case, one of each variant, and the extreme prefill cases.
QUICK_FULL = {(8, 1_000), (128, 1_000), (8, 100_000), (128, 100_000), (8, 200_000),
              (128, 200_000)}
QUICK_LOWLAT = {(1, 1_000), (4, 1_000), (1, 32_000), (4, 32_000)}
QUICK_VARIANT = {(32, 10_000), (128, 100_000)}
QUICK_ENGINE_WIDTH = {(1, 32_000), (8, 4_000), (128, 1_000), (8, 100_000)}
QUICK_PREFILL = {(1_024, 0, 1), (1_024, 131_072, 1), (16_384, 0, 1), (16_384, 131_072, 1),
                 (16_384, 131_072, 4)}


def quick_filter(cases: list, suite: str) -> list:
    """The --quick subset of a suite's cases."""
    decode = {"decode-full": QUICK_FULL, "decode-lowlat": QUICK_LOWLAT,
              "decode-variants": QUICK_VARIANT, "decode-engine-width": QUICK_ENGINE_WIDTH}
    if suite in decode:
        return [c for c in cases if (c.batch, c.nominal) in decode[suite]]
    if suite in ("prefill", "gather"):
        return [c for c in cases if (c.new_tokens, c.context, c.num_reqs) in QUICK_PREFILL]
    if suite == "engine":
        return [c for c in cases if c.nominal == 32_000 and c.batch in (8, 64)
                and (not c.prefills or c.prefills[0][1] == 32_768)]
    return list(cases)


# ---------------------------------------------------------------------------------------------
# Tiny CPU-smoke workloads: same code paths, sizes a CPU reference handles in seconds.

def smoke_cases() -> dict[str, list]:
    """Tiny stand-ins for every suite (CPU smoke). Not WORKLOADS.md sizes; no timing claims."""
    return {
        "decode-full": [DecodeCase("decode-full", 2, 2_100, 2, 2, 700),
                        DecodeCase("decode-full", 1, 900, 1, 1, 300)],
        "decode-lowlat": [DecodeCase("decode-lowlat", 1, 2_200, 2, 1)],
        "decode-variants": [DecodeCase("decode-variants", 1, 2_100, 1, 1, 1)],
        "decode-engine-width": [DecodeCase("decode-engine-width", 2, 2_100, 2, 1, width=64)],
        "prefill": [PrefillCase(32, 2_048, 2, 1), PrefillCase(16, 0, 1, 1)],
        "gather": [PrefillCase(32, 2_048, 2, 1)],
        "insert": [InsertCase(tokens=128, cache_tokens=16 * PAGE_SIZE, max_position=4_096)],
        "engine": engine_smoke_cases(),
    }


def _self_check() -> None:
    cases = full_cases()
    assert len(cases) == 28 and sum(c.weight for c in cases) == 10_000
    assert all(c.weight > 0 for c in cases)
    assert len(lowlat_cases()) == 12 and len(prefill_cases()) == 18
    assert math.gcd(*PREFILL_NEW_TOKENS) % max(PREFILL_REQS) == 0


_self_check()
