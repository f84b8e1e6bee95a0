"""Seeded generator of realistic engine states and op inputs (conformance cases).

Every case is built from a ``numpy.random.Generator`` seeded by ``case_seed(seed, check, i)``,
so ``(seed, check, index)`` names a case on any machine. Engine states share one physical block
pool per case: requests' pages are scattered over a random permutation of the pool, and every
byte a correct kernel must not use is poisoned (SPEC 2):

* unused blocks: half "NaN poison" (codes 0xAB, scale bytes 0x7F = E4M3 NaN), half "attractive
  poison" (codes 0x77/0xFF = +-6, scale 0x7E = 448: huge scores if a kernel ever reads them);
* slots past a request's written tokens in its last page: NaN poison;
* block-table entries at or past a request's page count: -1, large garbage ids, negative ids,
  and valid ids of poisoned blocks;
* padding bytes between pages when the page stride is larger than 9216.

Key and query values come from named distributions (``DISTRIBUTIONS``): gaussian, heavy-tailed
with outlier channels, constant/duplicate pages that force exact ties, tiny magnitudes that hit
the 2^-9 scale floor, huge magnitudes that saturate at 448, a per-page mix, and a "corrupt"
cache whose history pages carry NaN scale bytes (SPEC 4's NaN rules).

The poison values, storage and cache-view helpers live in ``conformance.fixtures``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nvfp4_indexer.constants import HEAD_DIM, PAGE_BYTES, PAGE_SIZE, SCALES_OFFSET
from nvfp4_indexer.reference import formats as F
from nvfp4_indexer.reference.paging import history_pages, write_tokens

from .fixtures import POISON_SCALE, cache_view, poison_slots, poisoned_storage, rope_cache

BOUNDARY_LENS = (1, 2, 8, 127, 128, 129, 255, 256, 257, 1920, 2047, 2048, 2049, 2050,
                 2175, 2176, 2177, 2303, 2304, 2305)
DISTRIBUTIONS = ("gaussian", "outlier", "ties", "tiny", "huge", "mixed", "corrupt")
PAGE_STRIDES = (PAGE_BYTES, PAGE_BYTES, PAGE_BYTES + 16, PAGE_BYTES + 256)
HEADS = (1, 2, 4)


@dataclass(frozen=True)
class Profile:
    """Sizes of one conformance run. ``smoke`` fits CI (2 cores, Triton interpreter);
    ``default`` is a moderate CPU run; ``full`` is for a GPU (contexts up to 128K tokens,
    batches up to 64)."""

    name: str
    codec_random: int  # random fp32 bit patterns for encode_e4m3
    quant_vectors: int  # random vectors per distribution for quantize_nvfp4
    write_cases: int
    write_tokens: int
    insert_cases: int
    insert_tokens: int
    gather_cases: int
    decode_cases: int
    max_batch: int
    long_lens: tuple[int, ...]  # "long" seq lens drawn besides the page boundaries
    case_tokens: int  # budget of cached tokens per paged case
    prefill_cases: int
    max_new_tokens: int
    mixed_cases: int
    wrapper_replays: int
    wrapper_batch: int
    max_position: int  # rows of the RoPE cos/sin cache in insert cases


PROFILES = {
    "smoke": Profile("smoke", codec_random=1 << 12, quant_vectors=24, write_cases=2,
                     write_tokens=48, insert_cases=2, insert_tokens=24, gather_cases=2,
                     decode_cases=7, max_batch=3, long_lens=(2049, 2304, 2600),
                     case_tokens=6000, prefill_cases=3, max_new_tokens=12, mixed_cases=1,
                     wrapper_replays=3, wrapper_batch=3, max_position=4096),
    "default": Profile("default", codec_random=1 << 18, quant_vectors=512, write_cases=6,
                       write_tokens=512, insert_cases=6, insert_tokens=256, gather_cases=6,
                       decode_cases=28, max_batch=8, long_lens=(2049, 4096, 4097, 8191, 16385),
                       case_tokens=48_000, prefill_cases=10, max_new_tokens=256,
                       mixed_cases=4, wrapper_replays=5, wrapper_batch=4, max_position=32768),
    # Sized to finish in about 3 minutes on one H200 (data generation runs on the host).
    "full": Profile("full", codec_random=1 << 20, quant_vectors=1024, write_cases=6,
                    write_tokens=4096, insert_cases=6, insert_tokens=2048, gather_cases=6,
                    decode_cases=20, max_batch=64,
                    long_lens=(2049, 8192, 32769, 65536, 100_000, 131_072),
                    case_tokens=600_000, prefill_cases=8, max_new_tokens=2048,
                    mixed_cases=4, wrapper_replays=10, wrapper_batch=16, max_position=131_072),
}


@dataclass
class Case:
    """One call of one op with its inputs; ``expected`` is None until an oracle fills it (the
    reference) or a golden set provides it.

    ``inputs`` holds tensors and plain scalars; a paged cache is stored as its whole
    ``storage`` (uint8 1-D, padding bytes included) plus ``num_blocks`` and ``page_stride``.
    """

    op: str
    name: str
    seed: int
    inputs: dict[str, Any]
    expected: dict[str, torch.Tensor] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        keys = ("B", "Q", "H", "R", "T", "seq_lens", "dist", "page_stride", "dtype")
        bits = [f"{k}={self.meta[k]}" for k in keys if k in self.meta]
        return " ".join(bits)


def case_seed(seed: int, check: str, index: int) -> int:
    """Seed of case ``index`` of ``check`` in a run seeded by ``seed`` (stable across runs)."""
    tag = int.from_bytes(check.encode()[:8].ljust(8, b"\0"), "little")
    return int(np.random.SeedSequence([seed, tag, index]).generate_state(1, np.uint64)[0]
               % (1 << 62))


# --------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------

def write_keys(storage: torch.Tensor, num_blocks: int, page_stride: int, keys: torch.Tensor,
               slots: torch.Tensor) -> None:
    """Quantize fp32 ``keys [T, 128]`` with the reference (SPEC 1.3) and write them at
    ``slots`` (SPEC 2) into ``storage`` on its device."""
    dev = storage.device
    codes, scales = F.quantize_nvfp4(keys.to(dev))
    write_tokens(cache_view(storage, num_blocks, page_stride), codes, scales, slots.to(dev))


def garbage_ids(rng: np.random.Generator, n: int, num_blocks: int) -> np.ndarray:
    """Poison block-table entries: -1, negative garbage, ids past the cache, and valid ids of
    (poisoned) blocks."""
    choices = np.stack([
        np.full(n, -1), -rng.integers(2, 1 << 30, size=n),
        rng.integers(num_blocks, 1 << 31, size=n, dtype=np.int64),
        rng.integers(0, max(num_blocks, 1), size=n)])
    pick = rng.integers(0, 4, size=n)
    return choices[pick, np.arange(n)].astype(np.int32)


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------

def dist_context(rng: np.random.Generator, dist: str) -> dict:
    """Per-case state of a distribution (outlier channels, tie pools), shared by the keys and
    the queries of one case."""
    return {"dist": dist, "channels": rng.choice(HEAD_DIM, size=3, replace=False),
            "pool": rng.standard_normal((3, HEAD_DIM)).astype(np.float32)}


def _page_values(rng: np.random.Generator, n: int, dist: str, ctx: dict) -> np.ndarray:
    if dist == "gaussian" or dist == "corrupt":
        return rng.standard_normal((n, HEAD_DIM), dtype=np.float32)
    if dist == "outlier":
        x = rng.standard_t(2.5, size=(n, HEAD_DIM)).astype(np.float32)
        x[:, ctx["channels"]] *= 40.0
        return x
    if dist == "ties":
        # A whole page holds one of three pool vectors (or an earlier page's copy):
        # page scores tie exactly.
        return np.repeat(ctx["pool"][rng.integers(0, 3)][None, :], n, axis=0)
    if dist == "tiny":
        mag = 10.0 ** rng.uniform(-14, -5, size=(n, 1))
        x = rng.standard_normal((n, HEAD_DIM)) * mag
        x[rng.random(n) < 0.1] = 0.0
        return x.astype(np.float32)
    if dist == "huge":
        mag = 10.0 ** rng.uniform(2.5, 7, size=(n, 1))
        return (rng.standard_normal((n, HEAD_DIM)) * mag).astype(np.float32)
    raise ValueError(f"unknown distribution {dist!r}")


def request_keys(rng: np.random.Generator, n_tokens: int, dist: str, ctx: dict) -> np.ndarray:
    """fp32 keys ``[n_tokens, 128]`` of one request, generated page by page."""
    out = np.empty((n_tokens, HEAD_DIM), dtype=np.float32)
    for p0 in range(0, n_tokens, PAGE_SIZE):
        n = min(PAGE_SIZE, n_tokens - p0)
        d = dist
        if dist == "mixed":
            d = ("gaussian", "outlier", "ties", "tiny", "huge")[rng.integers(0, 5)]
        if d == "ties" and p0 and rng.random() < 0.3:  # exact copy of an earlier page
            src = rng.integers(0, p0 // PAGE_SIZE) * PAGE_SIZE
            out[p0:p0 + n] = out[src:src + n]
            continue
        out[p0:p0 + n] = _page_values(rng, n, d, ctx)
    return out


def query_values(rng: np.random.Generator, rows: int, heads: int, dist: str,
                 ctx: dict) -> np.ndarray:
    """fp32 queries ``[rows, H, 128]`` for ``dist`` (before E4M3 encoding)."""
    x = rng.standard_normal((rows, heads, HEAD_DIM)).astype(np.float32)
    if dist == "outlier":
        x[..., ctx["channels"]] *= 20.0
    elif dist == "tiny":
        x *= (10.0 ** rng.uniform(-7, -3, size=(rows, heads, 1))).astype(np.float32)
    elif dist == "huge":
        x *= (10.0 ** rng.uniform(1, 4, size=(rows, heads, 1))).astype(np.float32)
    elif dist == "mixed":
        x *= (10.0 ** rng.uniform(-4, 3, size=(rows, heads, 1))).astype(np.float32)
    return x


def encode_queries(x: np.ndarray) -> torch.Tensor:
    """E4M3 queries (SPEC 1.1) from fp32 values."""
    return F.encode_e4m3(torch.from_numpy(np.ascontiguousarray(x)))


def random_e4m3_bytes(rng: np.random.Generator, shape) -> torch.Tensor:
    """Garbage E4M3 bytes (NaN included) for rows nothing may read (padding rows)."""
    return torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8)).view(
        torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------
# Engine states
# --------------------------------------------------------------------------------------------

@dataclass
class Pool:
    """A shared physical block pool with requests' pages scattered over it."""

    storage: torch.Tensor
    num_blocks: int
    page_stride: int
    block_table: torch.Tensor  # int32 [R, W]
    seq_lens: torch.Tensor  # int32 [R]
    corrupted: list = field(default_factory=list)  # (request, logical page, kind)
    ctx: dict = field(default_factory=dict)  # the distribution state (queries reuse it)


def build_pool(rng: np.random.Generator, seq_lens: list[int], dist: str, *,
               extra_cols: int | None = None, page_stride: int | None = None,
               spare_blocks: int | None = None, device=None) -> Pool:
    """Allocate a poisoned pool, scatter each request's ceil(seq_len/128) pages over it, write
    tokens ``0 .. seq_len-1`` with keys of ``dist`` and poison everything else (module doc)."""
    n_pages = [(s + PAGE_SIZE - 1) // PAGE_SIZE for s in seq_lens]
    total = sum(n_pages)
    if spare_blocks is None:
        spare_blocks = int(rng.integers(1, 3 + total // 4 + 1))
    num_blocks = total + spare_blocks
    if page_stride is None:
        page_stride = int(rng.choice(PAGE_STRIDES))
    storage = poisoned_storage(rng, num_blocks, page_stride, device)
    perm = rng.permutation(num_blocks)
    width = max(max(n_pages, default=0) + (int(rng.integers(0, 3)) if extra_cols is None
                                           else extra_cols), 1)
    bt = np.empty((len(seq_lens), width), dtype=np.int32)
    ctx = dist_context(rng, dist)
    used = 0
    for r, (s, n) in enumerate(zip(seq_lens, n_pages)):
        blocks = perm[used:used + n]
        used += n
        bt[r, :n] = blocks
        bt[r, n:] = garbage_ids(rng, width - n, num_blocks)
        if s == 0:
            continue
        keys = torch.from_numpy(request_keys(rng, s, dist, ctx))
        t = np.arange(s)
        slots = torch.from_numpy(blocks[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE)
        write_keys(storage, num_blocks, page_stride, keys, slots)
        poison_slots(storage, page_stride, int(blocks[-1]), s - (n - 1) * PAGE_SIZE)
    pool = Pool(storage, num_blocks, page_stride, torch.from_numpy(bt),
                torch.tensor(seq_lens, dtype=torch.int32), ctx=ctx)
    if dist == "corrupt":
        corrupt_history(rng, pool)
    return pool


def corrupt_history(rng: np.random.Generator, pool: Pool) -> None:
    """Put NaN scale bytes (0x7F) into some history pages: one page entirely NaN (it scores
    NaN), others with a few NaN tokens (skipped by the max) (SPEC 4)."""
    hist = history_pages(pool.seq_lens).tolist()
    for r, n in enumerate(hist):
        if n < 2:
            continue
        pages = rng.choice(n, size=min(n, 3), replace=False)
        for k, j in enumerate(pages.tolist()):
            base = int(pool.block_table[r, j]) * pool.page_stride + SCALES_OFFSET
            if k == 0:
                pool.storage[base: base + PAGE_SIZE * 8] = POISON_SCALE
                pool.corrupted.append((r, j, "all-nan"))
            else:
                toks = rng.choice(PAGE_SIZE, size=5, replace=False)
                for t in toks.tolist():
                    pool.storage[base + 8 * t + int(rng.integers(0, 8))] = POISON_SCALE
                pool.corrupted.append((r, j, "some-nan"))


def pick_seq_len(rng: np.random.Generator, profile: Profile, min_len: int,
                 long_ok: bool = True) -> int:
    """A seq len at or around a page boundary, a profile "long" length, or uniform."""
    u = rng.random()
    if u < 0.45:
        s = int(rng.choice(BOUNDARY_LENS))
    elif u < 0.8 and long_ok:
        s = int(rng.choice(profile.long_lens))
    else:
        s = int(rng.integers(1, max(profile.long_lens[0], 2) + 1))
    return max(s, min_len)


def _fit_budget(lens: list[int], budget: int, floor: int, first_floor: int | None = None
                ) -> list[int]:
    """Halve the longest requests (not below ``floor``; request 0 not below ``first_floor``,
    and only once the others cannot shrink) until the cached tokens fit ``budget``."""
    lens = list(lens)
    first_floor = floor if first_floor is None else first_floor
    while sum(lens) > budget:
        others = [i for i in range(1, len(lens)) if lens[i] > floor]
        if others:
            i = max(others, key=lambda j: lens[j])
            lens[i] = max(floor, lens[i] // 2)
        elif lens and lens[0] > first_floor:
            lens[0] = max(first_floor, lens[0] // 2)
        else:
            break
    return lens


def decode_seq_lens(rng: np.random.Generator, profile: Profile, batch: int, q: int) -> list[int]:
    """Seq lens of a decode batch: the first request past 16 pages (top-k active), padding
    requests (0) mostly at the end, the rest boundary / long / uniform, all >= Q."""
    lens = [pick_seq_len(rng, profile, q) for _ in range(batch)]
    lens[0] = max(lens[0], int(rng.choice(profile.long_lens)))
    lens = _fit_budget(lens, profile.case_tokens, q, max(q, 2049))
    for b in range(1, batch):
        if rng.random() < 0.2:
            lens[b] = 0
    if batch > 1 and rng.random() < 0.5:  # CUDA-graph style: padding at the end
        lens[-1] = 0
    return lens


def decode_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
                *, batch: int | None = None, q: int | None = None, heads: int | None = None,
                device=None) -> Case:
    """A uniform decode batch (SPEC 6) over a poisoned shared pool."""
    q = q or int(rng.choice([1, 1, 2, 3, 4, 8]))
    heads = heads or int(rng.choice(HEADS))
    batch = batch or int(rng.integers(1, profile.max_batch + 1))
    lens = decode_seq_lens(rng, profile, batch, q)
    pool = build_pool(rng, lens, dist, device=device)
    qv = encode_queries(query_values(rng, batch * q, heads, dist, pool.ctx))
    for b, s in enumerate(lens):
        if s == 0:
            qv[b * q:(b + 1) * q] = random_e4m3_bytes(rng, (q, heads, HEAD_DIM))
    if dist == "corrupt" and batch * q > 1:
        qv.view(torch.uint8)[int(rng.integers(0, batch * q)), 0, 3] = 0x7F  # a NaN query
    inputs = _pool_inputs(pool)
    inputs.update(index_q=qv.to(device), query_len=q)
    meta = dict(B=batch, Q=q, H=heads, seq_lens=lens, dist=dist, page_stride=pool.page_stride,
                corrupted=pool.corrupted)
    return Case("decode", name, seed, inputs, meta=meta)


def _pool_inputs(pool: Pool) -> dict:
    return dict(storage=pool.storage, num_blocks=pool.num_blocks, page_stride=pool.page_stride,
                block_table=pool.block_table.to(pool.storage.device),
                seq_lens=pool.seq_lens.to(pool.storage.device))


def prefill_requests(rng: np.random.Generator, profile: Profile, n: int) -> tuple[list, list]:
    """(q_lens, seq_lens) of prefill requests with cached context (bottom-right aligned)."""
    q_lens, lens = [], []
    for _ in range(n):
        ql = int(rng.integers(1, profile.max_new_tokens + 1))
        ctx = 0 if rng.random() < 0.25 else pick_seq_len(rng, profile, 0)
        q_lens.append(ql)
        lens.append(ctx + ql)
    lens = _fit_budget(lens, profile.case_tokens, 1)
    lens = [max(s, ql) for s, ql in zip(lens, q_lens)]
    if lens and max(lens) < 2049:  # keep top-k active in one request
        lens[0] = int(rng.choice(profile.long_lens)) + q_lens[0]
    return q_lens, lens


def gather_budget(rng: np.random.Generator, lens: list[int]) -> int | None:
    """A ``max_gather_pages`` that forces several chunks, or None for the default."""
    hist = [max(s - 1, 0) // PAGE_SIZE for s in lens]
    if rng.random() < 0.4:
        return None
    return max(hist) + int(rng.integers(0, 3))


def prefill_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
                 *, device=None) -> Case:
    """Prefill requests with cached context (SPEC 7), chunked by a small gather budget."""
    r = int(rng.integers(1, 4 + 1))
    heads = int(rng.choice(HEADS))
    q_lens, lens = prefill_requests(rng, profile, r)
    pool = build_pool(rng, lens, dist, device=device)
    t = sum(q_lens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    qv = encode_queries(query_values(rng, t, heads, dist, pool.ctx))
    inputs = _pool_inputs(pool)
    inputs.update(index_q=qv.to(device), cu_seqlens_q=cu.to(device),
                  max_gather_pages=gather_budget(rng, lens))
    meta = dict(R=r, H=heads, T=t, q_lens=q_lens, seq_lens=lens, dist=dist,
                page_stride=pool.page_stride, corrupted=pool.corrupted)
    return Case("prefill", name, seed, inputs, meta=meta)


def mixed_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
               *, device=None) -> Case:
    """A decode-first batch (SPEC 8): decode requests then prefill requests with context,
    sharing one pool, one block table and one output buffer."""
    q = int(rng.choice([1, 2, 4, 8]))
    heads = int(rng.choice(HEADS))
    bd = int(rng.integers(1, profile.max_batch + 1))
    dl = decode_seq_lens(rng, profile, bd, q)
    q_lens, pl = prefill_requests(rng, profile, int(rng.integers(1, 3 + 1)))
    pool = build_pool(rng, dl + pl, dist, device=device)
    nd = bd * q
    tp = sum(q_lens)
    qv = encode_queries(query_values(rng, nd + tp, heads, dist, pool.ctx))
    for b, s in enumerate(dl):
        if s == 0:
            qv[b * q:(b + 1) * q] = random_e4m3_bytes(rng, (q, heads, HEAD_DIM))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    inputs = _pool_inputs(pool)
    inputs.update(index_q=qv.to(device), query_len=q, num_decode_reqs=bd,
                  cu_seqlens_q=cu.to(device), max_gather_pages=gather_budget(rng, pl))
    meta = dict(B=bd, Q=q, R=len(pl), H=heads, T=nd + tp, seq_lens=dl + pl, dist=dist,
                page_stride=pool.page_stride)
    return Case("mixed", name, seed, inputs, meta=meta)


def gather_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
                *, device=None) -> Case:
    """Workspace gather (SPEC 7) of requests including empty (seq_len 0) ones."""
    r = int(rng.integers(1, 5 + 1))
    lens = [0 if rng.random() < 0.2 else pick_seq_len(rng, profile, 1) for _ in range(r)]
    lens = _fit_budget(lens, min(profile.case_tokens // 2, 40_000), 1)
    pool = build_pool(rng, lens, dist, device=device)
    meta = dict(R=r, seq_lens=lens, dist=dist, page_stride=pool.page_stride)
    return Case("gather_index_k_fp8", name, seed, _pool_inputs(pool), meta=meta)


def scores_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
                *, device=None) -> Case:
    """``page_scores`` over a mixed set of requests (decode-like and prefill-like rows)."""
    c = prefill_case(rng, profile, name, seed, dist, device=device)
    inputs = dict(c.inputs)
    inputs["query_start_loc"] = inputs.pop("cu_seqlens_q")
    inputs.pop("max_gather_pages")
    return Case("page_scores", name, seed, inputs, meta=c.meta)


# --------------------------------------------------------------------------------------------
# Writes and inserts
# --------------------------------------------------------------------------------------------

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}


def scattered_slots(rng: np.random.Generator, t: int, num_blocks: int) -> torch.Tensor:
    """``t`` distinct slots in random order over the pool, ~15% of them -1 (skip)."""
    slots = rng.choice(num_blocks * PAGE_SIZE, size=t, replace=False).astype(np.int64)
    slots[rng.random(t) < 0.15] = -1
    return torch.from_numpy(slots)


def key_values(rng: np.random.Generator, t: int, dist: str) -> np.ndarray:
    """fp32 keys for write cases: each token from ``dist`` (mixed: per token)."""
    ctx = dist_context(rng, dist)
    rows = []
    for _ in range(t):
        d = dist if dist not in ("mixed", "corrupt") else \
            ("gaussian", "outlier", "ties", "tiny", "huge")[rng.integers(0, 5)]
        rows.append(_page_values(rng, 1, d, ctx))
    return np.concatenate(rows) if rows else np.zeros((0, HEAD_DIM), np.float32)


def _write_shape(rng: np.random.Generator, max_tokens: int) -> tuple[int, int, int, str]:
    """``(tokens, num_blocks, page_stride, key dtype name)`` of a write / insert case: up to
    ``max_tokens`` tokens, no more than the blocks hold."""
    t = int(rng.integers(1, max_tokens + 1))
    num_blocks = int(rng.integers(1, max(2, t // 32) + 2))
    t = min(t, num_blocks * PAGE_SIZE)
    page_stride = int(rng.choice(PAGE_STRIDES))
    return t, num_blocks, page_stride, str(rng.choice(list(_FLOAT_DTYPES)))


def write_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
               *, device=None) -> Case:
    """``write_index_k`` of scattered tokens (some skipped) into a poisoned cache."""
    t, num_blocks, page_stride, dtype = _write_shape(rng, profile.write_tokens)
    k = torch.from_numpy(key_values(rng, t, dist)).to(_FLOAT_DTYPES[dtype])
    slots = scattered_slots(rng, t, num_blocks)
    if rng.random() < 0.5:
        slots = slots.to(torch.int32)
    inputs = dict(storage=poisoned_storage(rng, num_blocks, page_stride, device),
                  num_blocks=num_blocks, page_stride=page_stride, k=k.to(device),
                  slot_mapping=slots.to(device))
    meta = dict(T=t, dist=dist, dtype=dtype, page_stride=page_stride)
    return Case("write_index_k", name, seed, inputs, meta=meta)


def norm_inputs(rng: np.random.Generator, profile: Profile, t: int, dist: str) -> dict:
    """Positions, Gemma norm weight and RoPE cache for an insert / query case. ``tiny`` and
    ``huge`` use weights near -1 and large weights (scale floor / saturation after the norm)."""
    rotary_dim = int(rng.choice([64, 64, 32, 128]))
    max_pos = int(rng.integers(max(t, 16), profile.max_position + 1))
    w = rng.standard_normal(HEAD_DIM).astype(np.float32) * 0.5
    if dist == "tiny":
        w = (-1.0 + 10.0 ** rng.uniform(-9, -5, size=HEAD_DIM)).astype(np.float32)
    elif dist == "huge":
        w = (10.0 ** rng.uniform(1, 4, size=HEAD_DIM)).astype(np.float32)
    wdtype = str(rng.choice(list(_FLOAT_DTYPES)))
    cdtype = str(rng.choice(["float32", "bfloat16"]))
    return dict(positions=torch.from_numpy(rng.integers(0, max_pos, size=t)),
                weight=torch.from_numpy(w).to(_FLOAT_DTYPES[wdtype]),
                cos_sin_cache=rope_cache(max_pos, rotary_dim, _FLOAT_DTYPES[cdtype]),
                rotary_dim=rotary_dim, eps=float(rng.choice([1e-6, 1e-5])))


def insert_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
                *, device=None) -> Case:
    """Fused norm + RoPE + quantize + write (SPEC 3) into a poisoned cache."""
    t, num_blocks, page_stride, dtype = _write_shape(rng, profile.insert_tokens)
    kv = key_values(rng, t, "gaussian" if dist in ("tiny", "huge") else dist)
    kv[rng.random(t) < 0.05] = 0.0  # zero vectors: rms -> eps, scale floor
    k = torch.from_numpy(kv).to(_FLOAT_DTYPES[dtype])
    inputs = dict(storage=poisoned_storage(rng, num_blocks, page_stride, device),
                  num_blocks=num_blocks, page_stride=page_stride, k=k,
                  slot_mapping=scattered_slots(rng, t, num_blocks))
    inputs.update(norm_inputs(rng, profile, t, dist))
    inputs = {k_: (v.to(device) if isinstance(v, torch.Tensor) else v) for k_, v in inputs.items()}
    meta = dict(T=t, dist=dist, dtype=dtype, page_stride=page_stride,
                rotary_dim=inputs["rotary_dim"])
    return Case("insert_index_k", name, seed, inputs, meta=meta)


def query_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, dist: str,
               *, device=None) -> Case:
    """Query norm + RoPE + E4M3 encode (SPEC 3)."""
    t = int(rng.integers(1, max(2, profile.insert_tokens // 2) + 1))
    heads = int(rng.choice(HEADS))
    dtype = str(rng.choice(list(_FLOAT_DTYPES)))
    x = query_values(rng, t, heads, "gaussian" if dist in ("tiny", "huge") else dist,
                     dist_context(rng, dist))
    q = torch.from_numpy(x).to(_FLOAT_DTYPES[dtype])
    inputs = dict(q=q)
    inputs.update(norm_inputs(rng, profile, t, dist))
    inputs = {k_: (v.to(device) if isinstance(v, torch.Tensor) else v) for k_, v in inputs.items()}
    meta = dict(T=t, H=heads, dist=dist, dtype=dtype, rotary_dim=inputs["rotary_dim"])
    return Case("prepare_index_q", name, seed, inputs, meta=meta)


def _nan_norm_inputs(rng: np.random.Generator, inputs: dict, x: torch.Tensor) -> torch.Tensor:
    """Put SPEC 1.1 / 1.3 NaN edges into a norm + RoPE case, in place on ``inputs``: one NaN
    norm-weight dim (every row then has one or two NaN values among finite ones, so a group's
    amax must skip NaN), a NaN cos/sin row at the position of the last token and ~1/8 of the
    others, and returns ``x`` (float32, leading dims flattened to rows) with a NaN element in
    row 0 and ~1/8 of the rows (the norm makes the whole row NaN) and a +-inf element in row 1
    and ~1/16 of the rows (NaN there, 0 elsewhere)."""
    w = inputs["weight"].clone()
    w[int(rng.integers(0, HEAD_DIM))] = float("nan")
    inputs["weight"] = w
    cs = inputs["cos_sin_cache"].clone()
    p_nan = int(rng.integers(0, cs.shape[0]))
    cs[p_nan, int(rng.integers(0, cs.shape[1]))] = float("nan")
    inputs["cos_sin_cache"] = cs
    pos = inputs["positions"].clone()
    pos[torch.from_numpy(rng.random(pos.shape[0]) < 0.125)] = p_nan
    pos[-1] = p_nan
    inputs["positions"] = pos
    rows = x.reshape(-1, HEAD_DIM).to(torch.float32).clone()
    n = rows.shape[0]
    idx = torch.arange(n)
    nan_rows = torch.from_numpy(rng.random(n) < 0.125)
    nan_rows[0] = True
    inf_rows = torch.from_numpy(rng.random(n) < 0.0625) & ~nan_rows
    inf_rows[1:2] = True
    dims = torch.from_numpy(rng.integers(0, HEAD_DIM, size=n))
    rows[idx[nan_rows], dims[nan_rows]] = float("nan")
    signs = torch.from_numpy(rng.choice([-1.0, 1.0], size=n)).to(torch.float32)
    rows[idx[inf_rows], dims[inf_rows]] = signs[inf_rows] * float("inf")
    return rows


def nan_insert_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, *,
                    device=None) -> Case:
    """``insert_index_k`` with NaN / inf keys, a NaN norm-weight dim and a NaN cos/sin row:
    NaN values skipped by the group amax and quantized to code 0 (SPEC 1.3, 3)."""
    c = insert_case(rng, profile, name, seed, "gaussian")
    inputs = dict(c.inputs)
    k = inputs["k"]
    inputs["k"] = _nan_norm_inputs(rng, inputs, k).to(k.dtype)
    inputs = {k_: (v.to(device) if isinstance(v, torch.Tensor) else v) for k_, v in inputs.items()}
    return Case("insert_index_k", name, seed, inputs, meta=dict(c.meta, dist="nan"))


def nan_query_case(rng: np.random.Generator, profile: Profile, name: str, seed: int, *,
                   device=None) -> Case:
    """``prepare_index_q`` with NaN / inf queries, a NaN norm-weight dim and a NaN cos/sin
    row: NaN values encode as 0x7F (SPEC 1.1, 3)."""
    c = query_case(rng, profile, name, seed, "gaussian")
    inputs = dict(c.inputs)
    q = inputs["q"]
    inputs["q"] = _nan_norm_inputs(rng, inputs, q).reshape(q.shape).to(q.dtype)
    inputs = {k_: (v.to(device) if isinstance(v, torch.Tensor) else v) for k_, v in inputs.items()}
    return Case("prepare_index_q", name, seed, inputs, meta=dict(c.meta, dist="nan"))


# --------------------------------------------------------------------------------------------
# Codec inputs
# --------------------------------------------------------------------------------------------

def e4m3_all_values() -> torch.Tensor:
    """fp32 values of the 256 E4M3 bytes (NaN for 0x7F / 0xFF)."""
    return F.decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8))


def e4m3_edge_inputs() -> torch.Tensor:
    """fp32 inputs on and around every E4M3 rounding boundary (SPEC 1.1): all values,
    midpoints between neighbours (ties to even) and one fp32 ulp either side, the saturation
    range, infinities, NaN, signed zeros, and values below half the smallest subnormal."""
    v = e4m3_all_values()
    pos = torch.unique(v[torch.isfinite(v) & (v >= 0)])  # sorted, 0 .. 448
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32
    extra = torch.tensor([464.0, 480.0, 500.0, 1e4, 3.4e38, float("inf"), float("nan"),
                          2.0 ** -10, 2.0 ** -11, 1e-30, 1.4e-45, 0.0], dtype=torch.float32)
    base = torch.cat([pos, mids, extra])
    around = torch.cat([base, torch.nextafter(base, torch.full_like(base, float("inf"))),
                        torch.nextafter(base, torch.zeros_like(base))])
    return torch.cat([around, -around])


def random_f32_bits(rng: np.random.Generator, n: int) -> torch.Tensor:
    """``n`` fp32 values: half uniform random bit patterns, half with exponents near the E4M3
    range (2^-12 .. 2^10) and random mantissas."""
    a = rng.integers(0, 1 << 32, size=n // 2, dtype=np.uint64).astype(np.uint32)
    m = rng.integers(0, 1 << 23, size=n - n // 2, dtype=np.uint32)
    e = rng.integers(127 - 12, 127 + 10, size=n - n // 2).astype(np.uint32)
    s = rng.integers(0, 2, size=n - n // 2).astype(np.uint32)
    b = (s << 31) | (e << 23) | m
    return torch.from_numpy(np.concatenate([a, b]).view(np.float32).copy())


def all_16bit(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16-bit float dtype (65536 values)."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)


def quantizer_edge_groups() -> torch.Tensor:
    """fp32 vectors ``[N, 128]`` whose groups hit every SPEC 1.3 edge: zeros, -0, NaN and inf
    elements, amax/6 exactly on / one ulp around E4M3 midpoints, the 2^-9 scale floor and the
    rounding-to-zero boundary, saturation (amax/6 >= 448, 464 tie), fp32 max, and elements on /
    around every E2M1 threshold for several scales (where x / s and x * (1/s) differ)."""
    g = 16
    groups: list[torch.Tensor] = []
    f = torch.float32

    def grp(vals):
        t = torch.zeros(g, dtype=f)
        vals = torch.as_tensor(vals, dtype=f).flatten()[:g]
        t[:len(vals)] = vals
        groups.append(t)

    grp([0.0])
    grp(torch.full((g,), -0.0))
    grp([float("nan")] + [1.0] * 15)
    grp(torch.full((g,), float("nan")))
    grp([float("inf"), 1.0, -2.0, 3.0])
    grp([-float("inf"), 1.0, 0.5])
    grp([float("inf"), -float("inf"), float("nan")])
    v = e4m3_all_values()
    pos = torch.unique(v[torch.isfinite(v) & (v > 0)])
    mids = (pos[1:] + pos[:-1]) / 2
    for m in torch.cat([mids[::3], pos[::5]]):
        amax = m * 6  # exact: amax / 6 == m in IEEE fp32
        for a in (amax, torch.nextafter(amax, amax * 2), torch.nextafter(amax, amax * 0)):
            grp(torch.linspace(-1, 1, g) * a)
    for amax in (1e-12, 1e-30, 6 * 2.0 ** -10, 6 * 2.0 ** -10 * (1 + 2.0 ** -20), 6 * 2.0 ** -9,
                 2688.0, 2688.0 * 1.03, 2784.0, 2784.0 * (1 + 2.0 ** -22), 1e30, 3.4028235e38):
        grp([amax, -amax / 3, amax / 7, -amax])
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=f)
    for s in (1.0, 0.875, 0.6875, 2.0 ** -9, 3 * 2.0 ** -9, 448.0, 0.1015625, 13.0):
        s_t = torch.tensor(s, dtype=f)
        x = thresholds * s_t
        for xs in (x, torch.nextafter(x, x * 2), torch.nextafter(x, x * 0)):
            grp(torch.cat([torch.tensor([6 * s], dtype=f), xs, -xs[:7]]))
        grp(torch.tensor([6 * s, -0.1 * s, -0.2 * s, -0.25 * s, 0.25 * s, -1e-30], dtype=f))
    vecs = torch.stack(groups)
    pad = (-len(vecs)) % 8
    if pad:
        vecs = torch.cat([vecs, torch.zeros(pad, g, dtype=f)])
    # Spread groups over vectors; a roll gives each group a different slot in the 8.
    n = len(vecs) // 8
    a = vecs.reshape(n, 8 * g)
    b = torch.roll(vecs, 3, dims=0).reshape(n, 8 * g)
    return torch.cat([a, b])


def random_vectors(rng: np.random.Generator, n: int, dist: str) -> torch.Tensor:
    """``n`` fp32 vectors of ``dist`` for quantize checks."""
    return torch.from_numpy(key_values(rng, n, dist))


# --------------------------------------------------------------------------------------------
# Top-k contract cases: caches whose page scores are designed (SPEC 5)
# --------------------------------------------------------------------------------------------

NUM_CONTRACT_CASES = 11


def _designed_value_bytes() -> list[tuple[int, int]]:
    """(code, scale byte) pairs in descending order of their dequantized value (all distinct),
    from +6 * 2 down to -6 * 2: score of a page whose tokens all hold it in dim 0."""
    pairs = [(c, 0x40) for c in (7, 6, 5, 4, 3, 2, 1)] + [(c, 0x38) for c in (1,)] + \
        [(0, 0x38)] + [(c, 0x38) for c in (9,)] + [(c, 0x40) for c in (9, 10, 11, 12, 13, 14, 15)]
    return pairs


def _set_page(storage: torch.Tensor, page_stride: int, block: int, code: int, scale: int,
              nan: bool = False) -> None:
    """Every token of ``block``: dim 0 holds E2M1 ``code`` under scale byte ``scale``, other
    dims code 0; other groups' scale bytes 0x38. ``nan``: group 0's scale is 0x7F."""
    base = block * page_stride
    page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    codes = page[:SCALES_OFFSET].view(PAGE_SIZE, 64)
    codes[:, 0] = code & 0x0F
    scales = page[SCALES_OFFSET:].view(PAGE_SIZE, 8)
    scales[:] = 0x38
    scales[:, 0] = POISON_SCALE if nan else scale
    storage[base:base + PAGE_BYTES] = page.to(storage.device)


def contract_cases(device=None) -> list[Case]:
    """Decode cases with designed page scores that pin SPEC 5's output contract: exact ties
    (all equal; ties straddling the 15th slot), strict orders, NaN pages, +0 vs -0 scores,
    local pages 15 / 16 / 17 and a request whose Q = 8 queries cross from L = 15 to L = 16.
    Queries are one-hot on dim 0, +1 for head 0 and -1 for head 1 (opposite rankings)."""
    vals = _designed_value_bytes()
    hi, mid, zero, neg = vals[0], vals[6], (0, 0x38), vals[-1]
    negzero = (8, 0x38)  # -0: scores -0.0, equal to +0.0
    designs = {
        "all-equal": ([mid] * 20, [], 2049),
        "ties-at-cut": ([hi if j % 2 else mid for j in range(24)], [], 24 * 128 + 1),
        "descending": ([vals[j % len(vals)] for j in range(17)], [], 17 * 128 + 1),
        "ascending": ([vals[len(vals) - 1 - j % len(vals)] for j in range(18)], [], 18 * 128 + 1),
        "nan-pages": ([mid] * 10 + [hi] * 10, [1, 4, 12, 13, 19], 20 * 128 + 1),
        "all-nan": ([mid] * 17, list(range(17)), 17 * 128 + 1),
        "signed-zero": ([zero if j % 3 else negzero for j in range(18)] + [neg] * 2, [],
                        20 * 128 + 1),
        "L15": ([vals[j % 5] for j in range(16)], [], 2048),
        "L16": ([vals[(3 * j) % 9] for j in range(17)], [], 2049),
        "L17": ([vals[(5 * j) % 11] for j in range(18)], [7], 2177),
        "cross-15-16-q8": ([vals[(7 * j) % 13] for j in range(17)], [], 2052),
    }
    assert len(designs) == NUM_CONTRACT_CASES
    cases = []
    for i, (name, (pages, nan_pages, seq_len)) in enumerate(designs.items()):
        q = 8 if name.endswith("q8") else 1
        n_pages = (seq_len + PAGE_SIZE - 1) // PAGE_SIZE
        rng = np.random.default_rng(1000 + i)
        num_blocks = n_pages + 3
        storage = poisoned_storage(rng, num_blocks, PAGE_BYTES, device)
        perm = rng.permutation(num_blocks)[:n_pages]
        for j in range(n_pages):
            code, scale = pages[j] if j < len(pages) else mid
            _set_page(storage, PAGE_BYTES, int(perm[j]), code, scale, nan=j in nan_pages)
        poison_slots(storage, PAGE_BYTES, int(perm[-1]), seq_len - (n_pages - 1) * PAGE_SIZE)
        width = n_pages + 1
        bt = np.empty((2, width), dtype=np.int32)
        bt[0, :n_pages] = perm
        bt[0, n_pages:] = -1
        bt[1] = garbage_ids(rng, width, num_blocks)  # a padding request
        qb = torch.zeros((2 * q, 2, HEAD_DIM), dtype=torch.uint8)
        qb[:q, 0, 0] = 0x38  # +1.0
        qb[:q, 1, 0] = 0xB8  # -1.0
        qb[q:] = torch.from_numpy(rng.integers(0, 256, size=(q, 2, HEAD_DIM), dtype=np.uint8))
        inputs = dict(storage=storage, num_blocks=num_blocks, page_stride=PAGE_BYTES,
                      block_table=torch.from_numpy(bt).to(device),
                      seq_lens=torch.tensor([seq_len, 0], dtype=torch.int32, device=device),
                      index_q=qb.view(torch.float8_e4m3fn).to(device), query_len=q)
        meta = dict(B=2, Q=q, H=2, seq_lens=[seq_len, 0], dist=f"contract:{name}",
                    page_stride=PAGE_BYTES, nan_pages=nan_pages)
        cases.append(Case("decode", f"decode/contract/{name}", 1000 + i, inputs, meta=meta))
    return cases
