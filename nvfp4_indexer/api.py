"""Public API (SPEC 11): validate (SPEC 10), pick a backend, dispatch.

Every operation takes ``backend="auto" | "reference" | "triton"``; "auto" is Triton for CUDA
tensors and the reference otherwise. Tensors stay on the caller's device. Eager calls check
device values too (they may sync); ``DecodeIndexerWrapper.run`` checks metadata only and relies
on its ``plan()``.
"""

from __future__ import annotations

import torch

from . import reference as ref
from . import _LAZY
from . import validation as v
from .constants import HEAD_DIM, PAGE_BYTES, PAGE_SIZE, TOPK
from .reference.paging import history_pages

# SPEC 11: the constants and every name the package resolves from this module
__all__ = ["PAGE_SIZE", "HEAD_DIM", "TOPK", "PAGE_BYTES",
           *(name for name, module in _LAZY.items() if module == ".api")]


def triton_backend():
    """The Triton backend package ``nvfp4_indexer.triton``, imported on first use (Triton is
    only needed when used; TRITON_INTERPRET is read at its import)."""
    from . import triton as kernels
    return kernels


def encode_e4m3(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Encode floats to E4M3, round-to-nearest-even, saturating (SPEC 1.1).

    Args:
        x: float32/float16/bfloat16/float64 tensor, any shape (converted to fp32 first).
    Returns:
        ``float8_e4m3fn`` tensor of ``x``'s shape: beyond +-448 and +-inf give +-448, NaN gives
        byte 0x7F, -0.0 gives 0x80.
    Raises:
        TypeError / ValueError: ``x`` is not a float tensor of a supported dtype.
    """
    v.check_tensor("x", x, dtypes=v.FLOAT_DTYPES + (torch.float64,))
    x = x.float() if x.dtype == torch.float64 else x  # SPEC 1.1: converted to fp32 first
    if v.check_backend(backend, x.device) == "triton":
        return triton_backend().encode_e4m3(x)
    return ref.encode_e4m3(x)


def quantize_nvfp4(x: torch.Tensor, *, backend: str = "auto"):
    """NVFP4 block quantization, 16 values per E4M3 scale (SPEC 1.3).

    Args:
        x: float32/float16/bfloat16 ``[..., 128]``.
    Returns:
        ``(codes uint8 [..., 64], scales float8_e4m3fn [..., 8])``; dim 2i is the low nibble
        and dim 2i+1 the high nibble of code byte i.
    Raises:
        ValueError: wrong dtype or last dim not 128.
    """
    v.check_tensor("x", x, dtypes=v.FLOAT_DTYPES + (torch.float64,))
    x = x.float() if x.dtype == torch.float64 else x  # converted to fp32 first
    if x.dim() < 1 or x.shape[-1] != HEAD_DIM:
        v.fail("x", f"shape [..., {HEAD_DIM}]", f"shape {tuple(x.shape)}")
    if v.check_backend(backend, x.device) == "triton":
        return triton_backend().quantize_nvfp4(x)
    return ref.quantize_nvfp4(x)


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float8_e4m3fn, *, backend: str = "auto"):
    """Dequantize NVFP4 vectors (SPEC 1.4).

    Args:
        codes: uint8 ``[..., 64]``; scales: ``float8_e4m3fn`` (or uint8 bytes) ``[..., 8]``.
        dtype: ``float8_e4m3fn`` gives ``encode_e4m3(e2m1 * scale)`` (what scorers score);
            ``float32`` gives the exact product.
    Returns:
        ``[..., 128]`` tensor of ``dtype``.
    Raises:
        ValueError: shapes or dtypes; NotImplementedError: another ``dtype``.
    """
    v.check_scales_codes(codes, scales)
    if dtype not in (torch.float8_e4m3fn, torch.float32):
        raise NotImplementedError(f"dtype: expected torch.float8_e4m3fn or torch.float32, "
                                  f"got {dtype}")
    if v.check_backend(backend, codes.device) == "triton":
        return triton_backend().dequantize_nvfp4(codes, scales, dtype)
    return ref.dequantize_nvfp4(codes, scales, dtype)


def new_index_cache(num_blocks: int, device=None, page_stride: int = PAGE_BYTES) -> torch.Tensor:
    """Allocate a zeroed paged index-K cache (SPEC 2).

    Args:
        num_blocks: physical pages (blocks), >= 0 (Python or numpy integer).
        device: torch device (default: torch's default device; "cuda" is the current one).
        page_stride: bytes from one page to the next, a multiple of 16, >= 9216.
    Returns:
        ``uint8 [num_blocks, 128, 72]`` view with strides ``(page_stride, 72, 1)`` over
        ``num_blocks * page_stride`` bytes. Its rows are a reinterpretation of page bytes, not
        tokens.
    Raises:
        ValueError: negative ``num_blocks``, a bad ``page_stride``, a ``device`` that does not
        exist, or ``num_blocks * page_stride`` bytes that the device cannot hold (past int64,
        its total memory, or refused by its allocator): the message names the argument and
        the bytes asked for (SPEC 10).
    """
    num_blocks = v.check_int("num_blocks", num_blocks, lo=0)
    if not v.is_int(page_stride) or page_stride < PAGE_BYTES or page_stride % 16:
        v.fail("page_stride", f"an int >= {PAGE_BYTES} and a multiple of 16", repr(page_stride))
    page_stride = int(page_stride)
    dev = v.check_device("device", device)
    nbytes = num_blocks * page_stride
    name = "page_stride" if page_stride // PAGE_BYTES > num_blocks else "num_blocks"
    return v.allocate(name, nbytes, dev, f"num_blocks={num_blocks} x page_stride={page_stride}",
                      lambda: ref.new_index_cache(num_blocks, dev, page_stride))


def write_index_k(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, *,
                  backend: str = "auto") -> None:
    """NVFP4-quantize keys and write them at their slots (SPEC 1.3, 2).

    Args:
        cache: the paged cache (``new_index_cache``).
        k: float ``[T, 128]`` keys, already normalized and rotated.
        slot_mapping: int32/int64 ``[T]``: physical_block * 128 + offset; negative = skip.
    Raises:
        ValueError: shapes, dtypes, devices; a slot outside the cache; duplicate slots; a
        cache whose memory overlaps ``k`` or ``slot_mapping``.
    """
    dev = _check_write(cache, k, slot_mapping)
    v.check_slot_mapping_values(slot_mapping, cache.shape[0])
    k = _fp32_if_double(k)
    if v.check_backend(backend, dev) == "triton":
        return triton_backend().write_index_k(cache, k, slot_mapping)
    codes, scales = ref.quantize_nvfp4(k)
    ref.write_tokens(cache, codes, scales, slot_mapping)


def read_index_k(cache: torch.Tensor, block: int):
    """Codes ``uint8 [128, 64]`` and scales ``float8_e4m3fn [128, 8]`` of physical ``block``
    (token-major, decoded from the page layout of SPEC 2).

    Raises:
        ValueError: bad cache, or ``block`` outside ``[0, num_blocks)``.
    """
    v.check_cache(cache)
    if not v.is_int(block) or not 0 <= block < cache.shape[0]:
        v.fail("block", f"an int in [0, {cache.shape[0]})", repr(block))
    codes, scales = ref.read_blocks(cache, torch.tensor(int(block), device=cache.device))
    return codes.clone(), scales.clone()


def insert_index_k(cache: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, k_norm_weight: torch.Tensor,
                   cos_sin_cache: torch.Tensor, *, rotary_dim: int = 64, eps: float = 1e-6,
                   backend: str = "auto") -> None:
    """Fused Gemma RMSNorm + NeoX RoPE + NVFP4 quantize + paged write of index keys (SPEC 3).

    Args:
        cache: the paged cache. k: bf16/fp16/fp32 ``[T, 128]``. positions: int ``[T]``.
        slot_mapping: int ``[T]`` (negative = skip). k_norm_weight: float ``[128]``
        (norm multiplies by ``1 + w``). cos_sin_cache: float ``[max_position, rotary_dim]``
        (cos first half, sin second). rotary_dim: rotated leading dims (even). eps: norm eps.
    Raises:
        ValueError: shapes, dtypes, devices, positions outside ``cos_sin_cache``, slots outside
        the cache, duplicate slots, an ``eps`` that is not finite and > 0 once rounded to fp32
        (SPEC 3), a cache whose memory overlaps an input.
    """
    dev = _check_write(cache, k, slot_mapping, positions=positions, k_norm_weight=k_norm_weight,
                       cos_sin_cache=cos_sin_cache)
    v.check_norm_inputs("k", k, positions, k_norm_weight, "k_norm_weight", cos_sin_cache,
                        rotary_dim, eps, dev)
    v.check_slot_mapping_values(slot_mapping, cache.shape[0])
    k, k_norm_weight, cos_sin_cache = map(_fp32_if_double, (k, k_norm_weight, cos_sin_cache))
    rotary_dim, eps = int(rotary_dim), float(eps)  # numpy scalars -> Python (SPEC 11)
    if v.check_backend(backend, dev) == "triton":
        return triton_backend().insert_index_k(cache, k, positions, slot_mapping, k_norm_weight,
                                         cos_sin_cache, rotary_dim, eps)
    ref.insert_index_k(cache, k, positions, slot_mapping, k_norm_weight, cos_sin_cache,
                       rotary_dim, eps)


def prepare_index_q(q: torch.Tensor, positions: torch.Tensor, q_norm_weight: torch.Tensor,
                    cos_sin_cache: torch.Tensor, *, rotary_dim: int = 64, eps: float = 1e-6,
                    backend: str = "auto") -> torch.Tensor:
    """Gemma RMSNorm + NeoX RoPE + E4M3 encode of index queries, no scale (SPEC 3).

    Args:
        q: bf16/fp16/fp32 ``[T, H, 128]``; positions: int ``[T]``; q_norm_weight: ``[128]``;
        cos_sin_cache: ``[max_position, rotary_dim]``.
    Returns:
        ``float8_e4m3fn [T, H, 128]``.
    Raises:
        ValueError: shapes, dtypes, devices, positions outside ``cos_sin_cache``, an ``eps``
        that is not finite and > 0 once rounded to fp32 (SPEC 3).
    """
    v.check_tensor("q", q, dtypes=v.FLOAT_DTYPES + (torch.float64,), shape=(None, None, HEAD_DIM))
    v.check_norm_inputs("q", q, positions, q_norm_weight, "q_norm_weight", cos_sin_cache,
                        rotary_dim, eps, q.device)
    q, q_norm_weight, cos_sin_cache = map(_fp32_if_double, (q, q_norm_weight, cos_sin_cache))
    rotary_dim, eps = int(rotary_dim), float(eps)  # numpy scalars -> Python (SPEC 11)
    if v.check_backend(backend, q.device) == "triton":
        return triton_backend().prepare_index_q(q, positions, q_norm_weight, cos_sin_cache,
                                          rotary_dim, eps)
    return ref.prepare_index_q(q, positions, q_norm_weight, cos_sin_cache, rotary_dim, eps)


def _check_write(cache, k, slot_mapping, **more) -> torch.device:
    """A cache write's shared checks (SPEC 2, 10): the cache, ``k [T, 128]`` and
    ``slot_mapping [T]`` on its device, and a cache that overlaps none of them nor ``more``
    (checked when they are tensors; their own checks follow). Returns the cache's device."""
    v.check_cache(cache)
    dev = cache.device
    v.check_tensor("k", k, dtypes=v.FLOAT_DTYPES + (torch.float64,), shape=(None, HEAD_DIM),
                   device=dev)
    v.check_tensor("slot_mapping", slot_mapping, dtypes=v.INT_DTYPES, shape=(k.shape[0],),
                   device=dev)
    inputs = [("k", k), ("slot_mapping", slot_mapping)]
    inputs += [(n, t) for n, t in more.items() if isinstance(t, torch.Tensor)]
    v.check_no_overlap("cache", cache, inputs)
    return dev


def _fp32_if_double(t: torch.Tensor) -> torch.Tensor:
    """float64 inputs are converted to fp32 first (SPEC 1.1, 3); other dtypes pass through."""
    return t.float() if t.dtype == torch.float64 else t


def _check_paged(cache, block_table, seq_lens):
    v.check_cache(cache)
    dev = cache.device
    v.check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    if block_table.stride(-1) != 1:
        v.fail("block_table", "unit stride in the last dim", f"strides {block_table.stride()}")
    v.check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(block_table.shape[0],),
                   device=dev, contiguous=True)
    return dev


def gather_index_k_fp8(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       *, backend: str = "auto"):
    """Dequantize every request's history pages into a compact FP8 workspace (SPEC 7).

    Args:
        cache: the paged cache. block_table: int32 ``[R, W]``. seq_lens: int32 ``[R]``, tokens
        per request; request r contributes (seq_len - 1) // 128 pages.
    Returns:
        ``(workspace float8_e4m3fn [P, 128, 128], page_offsets int32 [R+1])``, P = total pages;
        request r's logical page j is ``workspace[page_offsets[r] + j]`` (token-major).
    Raises:
        ValueError: shapes, dtypes, devices, a negative seq_len, a block table narrower than a
        request needs, block ids outside the cache.
    """
    dev = _check_paged(cache, block_table, seq_lens)
    if bool((seq_lens < 0).any()):
        v.fail("seq_lens", "values >= 0", f"min {int(seq_lens.min())}")
    v.check_block_table(block_table, seq_lens, cache.shape[0])
    if v.check_backend(backend, dev) == "triton":
        return triton_backend().gather_index_k_fp8(cache, block_table, seq_lens)
    return ref.gather_index_k_fp8(cache, block_table, seq_lens)


def page_scores(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                backend: str = "auto") -> torch.Tensor:
    """Page scores of every query row against its history pages (SPEC 4).

    Args:
        index_q: ``float8_e4m3fn [T, H, 128]``. cache: the paged cache. block_table: int32
        ``[R, W]``. seq_lens: int32 ``[R]`` (context + this step's tokens).
        query_start_loc: int32 ``[R+1]`` row offsets (queries bottom-right aligned; a request
        may have no rows).
    Returns:
        float32 ``[T, H, W]``: max over each history page's tokens of the q . K dot product
        (exact, rounded once to fp32 by the reference); -inf where page j >= the row's local page,
        so every row of a request of seq_len 0 (SPEC 5's padding rows) is -inf.
    Raises:
        ValueError: shapes, dtypes, devices, ``query_start_loc`` not from 0 to T or decreasing,
        q_len > seq_len for a request of seq_len > 0, narrow block table, block ids outside the
        cache.
    """
    dev = _check_paged(cache, block_table, seq_lens)
    v.check_index_q(index_q, device=dev)
    v.check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,),
                   shape=(block_table.shape[0] + 1,), device=dev, contiguous=True)
    q_lens = v.check_offsets("query_start_loc", query_start_loc, index_q.shape[0], min_len=0)
    v.check_q_lens_fit(q_lens, seq_lens, "query_start_loc", padding=True)
    v.check_block_table(block_table, seq_lens, cache.shape[0])
    if v.check_backend(backend, dev) == "triton":
        return triton_backend().page_scores(index_q, cache, block_table, seq_lens,
                                      query_start_loc)
    return ref.page_scores(index_q, cache, block_table, seq_lens, query_start_loc)


def decode_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, query_len: int, *, out: torch.Tensor | None = None,
                   topk: int = TOPK, backend: str = "auto") -> torch.Tensor:
    """Top-k page selection for a uniform decode batch (SPEC 5, 6), eager.

    Args:
        index_q: ``float8_e4m3fn [B*Q, H, 128]``, request-major (row = b*Q + i).
        cache: the paged cache. block_table: int32 ``[B, W]``. seq_lens: int32 ``[B]``: each
        Q <= seq_len <= W*128, or 0 for a padding request. query_len: Q in 1..8.
        out: optional int32 ``[B*Q, H, topk]`` to write into. topk: 16 (the reference takes any
        K >= 2).
    Returns:
        int32 ``[B*Q, H, topk]`` logical page ids (``out`` when given): 15 best history pages
        then the local page; fewer history pages ascending then -1; padding rows ``[0, -1...]``.
    Raises:
        ValueError: shapes, dtypes, devices, ``query_len``, ``seq_lens`` ranges, narrow block
        table, block ids outside the cache, an ``out`` whose memory overlaps an input,
        ``backend="triton"`` on CPU tensors without TRITON_INTERPRET=1.
        NotImplementedError: topk != 16 or Q * H > 64 on Triton.
    """
    dev = _check_paged(cache, block_table, seq_lens)
    query_len = v.check_query_len(query_len)
    b = block_table.shape[0]
    v.check_index_q(index_q, rows=b * query_len, device=dev)
    h = index_q.shape[1]
    backend = v.check_backend(backend, dev)
    topk = v.check_topk(topk, backend)
    if out is not None:
        v.check_out(out, b * query_len, h, topk, dev)
        v.check_no_overlap("out", out, (("index_q", index_q), ("cache", cache),
                                        ("block_table", block_table), ("seq_lens", seq_lens)))
    v.check_decode_values(block_table, seq_lens, query_len, cache.shape[0])
    if b == 0 or block_table.shape[1] == 0:
        backend = "reference"  # nothing to score: every row is padding (or there is none)
    if backend == "triton":
        if out is None:
            out = torch.empty((b * query_len, h, topk), dtype=torch.int32, device=dev)
        triton_backend().decode_indexer(index_q, cache, block_table, seq_lens, query_len, out)
        return out
    result = ref.decode_indexer(index_q, cache, block_table, seq_lens, query_len, topk)
    return result if out is None else out.copy_(result)


def max_gather_pages(max_model_len: int, max_num_batched_tokens: int) -> int:
    """FP8 workspace pages one prefill chunk may gather (SPEC 7):
    ``ceil(max(max_model_len, 4 * max_num_batched_tokens) / 128)``; one request always fits.

    Raises:
        ValueError: a non-positive argument.
    """
    return ref.max_gather_pages(v.check_int("max_model_len", max_model_len, lo=1),
                                v.check_int("max_num_batched_tokens", max_num_batched_tokens,
                                            lo=1))


def prefill_indexer(index_q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, *,
                    max_gather_pages: int | None = None, out: torch.Tensor | None = None,
                    topk: int = TOPK, backend: str = "auto",
                    allow_fp8_mma: bool = False) -> torch.Tensor:
    """Top-k page selection for prefill requests with cached context (SPEC 5, 7).

    Args:
        index_q: ``float8_e4m3fn [Tp, H, 128]``. cache: the paged cache. block_table: int32
        ``[R, W]``. cu_seqlens_q: int32 ``[R+1]`` row offsets (each q_len >= 1). seq_lens: int32
        ``[R]``, context + new tokens (q_len <= seq_len <= W*128).
        max_gather_pages: FP8 workspace budget in pages per chunk; default
        ``max_gather_pages(W * 128, Tp)``. out: optional int32 ``[Tp, H, topk]``.
        allow_fp8_mma: opt in to inexact scores (SPEC 9, b = 5 instead of 15): on a CUDA SM90
        GPU with Gluon the Triton backend scores in dot mode "fp8" (E4M3 operands on the FP8
        tensor cores; the Gluon prefill kernel's FP8 form, ~1.25x faster on long chunks);
        elsewhere, and on the reference backend, no effect.
    Returns:
        int32 ``[Tp, H, topk]`` logical page ids (``out`` when given).
    Raises:
        ValueError: shapes, dtypes, devices, ranges (``cu_seqlens_q`` not from 0 to Tp or with
        a request of no rows, q_len > seq_len), a ``max_gather_pages`` below one request's
        history pages, ``allow_fp8_mma`` not a bool, an ``out`` whose memory overlaps an
        input. NotImplementedError: topk != 16 on Triton.
    """
    dev = _check_paged(cache, block_table, seq_lens)
    if not isinstance(allow_fp8_mma, bool):
        v.fail("allow_fp8_mma", "a bool", repr(allow_fp8_mma))
    v.check_index_q(index_q, device=dev)
    v.check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,),
                   shape=(block_table.shape[0] + 1,), device=dev, contiguous=True)
    t, h, _ = index_q.shape
    backend = v.check_backend(backend, dev)
    topk = v.check_topk(topk, backend)
    if out is not None:
        v.check_out(out, t, h, topk, dev)
        v.check_no_overlap("out", out, (("index_q", index_q), ("cache", cache),
                                        ("block_table", block_table),
                                        ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)))
    v.check_prefill_values(block_table, cu_seqlens_q, seq_lens, t, cache.shape[0])
    if max_gather_pages is None:
        max_gather_pages = ref.max_gather_pages(max(block_table.shape[1], 1) * PAGE_SIZE,
                                                max(t, 1))
    else:
        max_gather_pages = v.check_int("max_gather_pages", max_gather_pages, lo=0)
    ref.plan_chunks(history_pages(seq_lens).tolist(), max_gather_pages)  # raises if too small
    if t == 0:
        backend = "reference"  # no rows
    if backend == "triton":
        if out is None:
            out = torch.empty((t, h, topk), dtype=torch.int32, device=dev)
        triton_backend().prefill_indexer(index_q, cache, block_table, cu_seqlens_q, seq_lens,
                                   max_gather_pages, out,
                                   config=_prefill_config(allow_fp8_mma, dev))
        return out
    result = ref.prefill_indexer(index_q, cache, block_table, cu_seqlens_q, seq_lens,
                                 max_gather_pages, topk)
    return result if out is None else out.copy_(result)


class PlannedDecodeBuffers:
    """What the decode wrappers share (SPEC 6): the caller's persistent ``block_table``
    ``[B, W]`` and ``seq_lens`` ``[B]`` buffers, read in place by ``run()``; the query length
    fixed at the first ``plan()``; the plan's copies into those buffers; padding rows."""

    _name = "DecodeIndexerWrapper"

    def _set_buffers(self, num_heads: int, block_table_buffer: torch.Tensor,
                     seq_lens_buffer: torch.Tensor, use_cuda_graph: bool) -> None:
        self.num_heads = num_heads
        self.block_table = block_table_buffer
        self.seq_lens = seq_lens_buffer
        self.use_cuda_graph = use_cuda_graph
        self.query_len: int | None = None
        self._runner = None

    @property
    def num_reqs(self) -> int:
        return self.block_table.shape[0]

    def _copy_plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   non_blocking: bool = False) -> None:
        """Copy a validated ``block_table [B, W']`` (its first W columns when wider) and
        ``seq_lens [B]`` into the buffers (``validation.copy_planned``: nothing for the
        buffers themselves, overlapping views from clones)."""
        cols = min(self.block_table.shape[1], block_table.shape[1])
        v.copy_planned(((seq_lens, self.seq_lens),
                        (block_table[:, :cols], self.block_table[:, :cols])), non_blocking)

    def _planned_rows(self) -> int:
        """B * Q of the plan; RuntimeError before the first ``plan()``."""
        if self.query_len is None:
            raise RuntimeError(f"{self._name}.run() called before plan()")
        return self.num_reqs * self.query_len

    def _check_not_capturing(self) -> None:
        if self.block_table.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self._name}: the reference backend syncs and cannot be "
                               "captured in a CUDA graph; use backend='triton'")

    @staticmethod
    def _padding_rows(out: torch.Tensor) -> torch.Tensor:
        """Every row is a padding row ``[0, -1 x 15]`` (SPEC 5): a block table of width 0."""
        out.fill_(-1)
        out[..., 0] = 0
        return out


class DecodeIndexerWrapper(PlannedDecodeBuffers):
    """Decode indexer for one (padded batch size B, query length Q), CUDA-graph safe (SPEC 6).

    The wrapper reads the caller's persistent ``block_table_buffer`` int32 ``[B, W]`` and
    ``seq_lens_buffer`` int32 ``[B]`` in place. ``plan()`` runs outside capture every step: it
    validates (may sync) and copies new metadata into those buffers when given other tensors.
    ``run()`` allocates nothing, never syncs or reads device values on the host, and can be
    captured in a CUDA graph; replays after in-place changes to the buffers give fresh results.
    Keep the wrapper alive as long as graphs that captured its ``run()``.

    Args:
        num_heads: index heads H per rank (Triton: Q * H <= 64 rows per request).
        block_table_buffer / seq_lens_buffer: the persistent buffers (same device).
        use_cuda_graph: True when ``run()`` will be captured: the Triton kernels are compiled
            and warmed up at the first ``plan()``, so capture never compiles (False: at the
            first ``run()``).
        backend: "auto" | "reference" | "triton" (the reference run() syncs: not capturable).
        score_buffer: optional float32 scratch shared by wrappers that never run at once
            (Triton; see ``nvfp4_indexer.triton.score_buffer_size``): a contiguous 1-d
            float32 tensor on the buffers' device, 8-byte aligned, checked here on every
            backend (its size against the wrapper's shapes, exactly at the first ``plan()``).
        num_blocks: the cache's block count (SPEC 10). ``plan()`` checks block ids against
            it; without it the wrapper learns it from ``plan(num_blocks=)`` or the cache of
            its first ``run()``, and a ``plan()`` before either checks ids >= 0 only. Kernels
            never read outside the cache they are given whatever the plan saw (block ids are
            clamped into it; seq_lens to the block-table width).
        allow_fp8_mma: opt in to inexact scores (SPEC 9, b = 5 instead of 15): on an SM90
            GPU the Triton backend then multiplies E4M3 operands on the FP8 tensor cores
            where that is faster (large batches; ``nvfp4_indexer.triton.DecodeConfig``
            ``dot="fp8"``), exactly elsewhere. Observed worst error ~2^-13 of a row's
            magnitude; docs/performance.md gives speed and selections. No effect on the
            reference backend or off CUDA (exact).
    Raises:
        ValueError: bad buffers (or buffers whose memory overlaps), ``num_heads``,
        ``score_buffer``, ``num_blocks`` or ``allow_fp8_mma`` (not a bool).
    """

    def __init__(self, num_heads: int, *, block_table_buffer: torch.Tensor,
                 seq_lens_buffer: torch.Tensor, use_cuda_graph: bool = True,
                 backend: str = "auto", score_buffer: torch.Tensor | None = None,
                 num_blocks: int | None = None, allow_fp8_mma: bool = False):
        num_heads = v.check_int("num_heads", num_heads, lo=1)
        if not isinstance(allow_fp8_mma, bool):
            v.fail("allow_fp8_mma", "a bool", repr(allow_fp8_mma))
        dev = v.check_plan_buffers(block_table_buffer, seq_lens_buffer)
        self.num_blocks = v.check_int("num_blocks", num_blocks, lo=0, optional=True)
        self.backend = v.check_backend(backend, dev)
        self.allow_fp8_mma = allow_fp8_mma
        if score_buffer is not None:
            _check_score_buffer(score_buffer, dev, *block_table_buffer.shape, num_heads,
                                _runner_config(allow_fp8_mma, dev, self.backend))
            v.check_no_overlap("score_buffer", score_buffer,
                               (("block_table_buffer", block_table_buffer),
                                ("seq_lens_buffer", seq_lens_buffer)))
        self._set_buffers(num_heads, block_table_buffer, seq_lens_buffer, use_cuda_graph)
        self.score_buffer = score_buffer

    def runner_config(self):
        """The Triton runner's ``DecodeConfig``: ``dot="fp8"`` with ``allow_fp8_mma`` on a
        CUDA device, else None (the defaults)."""
        return _runner_config(self.allow_fp8_mma, self.block_table.device, self.backend)

    def plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int, *,
             num_blocks: int | None = None) -> None:
        """Validate this step's metadata (syncs) and copy it into the wrapper's buffers:
        nothing is copied for a tensor that is the buffer itself (same data pointer, shape,
        strides and dtype; for ``block_table``, the buffer's first W' columns), and a tensor
        that overlaps a buffer otherwise is copied from a clone, so ``run()`` reads what
        ``plan()`` validated.

        Args:
            block_table: int32 ``[B, W']`` with W' <= W (the buffer itself is fine);
            seq_lens: int32 ``[B]``; query_len: Q in 1..8, fixed per wrapper once planned.
            num_blocks: the cache's block count, to check block ids against; remembered for
            later plans (default: the one given to the constructor or learned from the
            cache of an earlier ``run()``; none known yet: ids >= 0 only).
        Raises:
            ValueError: shapes, ranges (SPEC 6, 10: block ids outside the cache), a changed
            ``query_len``, a ``score_buffer`` too small for these shapes (Triton).
            NotImplementedError: Q * H > 64 on Triton.
        Nothing is copied and the wrapper stays unplanned when it raises.
        """
        dev = self.block_table.device
        b, w = self.block_table.shape
        query_len = v.check_query_len(query_len)
        num_blocks = v.check_int("num_blocks", num_blocks, lo=0, optional=True)
        if num_blocks is None:
            num_blocks = self.num_blocks
        # Validate before copying (SPEC 10: nothing is written on bad input).
        v.check_decode_plan(self.block_table, block_table, seq_lens, query_len, self.query_len,
                            num_blocks)
        # Build (and, for graphs, compile) the Triton runner before touching any buffer: an
        # unsupported shape (Q * H > 64) raises here with the caller's buffers intact.
        if self.backend == "triton" and self._runner is None and b > 0 and w > 0:
            self._runner = triton_backend().DecodeRunner(
                self.num_heads, b, w, query_len, dev, score_buffer=self.score_buffer,
                config=self.runner_config(), warmup=self.use_cuda_graph and dev.type == "cuda")
        self._copy_plan(block_table, seq_lens)
        self.query_len = query_len
        self.num_blocks = num_blocks

    def run(self, index_q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Select pages for the planned batch into ``out`` (capturable on Triton).

        Args:
            index_q: ``float8_e4m3fn [B*Q, H, 128]``; cache: the paged cache, with at least
            the ``num_blocks`` the plan checked block ids against (the first ``run()`` of a
            wrapper that knew none teaches it this cache's count); out: int32 ``[B*Q, H, 16]``.
        Buffers edited after ``plan()`` never make a kernel read outside the cache or the
        block-table row (SPEC 10): seq_lens are clamped to the width W * 128 and block ids
        into ``[0, num_blocks)`` (Triton); the reference clamps seq_lens alike and raises
        ``ValueError`` for block ids outside the cache.
        Returns:
            ``out``.
        Raises:
            RuntimeError: ``run()`` before ``plan()``, or the reference backend under capture.
            ValueError: shapes, dtypes, devices (metadata only, no sync); an ``out`` whose
            memory overlaps ``index_q``, the cache or the wrapper's buffers; a cache with
            fewer blocks than the plan checked against, or with none (Triton); block ids
            outside the cache (reference, which syncs).
        """
        rows = self._planned_rows()
        v.check_run(index_q, cache, out, rows, self.num_heads, self.block_table, self.seq_lens,
                    self.score_buffer)
        n_cache = cache.shape[0]
        if self.num_blocks is not None and n_cache < self.num_blocks:
            v.fail("cache", f"at least {self.num_blocks} blocks (plan() checked block ids "
                   f"against {self.num_blocks})", f"{n_cache} blocks")
        if self.num_blocks is None:
            self.num_blocks = n_cache  # later plans check block ids against this cache
        if rows == 0:
            return out
        if self.block_table.shape[1] == 0:  # every request is padding (SPEC 5)
            return self._padding_rows(out)
        if self.backend == "triton":
            if n_cache == 0:  # the kernels clamp block ids into [0, num_blocks): none exists
                v.fail("cache", "at least 1 block (backend 'triton')", "0 blocks")
            self._runner.run(index_q, cache, self.block_table, self.seq_lens, out)
            return out
        self._check_not_capturing()
        # as the kernels: seq_lens clamped to the block-table width (buffers edited after plan)
        seq_lens = self.seq_lens.clamp(0, self.block_table.shape[1] * PAGE_SIZE)
        v.check_block_table_values(self.block_table, history_pages(seq_lens), n_cache,
                                   name="block_table_buffer")
        out.copy_(ref.decode_indexer(index_q, cache, self.block_table, seq_lens,
                                     self.query_len))
        return out


def _runner_config(allow_fp8_mma: bool, device: torch.device, backend: str):
    """A decode wrapper's Triton ``DecodeConfig``: ``dot="fp8"`` when ``allow_fp8_mma`` on a
    CUDA device with the Triton backend, else None (the defaults)."""
    if not allow_fp8_mma or device.type != "cuda" or backend != "triton":
        return None
    kernels = triton_backend()
    from .triton.device import portable_default
    if portable_default(device):  # the interpreter: exact fp32 only
        return None
    return kernels.DecodeConfig(dot="fp8")


def _prefill_config(allow_fp8_mma: bool, device: torch.device):
    """``prefill_indexer``'s Triton ``PrefillConfig``: ``triton.prefill.fp8_config`` (``dot=
    "fp8"`` when ``allow_fp8_mma`` where the Gluon prefill kernel's FP8 form runs), else None."""
    if not allow_fp8_mma:
        return None
    return triton_backend().prefill.fp8_config(device, allow_fp8_mma)


def _check_score_buffer(buf, device, num_reqs: int, width: int, num_heads: int,
                        config=None) -> None:
    """A wrapper's ``score_buffer`` (SPEC 6, 10): a contiguous 1-d float32 tensor on
    ``device``, 8-byte aligned, no smaller than the least any query length needs (the exact
    size, which depends on Q, is checked at the first Triton ``plan()``)."""
    v.check_tensor("score_buffer", buf, dtypes=(torch.float32,), ndim=1, device=device,
                   contiguous=True)
    if buf.data_ptr() % 8:
        v.fail("score_buffer", "an 8-byte aligned start", f"data_ptr {buf.data_ptr():#x}")
    if num_reqs == 0 or width == 0:
        return  # no runner: nothing is scored
    try:
        kernels = triton_backend()
    except ModuleNotFoundError as e:  # no Triton: the size only matters to its backend
        if e.name != "triton":
            raise
        return
    sizes = [kernels.score_buffer_size(num_reqs, width, num_heads, q,
                                       num_sms=kernels.device.num_sms(device), config=config,
                                       device=device)
             for q in range(1, 9) if q * num_heads <= kernels.decode.dispatch.MAX_ROWS]
    if sizes and buf.numel() < min(sizes):
        v.fail("score_buffer", f"at least {min(sizes)} float32 elements "
               "(nvfp4_indexer.triton.score_buffer_size)", f"{buf.numel()}")
