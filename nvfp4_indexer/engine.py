"""Engine-facing indexer (SPEC 8.1): one planner and one forward per step for mixed batches.

The metadata builder and impl of the original design (``docs/spec/seed/indexer_nvfp4.txt``)
as one object an engine keeps for its indexer layers::

    indexer = Indexer(IndexerConfig(num_heads, max_model_len, max_num_batched_tokens,
                                    max_num_seqs, max_decode_query_len=4,
                                    cudagraph_batch_sizes=(1, 2, 4, 8), device="cuda"))
    md = indexer.plan(StepMetadata.from_vllm(common_attn_metadata, num_decodes))  # per step
    for layer in layers:
        indexer.forward(index_q, layer_cache, md, topk_buffer)                    # per layer

Memory (allocated in ``Indexer.__init__``; ``Indexer.memory_bytes()``):

- the FP8 gather workspace, ``max_gather_pages(max_model_len, max_num_batched_tokens)`` pages;
- one float32 score scratch shared by every decode wrapper and by the prefill scorer (they
  never run at once: one stream, one step at a time), sized for the largest decode batch
  (``max(max_num_seqs, max(cudagraph_batch_sizes))`` requests) at the longest context and for
  a full prefill chunk; a prefill chunk that would need more scores with fewer splits;
- one block-table buffer ``int32 [max_decode_reqs, ceil(max_model_len / 128)]`` and one
  seq-lens buffer shared by the decode wrappers (wrapper (B, Q) reads rows ``[:B]``: their
  addresses never move, so CUDA graphs captured on them stay valid);
- two host staging buffers and their device twins (a step's prefill metadata: one
  non-blocking host-to-device copy per step; the two alternate, so that the views of step N's
  metadata stay distinct from step N+1's).

Decode wrappers (``DecodeIndexerWrapper``, one per (padded batch size, Q)) are created on first
use; creating one compiles its kernels (Triton on a GPU), which syncs once. After that,
``plan`` reads host copies only: no device-to-host transfer and no sync.

Planning is host work on ``query_start_loc_cpu`` / ``seq_lens_cpu`` (SPEC 8.1); it prepares
every launch of ``forward`` and enqueues a few small device ops on the current stream:

- a decode-only step: one multi-tensor copy of the decode block table and seq lens into the
  wrapper's buffers, which its CUDA graphs read (none when the step's tensors are those
  buffers). On CUDA, when the step's two tensors are the ones of an earlier step (same
  addresses, shapes and strides: an engine's persistent buffers), the copy is replayed from a
  CUDA graph captured at the second such step (``copy_graphs.CopyGraphs``, up to 8 per
  wrapper): less host time, the same bytes;
- a step with prefill requests: one non-blocking copy of the staged prefill metadata. Its
  decode rows run eagerly, so the Triton wrapper reads the step's block table and seq lens in
  place at ``forward``. Those two are copied into the buffers (rows ``[:num_decodes]``) as in a
  decode-only step when the block table is narrower than ``ceil(max_model_len / 128)``, with
  the reference backend and with context-parallel decoders.

The first plan of a (num_decodes, Q) also builds its wrapper (a compile and a sync on a GPU).

The prefill kernels clamp each device seq len by its staged host copy themselves (Triton; the
reference backend clamps in ``plan``), so no row reads past the pages ``plan`` sized. An
``IndexerMetadata`` is valid until the next ``plan()``; ``forward`` must run on the stream
``plan`` ran on, and the step's device tensors must stay alive and unchanged until then.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from . import validation as v
from .api import DecodeIndexerWrapper, max_gather_pages, triton_backend
from .constants import HEAD_DIM, MAX_QUERY_LEN, PAGE_BYTES, PAGE_SIZE, SHORT_MAX_LOCAL, TOPK
from .copy_graphs import CopyGraphs
from .reference.paging import history_page_count, local_pages
from .reference.prefill import plan_chunks

__all__ = ["IndexerConfig", "StepMetadata", "IndexerMetadata", "Indexer", "PrefillChunk",
           "plan_prefill_chunks"]

# Rows a Triton decode program holds per request (``decode.dispatch.MAX_ROWS``): Q * H <= 64.
MAX_DECODE_ROWS = 64
_NUM_STAGING = 2  # alternating staging slots
_INT32_MAX = 2 ** 31 - 1
# Up to this many requests, host loops over Python ints beat numpy's per-call cost (~1-3 us)
_SCALAR_MAX = 16


def _min_max(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty array: argmin / argmax are several times cheaper than
    ``a.min()`` (a ufunc reduce) on the short arrays of one step (host time)."""
    return int(a[a.argmin()]), int(a[a.argmax()])


def _make_room(cache: dict, limit: int) -> dict:
    """``cache`` (a host-side cache of views or plans), emptied first once it holds more than
    ``limit`` entries."""
    if len(cache) > limit:
        cache.clear()
    return cache


def _pos_int(name: str, val) -> int:
    if not v.is_int(val) or val < 1:
        v.fail(name, "a positive int", repr(val))
    return int(val)


@dataclass(frozen=True)
class IndexerConfig:
    """Static configuration of an ``Indexer`` (SPEC 8.1), validated at construction (SPEC 10).

    Args:
        num_heads: this rank's index heads H (1 .. 64 // max_decode_query_len: the decode
            kernels hold Q * H <= 64 rows per request).
        max_model_len: longest request in tokens (context + new tokens).
        max_num_batched_tokens: most tokens of one step.
        max_num_seqs: most requests of one step.
        max_decode_query_len: most queries per decode request (1..8: speculative decoding
            with up to 7 draft tokens).
        cudagraph_batch_sizes: padded decode batch sizes the engine captures (ints >= 1).
        device: where the buffers live (default: torch's current default device), stored as
            the device ``torch.empty(0, device=device)`` uses ("cpu:0" becomes "cpu", "cuda"
            the current CUDA device; SPEC 10).
        context_parallel_group: None, or a ``torch.distributed.ProcessGroup`` for decode
            context parallelism (SPEC 8.2; ``Indexer`` builds one
            ``ContextParallelDecodeWrapper`` per (padded batch size, Q), exchanging
            candidates by all-gather).
        allow_fp8_mma: scores may be inexact (SPEC 9 b = 5): E4M3 operands on SM90's FP8
            tensor cores where faster -- the decode wrappers' ``allow_fp8_mma`` (ignored with
            ``context_parallel_group``: its decoders score exactly) and, on the Triton
            backend of a CUDA SM90 GPU with Gluon, prefill chunks in dot mode "fp8" (the
            Gluon prefill kernel's E4M3 form; ``prefill_indexer``'s ``allow_fp8_mma``; also
            with ``context_parallel_group``, which concerns decode only).
        topk / init_blocks / local_blocks / block_size / head_dim / score_type: the original
            design's indexer settings; only 16 / 0 / 1 / 128 / 128 / "max" are supported.
    Raises:
        ValueError: a non-positive size or one past int32 (2**31 - 1), bad batch sizes, a
        device that does not exist, ``allow_fp8_mma`` not a bool. TypeError:
        ``context_parallel_group`` neither None nor a ``ProcessGroup``. NotImplementedError:
        ``max_decode_query_len`` > 8, ``num_heads * max_decode_query_len`` > 64, or another
        top-k / block setting; the message names the supported values.
    """

    num_heads: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_decode_query_len: int = 1
    cudagraph_batch_sizes: tuple = ()
    device: Any = None
    context_parallel_group: Any = None
    allow_fp8_mma: bool = False
    topk: int = TOPK
    init_blocks: int = 0
    local_blocks: int = 1
    block_size: int = PAGE_SIZE
    head_dim: int = HEAD_DIM
    score_type: str = "max"

    def __post_init__(self):
        settings = (self.topk, self.init_blocks, self.local_blocks, self.block_size,
                    self.head_dim, self.score_type)
        if settings != (TOPK, 0, 1, PAGE_SIZE, HEAD_DIM, "max"):
            raise NotImplementedError(
                f"(topk, init_blocks, local_blocks, block_size, head_dim, score_type): the "
                f"NVFP4 indexer supports ({TOPK}, 0, 1, {PAGE_SIZE}, {HEAD_DIM}, 'max'), got "
                f"{settings}")
        for name in ("num_heads", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                     "max_decode_query_len"):
            val = _pos_int(name, getattr(self, name))
            if val > _INT32_MAX:  # seq lens, offsets and block counts are int32 (SPEC 8.1)
                v.fail(name, f"at most {_INT32_MAX} (int32 step metadata)", val)
            object.__setattr__(self, name, val)
        if self.max_decode_query_len > MAX_QUERY_LEN:
            raise NotImplementedError(
                f"max_decode_query_len: the NVFP4 indexer scores at most {MAX_QUERY_LEN} decode "
                f"queries per request (1..{MAX_QUERY_LEN}, num_speculative_tokens <= "
                f"{MAX_QUERY_LEN - 1}), got {self.max_decode_query_len}")
        max_heads = MAX_DECODE_ROWS // self.max_decode_query_len
        if self.num_heads > max_heads:
            raise NotImplementedError(
                f"num_heads: with max_decode_query_len={self.max_decode_query_len} the decode "
                f"kernels serve 1..{max_heads} index heads per rank "
                f"(num_heads * max_decode_query_len <= {MAX_DECODE_ROWS}), got {self.num_heads}")
        if not isinstance(self.allow_fp8_mma, bool):
            v.fail("allow_fp8_mma", "a bool", repr(self.allow_fp8_mma))
        sizes = self.cudagraph_batch_sizes
        if sizes is None:
            sizes = ()
        try:
            sizes = tuple(sizes)
        except TypeError:
            v.fail("cudagraph_batch_sizes", "a sequence of positive ints", repr(sizes))
        for s in sizes:
            if not v.is_int(s) or s < 1:
                v.fail("cudagraph_batch_sizes", "a sequence of positive ints",
                       repr(self.cudagraph_batch_sizes))
        object.__setattr__(self, "cudagraph_batch_sizes", tuple(sorted({int(s) for s in sizes})))
        object.__setattr__(self, "device", v.check_device("device", self.device))
        group = self.context_parallel_group
        if group is not None:
            import torch.distributed as dist
            pg = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
            if pg is None or not isinstance(group, pg):
                raise TypeError(f"context_parallel_group: expected None or a "
                                f"torch.distributed.ProcessGroup, got {type(group).__name__} "
                                f"({group!r:.60})")

    @property
    def max_pages(self) -> int:
        """Block-table entries the longest request uses, ceil(max_model_len / 128)."""
        return -(-self.max_model_len // PAGE_SIZE)

    @property
    def max_decode_reqs(self) -> int:
        """Largest (padded) decode batch: max(max_num_seqs, largest CUDA-graph size)."""
        return max((self.max_num_seqs,) + self.cudagraph_batch_sizes)

    @property
    def gather_pages(self) -> int:
        """FP8 workspace pages: ``max_gather_pages(max_model_len, max_num_batched_tokens)``."""
        return max_gather_pages(self.max_model_len, self.max_num_batched_tokens)

    def padded_batch_size(self, num_decodes: int) -> int:
        """The smallest CUDA-graph batch size >= ``num_decodes`` (``num_decodes`` itself when
        none is): what an engine pads a decode-only batch to with zero-length requests."""
        return next((s for s in self.cudagraph_batch_sizes if s >= num_decodes), num_decodes)


@dataclass
class StepMetadata:
    """One engine step in vLLM's terms (SPEC 8.1).

    Attributes:
        query_start_loc: int32 ``[R+1]`` on the device (row offsets of each request's queries).
        query_start_loc_cpu: its host copy (int32 / int64, CPU).
        seq_lens: int32 ``[R]`` on the device: context + this step's tokens.
        seq_lens_cpu: host copy (int32 / int64, CPU), exact or an upper bound (it may only
            over-size plans): prefill chunks are planned and clamped to it; decode rows use
            the device ``seq_lens`` (clamped by the kernels to the block-table width).
        block_table: int32 ``[R, W]`` on the device, unit stride in the last dim.
        num_decodes: requests ``0 .. num_decodes - 1`` are decode requests (one query length Q,
            or 0 for requests that pad a CUDA-graph batch, at the end, with seq len 0, only in
            steps without prefill requests); the rest are prefill requests.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    num_decodes: int

    @classmethod
    def from_vllm(cls, common_attn_metadata, num_decodes: int) -> "StepMetadata":
        """Read vLLM's ``CommonAttentionMetadata`` by field name (vLLM is not imported):
        ``query_start_loc``, ``query_start_loc_cpu``, ``seq_lens``,
        ``seq_lens_cpu_upper_bound`` (or ``seq_lens_cpu``), ``block_table_tensor``.

        Raises:
            AttributeError: fields are missing (the message names every missing one).
        """
        m = common_attn_metadata
        names = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "block_table_tensor")
        missing = [n for n in names if not hasattr(m, n)]
        seq_cpu = getattr(m, "seq_lens_cpu_upper_bound", None)
        if seq_cpu is None:
            seq_cpu = getattr(m, "seq_lens_cpu", None)
            if seq_cpu is None:
                missing.append("seq_lens_cpu_upper_bound or seq_lens_cpu")
        if missing:
            raise AttributeError(f"common_attn_metadata: expected the fields {missing} (vLLM "
                                 f"CommonAttentionMetadata), got {type(m).__name__} without "
                                 "them")
        return cls(query_start_loc=m.query_start_loc, query_start_loc_cpu=m.query_start_loc_cpu,
                   seq_lens=m.seq_lens, seq_lens_cpu=seq_cpu, block_table=m.block_table_tensor,
                   num_decodes=num_decodes)


@dataclass
class PrefillChunk:
    """One prefill chunk (SPEC 7): requests ``[req_start, req_end)`` (indices among the step's
    prefill requests), their query rows ``[row_start, row_end)`` relative to the first prefill
    row, and their history pages packed at ``page_offsets`` (host ints: lists from
    ``plan_prefill_chunks``; tuples or lists from ``Indexer.plan``)."""

    req_start: int
    req_end: int
    row_start: int
    row_end: int
    page_offsets: list  # [n+1] workspace offsets of each request's history (gathered pages)
    gather_pages: list  # [n] pages gathered per request (0 for requests with only short rows)
    total_pages: int
    # Triton launch plan (host) and device views of the staged metadata, set by Indexer.plan
    launch: dict = field(default_factory=dict)
    dev: dict = field(default_factory=dict)


def plan_prefill_chunks(query_start_loc: list[int], seq_lens: list[int], budget: int, *,
                        skip_short: bool = True) -> list[PrefillChunk]:
    """Group prefill requests into chunks whose history pages fit ``budget`` (SPEC 7); host only.

    Args:
        query_start_loc: host ints ``[P+1]`` of the prefill requests (any base; rows of the
            chunks are relative to ``query_start_loc[0]``).
        seq_lens: host ints ``[P]`` (context + new tokens).
        budget: workspace pages per chunk (``max_gather_pages``).
        skip_short: requests whose last query's local page is <= 15 gather no page (their
            rows select by formula, SPEC 5); False gathers every history page (reference).
    Returns:
        ``PrefillChunk`` list in request order; chunks are formed by history pages
        ((seq_len - 1) // 128 per request), so every chunk fits ``budget``.
    Raises:
        ValueError: a request needs more than ``budget`` pages (names ``max_gather_pages``).
    """
    hist = [history_page_count(s) for s in seq_lens]
    if skip_short:
        from .triton.prefill.dispatch import gather_pages_needed
        need = gather_pages_needed(seq_lens)
    q0 = query_start_loc[0] if query_start_loc else 0
    chunks = []
    for a, b in plan_chunks(hist, budget):
        gathered = need[a:b] if skip_short else hist[a:b]
        offsets = [0]
        for n in gathered:
            offsets.append(offsets[-1] + n)
        chunks.append(PrefillChunk(a, b, query_start_loc[a] - q0, query_start_loc[b] - q0,
                                   offsets, gathered, offsets[-1]))
    return chunks


@dataclass(frozen=True)
class IndexerMetadata:
    """What ``Indexer.plan`` produced for one step (valid until the next ``plan()``).
    ``Indexer.forward`` accepts only the object its latest ``plan()`` returned (SPEC 8.1):
    not metadata of another ``Indexer``, of an older plan, built by hand or copied with
    ``dataclasses.replace``.

    Attributes:
        num_decodes: decode requests (padding included). decode_query_len: their Q (0: none).
        num_decode_rows: ``num_decodes * Q``. prefill_row_start: first prefill row
        (``query_start_loc[num_decodes]``). num_prefill_rows: prefill rows.
        num_rows: rows the step writes (``out`` rows past it are never written).
        decoder: the decode wrapper planned for (num_decodes, Q), or None.
        prefill_chunks: ``PrefillChunk`` list (eager, in order).
        decode_inputs: in a step with prefill requests (never captured), the step's own
            decode ``(block_table [B, W] view, seq_lens)`` the Triton decode wrapper reads at
            ``forward`` instead of copies in its buffers (None: the buffers).
        generation: the planning ``Indexer``'s plan count. owner: a weak reference to it.
        reads: ``(name, byte span)`` (``validation.byte_span``) of the tensors ``forward``
            reads or writes besides ``index_q``, ``cache`` and ``out``: ``out`` may overlap
            none of them.
    """

    num_decodes: int
    decode_query_len: int
    num_decode_rows: int
    prefill_row_start: int
    num_prefill_rows: int
    num_rows: int
    decoder: Any = None
    prefill_chunks: list = field(default_factory=list)
    generation: int = 0
    decode_inputs: Any = None  # a mixed step's decode (block table, seq lens) read in place
    owner: Any = field(default=None, repr=False, compare=False)
    reads: tuple = field(default=(), repr=False, compare=False)

    @property
    def decode_only(self) -> bool:
        """True when the step has no prefill rows (its forward is capturable)."""
        return not self.prefill_chunks


class _Decoder(Protocol):
    """What the decode path calls (``DecodeIndexerWrapper``'s plan/run interface, planned from
    host-validated metadata). A context-parallel decoder (SPEC 8.2) provides the same."""

    def plan_from_host(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_len: int) -> None: ...

    def run(self, index_q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor): ...


class _HostPlannedDecodeWrapper(DecodeIndexerWrapper):
    """A ``DecodeIndexerWrapper`` whose step plan was validated by ``Indexer.plan`` on host
    copies: ``plan_from_host`` copies the step's device metadata into the wrapper's buffers
    (device-to-device, no sync, nothing read on the host). ``plan``/``run`` keep their meaning.
    On CUDA a copy that repeats (the same source tensors: an engine's persistent buffers) is
    replayed from a CUDA graph (``copy_graphs.CopyGraphs``: less host time per plan)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dev = self.block_table.device  # built at a wrapper's first use (which compiles, syncs)
        self._copies = CopyGraphs(dev) if CopyGraphs.supported(dev) else None

    def plan_from_host(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_len: int) -> None:
        """Copy this step's (host-validated) ``block_table [B, W']`` and ``seq_lens [B]`` into
        the wrapper's buffers; the first call builds (and on a GPU compiles) the runner. On
        CUDA, a copy from the same two source tensors (address, shape, stride) as earlier
        steps is captured into a CUDA graph at the second such step and replayed from the
        third on (``copy_graphs.CopyGraphs``).

        Raises:
            ValueError: a ``query_len`` other than the wrapper's.
            NotImplementedError: Q * H > 64 on Triton.
        """
        b, w = self.block_table.shape
        self._check_query_len(query_len)
        if self.backend == "triton" and self._runner is None and b > 0 and w > 0:
            dev = self.block_table.device
            self._runner = triton_backend().DecodeRunner(
                self.num_heads, b, w, query_len, dev, score_buffer=self.score_buffer,
                config=self.runner_config(), warmup=self.use_cuda_graph and dev.type == "cuda")
        # Skipped when the caller passes the buffers themselves (in-place mode, Indexer).
        dst, src = [], []
        sl_ptr, bt_ptr = seq_lens.data_ptr(), block_table.data_ptr()
        bt_stride = block_table.stride()
        if sl_ptr != self.seq_lens.data_ptr():
            dst.append(self.seq_lens)
            src.append(seq_lens)
        bt = self.block_table
        if bt_ptr != bt.data_ptr() or bt_stride != bt.stride():
            cols = block_table.shape[1]  # no slicing when the widths agree (host time)
            if cols == w:
                dst.append(bt)
                src.append(block_table)
            elif cols > w:
                dst.append(bt)
                src.append(block_table[:, :w])
            else:
                dst.append(bt[:, :cols])
                src.append(block_table)
        if len(dst) == 2:  # one launch on CUDA (multi-tensor copy or graph) when both are dense
            if self._copies is not None:
                # what the copy depends on (dtypes, seq lens shape and contiguity: checked by plan)
                self._copies.copy((bt_ptr, block_table.shape, bt_stride, sl_ptr), dst, src)
            else:
                torch._foreach_copy_(dst, src, non_blocking=True)
        elif dst:
            dst[0].copy_(src[0], non_blocking=True)
        self.query_len = query_len

    def _check_query_len(self, query_len: int) -> None:
        if self.query_len is not None and query_len != self.query_len:
            v.fail("query_len", f"{self.query_len} (one wrapper per query length)", query_len)

    def plan_eager(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   query_len: int):
        """Plan a step whose decode rows run eagerly (a mixed step: never captured). Triton
        with a runner and a block table at least as wide as the buffers: nothing is copied,
        and the returned ``(block_table view [B, W], seq_lens)`` are what ``run_planned``
        reads (at ``forward``: the step's tensors must stay as they are until then). Else
        ``plan_from_host`` copies and this returns None (``run_planned`` reads the buffers).

        Raises:
            ValueError: a ``query_len`` other than the wrapper's.
        """
        w = self.block_table.shape[1]
        if self.backend != "triton" or self._runner is None or block_table.shape[1] < w:
            self.plan_from_host(block_table, seq_lens, query_len)
            return None
        self._check_query_len(query_len)
        self.query_len = query_len
        return (block_table if block_table.shape[1] == w else block_table[:, :w]), seq_lens

    def run_planned(self, index_q: torch.Tensor, cache: torch.Tensor,
                    out: torch.Tensor, inputs: tuple | None = None) -> torch.Tensor:
        """``run`` for inputs ``Indexer.forward`` has validated (capturable on Triton): no
        second round of checks and no remembered cache size (each layer's cache is checked
        by the Indexer; the Triton kernels clamp block ids into the cache they are given).
        ``inputs``: ``plan_eager``'s (block table, seq lens) in place of the buffers."""
        if self.backend == "triton":
            bt, sl = inputs if inputs is not None else (self.block_table, self.seq_lens)
            self._runner.run(index_q, cache, bt, sl, out)
            return out
        self.num_blocks = None  # reference: block ids were checked against this cache
        return self.run(index_q, cache, out)


class _Staging:
    """One host buffer and its device twin.

    The host buffer is pageable on purpose, so that the next plan may rewrite it at once. A
    pinned buffer needs an event per copy (``Event.record``: ~10 us of host time on the
    H200's host, ``benchmarks/labs/hostop_cost.py``) and a wait before its reuse. The reuse
    rests on how the driver copies pageable memory. CUDA documents such a ``cudaMemcpyAsync``
    as possibly synchronous with respect to the host, or as synchronizing with the stream to
    stage the bytes into pinned memory; both are safe here. Measured on the H200 with
    driver 580, the copy returns in 5-7 us without waiting for a busy stream, and the step's
    rows are right when its slot is rewritten before the copy has run
    (``tests/engine/test_graphs.py::test_staging_reused_while_the_stream_is_busy``). A driver that
    read pageable memory after returning would give a step the metadata of the plan two
    steps later; that takes a stream at least two plans behind the host.

    Fixed regions (``S = max_num_seqs`` prefill requests at most): seq-len caps ``[0, S)``,
    absolute query offsets ``[S, 2S+1)``, the chunks' workspace offsets ``[2S+1, 4S+1)``
    (chunk k's n+1 at ``a_k + k``), page counts ``[4S+1, 5S+1)`` (at ``a_k``), row blocks
    from ``5S+1`` (each chunk's ``[2, nb]``, one after the other). The device views of chunk
    0's regions are made once, so a one-chunk step slices nothing but its seq-len caps."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device):
        s = max_seqs
        self.qsl_at, self.off_at, self.pages_at, self.blk_at = s, 2 * s + 1, 4 * s + 1, 5 * s + 1
        n = self.elems(max_seqs, max_blocks)
        self.size, self.max_blocks = n, max_blocks
        self.host = torch.zeros(n, dtype=torch.int32)
        self.host_np = self.host.numpy()
        self.copies = device.type != "cpu"  # on the CPU the host buffer is the device one
        self.dev = torch.zeros(n, dtype=torch.int32, device=device) if self.copies \
            else self.host
        d = self.dev
        self.qsl = d[self.qsl_at:self.off_at]
        self.off0, self.pages0, self.blk0 = (d[self.off_at:self.pages_at],
                                             d[self.pages_at:self.blk_at], d[self.blk_at:])
        self._caps: dict = {}
        self._views: dict = {}  # views() cache
        self._copies: dict = {}  # copy() cache

    @staticmethod
    def elems(max_seqs: int, max_blocks: int) -> int:
        """int32 elements of one staging buffer (the regions above)."""
        return 5 * max_seqs + 1 + 2 * max_blocks

    def caps(self, n: int) -> torch.Tensor:
        """Device view of the first ``n`` seq-len caps (cached by n)."""
        got = self._caps.get(n)
        if got is None:
            got = self._caps[n] = self.dev[:n]
        return got

    def views(self, off: int, pages: int, blk: int) -> tuple:
        """Device views from ``off`` / ``pages`` / ``blk`` to the end of their regions (a later
        chunk's workspace offsets, page counts and row blocks; cached: the buffer never
        moves)."""
        key = (off, pages, blk)
        got = self._views.get(key)
        if got is None:
            d = self.dev
            got = _make_room(self._views, 4096)[key] = (d[off:self.pages_at],
                                                        d[pages:self.blk_at], d[blk:])
        return got

    def copy(self, hi: int) -> None:
        """Non-blocking H2D copy of ``host[:hi]`` into ``dev[:hi]`` (rounded up to a power of
        two: a few cached views); nothing to copy on the CPU."""
        if not self.copies:
            return
        n = min(1 << (hi - 1).bit_length(), self.size) if hi > 1 else 1
        got = self._copies.get(n)
        if got is None:  # (device, host) views of host[:n], n a power of two (host time)
            got = self._copies[n] = (self.dev[:n], self.host[:n])
        got[0].copy_(got[1], non_blocking=True)


class Indexer:
    """The engine-facing NVFP4 indexer (SPEC 8.1): ``plan(step)`` once per step, then
    ``forward(index_q, cache, metadata, out)`` per layer.

    Args:
        config: an ``IndexerConfig``.
        backend: "auto" | "reference" | "triton" ("auto": Triton on CUDA, else the reference).
    With ``config.context_parallel_group`` (SPEC 8.2) the decode rows go through one
    ``context_parallel.ContextParallelDecodeWrapper`` per (padded batch size, Q): every rank
    scores the pages j % W == r for all ranks' heads, and ``plan`` / ``forward`` (and the first
    use of a batch size) are collective, so every rank must call them in the same order with
    the same step metadata. Prefill is not split.

    Raises:
        ValueError: a bad backend for the config's device; buffers the device cannot hold
        (``memory_bytes()`` is computed before anything is allocated: past the device's
        total memory, or refused by its allocator): the message names the config field that
        sized the largest buffer, the bytes asked for and ``memory_bytes()``'s figures.
    """

    def __init__(self, config: IndexerConfig, *, backend: str = "auto"):
        if not isinstance(config, IndexerConfig):
            raise TypeError(f"config: expected an IndexerConfig, got {type(config).__name__}")
        self.config = c = config
        dev = c.device
        self.device = dev
        self.backend = v.check_backend(backend, dev)
        if c.context_parallel_group is not None and self.backend == "triton":
            import torch.distributed as dist
            world = dist.get_world_size(c.context_parallel_group) \
                if dist.is_available() and dist.is_initialized() else 1
            if c.num_heads * world * c.max_decode_query_len > 64:
                raise NotImplementedError(
                    f"context_parallel_group: the Triton context-parallel decoder scores "
                    f"num_heads * group size * max_decode_query_len <= 64 rows per request, "
                    f"got {c.num_heads} * {world} * {c.max_decode_query_len}")
        self._generation = 0
        self._ref = weakref.ref(self)  # IndexerMetadata.owner (weak: no cycle through _latest)
        self._latest: IndexerMetadata | None = None  # what forward accepts
        self.max_decode_reqs = c.max_decode_reqs
        # row blocks of one step: each request's rows in blocks of >= 16 rows
        # (``triton.heuristics.MIN_BLOCK_M``), one partial block per request
        max_blocks = c.max_num_seqs + -(-(c.max_num_batched_tokens * c.num_heads) // 16)
        self._bytes = self._buffer_bytes(max_blocks)  # refuses what cannot fit, allocates none
        alloc = self._allocate
        self.workspace = alloc("workspace", lambda: torch.empty(
            (c.gather_pages, PAGE_SIZE, HEAD_DIM), dtype=torch.float8_e4m3fn, device=dev))
        # One block table / seq lens buffer for all decode wrappers (rows [:B] of each).
        self.decode_block_table, self.decode_seq_lens = alloc("decode_buffers", lambda: (
            torch.zeros((self.max_decode_reqs, c.max_pages), dtype=torch.int32, device=dev),
            torch.zeros(self.max_decode_reqs, dtype=torch.int32, device=dev)))
        self.score_buffer = alloc("score_scratch", lambda: torch.empty(
            self._bytes["score_scratch"] // 4, dtype=torch.float32, device=dev))
        self.decoders: dict[tuple[int, int], _Decoder] = {}
        self._staging = alloc("staging_device", lambda: [
            _Staging(c.max_num_seqs, max_blocks, dev) for _ in range(_NUM_STAGING)])
        # byte spans of the buffers forward reads or writes besides index_q, cache and out
        self._own_spans = tuple((name, v.byte_span(t)) for name, t in (
            ("the Indexer's workspace", self.workspace),
            ("the Indexer's decode_block_table", self.decode_block_table),
            ("the Indexer's decode_seq_lens", self.decode_seq_lens),
            ("the Indexer's score_buffer", self.score_buffer),
            *(("the Indexer's staging", st.dev) for st in self._staging)))
        self._budget = c.gather_pages
        self._blocks: dict = {}  # _single_blocks cache
        self._slot = 0
        self._ramps: dict = {}  # _ramp cache
        self._fast_device = dev.type in ("cpu", "cuda")  # _check_step_fast's device compare
        self._num_sms = None
        self._views: dict = {}  # _scratch_views cache
        self._templates: dict = {}  # _launch_template cache
        self._row_ramps: dict = {}  # _row_ramp cache
        if self.backend == "triton":
            self._setup_triton()

    def _setup_triton(self) -> None:
        """What every prefill launch shares, resolved once: the chunks' settings (as
        ``prefill_indexer`` resolves them with the same ``allow_fp8_mma``), the gather
        launcher (page counts), the workspace's byte view and the SM count."""
        from .triton.device import device_guard, num_sms
        from .triton.prefill import fp8_config, gather_launcher, resolve_prefill
        from .triton.prefill.dispatch import prefill_block_m
        dev = self.device
        self._num_sms = num_sms(dev)
        self._settings = resolve_prefill(dev, fp8_config(dev, self.config.allow_fp8_mma))
        self._gather = gather_launcher(dev, lengths_are_seq_lens=False)
        self._ws8 = self.workspace.view(torch.uint8)
        self._device_guard = device_guard
        self._score_elems = self.score_buffer.numel()
        self._prefill_block_m = prefill_block_m  # no import on the plan path (host time)

    # -- memory ---------------------------------------------------------------------------

    def _score_buffer_elems(self) -> int:
        """float32 elements of the shared scratch: the largest decode runner's need over every
        (B, Q) this config can plan, and a full prefill chunk's (Triton only; by the Triton
        kernel's rule: a Gluon chunk of few row blocks may want up to ~2x that and is planned
        with fewer splits where it does not fit, ``plan_prefill_chunk``'s ``cap``)."""
        c = self.config
        if self.backend != "triton":
            return 2
        kernels = triton_backend()
        sms = kernels.device.num_sms(c.device)
        cfg = kernels.DecodeConfig(dot="fp8") if c.allow_fp8_mma and c.device.type == "cuda" \
            and not kernels.device.portable_default(c.device) else None
        dec = max(kernels.score_buffer_size(b, c.max_pages, c.num_heads, q, num_sms=sms,
                                            config=cfg, device=c.device)
                  for q in range(1, c.max_decode_query_len + 1)
                  for b in range(1, self.max_decode_reqs + 1))
        blocks = -(-(c.max_num_batched_tokens * c.num_heads) // 128)
        pre = kernels.prefill.dispatch.prefill_launch(blocks, max(c.max_pages - 1, 0), 128,
                                                      sms)["scratch"]
        return max(dec, pre, 2)

    def _buffer_bytes(self, max_blocks: int) -> dict[str, int]:
        """``memory_bytes()``'s buffers, from the config alone (nothing allocated); refuses
        (``validation.check_fits``) sizes past the device's memory, naming the field that
        sized the largest buffer. The closed-form sizes are checked before the score
        scratch's, which is computed over every decode batch size."""
        c = self.config
        on_device = c.device.type != "cpu"  # staging: device twins off the CPU
        staging = _NUM_STAGING * 4 * _Staging.elems(c.max_num_seqs, max_blocks)
        d = {"workspace": c.gather_pages * PAGE_SIZE * HEAD_DIM,
             "decode_buffers": self.max_decode_reqs * (c.max_pages + 1) * 4,
             "staging_device": staging if on_device else 0, "staging_host": staging}
        self._check_fits(d)
        d["score_scratch"] = 4 * self._score_buffer_elems()
        self._check_fits(d)
        return d

    def _sized_by(self, buffer: str) -> str:
        """The config field that makes ``buffer`` (a ``memory_bytes()`` key) large."""
        c = self.config
        if buffer == "workspace":
            return "max_model_len" if c.max_model_len >= 4 * c.max_num_batched_tokens else \
                "max_num_batched_tokens"
        if buffer == "decode_buffers":
            return "max_model_len" if c.max_pages >= self.max_decode_reqs else \
                "max_num_seqs" if c.max_num_seqs == self.max_decode_reqs else \
                "cudagraph_batch_sizes"
        if buffer == "score_scratch":
            return "max_model_len"
        # staging: the step's requests and its (token, head) row blocks
        return "max_num_batched_tokens" if c.max_num_batched_tokens * c.num_heads \
            >= 16 * c.max_num_seqs else "max_num_seqs"

    def _asked(self, buffer: str, d: dict) -> tuple[str, str]:
        """(field, what it asks for) of an allocation error naming ``buffer``."""
        f = self._sized_by(buffer)
        sizes = ", ".join(f"{k}={n}" for k, n in d.items())
        return f, (f"{f}={getattr(self.config, f)!r} sizes {buffer}, {d[buffer]} bytes; "
                   f"memory_bytes(): {sizes}")

    def _check_fits(self, d: dict) -> None:
        """The device buffers, and the host staging, within memory (SPEC 10); on the CPU
        both at once."""
        dev = self.config.device
        groups = [(dev, list(d))] if dev.type == "cpu" else \
            [(dev, [k for k in d if k != "staging_host"]), (torch.device("cpu"), ["staging_host"])]
        for where, keys in groups:
            f, asked = self._asked(max(keys, key=d.get), d)
            v.check_fits(f, sum(d[k] for k in keys), where, f"Indexer buffers on {where}; "
                         + asked)

    def _allocate(self, buffer: str, make):
        """``make()`` the buffer(s) ``memory_bytes()`` calls ``buffer``; an allocator failure
        is a ValueError naming the field that sized it and the bytes (SPEC 10)."""
        f, asked = self._asked(buffer, self._bytes)
        return v.allocate(f, self._bytes[buffer], self.config.device, asked, make)

    def memory_bytes(self) -> dict[str, int]:
        """Device (and host staging) memory the indexer holds, in bytes, by buffer:
        ``workspace``, ``score_scratch``, ``decode_buffers`` (shared block table / seq lens),
        ``staging_device``, ``staging_host``, ``decoders`` (the exchange buffers and
        scratch of context-parallel decoders created so far: they are allocated at the first
        use of a (padded batch size, Q); 0 without ``context_parallel_group``) and
        ``total_device``. The FP8 workspace dominates at long contexts. All but
        ``decoders`` are computed from the config before anything is allocated.
        """
        d = dict(self._bytes)
        d["decoders"] = sum(dec.buffer_bytes() for dec in self.decoders.values()
                            if hasattr(dec, "buffer_bytes"))
        d["total_device"] = (d["workspace"] + d["score_scratch"] + d["decode_buffers"]
                             + d["staging_device"] + d["decoders"])
        return d

    # -- decode wrappers ------------------------------------------------------------------

    def decoder(self, num_decodes: int, query_len: int) -> _Decoder:
        """The decode wrapper of (padded batch size, Q), created on first use (its buffers are
        rows ``[:num_decodes]`` of the shared buffers and never move). Creating one on a GPU
        compiles its kernels (one sync): call this before capturing / timing a batch size.

        Raises:
            ValueError: ``num_decodes`` outside 1..max_decode_reqs, ``query_len`` outside
            1..max_decode_query_len.
        """
        c = self.config
        if not v.is_int(num_decodes) or not 1 <= num_decodes <= self.max_decode_reqs:
            v.fail("num_decodes", f"an int in 1..{self.max_decode_reqs} (max(max_num_seqs, "
                   "largest cudagraph batch size))", repr(num_decodes))
        if not v.is_int(query_len) or not 1 <= query_len <= c.max_decode_query_len:
            v.fail("query_len", f"an int in 1..{c.max_decode_query_len} (max_decode_query_len)",
                   repr(query_len))
        key = (int(num_decodes), int(query_len))
        dec = self.decoders.get(key)
        if dec is None:
            if c.context_parallel_group is not None:  # SPEC 8.2 (collective construction)
                from .context_parallel import ContextParallelDecodeWrapper
                dec = ContextParallelDecodeWrapper(
                    c.num_heads, c.context_parallel_group,
                    block_table_buffer=self.decode_block_table[:key[0]],
                    seq_lens_buffer=self.decode_seq_lens[:key[0]], query_len=key[1],
                    use_cuda_graph=self.device.type == "cuda", backend=self.backend)
                self.decoders[key] = dec
                return dec
            dec = _HostPlannedDecodeWrapper(
                c.num_heads, block_table_buffer=self.decode_block_table[:key[0]],
                seq_lens_buffer=self.decode_seq_lens[:key[0]],
                use_cuda_graph=self.device.type == "cuda", backend=self.backend,
                score_buffer=self.score_buffer if self.backend == "triton" else None,
                allow_fp8_mma=c.allow_fp8_mma)
            dec.plan_from_host(self.decode_block_table[:key[0]], self.decode_seq_lens[:key[0]],
                               key[1])  # builds the runner (compiles on a GPU)
            self.decoders[key] = dec
        return dec

    # -- plan -----------------------------------------------------------------------------

    def _check_step(self, step: StepMetadata):
        """Metadata and host-value checks (SPEC 10); returns ``(num_decodes, Q, query_start_loc
        host array, seq lens host array, the prefill requests' absolute query offsets [P+1]
        and seq lens [P] as lists of ints)`` (the last two None without prefill requests).
        A few vectorized checks accept a well-formed step (``_check_step_fast``); anything
        they do not accept goes through the full checks, which raise the precise error (or
        accept what the fast path is too narrow for)."""
        r = self._check_step_fast(step)
        return r if r is not None else self._check_step_full(step)

    def _ramp(self, dtype, q: int) -> bytes:
        """Bytes of ``arange(max_decode_reqs + 1) * q`` in numpy ``dtype``: the
        ``query_start_loc`` of decode requests of one length q (a prefix of it)."""
        key = (dtype, q)
        b = self._ramps.get(key)
        if b is None:
            b = self._ramps[key] = (np.arange(self.max_decode_reqs + 1, dtype=np.int64)
                                    * q).astype(dtype).tobytes()
        return b

    def _check_step_fast(self, step):
        """The checks of ``_check_step_full`` for the common well-formed step, in a few
        vectorized numpy ops (host time): returns what it returns, or None when any condition
        is not plainly met (then the full checks decide and name the error). Every condition
        below implies the full checks pass with the same result."""
        if type(step) is not StepMetadata or not self._fast_device:
            return None
        sc, qc = step.seq_lens_cpu, step.query_start_loc_cpu
        qd, sd, bt, nd = step.query_start_loc, step.seq_lens, step.block_table, step.num_decodes
        T, dev, ints = torch.Tensor, self.device, v.INT_DTYPES
        if not (type(sc) is T and type(qc) is T and type(qd) is T and type(sd) is T
                and type(bt) is T and type(nd) is int):
            return None
        ss = sc.shape
        if not (len(ss) == 1 and sc.is_cpu and sc.dtype in ints):
            return None
        r = ss[0]
        i32 = torch.int32
        rows, bs = (r + 1,), bt.shape  # shape compares: one call each (host time)
        if not (0 <= nd <= r and r and qc.shape == rows and qc.is_cpu and qc.dtype in ints
                and qd.shape == rows and qd.dtype == i32 and qd.device == dev
                and sd.shape == ss and sd.dtype == i32 and sd.device == dev
                and sd.is_contiguous() and len(bs) == 2 and bs[0] == r and bt.dtype == i32
                and bt.device == dev and (bs[1] <= 1 or bt.stride()[1] == 1)
                and nd <= self.max_decode_reqs):
            return None
        c = self.config
        qsl, sl = qc.numpy(), sc.numpy()
        limit = min(bs[1] * PAGE_SIZE, c.max_model_len)
        total = int(qsl[r])
        if total > c.max_num_batched_tokens:
            return None
        q = 0
        if nd:
            q = int(qsl[1])
            if not 1 <= q <= c.max_decode_query_len:
                return None
            isz = qsl.itemsize
            ramp = self._ramp(qsl.dtype, q)
            if nd == r and total != nd * q:  # zero-length (padding) requests at the end
                n_real = total // q
                if n_real < 1 or n_real * q != total:
                    return None
                head = qsl[:n_real + 1]
                if head.tobytes() != ramp[:(n_real + 1) * isz] or \
                        _min_max(qsl[n_real + 1:]) != (total, total) or \
                        _min_max(sl[n_real:]) != (0, 0):
                    return None
            else:
                n_real = nd
                # C-order bytes equal: qsl[:nd + 1] == [0, q, 2q, ..., nd * q]
                if (qsl if nd == r else qsl[:nd + 1]).tobytes() != ramp[:(nd + 1) * isz]:
                    return None
            if n_real:
                lo, hi = _min_max(sl[:n_real] if n_real < r else sl)
                if lo < q or hi > limit:
                    return None
        elif qsl[0] != 0:
            return None
        if nd < r:
            if r > c.max_num_seqs:  # no padding in a mixed step: every request is real
                return None
            pq, ps = qsl[nd:].tolist(), sl[nd:].tolist()  # Python ints: no wrap-around
            if r - nd <= _SCALAR_MAX:  # a few prefill requests: scalar compares
                prev = pq[0]
                for end, s in zip(pq[1:], ps):
                    if not 1 <= end - prev <= s <= limit:
                        return None
                    prev = end
            else:
                pq64, ps64 = qsl[nd:].astype(np.int64), sl[nd:].astype(np.int64)
                ql = pq64[1:] - pq64[:-1]
                if _min_max(ql)[0] < 1 or _min_max(ps64 - ql)[0] < 0 or \
                        _min_max(ps64)[1] > limit:
                    return None
            return nd, q, qsl, sl, pq, ps
        return nd, q, qsl, sl, None, None

    def _check_step_full(self, step: StepMetadata):
        """Metadata and host-value checks (SPEC 10); returns what ``_check_step`` returns."""
        if not isinstance(step, StepMetadata):
            raise TypeError(f"step: expected a StepMetadata, got {type(step).__name__}")
        c, dev = self.config, self.device
        v.check_tensor("seq_lens_cpu", step.seq_lens_cpu, dtypes=v.INT_DTYPES, ndim=1,
                       device="cpu")
        r = step.seq_lens_cpu.shape[0]
        v.check_tensor("query_start_loc_cpu", step.query_start_loc_cpu, dtypes=v.INT_DTYPES,
                       shape=(r + 1,), device="cpu")
        v.check_tensor("query_start_loc", step.query_start_loc, dtypes=(torch.int32,),
                       shape=(r + 1,), device=dev)
        v.check_tensor("seq_lens", step.seq_lens, dtypes=(torch.int32,), shape=(r,), device=dev,
                       contiguous=True)
        v.check_tensor("block_table", step.block_table, dtypes=(torch.int32,), shape=(r, None),
                       device=dev)
        if step.block_table.stride(-1) != 1 and step.block_table.shape[1] > 1:
            v.fail("block_table", "unit stride in the last dim", f"strides "
                   f"{step.block_table.stride()}")
        nd = step.num_decodes
        if not v.is_int(nd) or not 0 <= nd <= r:
            v.fail("num_decodes", f"an int in 0..{r} (requests in the step)", repr(nd))
        nd = int(nd)
        qsl = step.query_start_loc_cpu.numpy().astype(np.int64, copy=False)
        sl = step.seq_lens_cpu.numpy().astype(np.int64, copy=False)
        ql = np.diff(qsl)
        if r + 1 and (qsl[0] != 0 or (ql < 0).any()):
            v.fail("query_start_loc_cpu", "non-decreasing offsets from 0",
                   f"{qsl[:8].tolist()}{' ...' if r > 7 else ''}")
        if qsl[-1] > c.max_num_batched_tokens:
            v.fail("query_start_loc_cpu", f"at most max_num_batched_tokens="
                   f"{c.max_num_batched_tokens} rows", f"{int(qsl[-1])}")
        limit = min(step.block_table.shape[1] * PAGE_SIZE, c.max_model_len)
        bad = (sl < 0) | (sl > limit)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            v.fail("seq_lens_cpu", f"values in 0..{limit} (min(block_table width * 128, "
                   "max_model_len))", f"seq_lens_cpu[{i}]={int(sl[i])}")
        q = 0
        if nd:
            if nd > self.max_decode_reqs:
                v.fail("num_decodes", f"at most {self.max_decode_reqs} (max(max_num_seqs, "
                       "largest cudagraph batch size))", nd)
            dq = ql[:nd]
            real = np.flatnonzero(dq)
            if real.size == 0:
                v.fail("query_start_loc_cpu", "at least one decode request with a query "
                       f"length in 1..{c.max_decode_query_len}", "only zero-length ones")
            q = int(dq[real[0]])
            if not 1 <= q <= c.max_decode_query_len:
                v.fail("query_start_loc_cpu", f"decode query lengths in 1.."
                       f"{c.max_decode_query_len} (max_decode_query_len)", f"{q} for request "
                       f"{int(real[0])}")
            n_real = real.size
            if real[-1] != n_real - 1 or (dq[:n_real] != q).any():
                i = int(np.flatnonzero((dq[:n_real] != q))[0]) if (dq[:n_real] != q).any() \
                    else int(np.flatnonzero(dq == 0)[0])
                v.fail("query_start_loc_cpu", f"decode requests of one query length {q}, "
                       "zero-length (padding) ones last", f"length {int(dq[i])} for "
                       f"decode request {i}")
            if n_real < nd:
                if nd < r:
                    v.fail("num_decodes", "no zero-length (padding) decode requests in a step "
                           "with prefill requests", f"{nd - n_real} padding requests and "
                           f"{r - nd} prefill requests")
                if (sl[n_real:nd] != 0).any():
                    i = n_real + int(np.flatnonzero(sl[n_real:nd])[0])
                    v.fail("seq_lens_cpu", "0 for zero-length (padding) decode requests",
                           f"seq_lens_cpu[{i}]={int(sl[i])}")
            short = sl[:n_real] < q
            if short.any():
                i = int(np.flatnonzero(short)[0])
                v.fail("seq_lens_cpu", f">= query_len={q} for every decode request",
                       f"seq_lens_cpu[{i}]={int(sl[i])}")
        if nd < r:
            if r > c.max_num_seqs:
                v.fail("step", f"at most max_num_seqs={c.max_num_seqs} requests in a step with "
                       "prefill requests (len(seq_lens_cpu))",
                       f"{r} requests ({nd} decode + {r - nd} prefill)")
            pq, ps = ql[nd:], sl[nd:]
            empty = pq < 1
            if empty.any():
                i = int(np.flatnonzero(empty)[0])
                v.fail("query_start_loc_cpu", "q_len >= 1 for every prefill request (offsets "
                       "increasing past num_decodes)", f"q_len={int(pq[i])} for request {nd + i}")
            bad = pq > ps
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                v.fail("seq_lens_cpu", "1 <= q_len <= seq_len for every prefill request",
                       f"q_len={int(pq[i])}, seq_len={int(ps[i])} for request {nd + i}")
            return nd, q, qsl, sl, qsl[nd:].tolist(), sl[nd:].tolist()
        return nd, q, qsl, sl, None, None

    def plan(self, step: StepMetadata) -> IndexerMetadata:
        """Plan one step (SPEC 8.1): outside CUDA-graph capture, every step.

        Validates ``step`` against its host copies (shapes, dtypes, devices; query lengths,
        seq lens, padding, sizes against the config), re-plans the decode wrapper of
        (num_decodes, Q) and groups the prefill requests into chunks that fit the workspace
        (their metadata staged in one host buffer: one non-blocking host-to-device copy per
        step; every launch of ``forward`` prepared). A decode-only step's block table and seq
        lens are copied into the wrapper's buffers (device to device; what its CUDA graphs
        read). In a step with prefill requests the Triton decode rows read the step's own
        tensors when ``forward`` runs (see the module doc for the cases that copy): keep them
        unchanged until then. Reads no device value and never syncs (except the first time a
        (num_decodes, Q) is seen on a GPU: its kernels compile).

        Returns:
            ``IndexerMetadata``, valid until the next ``plan()``.
        Raises:
            TypeError / ValueError: bad step metadata (nothing is written or copied); with
            ``context_parallel_group``, the first use of a (num_decodes, Q) is collective
            and raises on every rank when the ranks disagree.
        """
        nd, q, qsl, sl, pq, ps = self._check_step(step)
        r = sl.shape[0]
        dec = None
        if nd:  # self.decoder raises before any copy on bad sizes (and creates on first use)
            dec = self.decoders.get((nd, q)) or self.decoder(nd, q)
        p0 = int(qsl[nd])
        pre_rows = int(qsl[r]) - p0
        if nd < r:
            bt, sq = step.block_table, step.seq_lens
            if nd:  # one view op each for the decode and prefill rows (host time)
                bt_d, bt = bt.split_with_sizes((nd, r - nd))
                sq_d, sq = sq.split_with_sizes((nd, r - nd))
            chunks = self._plan_prefill(bt, sq, pq, ps)
        else:
            chunks = []
        # Everything validated: now write (decode buffers).
        self._generation += 1
        inputs = None
        if dec is not None:
            if nd == r:  # no slicing (host time); the buffers themselves are not copied
                dec.plan_from_host(step.block_table, step.seq_lens, q)
            elif type(dec) is _HostPlannedDecodeWrapper:  # eager rows: read in place
                inputs = dec.plan_eager(bt_d, sq_d, q)
            else:
                dec.plan_from_host(bt_d, sq_d, q)
        reads = self._own_spans
        if nd < r:  # the step's tensors that eager rows read at forward
            reads += (("the step's block_table", v.byte_span(step.block_table)),
                      ("the step's seq_lens", v.byte_span(step.seq_lens)))
        md = self._latest = IndexerMetadata(
            nd, q, nd * q, p0, pre_rows, max(nd * q, p0 + pre_rows), dec, chunks,
            self._generation, inputs, self._ref, reads)
        return md

    def _plan_prefill(self, bt_all, seq_lens, pq, ps) -> list[PrefillChunk]:
        """Chunks of the step's prefill requests (SPEC 7) from their block table rows
        ``bt_all [P, W]``, device seq lens ``seq_lens [P]``, absolute query offsets ``pq``
        (ints ``[P+1]``) and host seq lens ``ps`` (ints ``[P]``), on host ints; Triton: each
        chunk's row blocks, splits and scratch, staged in one host buffer (one
        non-blocking H2D copy per step), and every launch's arguments. Triton: the score and
        merge kernels read ``min(device seq len, staged host copy)`` (``scan.block_rows_info``),
        so no kernel reads past what the plan sized and ``plan`` issues no clamp op; the
        device seq lens are read when ``forward`` runs. Reference: clamped here (one op per
        chunk)."""
        n_pre = len(ps)
        # seq_len >= q_len >= 1 (checked): history pages of the last query
        hist = [(x - 1) // PAGE_SIZE for x in ps]
        bounds = plan_chunks(hist, self._budget)
        p0 = pq[0]
        if self.backend != "triton":  # the reference reads device values (it may sync)
            chunks = []
            for a, b in bounds:
                cap = torch.as_tensor(ps[a:b], dtype=torch.int32).to(self.device)
                gathered = hist[a:b]
                offsets = list(itertools.accumulate(gathered, initial=0))
                ch = PrefillChunk(a, b, pq[a] - p0, pq[b] - p0, offsets, gathered,
                                  offsets[-1])
                ch.dev = {"qsl_cpu": [x - pq[a] for x in pq[a:b + 1]],
                          "seq": torch.minimum(seq_lens[a:b], cap),
                          "block_table": bt_all[a:b]}
                chunks.append(ch)
            return chunks
        prefill_block_m = self._prefill_block_m
        h = self.config.num_heads
        st = self._staging[self._slot]
        host = st.host_np
        # Host work first (nothing is written before every size is known to fit).
        plans, n_blk = [], 0
        for a, b in bounds:
            if b - a == 1:  # one request: scalars, cached row blocks
                hk = hist[a]
                g = hk if hk > SHORT_MAX_LOCAL else 0  # short rows only: select by formula
                gathered, offs, nblk = (g,), (0, g), None
                bm, blocks = self._single_blocks(pq[a + 1] - pq[a], h)
                nb, top = blocks.shape[0] // 2, hk
            else:
                hs = hist[a:b]
                gathered = [x if x > SHORT_MAX_LOCAL else 0 for x in hs]
                offs = list(itertools.accumulate(gathered, initial=0))
                qlen = [pq[i + 1] - pq[i] for i in range(a, b)]
                bm = prefill_block_m(max(qlen), h)
                nblk = [-(-(x * h) // bm) for x in qlen]  # row blocks per request
                blocks, nb = qlen, sum(nblk)
                top = max(hs)  # a request's last row block has its largest page
            tpl = self._launch_template(nb, top if top > SHORT_MAX_LOCAL else 0, bm)
            plans.append((a, b, nb, gathered, offs, blocks, nblk, bm, tpl, n_blk))
            n_blk += nb
        if n_blk > st.max_blocks:  # cannot happen within the config's limits
            v.fail("step", f"at most {st.max_blocks} prefill row blocks (staging)", n_blk)
        self._slot = (self._slot + 1) % _NUM_STAGING
        host[:n_pre] = ps
        host[st.qsl_at:st.qsl_at + n_pre + 1] = pq
        for k, (a, b, nb, gathered, offs, blocks, nblk, bm, _, bo) in enumerate(plans):
            at = st.off_at + a + k
            host[at:at + b - a + 1] = offs
            host[st.pages_at + a:st.pages_at + b] = gathered
            at = st.blk_at + 2 * bo
            if nblk is None:  # one request: cached blocks
                host[at:at + 2 * nb] = blocks
                if a:
                    host[at:at + nb] = a  # blocks name the step's prefill requests
            else:
                self._stage_row_blocks(host[at:at + 2 * nb], a, blocks, nblk, ps[a:b], h,
                                       bm)
        st.copy(st.blk_at + 2 * n_blk)
        # the score / merge kernels read min(device seq len, staged host copy): no row reads
        # past the planned pages, and no clamp op here (host time)
        caps = st.caps(n_pre)
        width = bt_all.shape[1]
        ws8, qsl_d = self._ws8, st.qsl
        gather = self._gather
        chunks = []
        for k, (a, b, nb, gathered, offs, _, _, _, tpl, bo) in enumerate(plans):
            n = b - a
            if k == 0:
                ws_off, pages, blk, bt = st.off0, st.pages0, st.blk0, bt_all
            else:  # the staging views are cached; the step's block table is sliced
                ws_off, pages, blk = st.views(st.off_at + a + k, st.pages_at + a,
                                              st.blk_at + 2 * bo)
                bt = bt_all[a:]
            total = offs[-1]
            max_gather = max(gathered)
            gpages, launches = gather.plan(n, bt, pages, ws_off, max_gather, width, None,
                                           self._num_sms) if total else (1, [])
            plan, cand, win = tpl
            # the score kernel reads ws offsets at (request - a): blocks name step requests
            launch = {"plan": plan, "block_m": plan.block_m, "gather": launches,
                      "gather_pages": gpages, "width": width,
                      "score_args": (ws8, ws_off, a, qsl_d, seq_lens, caps, blk, cand, win)}
            chunks.append(PrefillChunk(
                a, b, pq[a] - p0, pq[b] - p0, offs, gathered, total, launch,
                {"qsl": qsl_d, "seq": seq_lens, "caps": caps, "ws_off": ws_off, "pages": pages,
                 "blocks": blk, "num_blocks": nb, "block_table": bt}))
        return chunks

    def _launch_template(self, num_blocks: int, score_pages: int, block_m: int) -> tuple:
        """What a prefill chunk's launches share with every chunk of the same (row blocks,
        score pages, BLOCK_M), cached (host time; never edited): ``(plan_prefill_chunk``'s
        plan under the shared scratch's cap, its candidate and window scratch views)``."""
        key = (num_blocks, score_pages, block_m)
        got = self._templates.get(key)
        if got is None:
            from .triton.prefill import plan_prefill_chunk
            plan = plan_prefill_chunk(self._settings, self.config.num_heads, num_blocks,
                                      score_pages, block_m, self._num_sms, self._score_elems)
            cand, win = self._scratch_views(plan.cand_elems, plan.win_elems)
            got = _make_room(self._templates, 4096)[key] = (plan, cand, win)
        return got

    def _stage_row_blocks(self, dst: np.ndarray, a: int, q_lens: list, nblk: list,
                          seq_lens: list, h: int, bm: int) -> None:
        """Write a several-request chunk's row blocks ``[2, nb]`` (step prefill request,
        first row) into the int32 staging view ``dst`` (``2 * nb`` long): request ``a + i``
        (query length ``q_lens[i]``) has ``nblk[i]`` blocks of ``bm`` rows, as
        ``triton.prefill.dispatch.plan_row_blocks``. A few requests: one fill and one ramp
        copy each; more: ``plan_row_blocks`` itself."""
        nb = dst.shape[0] // 2
        if len(nblk) <= _SCALAR_MAX:
            ramp = self._row_ramp(bm)
            at = 0
            for i, m in enumerate(nblk):
                dst[at:at + m] = a + i
                dst[nb + at:nb + at + m] = ramp[:m]
                at += m
            return
        from .triton.prefill.dispatch import plan_row_blocks
        reqs, row0s = plan_row_blocks(np.asarray(q_lens, dtype=np.int64),
                                      np.asarray(seq_lens, dtype=np.int64), h, bm, pages=False)
        dst[:nb] = reqs
        if a:
            dst[:nb] += a  # blocks name the step's prefill requests
        dst[nb:] = row0s

    def _row_ramp(self, block_m: int) -> np.ndarray:
        """``arange(max row blocks) * block_m`` (int32, cached by block_m): first rows."""
        got = self._row_ramps.get(block_m)
        if got is None:
            n = self._staging[0].max_blocks
            got = self._row_ramps[block_m] = np.arange(0, n * block_m, block_m,
                                                        dtype=np.int64).astype(np.int32)
        return got

    def _single_blocks(self, q_len: int, h: int):
        """(BLOCK_M, int32 ``[2, nb]`` row blocks (request 0, first rows)) of a one-request
        chunk of ``q_len`` queries (cached by q_len)."""
        got = self._blocks.get(q_len)
        if got is None:
            from .triton.prefill.dispatch import plan_row_blocks, prefill_block_m
            bm = prefill_block_m(q_len, h)
            one = np.array([q_len], dtype=np.int64)
            blocks = np.concatenate(plan_row_blocks(one, one, h, bm, pages=False)
                                    ).astype(np.int32)
            got = _make_room(self._blocks, 4096)[q_len] = (bm, blocks)
        return got

    def _scratch_views(self, n_cand: int, win_elems: int):
        """(int64 candidates, float32 window scratch) views of the shared score scratch
        (cached by size)."""
        key = (n_cand, win_elems)
        got = self._views.get(key)
        if got is None:
            sb = self.score_buffer
            cand = sb[:2 * max(n_cand, 1)].view(torch.int64)
            win = sb[2 * n_cand:2 * n_cand + win_elems] if win_elems else sb[:1]
            got = _make_room(self._views, 256)[key] = (cand, win)
        return got

    # -- forward --------------------------------------------------------------------------

    def _check_forward(self, index_q, cache, metadata, out) -> None:
        """forward's checks (SPEC 10): a few plain comparisons accept well-formed inputs;
        anything else goes through the full checks, which name the error."""
        if not self._forward_inputs_plain(index_q, cache, metadata, out):
            self._check_forward_full(index_q, cache, metadata, out)

    def _forward_inputs_plain(self, index_q, cache, metadata, out) -> bool:
        """True when ``_check_forward_full`` plainly passes (every condition implies it)."""
        if metadata is self._latest and metadata is not None \
                and self._fast_device and type(index_q) is torch.Tensor \
                and type(cache) is torch.Tensor and type(out) is torch.Tensor \
                and index_q.dtype == torch.float8_e4m3fn and cache.dtype == torch.uint8 \
                and out.dtype == torch.int32:
            dev, h, rows = self.device, self.config.num_heads, metadata.num_rows
            qs, cs, os_, cst = index_q.shape, cache.shape, out.shape, cache.stride()
            if (index_q.device == dev and cache.device == dev and out.device == dev
                    and len(qs) == 3 and qs[0] >= rows and qs[1] == h and qs[2] == HEAD_DIM
                    and index_q.stride(2) == 1 and len(os_) == 3 and os_[0] >= rows
                    and os_[1] == h and os_[2] == TOPK and out.is_contiguous()
                    and len(cs) == 3 and cs[0] >= 1 and cs[1] == PAGE_SIZE and cs[2] == 72
                    and cst[1] == 72 and cst[2] == 1 and cst[0] >= 9216 and cst[0] % 16 == 0):
                # out's bytes overlap nothing forward reads (validation.check_no_overlap)
                lo = out.data_ptr()
                hi = lo + os_[0] * h * TOPK * 4
                if hi == lo:
                    return True
                c0 = cache.data_ptr()
                if c0 < hi and lo < c0 + (cs[0] - 1) * cst[0] + PAGE_BYTES:
                    return False
                if qs[0]:
                    q0, qst = index_q.data_ptr(), index_q.stride()
                    if q0 < hi and lo < q0 + (qs[0] - 1) * qst[0] + (h - 1) * qst[1] + HEAD_DIM:
                        return False
                for _, (a, b) in metadata.reads:
                    if a < hi and lo < b:
                        return False
                return True
        return False

    def _check_forward_full(self, index_q, cache, metadata, out) -> None:
        c, dev = self.config, self.device
        self._check_metadata(metadata)
        v.check_cache(cache)
        v.check_tensor("cache", cache, device=dev)
        v.check_index_q(index_q, num_heads=c.num_heads, device=dev)
        v.check_tensor("out", out, dtypes=(torch.int32,), shape=(None, c.num_heads, TOPK),
                       device=dev, contiguous=True)
        rows = metadata.num_rows
        for name, t in (("index_q", index_q), ("out", out)):
            if t.shape[0] < rows:
                v.fail(name, f"at least {rows} rows (the step's)", f"shape {tuple(t.shape)}")
        if rows and cache.shape[0] == 0:
            v.fail("cache", "at least one block", "an empty cache (0 blocks)")
        v.check_no_overlap("out", out, (("index_q", index_q), ("cache", cache))
                           + metadata.reads)

    def _check_metadata(self, md) -> None:
        """``md`` is what this Indexer's latest ``plan()`` returned, or a faithful copy of it
        (SPEC 8.1); the error names the fields that differ from that plan's."""
        if not isinstance(md, IndexerMetadata):
            raise TypeError(f"metadata: expected an IndexerMetadata, got {type(md).__name__}")
        latest = self._latest
        if md is latest:
            return
        owner = md.owner() if isinstance(md.owner, weakref.ref) else None
        if owner is self and md.generation != self._generation:
            raise RuntimeError("metadata: expected the IndexerMetadata of the latest plan() "
                               f"(plan {self._generation}), got plan {md.generation}")
        diff = _changed_fields(md, latest) if latest is not None else []
        if owner is self and latest is not None and not diff:
            return  # a copy of the latest plan's metadata
        if owner is self:
            what = "a changed copy of this Indexer's"
        elif md.owner is None:
            what = "metadata built by hand (owner None)"
        else:
            what = "metadata of another Indexer" + (
                f" (num_heads={owner.config.num_heads})" if isinstance(owner, Indexer) else "")
        if latest is None:
            what += ", before this Indexer's first plan()"
        elif diff:
            what += "; fields unlike the plan's: " + ", ".join(
                f"{n}={getattr(md, n)!r:.48}" for n in diff if n != "owner")
        v.fail("metadata", "the IndexerMetadata this Indexer's latest plan() returned", what)
    def forward(self, index_q: torch.Tensor, cache: torch.Tensor, metadata: IndexerMetadata,
                out: torch.Tensor) -> torch.Tensor:
        """Select pages for every row of the planned step into ``out`` (SPEC 8.1).

        Args:
            index_q: ``float8_e4m3fn [T, H, 128]`` (T >= the step's rows; unit last stride).
            cache: the paged index-K cache ``uint8 [N, 128, 72]`` (SPEC 2).
            metadata: this step's ``IndexerMetadata`` (from the latest ``plan()``).
            out: int32 ``[T', H, 16]`` contiguous, T' >= the step's rows.
        Decode rows ``[0, num_decodes * Q)`` go through the decode wrapper (no allocation, no
        sync: capturable for a decode-only step); prefill chunks run eagerly: gather into the
        reserved workspace, then Q8KV8 scoring + top-k, each into its own rows (Triton: the
        launches ``plan`` prepared). Rows past the step's are never written.
        Returns:
            ``out``.
        Raises:
            TypeError / ValueError: shapes, dtypes, devices (metadata only, no sync); an
            ``out`` whose memory overlaps ``index_q``, the cache or what the step reads;
            ``metadata`` not returned by this Indexer's ``plan()`` (another Indexer's, built
            by hand, a copy), naming the fields that differ.
            RuntimeError: metadata from an older ``plan()`` of this Indexer.
        """
        self._check_forward(index_q, cache, metadata, out)
        if self.backend != "triton":  # reference: every page the step reads is in the cache
            self._check_block_ids(metadata, cache.shape[0])
        if metadata.num_decode_rows:
            self._decode_rows(index_q, cache, metadata, out)
        if metadata.prefill_chunks:
            self._prefill_rows(index_q, cache, metadata, out)
        return out

    __call__ = forward

    @staticmethod
    def _decode_rows(index_q, cache, metadata: "IndexerMetadata", out) -> None:
        """The decode rows ``[0, num_decodes * Q)`` through the planned wrapper."""
        nr = metadata.num_decode_rows
        dec = metadata.decoder
        if nr != index_q.shape[0]:  # index_q and out may each have more rows (SPEC 8.1)
            index_q = index_q[:nr]
        if nr != out.shape[0]:
            out = out[:nr]
        if isinstance(dec, _HostPlannedDecodeWrapper):
            dec.run_planned(index_q, cache, out, metadata.decode_inputs)
        else:
            dec.run(index_q, cache, out)

    def _prefill_rows(self, index_q, cache, metadata: "IndexerMetadata", out) -> None:
        """Every prefill chunk's rows, in order (eager)."""
        if self.backend == "triton":
            with self._device_guard(self.device):
                self._triton_prefill(index_q, cache, metadata, out)
            return
        p0 = metadata.prefill_row_start
        for ch in metadata.prefill_chunks:
            lo, hi = p0 + ch.row_start, p0 + ch.row_end
            self._reference_chunk(index_q[lo:hi], cache, ch, metadata, out[lo:hi])

    @staticmethod
    def _check_block_ids(md: "IndexerMetadata", num_blocks: int) -> None:
        """Reference backend (syncs): block ids of every page the step's requests read lie in
        the cache (SPEC 10), checked before any row is written."""
        from .reference.paging import history_pages
        if md.decoder is not None:
            d = md.decoder
            v.check_block_table_values(d.block_table, history_pages(d.seq_lens.to(torch.long)),
                                       num_blocks, name="block_table")
        for ch in md.prefill_chunks:
            v.check_block_table_values(ch.dev["block_table"],
                                       history_pages(ch.dev["seq"].to(torch.long)), num_blocks,
                                       name="block_table")

    def _triton_prefill(self, index_q, cache, md, out) -> None:
        """Every chunk's planned launches: gather into the workspace, score, merge. The
        staged row offsets are absolute: the kernels take all of ``index_q`` and ``out``."""
        from .triton.prefill import launch_prefill_chunk
        ws8 = self._ws8
        gather = self._gather
        kernels = gather.kernels(cache, ws8)  # the byte path for a cache not 2-byte aligned
        q8 = None
        for ch in md.prefill_chunks:
            L = ch.launch
            if L["gather"]:
                gather.run(kernels[L["gather_pages"]], L["gather"], cache, ws8, L["width"])
            if q8 is None:  # after the first gather launch, if any (host time before it)
                q8 = index_q.view(torch.uint8)
            launch_prefill_chunk(L["plan"], q8, *L["score_args"], out)

    def _reference_chunk(self, q, cache, ch, md, out) -> None:
        """Reference: gather the chunk into the reserved workspace, score each request from
        it exactly and select (SPEC 4, 5, 7)."""
        from .reference.prefill import gather_index_k_fp8
        from .reference.scores import scores_from_keys
        from .reference.selection import select_pages
        bt, seq, qsl = ch.dev["block_table"], ch.dev["seq"], ch.dev["qsl_cpu"]
        ws, offsets = gather_index_k_fp8(cache, bt, seq)
        self.workspace[:ws.shape[0]].copy_(ws)
        sl, offsets = seq.tolist(), offsets.tolist()
        for i in range(ch.req_end - ch.req_start):
            lo, hi = qsl[i], qsl[i + 1]
            pos = torch.arange(sl[i] - (hi - lo), sl[i], device=q.device)
            local = local_pages(pos)
            keys = self.workspace[offsets[i]:offsets[i + 1]]
            scores, _ = scores_from_keys(q[lo:hi], keys, local)
            out[lo:hi] = select_pages(scores, local, TOPK)


def _changed_fields(md: IndexerMetadata, planned: IndexerMetadata) -> list[str]:
    """Fields of ``md`` that are not the planned metadata's (the same object, or an equal
    int)."""
    import dataclasses
    diff = []
    for f in dataclasses.fields(md):
        a, b = getattr(md, f.name), getattr(planned, f.name)
        if a is not b and not (type(a) is int and type(b) is int and a == b):
            diff.append(f.name)
    return diff
