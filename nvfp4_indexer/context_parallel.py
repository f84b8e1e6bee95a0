"""Decode context parallelism across ranks with ``torch.distributed`` (SPEC 8.2).

Every rank of a group of W ranks holds the same index cache (the index key has one head,
replicated across tensor-parallel ranks) and the queries of its own H_r index heads. One
decode step on rank r (``ContextParallelDecodeWrapper.run``):

1. all-gather the ranks' queries ``[B*Q, H_r, 128]`` into ``[B*Q, W*H_r, 128]`` (head
   ``s*H_r + h`` is rank s's head h);
2. score only logical pages ``j % W == r`` for all ``W*H_r`` heads and keep each row's best 16
   candidates as packed int64 (score, page) keys, whose signed order is SPEC 5's (score
   descending, equal scores by smaller id, NaN below every number);
3. exchange the candidates: ``exchange="all_gather"`` (SPEC 8.2's wording: every rank gets
   every rank's candidates for all heads) or ``"all_to_all"`` (each rank gets only its own
   heads' candidates: W times less received, same result);
4. merge for its own heads: the 15 largest keys of the ``W*16`` candidates, slot 15 = L;
   rows with L <= 15 and padding rows by formula (SPEC 5).

The page split is a function of the logical page id only and the union of the ranks' best
16 holds every row's 15 best pages, so every rank's output equals what it computes alone:
bit for bit on the reference backend, and per SPEC 9 on Triton (same page scores up to the
kernel's documented error).

All exchange buffers are allocated once per wrapper, on every rank together (construction,
or the first ``plan()`` when ``query_len`` is not given), after a small collective that
compares the ranks' configurations: ranks with different configurations (e.g. a head count
that the group size does not divide, so ranks hold different numbers of heads) all raise,
none hangs. ``run()`` allocates nothing, never syncs and reads no host values: on NCCL it is
capturable in a CUDA graph. All ranks must call ``plan`` / ``run`` in the same order with the
same metadata (block tables and sequence lengths are replicated across the group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import validation as v
from .api import PlannedDecodeBuffers
from .constants import HEAD_DIM
from .reference import candidates as ref_cand

__all__ = ["ContextParallelDecodeWrapper", "EXCHANGES", "exchange_bytes"]

EXCHANGES = ("all_gather", "all_to_all")
SEND_KEEP = ref_cand.KEEP  # candidates per row a rank sends (16)

# all_gather_single replaces all_gather_into_tensor in newer torch (same semantics)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchange_bytes(num_reqs: int, query_len: int, num_heads: int, world: int,
                   exchange: str = "all_gather") -> dict:
    """Bytes one rank sends and receives per decode step (SPEC 8.2 cost model).

    Args:
        num_reqs: B. query_len: Q. num_heads: H_r, index heads per rank. world: W.
        exchange: "all_gather" or "all_to_all" (the candidate exchange).
    Returns:
        dict with ``query_send`` / ``query_recv`` (E4M3 queries: ``B*Q*H_r*128`` sent,
        ``(W-1)`` times that received), ``cand_send`` / ``cand_recv`` (int64 keys, 16 per row
        and head: all_gather sends ``B*Q*W*H_r*16*8`` and receives ``(W-1)`` times that;
        all_to_all sends and receives ``(W-1)/W`` of it) and ``total_recv``. Only bytes that
        cross between ranks count (a rank's own share stays local).
    Raises:
        ValueError: a non-positive size or an unknown exchange.
    """
    for name, val in (("num_reqs", num_reqs), ("query_len", query_len),
                      ("num_heads", num_heads), ("world", world)):
        if not v.is_int(val) or val < 1:
            v.fail(name, "a positive int", repr(val))
    if exchange not in EXCHANGES:
        v.fail("exchange", " or ".join(repr(e) for e in EXCHANGES), repr(exchange))
    rows = num_reqs * query_len
    q = rows * num_heads * HEAD_DIM
    cand_all = rows * world * num_heads * SEND_KEEP * 8  # this rank's keys for every head
    if exchange == "all_gather":
        c_send, c_recv = cand_all, (world - 1) * cand_all
    else:
        c_send = c_recv = cand_all * (world - 1) // world
    return {"query_send": q, "query_recv": (world - 1) * q, "cand_send": c_send,
            "cand_recv": c_recv, "total_recv": (world - 1) * q + c_recv}


class ContextParallelDecodeWrapper(PlannedDecodeBuffers):
    """Decode indexer for one (padded batch B, query length Q) split over the ranks of a
    ``torch.distributed`` group (SPEC 6, 8.2); same ``plan`` / ``run`` interface as
    ``DecodeIndexerWrapper``.

    Construction is collective: every rank of ``group`` constructs its wrapper with the same
    arguments (its own buffers), and the ranks compare configurations.

    Args:
        num_heads: H_r, this rank's index heads (the same on every rank).
        group: the ``torch.distributed`` process group of the W ranks that share the index
            cache (NCCL with CUDA buffers, gloo with CPU buffers); None: the default group.
        block_table_buffer / seq_lens_buffer: this rank's persistent int32 ``[B, W']`` /
            ``[B]`` buffers, read in place (as ``DecodeIndexerWrapper``).
        query_len: Q, if known now: the exchange buffers are allocated (collectively) here
            instead of at the first ``plan()``.
        use_cuda_graph: compile the Triton kernels at setup so that capture never compiles.
        backend: "auto" | "reference" | "triton" (the reference syncs: not capturable).
        exchange: "all_gather" (default) or "all_to_all", how candidates are exchanged.
        runner_options: keyword arguments of the Triton ``ContextParallelRunner``: ``config``
            (a ``triton.config.DecodeConfig``: dot, dequant, num_splits, window, ...) and
            ``rows_per_program`` (tests and tuning).
    Raises:
        ValueError: bad buffers, ``num_heads``, ``exchange``, an uninitialized
            ``torch.distributed`` or a group device mismatch (NCCL needs CUDA buffers), on
            this rank; ranks whose configurations differ: ValueError on every rank, naming
            the differing fields and ranks. NotImplementedError (every rank): Triton with
            ``Q * W * H_r > 64``.
    """

    _name = "ContextParallelDecodeWrapper"

    def __init__(self, num_heads: int, group=None, *, block_table_buffer: torch.Tensor,
                 seq_lens_buffer: torch.Tensor, query_len: int | None = None,
                 use_cuda_graph: bool = True, backend: str = "auto",
                 exchange: str = "all_gather", runner_options: dict | None = None):
        if not dist.is_available() or not dist.is_initialized():
            v.fail("group", "an initialized torch.distributed process group",
                   "torch.distributed not initialized")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            v.fail("group", "a group this process belongs to", "a group without this rank")
        self._set_buffers(num_heads, block_table_buffer, seq_lens_buffer, use_cuda_graph)
        self.exchange = exchange
        self.runner_options = dict(runner_options or {})
        error = None
        try:
            self._check_local(query_len, backend)
        except (ValueError, TypeError) as e:
            error = e
        self._agree(error, query_len=query_len)
        if query_len is not None:
            self._agree(self._try_setup(query_len))

    # ------------------------------------------------------------------ setup (collective)

    def _check_local(self, query_len, backend) -> None:
        if not v.is_int(self.num_heads) or self.num_heads < 1:
            v.fail("num_heads", "a positive int", repr(self.num_heads))
        dev = v.check_plan_buffers(self.block_table, self.seq_lens)
        if self.exchange not in EXCHANGES:
            v.fail("exchange", " or ".join(repr(e) for e in EXCHANGES), repr(self.exchange))
        if query_len is not None:
            v.check_query_len(query_len)
        self.backend = v.check_backend(backend, dev)
        pg_backend = str(dist.get_backend(self.group)).lower()
        if pg_backend == "nccl" and dev.type != "cuda":
            v.fail("group", "a group whose backend can move the buffers' tensors (NCCL needs "
                   "CUDA buffers)", f"an NCCL group with buffers on {dev}")

    def _fingerprint(self, query_len) -> dict:
        """Everything that sizes a collective or changes results: equal on every rank."""
        bt = self.block_table
        return {"num_heads": self.num_heads, "num_reqs": int(bt.shape[0]),
                "width": int(bt.shape[1]), "query_len": query_len,
                "backend": getattr(self, "backend", None), "exchange": self.exchange,
                "device_type": bt.device.type, "runner_options": sorted(
                    (k, repr(x)) for k, x in self.runner_options.items())}

    def _agree(self, error: Exception | None, query_len=None) -> None:
        """Collective: gather every rank's configuration and local error; raise on every
        rank if any rank failed or the configurations differ (never a one-sided hang)."""
        mine = (None if error is not None else self._fingerprint(query_len),
                None if error is None else f"{type(error).__name__}: {error}")
        theirs = [None] * self.world
        dist.all_gather_object(theirs, mine, group=self.group)
        if error is not None:
            raise error
        failed = [(r, msg) for r, (_, msg) in enumerate(theirs) if msg is not None]
        if failed:
            r, msg = failed[0]
            raise ValueError(f"group: rank {r} of {self.world} refused its configuration "
                             f"({msg})")
        fps = [fp for fp, _ in theirs]
        diff = sorted(k for k in fps[0] if any(fp[k] != fps[0][k] for fp in fps))
        if diff:
            per_rank = "; ".join(f"rank {r}: " + ", ".join(f"{k}={fp[k]!r}" for k in diff)
                                 for r, fp in enumerate(fps))
            hint = (" (the group size must divide the total index heads: every rank holds "
                    "the same number)" if "num_heads" in diff else "")
            raise ValueError(f"group: expected the same context-parallel configuration on "
                             f"all {self.world} ranks{hint}, got {per_rank}")

    def _try_setup(self, query_len: int) -> Exception | None:
        try:
            self._setup(query_len)
        except (ValueError, NotImplementedError) as e:
            return e
        return None

    def _setup(self, query_len: int) -> None:
        """Allocate the exchange buffers and build (and compile) the Triton runner."""
        dev = self.block_table.device
        b, w = self.block_table.shape
        rows, hr, world = b * query_len, self.num_heads, self.world
        runner = None
        if self.backend == "triton" and b > 0 and w > 0:
            from .triton.decode import ContextParallelRunner
            runner = ContextParallelRunner(
                hr, world, self.rank, b, w, query_len, dev,
                warmup=self.use_cuda_graph and dev.type == "cuda", **self.runner_options)
        u8 = torch.uint8
        self._q_send = torch.empty((rows, hr, HEAD_DIM), dtype=u8, device=dev)
        self._q_recv = torch.empty((world * rows, hr, HEAD_DIM), dtype=u8, device=dev)
        self._q_all = torch.empty((rows, world * hr, HEAD_DIM), dtype=u8, device=dev)
        self._cand_send = torch.empty((world, rows, hr, SEND_KEEP), dtype=torch.int64,
                                      device=dev)
        n_recv = world if self.exchange == "all_gather" else 1
        self._cand_recv = torch.empty((world * n_recv, rows, hr, SEND_KEEP),
                                      dtype=torch.int64, device=dev)
        self._runner = runner
        self.query_len = query_len

    # ----------------------------------------------------------------------- plan / run

    @property
    def error_bits(self) -> int | None:
        """SPEC 9's b of the Triton scores (None: the reference is exact)."""
        return None if self._runner is None else self._runner.error_bits

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int, *,
             num_blocks: int | None = None) -> None:
        """Validate this step's metadata (syncs) and copy it into the wrapper's buffers
        (SPEC 6). Collective only on the first call of a wrapper built without
        ``query_len`` (the ranks agree on Q and allocate the exchange buffers).

        Args:
            block_table: int32 ``[B, W'']`` with W'' <= W' (the buffer itself is fine);
            seq_lens: int32 ``[B]``; query_len: Q in 1..8, fixed per wrapper.
            num_blocks: the cache's block count, to check block ids against (optional).
        Raises:
            ValueError: shapes, ranges (SPEC 6, 10), a changed ``query_len``, or (first plan)
            ranks planning different Q. NotImplementedError: Q * W * H_r > 64 on Triton.
        Nothing is copied when it raises. Every rank must plan the same metadata. As in
        ``DecodeIndexerWrapper.plan``, a tensor that is the buffer itself is not copied and
        one that overlaps a buffer otherwise is copied from a clone.
        """
        first = self.query_len is None
        error = None
        try:
            self._check_plan(block_table, seq_lens, query_len, num_blocks)
        except (ValueError, TypeError) as e:
            if not first:
                raise
            error = e
        if first:
            self._agree(error, query_len=query_len)
            self._agree(self._try_setup(query_len))
        self._copy_plan(block_table, seq_lens)

    def buffer_bytes(self) -> int:
        """Device bytes this wrapper allocated itself: exchange buffers and runner scratch."""
        bufs = [getattr(self, n, None) for n in ("_q_send", "_q_recv", "_q_all", "_cand_send",
                                                 "_cand_recv")]
        if self._runner is not None:
            bufs += [getattr(self._runner, "scratch", None), getattr(self._runner, "win", None)]
        return sum(t.numel() * t.element_size() for t in bufs if isinstance(t, torch.Tensor))

    def plan_from_host(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_len: int) -> None:
        """``plan`` for metadata already validated on host copies (``engine.Indexer.plan``):
        copy ``block_table [B, W'']`` and ``seq_lens [B]`` into the buffers (device to device,
        non-blocking, no sync, no collective). The wrapper must have been built with
        ``query_len``.

        Raises:
            RuntimeError: the wrapper was built without ``query_len``.
            ValueError: a ``query_len`` other than the wrapper's.
        """
        if self.query_len is None:
            raise RuntimeError("ContextParallelDecodeWrapper.plan_from_host: build the "
                               "wrapper with query_len (its setup is collective)")
        if query_len != self.query_len:
            v.fail("query_len", f"{self.query_len} (one wrapper per query length)", query_len)
        self._copy_plan(block_table, seq_lens, non_blocking=True)

    def _check_plan(self, block_table, seq_lens, query_len, num_blocks) -> None:
        query_len = v.check_query_len(query_len)
        v.check_decode_plan(self.block_table, block_table, seq_lens, query_len, self.query_len,
                            num_blocks)

    def run(self, index_q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Select pages for this rank's heads of the planned batch into ``out`` (collective;
        capturable on Triton with NCCL).

        Args:
            index_q: ``float8_e4m3fn [B*Q, H_r, 128]``, this rank's heads (unit last stride);
            cache: the paged cache (the same pages on every rank); out: int32
            ``[B*Q, H_r, 16]`` contiguous.
        Returns:
            ``out``: equal to ``decode_indexer`` of this rank's queries alone (SPEC 8.2, 9).
        Raises:
            RuntimeError: ``run()`` before ``plan()``, or the reference backend under capture.
            ValueError: shapes, dtypes, devices, an ``out`` whose memory overlaps
            ``index_q``, the cache or the buffers (metadata only, no sync). These depend only
            on shapes and addresses, so the ranks raise together when they pass alike tensors.
        """
        rows = self._planned_rows()
        q_len, hr, world = self.query_len, self.num_heads, self.world
        v.check_run(index_q, cache, out, rows, hr, self.block_table, self.seq_lens)
        if rows == 0:
            return out
        if cache.shape[0] == 0:  # same shapes on every rank: all ranks raise together
            v.fail("cache", "at least one block", "an empty cache (0 blocks)")
        if self._runner is None:  # reference (syncs): every rank checks the whole table, so
            # all raise together before any collective (the Triton kernels clamp instead)
            from .reference.paging import history_pages
            v.check_block_table_values(self.block_table,
                                       history_pages(self.seq_lens.to(torch.long)),
                                       cache.shape[0], name="block_table_buffer")
        if self.block_table.shape[1] == 0:  # every request is padding (SPEC 5)
            return self._padding_rows(out)
        if self.backend != "triton":
            self._check_not_capturing()
        # 1. queries of every rank's heads: [W, rows, H_r, 128] -> [rows, W*H_r, 128]
        q8 = index_q.view(torch.uint8)
        if not q8.is_contiguous():
            q8 = self._q_send.copy_(q8)
        _all_gather(self._q_recv, q8, group=self.group)
        self._q_all.view(rows, world, hr, HEAD_DIM).copy_(
            self._q_recv.view(world, rows, hr, HEAD_DIM).permute(1, 0, 2, 3))
        q_all = self._q_all.view(torch.float8_e4m3fn)
        # 2. this rank's pages for all heads -> send [W (owner of the head), rows, H_r, 16]
        if self._runner is not None:
            self._runner.score(q_all, cache, self.block_table, self.seq_lens, self._cand_send)
        else:
            cand = ref_cand.subset_candidates(q_all, cache, self.block_table, self.seq_lens,
                                              q_len, self.rank, world)
            self._cand_send.copy_(cand.view(rows, world, hr, SEND_KEEP).permute(1, 0, 2, 3))
        # 3. exchange; own: [W (source rank), rows, H_r, 16] for this rank's heads
        if self.exchange == "all_gather":
            _all_gather(self._cand_recv, self._cand_send, group=self.group)
            own = self._cand_recv.view(world, world, rows, hr, SEND_KEEP)[:, self.rank]
        else:
            dist.all_to_all_single(self._cand_recv, self._cand_send, group=self.group)
            own = self._cand_recv
        # 4. merge for this rank's heads
        if self._runner is not None:
            self._runner.merge(own, own.stride(0), self.seq_lens, out)
        else:
            cands = own.permute(1, 2, 0, 3).reshape(rows, hr, world * SEND_KEEP)
            out.copy_(ref_cand.merge_candidates(cands, self.seq_lens, q_len))
        return out
