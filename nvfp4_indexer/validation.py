"""Input checks shared by every backend (SPEC 10).

Every check raises before anything is written, with a message that names the argument, what
was expected and what was given. ``check_*`` helpers on tensor metadata never sync; the
``check_*_values`` helpers read device values and so belong to eager calls and ``plan()``.
"""

from __future__ import annotations

import numbers
import os

import numpy as np
import torch

from .constants import (HEAD_DIM, MAX_QUERY_LEN, NUM_GROUPS, PAGE_BYTES, PAGE_SIZE, TOKEN_BYTES,
                        TOPK)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("auto", "reference", "triton")


def is_int(x) -> bool:
    """An integer argument: Python or numpy integers, never bool (SPEC 11)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def check_int(name: str, x, *, lo: int | None = None, hi: int | None = None,
              choices=None, optional: bool = False) -> int | None:
    """``int(x)`` for a Python or numpy integer (never bool) in ``[lo, hi]`` / in ``choices``
    (SPEC 11); ``None`` passes through when ``optional``. One check for the API and the Triton
    launchers, so both accept the same integers.

    Raises:
        ValueError: naming ``name``, what was expected and what was given.
    """
    if optional and x is None:
        return None
    ok = is_int(x) and (lo is None or x >= lo) and (hi is None or x <= hi) \
        and (choices is None or int(x) in choices)
    if not ok:
        if choices is not None:
            want = f"one of {tuple(choices)}"
        elif lo is not None and hi is not None:
            want = f"an int in {lo}..{hi}"
        elif lo is not None:
            want = f"an int >= {lo}"
        elif hi is not None:
            want = f"an int <= {hi}"
        else:
            want = "an int"
        fail(name, ("None or " if optional else "") + want, repr(x))
    return int(x)


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def fail_first(name: str, bad: torch.Tensor, expected: str, got) -> None:
    """``fail(name, expected, got(i))`` for the first index i where the 1-d bool tensor
    ``bad`` is True; nothing when none is. Syncs."""
    if bool(bad.any()):
        fail(name, expected, got(int(bad.nonzero()[0, 0])))


def check_tensor(name: str, t, *, dtypes=None, ndim=None, shape=None, device=None,
                 contiguous: bool = False) -> None:
    """Type, dtype, rank, shape (None entries are free), device and contiguity of ``t``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":  # no data: nothing to read or write (SPEC 10)
        fail(name, "a tensor with data (CPU or CUDA)", "a tensor on the meta device")
    if dtypes is not None and t.dtype not in dtypes:
        fail(name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        fail(name, f"a {ndim}-d tensor" + (f" of shape {_shape_str(shape)}" if shape else ""),
             f"shape {tuple(t.shape)}")
    if shape is not None:
        for want, have in zip(shape, t.shape):
            if want is not None and want != have:
                fail(name, f"shape {_shape_str(shape)}", f"shape {tuple(t.shape)}")
    if device is not None and not on_device(t, device):
        fail(name, f"a tensor on {device} (like the other inputs)", f"device {t.device}")
    if contiguous and not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")


def on_device(t: torch.Tensor, device) -> bool:
    """Whether ``t`` is where ``torch.empty(0, device=device)`` would put it (SPEC 10): the
    device type, and the index only where ``device`` names one ("cpu" and "cpu:0" are one
    device; "cuda" is the current CUDA device). Reads metadata only."""
    want = device if isinstance(device, torch.device) else torch.device(device)
    have = t.device
    if have == want:
        return True
    if have.type != want.type:
        return False
    if want.type == "cpu":
        return True
    return want.index is None and (want.type != "cuda" or
                                   have.index == torch.cuda.current_device())


def check_device(name: str, device) -> torch.device:
    """The device ``torch.empty(0, device=device)`` would use (``None``: torch's default
    device): "cpu:0" is "cpu", "cuda" the current CUDA device (SPEC 10).

    Raises:
        ValueError: naming ``name``: not a device, or a device that does not exist (no CUDA,
        an index past the CUDA device count).
    """
    try:
        dev = torch.get_default_device() if device is None else \
            device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        fail(name, "a torch device such as 'cpu', 'cuda' or 'cuda:0'", repr(device))
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            fail(name, "a device that exists (no CUDA device is available)", repr(device))
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= count:
            fail(name, f"a device that exists (cuda:0 .. cuda:{count - 1})", repr(device))
        return torch.device("cuda", index)
    try:
        return torch.empty(0, device=dev).device
    except (RuntimeError, AssertionError) as e:
        fail(name, "a device that exists", f"{device!r} ({_first_line(e)})")


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes (CUDA: the card's; CPU: physical RAM), or None
    when it is not known."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


_MAX_BYTES = 2 ** 63 - 1  # torch sizes are int64


def check_fits(name: str, nbytes: int, device: torch.device, asked: str) -> None:
    """Refuse an allocation of ``nbytes`` (``asked`` says who asked, e.g. "num_blocks=8 x
    page_stride=9216") that no tensor on ``device`` can hold: past int64 or past the device's
    total memory (SPEC 10).

    Raises:
        ValueError: naming ``name``, the bytes asked for and the device's memory.
    """
    cap = device_memory_bytes(device)
    if nbytes > _MAX_BYTES or (cap is not None and nbytes > cap):
        limit = f"{device}'s {cap} bytes" if cap is not None and cap <= _MAX_BYTES \
            else f"{_MAX_BYTES} bytes (int64)"
        fail(name, f"a size that fits {limit}", f"{nbytes} bytes ({asked})")


def allocate(name: str, nbytes: int, device: torch.device, asked: str, make):
    """``make()`` (an allocation of ``nbytes`` on ``device``) after ``check_fits``; an
    allocator failure becomes a ValueError naming ``name`` and the bytes asked (SPEC 10)."""
    check_fits(name, nbytes, device, asked)
    try:
        return make()
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        fail(name, f"a size {device} can allocate", f"{nbytes} bytes ({asked}): "
             f"{_first_line(e)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, end)`` addresses of the bytes ``t``'s elements occupy (strides are never
    negative in torch); ``(0, 0)`` for an empty tensor."""
    if t.is_contiguous():  # the common case, without walking shape and strides (host time)
        n = t.nbytes
        if n == 0:
            return 0, 0
        lo = t.data_ptr()
        return lo, lo + n
    if t.numel() == 0:
        return 0, 0
    lo = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of ``a`` and ``b`` (``byte_span``, same device) intersect: a
    conservative test (two interleaved strided views count as overlapping)."""
    if a.device != b.device:
        return False
    a0, a1 = byte_span(a)
    b0, b1 = byte_span(b)
    return a0 < b1 and b0 < a1 and a0 < a1 and b0 < b1


def check_no_overlap(out_name: str, out: torch.Tensor, inputs) -> None:
    """An output (``out=``, the cache of a write, a buffer a call writes) whose memory overlaps
    none of ``inputs``: ``(name, x)`` pairs, x a tensor, None, or a ``byte_span`` on ``out``'s
    device (SPEC 10). Metadata only (no sync).

    Raises:
        ValueError: naming ``out_name`` and the input it overlaps.
    """
    lo, hi = byte_span(out)
    if lo == hi:
        return
    for name, t in inputs:
        if isinstance(t, tuple):
            a, b = t
        elif t is None or t.device != out.device:
            continue
        else:
            a, b = byte_span(t)
        if a < hi and lo < b:
            fail(out_name, f"memory that overlaps no input (it is written while {name} is "
                 "read)", f"bytes [{lo:#x}, {hi:#x}) overlapping {name}'s [{a:#x}, {b:#x})")


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements in the same order: data pointer, shape, strides, dtype and device
    (not only the same first address)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def copy_planned(pairs, non_blocking: bool = False) -> None:
    """A ``plan()``'s copies of validated metadata into persistent buffers: each
    ``(source, buffer)`` is copied unless the source is that buffer itself (``same_tensor``);
    a source whose memory overlaps any of the buffers is cloned first, so each buffer ends up
    holding exactly what ``plan()`` validated."""
    pairs = [(s, d) for s, d in pairs if not same_tensor(s, d)]
    bufs = [d for _, d in pairs]
    for s, d in [(s.clone() if any(overlaps(s, b) for b in bufs) else s, d) for s, d in pairs]:
        d.copy_(s, non_blocking=non_blocking)


def _shape_str(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_cache(cache) -> None:
    """The paged index-K cache: ``uint8 [num_blocks, 128, 72]`` with strides (S, 72, 1),
    S >= 9216 and a multiple of 16 (SPEC 2)."""
    check_tensor("cache", cache, dtypes=(torch.uint8,), shape=(None, PAGE_SIZE, TOKEN_BYTES))
    s = cache.stride()
    if cache.shape[0] > 0 and (s[1] != TOKEN_BYTES or s[2] != 1 or s[0] < PAGE_BYTES
                               or s[0] % 16 != 0):
        fail("cache", f"strides (S, {TOKEN_BYTES}, 1) with page stride S >= {PAGE_BYTES} and a "
             "multiple of 16", f"strides {s}")


def check_backend(backend: str, device: torch.device) -> str:
    """Resolve ``backend`` for tensors on ``device``: "auto" is Triton on CUDA, else reference."""
    if backend not in BACKENDS:
        fail("backend", " or ".join(repr(b) for b in BACKENDS), repr(backend))
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if backend == "triton" and device.type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        fail("backend", "'triton' with CUDA tensors (or TRITON_INTERPRET=1 set before import, "
             "for Triton's CPU interpreter)", f"'triton' with tensors on {device}")
    return backend


def check_topk(topk: int, backend: str) -> int:
    """K >= 2, and 16 off the reference (SPEC 5); returns it as a Python int."""
    topk = check_int("topk", topk, lo=2)
    if topk != TOPK and backend != "reference":
        raise NotImplementedError(f"topk: backend {backend!r} supports topk={TOPK}, got {topk} "
                                  "(the reference supports any topk >= 2)")
    return topk


def check_query_len(query_len) -> int:
    """Q in 1..8 (SPEC 6); returns it as a Python int."""
    return check_int("query_len", query_len, lo=1, hi=MAX_QUERY_LEN)


def check_index_q(index_q, rows=None, num_heads=None, device=None) -> None:
    check_tensor("index_q", index_q, dtypes=(torch.float8_e4m3fn,),
                 shape=(rows, num_heads, HEAD_DIM), device=device)
    if index_q.shape[1] < 1:
        fail("index_q", "at least one index head ([T, H >= 1, 128])",
             f"shape {tuple(index_q.shape)}")
    if index_q.stride(-1) != 1:
        fail("index_q", "unit stride in the last dim", f"strides {index_q.stride()}")


def check_out(out, rows: int, num_heads: int, topk: int, device) -> None:
    check_tensor("out", out, dtypes=(torch.int32,), shape=(rows, num_heads, topk), device=device,
                 contiguous=True)


def check_run(index_q, cache, out, rows: int, num_heads: int, block_table_buffer,
              seq_lens_buffer, score_buffer=None) -> None:
    """A decode wrapper's ``run()`` inputs (SPEC 6, 10; metadata only, no sync): the cache and
    ``index_q [rows, num_heads, 128]`` on the buffers' device, a contiguous int32 ``out
    [rows, num_heads, 16]`` whose memory overlaps none of them, the buffers nor
    ``score_buffer``."""
    dev = block_table_buffer.device
    check_cache(cache)
    check_tensor("cache", cache, device=dev)
    check_index_q(index_q, rows=rows, num_heads=num_heads, device=dev)
    check_out(out, rows, num_heads, TOPK, dev)
    check_no_overlap("out", out, (("index_q", index_q), ("cache", cache),
                                  ("block_table_buffer", block_table_buffer),
                                  ("seq_lens_buffer", seq_lens_buffer),
                                  ("score_buffer", score_buffer)))


def check_norm_inputs(x_name, x, positions, weight, weight_name, cos_sin_cache, rotary_dim,
                      eps, device) -> None:
    """Shared checks of the fused norm + RoPE inputs (SPEC 3)."""
    t = x.shape[0]
    check_tensor("positions", positions, dtypes=INT_DTYPES, shape=(t,), device=device)
    check_tensor(weight_name, weight, dtypes=FLOAT_DTYPES + (torch.float64,), shape=(HEAD_DIM,),
                 device=device)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=FLOAT_DTYPES + (torch.float64,), ndim=2,
                 device=device)
    if not is_int(rotary_dim) or rotary_dim <= 0 or rotary_dim % 2 \
            or rotary_dim > HEAD_DIM:
        fail("rotary_dim", f"an even int in 2..{HEAD_DIM}", repr(rotary_dim))
    if cos_sin_cache.shape[1] != rotary_dim:
        fail("cos_sin_cache", f"shape [max_position, {rotary_dim}] (rotary_dim)",
             f"shape {tuple(cos_sin_cache.shape)}")
    check_eps(eps)
    if t and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            fail("positions", f"values in [0, {cos_sin_cache.shape[0]}) (cos_sin_cache rows)",
                 f"values in [{lo}, {hi}]")


def check_eps(eps) -> float:
    """The norm eps (SPEC 3): a real number, rounded to fp32 first, finite and > 0 after that
    rounding (1e-300 and 1e-46 round to 0, 1e39 to inf). Returns ``float(eps)``.

    Raises:
        ValueError: naming ``eps``, with its fp32 rounding.
    """
    if not isinstance(eps, numbers.Real) or isinstance(eps, (bool, np.bool_)):
        fail("eps", "a real number, finite and > 0 in fp32", repr(eps))
    try:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            e32 = float(np.float32(float(eps)))
    except OverflowError:  # a Fraction / int past float64
        e32 = float("inf")
    if not (e32 > 0 and np.isfinite(e32)):
        fail("eps", "a real number that is finite and > 0 after rounding to fp32 (SPEC 3)",
             f"{eps!r} (fp32: {e32!r})")
    return float(eps)


def check_plan_buffers(block_table_buffer, seq_lens_buffer) -> torch.device:
    """A decode wrapper's persistent buffers (SPEC 6): contiguous int32 ``block_table_buffer
    [B, W]`` and ``seq_lens_buffer [B]`` on one device, not overlapping (``plan()`` writes
    both). Returns their device."""
    check_tensor("block_table_buffer", block_table_buffer, dtypes=(torch.int32,), ndim=2,
                 contiguous=True)
    dev = block_table_buffer.device
    check_tensor("seq_lens_buffer", seq_lens_buffer, dtypes=(torch.int32,),
                 shape=(block_table_buffer.shape[0],), device=dev, contiguous=True)
    check_no_overlap("seq_lens_buffer", seq_lens_buffer,
                     (("block_table_buffer", block_table_buffer),))
    return dev


def check_slot_mapping_values(slot_mapping, num_blocks: int) -> None:
    """Slots inside the cache, no duplicate non-negative slot (SPEC 2, 10). Syncs."""
    valid = slot_mapping[slot_mapping >= 0]
    if valid.numel() == 0:
        return
    hi = int(valid.max())
    if hi >= num_blocks * PAGE_SIZE:
        fail("slot_mapping", f"slots < num_blocks * 128 = {num_blocks * PAGE_SIZE} (cache too "
             "small)", f"slot {hi}")
    if torch.unique(valid).numel() != valid.numel():
        u, counts = torch.unique(valid, return_counts=True)
        fail("slot_mapping", "distinct non-negative slots", f"slot {int(u[counts > 1][0])} "
             f"{int(counts.max())} times")


def check_block_table_values(block_table, pages_read, num_blocks: int | None,
                             name: str = "block_table") -> None:
    """Block ids a request reads (entries below ``pages_read[r]``) inside the cache (>= 0 only
    when ``num_blocks`` is None: the caller cannot see the cache). Syncs."""
    if block_table.numel() == 0:
        return
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    read = cols[None, :] < pages_read.to(block_table.device)[:, None]
    ids = block_table[read]
    if not ids.numel():
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (num_blocks is not None and hi >= num_blocks):
        want = "block ids >= 0" if num_blocks is None else \
            f"block ids in [0, {num_blocks}) (cache blocks)"
        fail(name, f"{want} for every page a request reads", f"ids in [{lo}, {hi}]")


def check_block_table(block_table, seq_lens, num_blocks: int | None) -> None:
    """Block table wide enough for every request (ceil(seq_len / 128) columns) and the block
    ids a request reads inside the cache (SPEC 2, 10). Syncs."""
    from .reference.paging import history_pages  # local import: no cycle at module load
    s = seq_lens.to(torch.long)
    width = block_table.shape[1]
    too_long = s > width * PAGE_SIZE
    if bool(too_long.any()):
        r = int(too_long.nonzero()[0, 0])
        fail("block_table", f"at least ceil(seq_len / 128) columns for every request "
             f"(block table narrower than request {r} needs)",
             f"width {width} for seq_lens[{r}]={int(s[r])}")
    check_block_table_values(block_table, history_pages(s), num_blocks)


def check_decode_values(block_table, seq_lens, query_len: int, num_blocks: int | None) -> None:
    """SPEC 6 ranges: Q <= seq_len <= width * 128 or seq_len == 0; block ids in the cache."""
    s = seq_lens.to(torch.long)
    fail_first("seq_lens", ((s != 0) & (s < query_len)) | (s < 0),
               f"0 (padding) or >= query_len={query_len} for every request",
               lambda b: f"seq_lens[{b}]={int(s[b])}")
    check_block_table(block_table, seq_lens, num_blocks)


def check_decode_plan(buffer: torch.Tensor, block_table, seq_lens, query_len: int,
                      planned_query_len: int | None, num_blocks: int | None) -> None:
    """A decode wrapper's ``plan()`` metadata against its persistent ``block_table`` buffer
    ``[B, W]`` (SPEC 6, 10): Q fixed once planned, int32 ``block_table [B, W' <= W]`` and
    ``seq_lens [B]`` on the buffer's device, then the value ranges (syncs)."""
    dev = buffer.device
    b, w = buffer.shape
    if planned_query_len is not None and query_len != planned_query_len:
        fail("query_len", f"{planned_query_len} (one wrapper per query length)", query_len)
    check_tensor("block_table", block_table, dtypes=(torch.int32,), shape=(b, None), device=dev)
    if block_table.shape[1] > w:
        fail("block_table", f"at most {w} columns (block_table_buffer width)",
             f"shape {tuple(block_table.shape)}")
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(b,), device=dev)
    # against the width the caller gave (columns past it are never read)
    check_decode_values(block_table, seq_lens, query_len, num_blocks)


def check_prefill_values(block_table, cu_seqlens_q, seq_lens, num_rows: int,
                         num_blocks: int) -> None:
    """SPEC 7: cu_seqlens_q from 0 to Tp, increasing (q_len >= 1); q_len <= seq_len per
    request; block table wide enough; block ids in the cache."""
    q_lens = check_offsets("cu_seqlens_q", cu_seqlens_q, num_rows, min_len=1)
    check_q_lens_fit(q_lens, seq_lens, "cu_seqlens_q")
    check_block_table(block_table, seq_lens, num_blocks)


def check_offsets(name: str, offsets, num_rows: int, min_len: int):
    """Row offsets ``[R+1]`` (``cu_seqlens_q`` / ``query_start_loc``): first 0, last
    ``num_rows``, each request's length ``offsets[r+1] - offsets[r] >= min_len``. Returns the
    lengths (int64, host). Syncs."""
    qsl = offsets.to(torch.long).cpu()
    if int(qsl[0]) != 0 or int(qsl[-1]) != num_rows:
        fail(name, f"first 0 and last {num_rows} (index_q rows)",
             f"first {int(qsl[0])}, last {int(qsl[-1])}")
    q_lens = qsl[1:] - qsl[:-1]
    bad = q_lens < min_len
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        want = "non-decreasing offsets" if min_len == 0 else \
            f"increasing offsets (q_len = {name}[r+1] - {name}[r] >= {min_len} per request)"
        fail(name, want, f"{name}[{r}]={int(qsl[r])}, {name}[{r + 1}]={int(qsl[r + 1])} "
             f"(q_len {int(q_lens[r])} for request {r})")
    return q_lens


def check_q_lens_fit(q_lens, seq_lens, offsets_name: str, padding: bool = False) -> None:
    """q_len <= seq_len and seq_len >= 0 for every request (SPEC 4, 7); with ``padding``, a
    request of seq_len 0 may have rows (SPEC 5's padding rows). Syncs."""
    s = seq_lens.to(torch.long).cpu()
    fail_first("seq_lens", ((q_lens > s) & ((s != 0) if padding else True)) | (s < 0),
               f"0 <= q_len <= seq_len for every request (q_len from {offsets_name})",
               lambda r: f"q_len={int(q_lens[r])}, seq_len={int(s[r])} for request {r}")


def check_scales_codes(codes, scales) -> None:
    check_tensor("codes", codes, dtypes=(torch.uint8,))
    check_tensor("scales", scales, dtypes=(torch.float8_e4m3fn, torch.uint8), device=codes.device)
    if codes.dim() < 1 or codes.shape[-1] != HEAD_DIM // 2:
        fail("codes", f"shape [..., {HEAD_DIM // 2}]", f"shape {tuple(codes.shape)}")
    if tuple(scales.shape) != tuple(codes.shape[:-1]) + (NUM_GROUPS,):
        fail("scales", f"shape {list(codes.shape[:-1]) + [NUM_GROUPS]} (codes' leading dims, 8)",
             f"shape {tuple(scales.shape)}")
