"""The decode runner (SPEC 5, 6): executes a ``dispatch.DecodePlan`` for one static shape.

``DecodeRunner`` asks ``dispatch.plan_decode`` which kernels a shape (B, W, Q, H) takes on its
device, builds their launches once (``launcher.CachedLaunch``: little host work per eager
launch) and runs them: the one-launch kernel (``split_kernel``) and, with splits, its merge;
or a page-score kernel and its select (``page_scores``). ``score_buffer_size`` sizes the
scratch a runner needs; ``decode_indexer`` is the eager one-call form. Every plan selects the
same pages up to SPEC 9's ties (bounds: ``dot_modes.SCORE_ERROR_BITS``).
"""

from __future__ import annotations

import torch

from ...constants import HEAD_DIM, TOPK
from ...validation import check_int
from ..config import DecodeConfig, check_config
from ..device import capability, device_guard, gluon_available, num_sms
from ..dot_modes import SCORE_ERROR_BITS
from ..heuristics import cdiv
from ..launcher import CachedLaunch
from .dispatch import MAX_ROWS, DecodePlan, plan_decode
from .split_kernel import decode_merge_kernel, decode_score_kernel


def _device(device) -> torch.device:
    """``device`` as a ``torch.device`` with its CUDA index (default: the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def plan_for(num_heads: int, num_reqs: int, width: int, query_len: int, device,
             config: DecodeConfig | None = None, *, sms: int | None = None,
             validate: bool = True) -> DecodePlan:
    """``dispatch.plan_decode`` for ``device`` (its capability, SM count unless ``sms`` is
    given, and whether Gluon imports). Errors as ``plan_decode``."""
    device = torch.device(device)
    return plan_decode(num_heads, num_reqs, width, query_len, config,
                       capability=capability(device),
                       num_sms=num_sms(device) if sms is None else sms,
                       gluon=gluon_available(), validate=validate)


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
        split) followed by the window buffer (none for window 1), or the page scores
        ``[B, N, W]`` of a page-score mode. A buffer this size can back the runner of these
        shapes and config on such a GPU (wrappers that never run at once may share one: pass
        the largest size).
    Raises:
        ValueError: ``config`` not None or a ``DecodeConfig``. Bad sizes are refused by
        ``DecodeRunner``.
    """
    cfg = check_config("config", config, DecodeConfig)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    return plan_for(num_heads, num_reqs, num_pages, query_len, device, cfg, sms=num_sms,
                    validate=False).scratch_elems


def warmup_default(warmup: bool | None, device: torch.device) -> bool:
    """Whether a runner warms up: ``warmup``, or None = on CUDA (compiles every kernel it
    launches and syncs, so that CUDA-graph capture never compiles)."""
    return device.type == "cuda" if warmup is None else bool(warmup)


def warmup_inputs(num_reqs: int, query_len: int, q_heads: int, out_heads: int, width: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """Inputs of a warm-up launch (every request empty): ``(index_q, cache, block_table,
    seq_lens, out)``: zero ``float8_e4m3fn [B*Q, q_heads, 128]``, a one-block cache, zero
    int32 ``[B, width]`` and ``[B]``, empty int32 ``[B*Q, out_heads, 16]``."""
    from ...reference.paging import new_index_cache
    b, q = num_reqs, query_len
    return (torch.zeros((b * q, q_heads, HEAD_DIM), dtype=torch.float8_e4m3fn, device=device),
            new_index_cache(1, device=device),
            torch.zeros((b, width), dtype=torch.int32, device=device),
            torch.zeros((b,), dtype=torch.int32, device=device),
            torch.empty((b * q, out_heads, TOPK), dtype=torch.int32, device=device))


class DecodeRunner:
    """Capturable decode indexer for one static shape (B, W, Q, H) (SPEC 6).

    Args:
        num_heads: H (Q*H <= 64). num_reqs: padded batch B. width: block-table width W.
        query_len: Q (1..8). device: the CUDA device (or CPU under the interpreter).
        score_buffer: optional float32 scratch of at least
            ``score_buffer_size(B, W, H, Q, config=config)`` elements (8-byte aligned),
            shared with runners that never run concurrently.
        config: tuning (``config.DecodeConfig``: dot, dequant, num_splits, window, num_warps,
            num_stages, programs_per_sm, maxnreg, pdl, page_score_min_pages, ring_stages);
            None = defaults (``dispatch.plan_decode``: the runner's ``plan``). Every config
            selects the same pages up to SPEC 9's ties.
        warmup: compile both kernels now by one launch on an all-padding batch (default on
            CUDA), so that capturing ``run`` never compiles.
    Raises:
        ValueError: bad sizes, score buffer or config (a ptx / mma / wgflat / wgmma dequant
            mode off CUDA / under the interpreter or with a dot mode other than "fp16"
            ("wgflat" also takes "fp8"; with dot "fp8" the others run their fp16 form,
            ``dispatch.fp8_kernel_dot``);
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
        self.device = _device(device)
        self.num_heads, self.num_reqs, self.width, self.query_len = (num_heads, num_reqs,
                                                                     width, query_len)
        plan = self.plan = plan_for(num_heads, num_reqs, width, query_len, self.device, cfg)
        self.block_m, self.dot, self.dequant = plan.block_m, plan.dot, plan.dequant
        self.kernel_dot, self.num_splits, self.programs = (plan.kernel_dot, plan.num_splits,
                                                           plan.programs)
        self.window, self.keep = plan.window, plan.keep
        if score_buffer is None:
            score_buffer = torch.empty(2 * max(plan.cand_elems, 1) + plan.win_elems,
                                       dtype=torch.float32, device=self.device)
        self.scratch, self.win = self._scratch_view(score_buffer, plan.cand_elems,
                                                    plan.win_elems)
        self._prepare_launches()
        if warmup_default(warmup, self.device):
            self._warmup()

    def _prepare_launches(self) -> None:
        """The plan's kernels with their constexprs fixed (``launcher.CachedLaunch``: an eager
        launch costs little host time)."""
        plan = self.plan
        if plan.page_scores:
            from .page_scores import PageScoreLaunch
            self._page_score = PageScoreLaunch(plan)
            return
        self._score = CachedLaunch(decode_score_kernel, **plan.score.constexprs,
                                   **plan.score.options)
        self._merge, self._merge_grid_y = None, 0
        if plan.merge is not None:
            if plan.merge.kernel == "redux_merge":
                from .redux import redux_merge_kernel as kernel
            else:
                kernel = decode_merge_kernel
            self._merge = CachedLaunch(kernel, **plan.merge.constexprs, **plan.merge.options)
            self._merge_grid_y = cdiv(self.query_len * self.num_heads, plan.merge.rows)

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
        h = self.num_heads
        self.run(*warmup_inputs(self.num_reqs, self.query_len, h, h, self.width, self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
                (``page_scores.PageScoreLaunch``).
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
        if self.plan.page_scores:
            with device_guard(self.device):
                self._page_score(index_q, cache, block_table, seq_lens, out, self.win,
                                 num_blocks=cache.shape[0])
            return out
        q8 = index_q.view(torch.uint8)
        with device_guard(self.device):
            self._score((b, self.num_splits), q8, q8.stride(0), q8.stride(1), cache,
                        cache.stride(0), block_table, block_table.stride(0), seq_lens,
                        self.scratch, self.win, out, self.width, cache.shape[0], 0, 1)
            if self._merge is not None:
                self._merge((b, self._merge_grid_y), self.scratch, seq_lens, out, self.width)
        return out


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
