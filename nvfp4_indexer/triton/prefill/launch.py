"""Prefill plan and launch: what ``prefill_indexer`` and the engine's ``Indexer`` run per chunk
(SPEC 7).

- ``resolve_prefill(device, config)``: what every chunk of a call (or of an ``Indexer``)
  shares, resolved once from a ``PrefillConfig``: dot mode, tokens on N, whether the Gluon
  kernel may run and in which form, the Triton kernel's knobs.
- ``plan_prefill_chunk(settings, ...)``: one chunk's score launch (Triton or Gluon kernel, its
  splits / keep / window, ``dispatch.prefill_launch``) and merge launch, as ``CachedLaunch``
  objects with their grids (cached: plans of the same shape are shared).
- ``launch_prefill_chunk(plan, ...)``: the chunk's score and merge launches on a gathered
  workspace.
- ``prefill_indexer``: the stateless op; requests are grouped into chunks whose gathered
  pages fit ``max_gather_pages`` (``reference.prefill.plan_chunks``); a request whose last
  query's local page is <= 15 has only short rows (SPEC 5 gives their output by formula), so
  its pages are not gathered. Host syncs are allowed in prefill (SPEC 7): the plan reads
  ``cu_seqlens_q`` and ``seq_lens`` once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ...constants import HEAD_DIM, PAGE_SIZE, SHORT_MAX_LOCAL
from ...reference.prefill import plan_chunks
from ...validation import check_int
from ..config import PrefillConfig, check_config
from ..device import device_guard, num_sms
from ..dot_modes import resolve_dot
from ..heuristics import MAX_WINDOW_ELEMS, cdiv, merge_config, next_pow2
from ..launcher import CachedLaunch
from .dispatch import (TOKENS_ON_N_DOTS, gather_pages_needed, plan_row_blocks,
                       prefill_block_m, prefill_launch, prefill_wgmma_ok)
from .gather import gather_into
from .prefill import prefill_merge_kernel, prefill_score_kernel


@dataclass(frozen=True)
class PrefillSettings:
    """What every prefill chunk of a call shares (``resolve_prefill``).

    Attributes:
        dot: the Triton score kernel's dot mode. tokens_on_n: its page tokens on the MMA's N
        axis. wgmma: the Gluon kernel may take chunks (``dispatch.prefill_wgmma_ok``). fp8:
        Gluon chunks run its E4M3 form (dot "fp8" asked for; SPEC 9 b = 5). num_warps /
        num_stages (None: per chunk) / num_splits / window / block_m: ``PrefillConfig``'s.
    """

    dot: str
    tokens_on_n: bool
    wgmma: bool
    fp8: bool
    num_warps: int = 4
    num_stages: int | None = None
    num_splits: int | None = None
    window: int | None = None
    block_m: int | None = None


def resolve_prefill(device, config: PrefillConfig | None = None) -> PrefillSettings:
    """The ``PrefillSettings`` of prefill chunks on ``device`` with ``config`` (None: the
    defaults). Kernel None takes the Gluon kernel where it runs, unless a Triton-kernel knob
    (window, num_stages) is given. Dot "fp8" where the Gluon kernel runs: its chunks in the
    E4M3 form, the other chunks exact (fp16, tokens on N: no faster fp8 path there).

    Raises:
        ValueError: ``config`` not None or a ``PrefillConfig``; kernel "wgmma" where it cannot
        run (not a CUDA SM90 GPU with Gluon, dot other than fp16 / fp8, tokens on M).
    """
    cfg = check_config("config", config, PrefillConfig)
    dev = torch.device(device)
    dot = resolve_dot(cfg.dot, dev)
    auto = cfg.kernel is None and cfg.window is None and cfg.num_stages is None
    fp8 = dot == "fp8" and (cfg.kernel == "wgmma" or auto) \
        and cfg.tokens_on_n is not False and prefill_wgmma_ok(dev, "fp8", True)
    if fp8:
        dot = "fp16"
    tokens_on_n = dot in TOKENS_ON_N_DOTS if cfg.tokens_on_n is None else cfg.tokens_on_n
    wgmma = (cfg.kernel == "wgmma" or auto) and prefill_wgmma_ok(dev, dot, tokens_on_n)
    if cfg.kernel == "wgmma" and not wgmma:
        raise ValueError("kernel: 'wgmma' needs a CUDA SM90 GPU with Gluon, dot 'fp16' or "
                         f"'fp8', and tokens on N, got device {dev}, dot {dot!r}, "
                         f"tokens_on_n {tokens_on_n}")
    return PrefillSettings(dot, tokens_on_n, wgmma, fp8, cfg.num_warps, cfg.num_stages,
                           cfg.num_splits, cfg.window, cfg.block_m)


def fp8_config(device, allow_fp8_mma: bool) -> PrefillConfig | None:
    """The ``PrefillConfig`` of the public ``allow_fp8_mma``: ``dot="fp8"`` where the Gluon
    kernel's E4M3 form runs (``dispatch.prefill_wgmma_ok``: CUDA SM90 with Gluon, not the
    interpreter), else None (the defaults: exact)."""
    if allow_fp8_mma and prefill_wgmma_ok(device, "fp8", True):
        return PrefillConfig(dot="fp8")
    return None


@dataclass(frozen=True)
class PrefillLaunchPlan:
    """One prefill chunk's launches (``plan_prefill_chunk``); never edited (plans are shared).

    Attributes:
        num_blocks / block_m: row blocks and BLOCK_M. shape: ``dispatch.prefill_launch``'s
        dict (``ns, keep, win, cand, win_elems, scratch, kernel, stages, block_m``).
        score: the score kernel's ``CachedLaunch``; score_grid ``(num_blocks, ns)``.
        merge: the merge kernel's (None with one split); merge_grid ``(num_blocks,
        BLOCK_M / rows)``.
    """

    num_blocks: int
    block_m: int
    shape: dict
    score: CachedLaunch
    score_grid: tuple
    merge: CachedLaunch | None
    merge_grid: tuple | None

    @property
    def cand_elems(self) -> int:
        """int64 elements of the candidate scratch (0 unsplit)."""
        return self.shape["cand"]

    @property
    def win_elems(self) -> int:
        """float32 elements of the window scratch (0 for window 1)."""
        return self.shape["win_elems"]


@functools.lru_cache(maxsize=1024)
def plan_prefill_chunk(settings: PrefillSettings, num_heads: int, num_blocks: int,
                       score_pages: int, block_m: int, num_sms: int,
                       cap: int | None = None) -> PrefillLaunchPlan:
    """The score and merge launches of a chunk of ``num_blocks`` row blocks of ``block_m``
    rows whose longest block scores ``score_pages`` pages (0: every row short), for
    ``num_heads`` heads on a GPU of ``num_sms`` SMs (host only; cached).

    ``cap``: float32 elements the scratch may take (an ``Indexer``'s shared buffer: fewer
    splits until it fits, ``dispatch.prefill_launch``). The merge takes the bitonic top-16
    where a row has 16-64 candidate columns (``heuristics.merge_config(sort=True)``; H200:
    merge alone 1.4-1.6x faster than 15 rounds, bit-equal).
    """
    s = settings
    shape = prefill_launch(num_blocks, score_pages, block_m, num_sms, num_splits=s.num_splits,
                           window=s.window, cap=cap, wgmma=s.wgmma)
    ns, keep = shape["ns"], shape["keep"]
    if shape["kernel"] == "wgmma":
        from .prefill_wgmma import launch_options, prefill_wgmma_kernel
        score = CachedLaunch(prefill_wgmma_kernel, H=num_heads, BLOCK_M=block_m,
                             NUM_SPLITS=ns, **launch_options(s.fp8))
    else:
        score = CachedLaunch(prefill_score_kernel, H=num_heads, BLOCK_M=block_m,
                             NUM_SPLITS=ns, DOT=s.dot, WINDOW=shape["win"], KEEP=keep,
                             TOKENS_N=s.tokens_on_n, num_warps=s.num_warps,
                             num_stages=s.num_stages or shape["stages"])
    merge = merge_grid = None
    if ns > 1:
        rows, warps = merge_config(ns, keep, sort=True)
        merge = CachedLaunch(prefill_merge_kernel, H=num_heads, BLOCK_M=block_m, NUM_SPLITS=ns,
                             SPLITS_PAD=next_pow2(ns), ROWS=rows, KEEP=keep, SORT=1,
                             num_warps=warps)
        merge_grid = (num_blocks, cdiv(block_m, rows))
    return PrefillLaunchPlan(num_blocks, block_m, shape, score, (num_blocks, ns), merge,
                             merge_grid)


def launch_prefill_chunk(plan: PrefillLaunchPlan, q8: torch.Tensor, ws8, ws_off: torch.Tensor,
                         req_base: int, qsl: torch.Tensor, seq_lens: torch.Tensor,
                         caps: torch.Tensor, blocks: torch.Tensor, cand: torch.Tensor,
                         win: torch.Tensor, out: torch.Tensor) -> None:
    """Launch a chunk's score and merge kernels (no allocation, no sync; the caller makes the
    device current).

    Args:
        q8: the E4M3 queries as uint8 ``[T, H, 128]`` (unit last stride). ws8: the gathered
        workspace, uint8 ``[P, 128, 128]``. ws_off: int32 each request's first workspace page,
        indexed by request - ``req_base``. qsl: int32 query offsets of the requests the
        blocks name. seq_lens / caps: int32 device / planned seq lens (SPEC 8.1). blocks:
        int32 ``[2, num_blocks]`` (request, first row; ``dispatch.plan_row_blocks``). cand /
        win: int64 / float32 scratch of at least ``plan.cand_elems`` / ``plan.win_elems``
        elements (1 when 0). out: int32 ``[T, H, 16]`` contiguous (rows of the blocks only
        are written, SPEC 5).
    """
    qs = q8.stride()
    nb = plan.num_blocks
    plan.score(plan.score_grid, q8, qs[0], qs[1], ws8, ws_off, req_base, qsl, seq_lens, caps,
               blocks, nb, cand, win, out)
    if plan.merge is not None:
        plan.merge(plan.merge_grid, cand, qsl, seq_lens, caps, blocks, nb, out)


def prefill_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, max_gather_pages: int,
                    out: torch.Tensor, *, config: PrefillConfig | None = None) -> torch.Tensor:
    """Selected pages of prefill requests into ``out`` (SPEC 5, 7).

    Args:
        index_q: ``float8_e4m3fn [Tp, H, 128]`` (unit last stride). cache: ``uint8 [N, 128, 72]``
        paged cache. block_table: int32 ``[R, W]`` (unit last stride). cu_seqlens_q: int32
        ``[R+1]`` (each q_len >= 1). seq_lens: int32 ``[R]`` (q_len <= seq_len <= W*128).
        max_gather_pages: workspace budget in pages per chunk (>= any request's history).
        out: int32 ``[Tp, H, 16]`` contiguous.
        config: tuning (``config.PrefillConfig``: dot, num_splits, window, block_m, num_warps,
        num_stages, tokens_on_n, kernel, the gather's ``GatherConfig``); None = defaults
        (``dispatch``). The workspace is allocated once, for the largest chunk.
    Inputs are assumed validated (``nvfp4_indexer.api.prefill_indexer``). Syncs the host.
    Returns ``out``.
    Raises:
        ValueError: ``config`` not None or a ``PrefillConfig``; its window with
        window * BLOCK_M > 4096; a bad ``max_gather_pages``; kernel "wgmma" where it cannot
        run (``dispatch.prefill_wgmma_ok``).
    """
    cfg = check_config("config", config, PrefillConfig)
    max_gather_pages = check_int("max_gather_pages", max_gather_pages, lo=0)
    t, h, _ = index_q.shape
    num_reqs = block_table.shape[0]
    dev = index_q.device
    settings = resolve_prefill(dev, cfg)
    if t == 0 or num_reqs == 0:
        return out
    qsl = cu_seqlens_q.tolist()
    sl = seq_lens.tolist()
    need = gather_pages_needed(sl)
    chunks = plan_chunks(need, max(max_gather_pages, max(need)))
    ws_pages = max(sum(need[a:b]) for a, b in chunks)
    q_lens = np.diff(np.asarray(qsl, dtype=np.int64))
    seq = np.asarray(sl, dtype=np.int64)
    block_m = cfg.block_m or prefill_block_m(int(q_lens.max()), h)
    if cfg.window is not None and cfg.window * block_m > MAX_WINDOW_ELEMS:
        raise ValueError(f"window: expected window * BLOCK_M <= {MAX_WINDOW_ELEMS}, got "
                         f"{cfg.window} * {block_m}")
    workspace = torch.empty((max(ws_pages, 1), PAGE_SIZE, HEAD_DIM), dtype=torch.float8_e4m3fn,
                            device=dev)
    ws8 = workspace.view(torch.uint8)
    q8 = index_q.view(torch.uint8)
    sms = num_sms(dev)
    for a, b in chunks:
        reqs, row0s, pages = plan_row_blocks(q_lens[a:b], seq[a:b], h, block_m)
        nb = len(reqs)
        offsets = np.zeros(b - a + 1, dtype=np.int64)  # each request's first workspace page
        np.cumsum(need[a:b], out=offsets[1:])
        meta = torch.from_numpy(np.concatenate((reqs + a, row0s, offsets, need[a:b]))
                                .astype(np.int32)).to(dev)
        n = b - a
        blocks, ws_off, counts = meta[:2 * nb], meta[2 * nb:2 * nb + n + 1], meta[2 * nb + n + 1:]
        top = int(pages.max())
        plan = plan_prefill_chunk(settings, h, nb, top if top > SHORT_MAX_LOCAL else 0,
                                  block_m, sms)
        if offsets[-1]:
            gather_into(cache, block_table[a:b], counts, ws_off, workspace, max(need[a:b]),
                        lengths_are_seq_lens=False, config=cfg.gather)
        cand = torch.empty((max(plan.cand_elems, 1),), dtype=torch.int64, device=dev)
        scratch = torch.empty((max(plan.win_elems, 1),), dtype=torch.float32, device=dev)
        with device_guard(dev):
            launch_prefill_chunk(plan, q8, ws8, ws_off, a, cu_seqlens_q, seq_lens, seq_lens,
                                 blocks, cand, scratch, out)
    return out
