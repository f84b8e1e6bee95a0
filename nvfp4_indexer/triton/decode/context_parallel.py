"""Triton kernels of decode context parallelism (SPEC 8.2): one rank's share of the pages
for every rank's heads, and the merge after the candidate exchange.

Rank r of W runs, per decode step (``ContextParallelRunner``):

1. ``score``: the decode score kernel (``split_kernel.decode_score_kernel``) in page-subset mode,
   pages ``j = r, r + W, ...`` of each request, for all ``W * H_r`` heads (the gathered
   queries), always writing its split candidates to the scratch ``[B, BLOCK_M, NS, KEEP]``;
   then ``_cp_reduce_kernel`` keeps each row's 16 largest packed (score, page) keys
   (``topk`` packing, SPEC 5 order) and stores them grouped by the rank that owns the head:
   the send buffer int64 ``[W, B*Q, H_r, 16]`` (head ``s * H_r + h`` -> block ``s``).
2. (the caller exchanges the send buffers: all-gather or all-to-all)
3. ``merge``: ``_cp_merge_kernel`` reads, for each of this rank's rows, the ``W * 16``
   candidates the ranks sent it and writes the SPEC 5 output (``topk.write_selection``:
   15 largest keys, slot 15 = L, short and padding rows by formula).

The union of the ranks' 16 best holds every row's 15 best history pages, so the output is the
single-device selection of the same page scores. Like ``DecodeRunner``: nothing depends on
host values of the metadata, every program writes all of its outputs each run, and ``run``
allocates nothing (CUDA-graph capturable). Launch parameters:
``dispatch.plan_context_parallel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...constants import HEAD_DIM, TOPK
from ...validation import check_int
from .. import layout
from ..config import DecodeConfig, check_config
from ..device import capability, device_guard, num_sms
from ..dot_modes import SCORE_ERROR_BITS
from ..layout import local_page
from ..scan import clamped_seq_len, decode_rows, out_offsets
from ..topk import EMPTY, load_candidates, write_selection
from .dispatch import MAX_ROWS, SEND_KEEP, plan_context_parallel
from .runner import warmup_default, warmup_inputs
from .split_kernel import decode_score_kernel


@triton.jit(do_not_specialize=["num_rows", "width"],
            do_not_specialize_on_alignment=["cand_ptr", "seq_lens_ptr", "send_ptr"])
def _cp_reduce_kernel(cand_ptr, seq_lens_ptr, send_ptr, num_rows, width, Q: tl.constexpr,
                      H_R: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, ROWS: tl.constexpr,
                      KEEP: tl.constexpr):
    """Each row's 16 largest split candidates -> send buffer ``[WORLD, num_rows, H_R, 16]``
    (EMPTY where fewer). With more than 16 per row, rows of all-short programs send EMPTY
    only (their output is a formula)."""
    H: tl.constexpr = WORLD * H_R
    b = tl.program_id(0)
    m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    i = m // H
    h = m % H
    row_ok = m < Q * H
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)  # SPEC 10 clamp
    local = local_page(seq_len - Q + i)
    slot = tl.arange(0, layout.TOPK)[None, :]
    src = (b * BLOCK_M + m).to(tl.int64)
    if NUM_SPLITS * KEEP <= layout.TOPK:  # every candidate fits: copy (EMPTY-padded)
        res = tl.load(cand_ptr + src[:, None] * (NUM_SPLITS * KEEP) + slot,
                      mask=row_ok[:, None] & (slot < NUM_SPLITS * KEEP), other=EMPTY)
    else:  # 16 rounds of max-and-remove, skipped when every row is short
        keys = load_candidates(cand_ptr, src, row_ok, NUM_SPLITS, SPLITS_PAD, KEEP)
        res = tl.full([ROWS, layout.TOPK], EMPTY, tl.int64)
        if tl.max(tl.where(row_ok, local, 0), 0) > layout.HISTORY:
            for k in tl.static_range(layout.TOPK):
                best = tl.max(keys, 1)
                res = tl.where(slot == k, best[:, None], res)
                keys = tl.where(keys == best[:, None], EMPTY, keys)
    owner = h // H_R
    dst = ((owner * num_rows + b * Q + i).to(tl.int64) * H_R + h % H_R) * layout.TOPK
    tl.store(send_ptr + dst[:, None] + slot, res, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["src_stride", "width"],
            do_not_specialize_on_alignment=["recv_ptr", "seq_lens_ptr", "out_ptr"])
def _cp_merge_kernel(recv_ptr, src_stride, seq_lens_ptr, out_ptr, width, Q: tl.constexpr,
                     H_R: tl.constexpr, WORLD: tl.constexpr, WORLD_PAD: tl.constexpr,
                     ROWS: tl.constexpr):
    """SPEC 5 output of this rank's rows from the candidates received from every rank:
    ``recv_ptr + s * src_stride`` is rank s's int64 ``[B*Q, H_R, 16]`` block for this rank."""
    b = tl.program_id(0)
    m = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    seq_len = clamped_seq_len(seq_lens_ptr, b, width)  # SPEC 10 clamp
    h, row_ok, local, row = decode_rows(b, m, seq_len, Q, H_R)
    c = tl.arange(0, WORLD_PAD * layout.TOPK)[None, :]
    src = c // layout.TOPK
    ptr = recv_ptr + src.to(tl.int64) * src_stride + out_offsets(row, h, H_R)[:, None] \
        + c % layout.TOPK
    keys = tl.load(ptr, mask=row_ok[:, None] & (src < WORLD), other=EMPTY)
    write_selection(keys, local, out_ptr + out_offsets(row, h, H_R), row_ok)


class ContextParallelRunner:
    """One rank's kernels for one static shape (B, W', Q, H_r) and group size (SPEC 8.2).

    Args:
        num_heads: H_r, this rank's index heads (every rank has as many).
        world / rank: the group size W and this rank's index r (scores pages j % W == r).
        num_reqs: padded batch B. width: block-table width W'. query_len: Q (1..8).
        device: the CUDA device (or CPU under the interpreter).
        config: the score kernel's tuning (``config.DecodeConfig``, as ``DecodeRunner``;
            its dequant must be a one-launch kernel mode, ``KERNEL_DEQUANT_MODES``, and pdl
            False; page_score_min_pages is unused).
        rows_per_program: query rows per program of the reduce and merge kernels (a power of
            two; default ``heuristics.merge_config``'s one row on a GPU, and under the
            interpreter all of a request's rows: fewer interpreted programs).
    The runner's ``plan`` (``dispatch.ContextParallelPlan``) holds its launches.
        warmup: compile the kernels now (default on CUDA), so capture never compiles.
    Raises:
        ValueError: bad sizes or config. NotImplementedError: Q * W * H_r > 64 (the score
        kernel holds every rank's rows of a request in one tile).
    """

    def __init__(self, num_heads: int, world: int, rank: int, num_reqs: int, width: int,
                 query_len: int, device, *, config: DecodeConfig | None = None,
                 rows_per_program: int | None = None, warmup: bool | None = None):
        # Python or numpy integers, never bool (SPEC 11)
        num_heads, world, num_reqs, width, query_len = (
            check_int(name, val, lo=1) for name, val in (
                ("num_heads", num_heads), ("world", world), ("num_reqs", num_reqs),
                ("width", width), ("query_len", query_len)))
        rank = check_int("rank", rank, lo=0, hi=world - 1)
        rows_per_program = check_int("rows_per_program", rows_per_program, lo=1, optional=True)
        if rows_per_program is not None and rows_per_program & (rows_per_program - 1):
            raise ValueError(f"rows_per_program: expected None or a power of two, got "
                             f"{rows_per_program!r}")
        cfg = self.config = check_config("config", config, DecodeConfig)
        heads = world * num_heads
        if query_len * heads > MAX_ROWS:
            raise NotImplementedError(
                f"query_len * num_heads * group size: the Triton context-parallel decode "
                f"scores every rank's heads in one tile of at most {MAX_ROWS} rows per "
                f"request, got {query_len} * {num_heads} * {world}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_heads, self.world, self.rank = num_heads, world, rank
        self.num_reqs, self.width, self.query_len = num_reqs, width, query_len
        plan = self.plan = plan_context_parallel(
            num_heads, world, num_reqs, width, query_len, cfg,
            capability=capability(self.device), num_sms=num_sms(self.device),
            rows_per_program=rows_per_program)
        self.block_m, self.dot, self.dequant = plan.block_m, plan.dot, plan.dequant
        self.num_splits, self.keep, self.window = plan.num_splits, plan.keep, plan.window
        # the decode runner's scratch shapes (candidates always: the exchange needs them)
        self.scratch = torch.empty(plan.cand_elems, dtype=torch.int64, device=self.device)
        self.win = torch.empty(max(plan.win_elems, 1), dtype=torch.float32,
                               device=self.device)
        if warmup_default(warmup, self.device):
            self._warmup()

    @property
    def error_bits(self) -> int:
        """SPEC 9's b for this runner's dot mode."""
        return SCORE_ERROR_BITS[self.dot]

    def send_shape(self) -> tuple[int, int, int, int]:
        """Shape of the int64 send buffer ``score`` fills: ``(W, B*Q, H_r, 16)``."""
        return (self.world, self.num_reqs * self.query_len, self.num_heads, SEND_KEEP)

    def _warmup(self) -> None:
        dev = self.device
        q_all, cache, block_table, seq_lens, out = warmup_inputs(
            self.num_reqs, self.query_len, self.world * self.num_heads, self.num_heads,
            self.width, dev)
        send = torch.empty(self.send_shape(), dtype=torch.int64, device=dev)
        self.score(q_all, cache, block_table, seq_lens, send)
        self.merge(send, send[0].numel(), seq_lens, out)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def score(self, index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, send: torch.Tensor) -> torch.Tensor:
        """This rank's candidates for every rank's heads (no allocation, capturable).

        Args:
            index_q: ``float8_e4m3fn [B*Q, W*H_r, 128]`` (unit last stride): all ranks' heads,
            head ``s * H_r + h`` is rank s's head h. cache: the paged cache.
            block_table: int32 ``[B, W']`` (unit last stride). seq_lens: int32 ``[B]``.
            send: int64 ``send_shape()`` contiguous, written completely.
        Values are trusted (validated by the caller's ``plan()``). Returns ``send``.
        """
        b, q, hr, world = self.num_reqs, self.query_len, self.num_heads, self.world
        if tuple(index_q.shape) != (b * q, world * hr, HEAD_DIM) \
                or tuple(block_table.shape) != (b, self.width) or seq_lens.shape[0] != b \
                or tuple(send.shape) != self.send_shape() or not send.is_contiguous():
            raise ValueError(
                f"ContextParallelRunner.score: expected index_q [{b * q}, {world * hr}, "
                f"{HEAD_DIM}], block_table [{b}, {self.width}], seq_lens [{b}], contiguous "
                f"send {list(self.send_shape())}; got {tuple(index_q.shape)}, "
                f"{tuple(block_table.shape)}, {tuple(seq_lens.shape)}, {tuple(send.shape)}")
        q8 = index_q.view(torch.uint8)
        with device_guard(self.device):
            score, reduce = self.plan.score, self.plan.reduce
            decode_score_kernel[(b, self.num_splits)](
                q8, q8.stride(0), q8.stride(1), cache, cache.stride(0),
                block_table, block_table.stride(0), seq_lens, self.scratch, self.win,
                self.scratch, block_table.shape[1], cache.shape[0], self.rank, world,
                **score.constexprs, **score.options)
            _cp_reduce_kernel[(b, triton.cdiv(q * world * hr, reduce.rows))](
                self.scratch, seq_lens, send, b * q, self.width, **reduce.constexprs,
                **reduce.options)
        return send

    def merge(self, recv: torch.Tensor, src_stride: int, seq_lens: torch.Tensor,
              out: torch.Tensor) -> torch.Tensor:
        """SPEC 5 output of this rank's rows from the received candidates (capturable).

        Args:
            recv: int64 tensor whose storage from ``recv.data_ptr()`` holds, at element
            ``s * src_stride``, rank s's ``[B*Q, H_r, 16]`` candidates for this rank (e.g.
            ``recv_all_gather[:, rank]`` with ``src_stride = W * B*Q * H_r * 16``).
            seq_lens: int32 ``[B]``. out: int32 ``[B*Q, H_r, 16]`` contiguous.
        Returns ``out``.
        """
        b, q, hr = self.num_reqs, self.query_len, self.num_heads
        if recv.dtype != torch.int64 or tuple(out.shape) != (b * q, hr, TOPK):
            raise ValueError(f"ContextParallelRunner.merge: expected int64 recv and out "
                             f"[{b * q}, {hr}, {TOPK}], got {recv.dtype}, {tuple(out.shape)}")
        with device_guard(self.device):
            merge = self.plan.merge
            _cp_merge_kernel[(b, triton.cdiv(q * hr, merge.rows))](
                recv, src_stride, seq_lens, out, self.width, **merge.constexprs,
                **merge.options)
        return out
