"""The benchmark suites: build inputs, check the outputs once, time, and record one dict per
case (the JSON schema is documented in docs/benchmarks.md).

Paths timed (GPU):
- decode-full / decode-lowlat / decode-variants: the public ``DecodeIndexerWrapper``
  (``plan()`` outside, ``run()`` captured in CUDA graphs), one wrapper per rotation slot.
- prefill: the Triton entry point the public API dispatches to
  (``nvfp4_indexer.triton.prefill.prefill_indexer``), timed eagerly with an L2 flush before
  each call (it plans on the host from device values, so it cannot be captured); the public
  API call (validation included) is timed too (``api_us``).
- gather: the kernel launcher ``nvfp4_indexer.triton.gather.gather_into`` captured in CUDA
  graphs over rotated block tables, each slot with its own workspace; the public
  ``gather_index_k_fp8`` (which sizes the workspace with a host sync) eagerly (``api_us``).
- insert: ``nvfp4_indexer.triton.insert.insert_index_k`` captured in CUDA graphs over rotated
  inputs (eager + flush if capture fails), plus the public API call (``api_us``).
- the PyTorch reference (``backend="reference"``) on the same GPU and inputs, for cases under
  the reference caps, wall clock with a sync (``ref_us``, ``speedup`` = ref_us / us).
In ``--cpu-smoke`` every fast path is the reference backend on tiny inputs.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import PAGE_SIZE, TOPK
from nvfp4_indexer.reference.paging import read_blocks

from . import workloads as wl
from .pool import PagePool, random_index_q, random_keys
from .timing import (L2Flush, Timing, mix_ceiling_gbps, rotation_slots, sync, time_eager,
                     time_graph, time_host)

POISON = -7  # never a valid output value (outputs are >= -1)

# Issue 6 targets, reported next to the measurements (the tool measures; it does not gate).
TARGET_DECODE_WEIGHTED = 0.85
TARGET_DECODE_BIG_CASE = 0.75
TARGET_LOWLAT_US = 6.0
TARGET_LOWLAT_CASE = "b1_s32000_q8_h4"
TARGET_PREFILL_MATMUL = 0.50
TARGET_COPY_GATHER_INSERT = 0.80

# The parts of workloads.Traffic.parts that a gather / insert call writes; every other part is
# read. Traffic keeps no read / write split, so the split is derived here from the part names
# (gather: the FP8 workspace; insert: the 72 B per token written into the pages).
WRITTEN_PARTS = {"gather": ("workspace",), "insert": ("writes",)}


@dataclass
class Context:
    """Everything a suite needs: device, mode, protocol, ceilings, pool and the sinks."""

    device: torch.device
    smoke: bool
    fast_backend: str  # "triton" (GPU) or "reference" (CPU smoke)
    l2_bytes: int
    graph_calls: int
    warmup: int
    replays: int
    deadline: float  # time.monotonic() past which cases are skipped
    reference: bool = True
    ref_max_pages_bytes: int = 64_000_000
    ref_max_flops: float = 2.5e12
    copy_gbps: float | None = None
    matmul_tflops: float | None = None  # FP8 _scaled_mm ceiling
    mm16_tflops: float | None = None  # 16-bit (fp16 / bf16) matmul ceiling
    read_gbps: float | None = None  # read-only DRAM ceiling (stream_ceilings)
    write_gbps: float | None = None  # write-only DRAM ceiling
    pool: PagePool | None = None
    flush: L2Flush | None = None
    seed: int = 0
    log: Callable[[str], None] = print
    on_case: Callable[[str, list], None] = lambda suite, recs: None
    cuda_broken: bool = False
    errors: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def gen(self, name: str) -> torch.Generator:
        """A device generator seeded from the case name (same inputs on every run)."""
        seed = self.seed * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name))
        return torch.Generator(device=self.device).manual_seed(seed)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def ref_allowed(self, pages_bytes: int, flops: float = 0.0) -> str | None:
        """None when the reference may be timed on this case, else why not."""
        if not self.reference:
            return "reference timing off (--no-reference)"
        if pages_bytes > self.ref_max_pages_bytes:
            return f"pages > {self.ref_max_pages_bytes / 1e6:.0f} MB (reference cap)"
        if flops > self.ref_max_flops:
            return f"flops > {self.ref_max_flops:.1e} (reference cap)"
        if self.time_left() < 30:
            return "time budget"
        return None

    def check_cuda(self) -> None:
        """After an error: is the CUDA context still usable? (Sticky errors end GPU work.)"""
        if not self.cuda:
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001
            self.cuda_broken = True
            self.log(f"CUDA context unusable after an error ({type(e).__name__}: {e}); "
                     "remaining GPU cases are skipped")

    # -- timing helpers -----------------------------------------------------------------------

    def _cpu_eager(self, calls: list[Callable]):
        # CPU smoke: the reference is slow on CPU; one call proves the path, no claims
        return time_eager(calls, self.device, warmup=0, max_samples=1, min_samples=1)

    def time_capturable(self, calls: list[Callable]) -> Timing:
        """Graph replay timing on CUDA (eager + flush if capture fails); eager on CPU."""
        if not self.cuda:
            return self._cpu_eager(calls)
        try:
            return time_graph(calls, self.device, graph_calls=self.graph_calls,
                              warmup=self.warmup, replays=self.replays)
        except Exception as e:  # noqa: BLE001 - fall back, but say so
            self.check_cuda()
            if self.cuda_broken:
                raise
            t = self.time_uncapturable(calls)
            t.note = f"graph capture failed ({type(e).__name__}: {str(e)[:160]})"
            return t

    def time_uncapturable(self, calls: list[Callable], max_samples: int = 20) -> Timing:
        if not self.cuda:
            return self._cpu_eager(calls)
        return time_eager(calls, self.device, flush=self.flush, warmup=2,
                          max_samples=max_samples, min_samples=5)


# ---------------------------------------------------------------------------------------------
# Per-case records

def _gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def written_bytes(suite: str, parts: dict) -> int:
    """Bytes a ``suite`` ("gather" / "insert") call writes: the sum of its ``WRITTEN_PARTS``
    of ``Traffic.parts`` (bytes); the rest of ``bytes_moved`` is read.

    Raises:
        KeyError: a written part missing from ``parts`` (the traffic model was renamed).
    """
    return sum(parts[k] for k in WRITTEN_PARTS[suite])


def _finish(ctx: Context, rec: dict, t, nbytes: int, flops: int,
            bytes_written: int | None = None) -> dict:
    """Timing, GB/s, TFLOP/s and the ratios to the ceilings. ``bytes_written`` (of
    ``nbytes``; gather / insert) adds the read / write split and the mix ceiling."""
    rec["us"] = t.us
    rec["timing"] = t.as_dict()
    rec["gbps"] = _gbps(nbytes, t.us)
    rec["copy_ratio"] = rec["gbps"] / ctx.copy_gbps if ctx.copy_gbps else None
    rec["tflops"] = flops / (t.us * 1e-6) / 1e12 if flops else 0.0
    rec["matmul_ratio"] = (rec["tflops"] / ctx.matmul_tflops
                           if flops and ctx.matmul_tflops else None)
    rec["mm16_ratio"] = rec["tflops"] / ctx.mm16_tflops if flops and ctx.mm16_tflops else None
    if bytes_written is not None:
        rec["bytes_read"], rec["bytes_written"] = nbytes - bytes_written, bytes_written
        mix = (mix_ceiling_gbps(nbytes - bytes_written, bytes_written, ctx.read_gbps,
                                ctx.write_gbps) if ctx.read_gbps and ctx.write_gbps else None)
        rec["mix_ceiling_gbps"] = mix
        rec["mix_ratio"] = rec["gbps"] / mix if mix else None
    if rec.get("ref_us"):
        rec["speedup"] = rec["ref_us"] / t.us
    return rec


def _traffic_fields(tr: wl.Traffic) -> dict:
    return {"history_pages": tr.history_pages, "pages_bytes": tr.pages_bytes,
            "bytes_moved": tr.bytes_moved, "bytes_parts": tr.parts, "flops": tr.flops,
            "intensity_flop_per_byte": tr.flops / tr.bytes_moved if tr.bytes_moved else 0.0}


def _ref_time(ctx: Context, rec: dict, fn: Callable[[], object], est_flops: float = 0.0,
              single: bool = False):
    """Time the PyTorch reference on the case's inputs and return its result (for the
    comparison). Light cases: median of 3 after a warm-up; heavy ones, the CPU smoke and
    ``single``: one call."""
    holder = {}

    def call():
        holder["out"] = fn()
    light = est_flops <= 2e11 and not ctx.smoke and not single
    t = time_host(call, ctx.device, warmup=1 if light else 0, repeats=3 if light else 1,
                  max_seconds=3.0)
    rec["ref_us"] = t.us
    rec["ref_timing"] = t.as_dict()
    return holder["out"]


def _shared_score_buffer(ctx: Context, b: int, width: int, h: int, q_len: int):
    """One float32 scratch shared by a case's wrappers (they never run at once), sized by
    ``nvfp4_indexer.triton.decode.score_buffer_size``; None for the reference backend or
    when the runner needs none."""
    if ctx.fast_backend != "triton":
        return None
    from nvfp4_indexer.triton.decode import score_buffer_size
    n = score_buffer_size(b, width, h, q_len)
    return torch.empty(n, dtype=torch.float32, device=ctx.device) if n else None


def decode_case(ctx: Context, case: wl.DecodeCase) -> dict:
    dev, cache = ctx.device, ctx.pool.cache
    sl = case.seq_lens()
    b, q_len, h = case.batch, case.query_len, case.num_heads
    tr = wl.decode_traffic(sl, q_len, h)
    need = sum(wl.pages_needed(s) for s in sl)
    width = max(wl.pages_needed(s) for s in sl)
    slots = rotation_slots(tr.pages_bytes, ctx.l2_bytes, ctx.graph_calls,
                           max_slots=ctx.pool.num_pages // need)
    reuse = (slots - 1) * tr.pages_bytes
    rec = {"batch": b, "nominal": case.nominal, "query_len": q_len, "num_heads": h,
           "weight": case.weight, "seq_len_min": min(sl), "seq_len_max": max(sl),
           "seq_len_mean": sum(sl) / len(sl), "width": width, **_traffic_fields(tr),
           "slots": slots, "reuse_bytes": reuse,
           "reuse_over_l2": reuse / ctx.l2_bytes if ctx.l2_bytes else None,
           "path": f"DecodeIndexerWrapper(backend={ctx.fast_backend!r}).run"}
    tables = ctx.pool.block_tables(sl, slots, width)
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    q = random_index_q(b * q_len, h, dev, ctx.gen(case.name))
    out = torch.full((b * q_len, h, TOPK), POISON, dtype=torch.int32, device=dev)
    sb = _shared_score_buffer(ctx, b, width, h, q_len)
    rec["shared_score_buffer_elems"] = None if sb is None else sb.numel()
    wrappers = []
    for bt in tables:
        w = ni.DecodeIndexerWrapper(h, block_table_buffer=bt, seq_lens_buffer=seq,
                                    use_cuda_graph=ctx.cuda, backend=ctx.fast_backend,
                                    score_buffer=sb)
        w.plan(bt, seq, q_len, num_blocks=ctx.pool.num_pages)
        wrappers.append(w)
    wrappers[0].run(q, cache, out)
    sync(dev)
    rec["out_fully_written"] = bool((out != POISON).all())
    out0 = out.clone()
    why = ctx.ref_allowed(tr.pages_bytes, tr.flops)
    if why is None:
        ref = _ref_time(ctx, rec, lambda: ni.decode_indexer(q, cache, tables[0], seq, q_len,
                                                            backend="reference"), tr.flops,
                        single=case.suite == "decode-variants")
        rec["rows_equal_reference"] = float((ref == out0).all(dim=-1).float().mean())
    else:
        rec["ref_skipped"] = why
    calls = [lambda w=w: w.run(q, cache, out) for w in wrappers]
    t = ctx.time_capturable(calls)
    if t.method == "cuda-graph":
        # the buffer now holds the graph's last call (always the last slot, see
        # timing.graph_sequence); an eager run of that slot must agree
        check = torch.full_like(out, POISON)
        wrappers[-1].run(q, cache, check)
        sync(dev)
        rec["graph_replay_equals_eager"] = bool(torch.equal(check, out))
    rec = _finish(ctx, rec, t, tr.bytes_moved, tr.flops)
    rec["flag_big_under_75"] = bool(case.suite == "decode-full"
                                    and tr.pages_bytes >= wl.FLAG_PAGES_BYTES
                                    and rec["copy_ratio"] is not None
                                    and rec["copy_ratio"] < TARGET_DECODE_BIG_CASE)
    return rec


def _prefill_inputs(ctx: Context, case: wl.PrefillCase, slots: int):
    dev = ctx.device
    sl = case.seq_lens()
    width = max(wl.pages_needed(s) for s in sl)
    tables = ctx.pool.block_tables(sl, slots, width)
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    cu = torch.tensor(case.cu_seqlens_q(), dtype=torch.int32, device=dev)
    return sl, width, tables, seq, cu


def prefill_case(ctx: Context, case: wl.PrefillCase) -> dict:
    dev, cache = ctx.device, ctx.pool.cache
    tr = wl.prefill_traffic(case)
    slots = 2  # eager timing flushes L2 before every call; two slots alternate page sets
    sl, width, tables, seq, cu = _prefill_inputs(ctx, case, slots)
    h, t_rows = case.num_heads, case.new_tokens
    q = random_index_q(t_rows, h, dev, ctx.gen(case.name))
    out = torch.full((t_rows, h, TOPK), POISON, dtype=torch.int32, device=dev)
    mgp = ni.max_gather_pages(width * PAGE_SIZE, t_rows)  # the API's default budget
    rec = {"new_tokens": case.new_tokens, "context": case.context, "num_reqs": case.num_reqs,
           "num_heads": h, "q_len": case.q_len, "seq_len": sl[0], "width": width,
           "max_gather_pages": mgp, **_traffic_fields(tr), "slots": slots}
    if ctx.fast_backend == "triton":
        from nvfp4_indexer.triton import prefill as tp
        rec["path"] = "nvfp4_indexer.triton.prefill.prefill_indexer"

        def fast(bt):
            tp.prefill_indexer(q, cache, bt, cu, seq, mgp, out)
    else:
        rec["path"] = "prefill_indexer(backend='reference')"

        def fast(bt):
            ni.prefill_indexer(q, cache, bt, cu, seq, max_gather_pages=mgp, out=out,
                               backend="reference")
    fast(tables[0])
    sync(dev)
    rec["out_fully_written"] = bool((out != POISON).all())
    out0 = out.clone()
    why = ctx.ref_allowed(tr.pages_bytes, tr.flops)
    if why is None:
        ref = _ref_time(ctx, rec, lambda: ni.prefill_indexer(
            q, cache, tables[0], cu, seq, max_gather_pages=mgp, backend="reference"), tr.flops)
        rec["rows_equal_reference"] = float((ref == out0).all(dim=-1).float().mean())
    else:
        rec["ref_skipped"] = why
    t = ctx.time_uncapturable([lambda bt=bt: fast(bt) for bt in tables])
    api = ctx.time_uncapturable([lambda bt=bt: ni.prefill_indexer(
        q, cache, bt, cu, seq, max_gather_pages=mgp, out=out, backend=ctx.fast_backend)
        for bt in tables], max_samples=5)
    rec["api_us"] = api.us
    return _finish(ctx, rec, t, tr.bytes_moved, tr.flops)


GATHER_WORKSPACE_CAP_BYTES = 8 << 30  # all rotation slots' FP8 workspaces together


def gather_slots(case: wl.PrefillCase, l2: int, graph_calls: int,
                 max_slots: int | None = None) -> int:
    """Rotation slots of a gather case: ``rotation_slots`` of its traffic, capped by the
    workspace memory cap and ``max_slots`` (the pool)."""
    ws_bytes = wl.gather_traffic(case).parts["workspace"]
    cap = max(1, GATHER_WORKSPACE_CAP_BYTES // max(1, ws_bytes))
    if max_slots is not None:
        cap = min(cap, max_slots)
    return rotation_slots(wl.gather_traffic(case).bytes_moved, l2, graph_calls, max_slots=cap)


def gather_case(ctx: Context, case: wl.PrefillCase) -> dict:
    """The gather of a prefill case's history pages into the FP8 workspace (SPEC 7): the
    kernel launcher ``gather_into`` in CUDA graphs over cold-cache rotation slots, each slot
    with its own block table, page counts, page offsets and preallocated workspace (no host
    sync, no allocation in the timed call); plus the public API's eager call (``api_us``,
    host sizing sync and allocation included)."""
    ws_cap_bytes = GATHER_WORKSPACE_CAP_BYTES
    dev, cache = ctx.device, ctx.pool.cache
    tr = wl.gather_traffic(case)
    pages = [wl.history_pages(s) for s in case.seq_lens()]
    total, max_pages = sum(pages), max(pages)
    ws_bytes = total * wl.WORKSPACE_PAGE_BYTES
    need = sum(wl.pages_needed(s) for s in case.seq_lens())
    caps = {"pool": ctx.pool.num_pages // need,
            "workspace_memory": max(1, ws_cap_bytes // max(1, ws_bytes))}
    slots = rotation_slots(tr.bytes_moved, ctx.l2_bytes, ctx.graph_calls,
                           max_slots=min(caps.values()))
    sl, width, tables, seq, _ = _prefill_inputs(ctx, case, slots)
    reuse = (slots - 1) * tr.bytes_moved
    rec = {"new_tokens": case.new_tokens, "context": case.context, "num_reqs": case.num_reqs,
           "seq_len": sl[0], "width": width, **_traffic_fields(tr), "slots": slots,
           "slot_caps": caps, "reuse_bytes": reuse,
           "reuse_over_l2": reuse / ctx.l2_bytes if ctx.l2_bytes else None,
           "workspace_pages": total, "workspace_bytes_all_slots": slots * ws_bytes}
    offsets_host = [0]
    for n in pages:
        offsets_host.append(offsets_host[-1] + n)
    # per slot: block table, page counts, page offsets (int32) and a workspace of its own
    counts = [torch.tensor(pages, dtype=torch.int32, device=dev) for _ in range(slots)]
    offsets = [torch.tensor(offsets_host, dtype=torch.int32, device=dev) for _ in range(slots)]
    wss = [torch.empty((total, PAGE_SIZE, wl.HEAD_DIM), dtype=torch.float8_e4m3fn,
                       device=dev) for _ in range(slots)]
    wss[0].view(torch.uint8).fill_(0x5A)  # poison: every byte must be written
    if ctx.fast_backend == "triton":
        from nvfp4_indexer.triton import gather as tg
        _, dequant, tok_block, num_warps, parts, streaming = tg.resolve_tuning(dev)
        rec["path"] = "nvfp4_indexer.triton.gather.gather_into"
        rec["tuning"] = {"dequant": dequant, "tok_block": tok_block, "num_warps": num_warps,
                         "page_parts": parts}

        def fast(i, out=None):
            tg.gather_into(cache, tables[i], counts[i], offsets[i],
                           wss[i] if out is None else out, max_pages, lengths_are_seq_lens=False)
    else:
        rec["path"] = "gather_index_k_fp8(backend='reference')"

        def fast(i, out=None):
            ws, _ = ni.gather_index_k_fp8(cache, tables[i], seq, backend="reference")
            (wss[i] if out is None else out).copy_(ws)
    fast(0)
    sync(dev)
    why = ctx.ref_allowed(tr.pages_bytes)
    if why is None:
        ref_ws, ref_off = _ref_time(ctx, rec, lambda: ni.gather_index_k_fp8(
            cache, tables[0], seq, backend="reference"))
        rec["equal_reference"] = bool(
            torch.equal(wss[0].view(torch.uint8), ref_ws.view(torch.uint8))
            and ref_off.cpu().tolist() == offsets_host)
        del ref_ws, ref_off
    else:
        rec["ref_skipped"] = why
    t = ctx.time_capturable([lambda i=i: fast(i) for i in range(slots)])
    if t.method == "cuda-graph":
        # the last slot's workspace holds the graphs' output; an eager run must agree
        check = torch.full_like(wss[-1].view(torch.uint8), 0x5A).view(torch.float8_e4m3fn)
        fast(slots - 1, check)
        sync(dev)
        rec["graph_replay_equals_eager"] = bool(torch.equal(check.view(torch.uint8),
                                                            wss[-1].view(torch.uint8)))
        del check
    wss.clear()  # free the workspaces before the API timing
    api = ctx.time_uncapturable([lambda bt=bt: ni.gather_index_k_fp8(
        cache, bt, seq, backend=ctx.fast_backend) for bt in tables], max_samples=5)
    rec["api_us"] = api.us
    rec["api_timing"] = api.as_dict()
    return _finish(ctx, rec, t, tr.bytes_moved, 0, written_bytes("gather", tr.parts))


def rope_cache(max_position: int, rotary_dim: int, device, dtype=torch.bfloat16):
    """NeoX cos/sin cache ``[max_position, rotary_dim]`` (cos half, then sin half), base 1e4."""
    inv_freq = 1e4 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(dtype).to(device)


def insert_inputs(ctx: Context, case: wl.InsertCase, slots: int):
    """An insert case's own page pool and, per rotation slot, ``(keys bf16, positions,
    distinct random slots)``; plus the norm weight and the cos/sin cache.
    Returns ``(pool, weight, cos_sin, inputs)``."""
    dev = ctx.device
    pool = PagePool(case.cache_pages, dev, seed=ctx.seed + 5, log=ctx.log)
    gen = ctx.gen(case.name)
    cpu_gen = torch.Generator().manual_seed(ctx.seed + 17)
    weight = (0.1 * torch.randn(128, device=dev, generator=gen)).float()
    cos_sin = rope_cache(case.max_position, case.rotary_dim, dev)
    inputs = []
    for _ in range(slots):
        k = random_keys(case.tokens, dev, gen, pool.channel_scale, torch.bfloat16)
        pos = torch.randint(0, case.max_position, (case.tokens,), device=dev, generator=gen)
        slot = torch.randperm(case.cache_tokens, generator=cpu_gen)[:case.tokens].to(dev)
        inputs.append((k, pos, slot))
    return pool, weight, cos_sin, inputs


def insert_case(ctx: Context, case: wl.InsertCase) -> dict:
    dev = ctx.device
    tr = wl.insert_traffic(case)
    slots = rotation_slots(tr.bytes_moved, ctx.l2_bytes, ctx.graph_calls)
    pool, weight, cos_sin, inputs = insert_inputs(ctx, case, slots)
    cache = pool.cache
    rec = {"tokens": case.tokens, "cache_tokens": case.cache_tokens,
           "rotary_dim": case.rotary_dim, **_traffic_fields(tr), "slots": slots,
           "reuse_bytes": (slots - 1) * tr.bytes_moved,
           "reuse_over_l2": (slots - 1) * tr.bytes_moved / ctx.l2_bytes if ctx.l2_bytes
           else None, "pool_fill_backend": pool.fill_backend}
    eps, rd = 1e-6, case.rotary_dim
    if ctx.fast_backend == "triton":
        from nvfp4_indexer.triton import insert as ti
        rec["path"] = "nvfp4_indexer.triton.insert.insert_index_k"

        def fast(k, pos, slot, c=cache):
            ti.insert_index_k(c, k, pos, slot, weight, cos_sin, rd, eps)
    else:
        rec["path"] = "insert_index_k(backend='reference')"

        def fast(k, pos, slot, c=cache):
            ni.insert_index_k(c, k, pos, slot, weight, cos_sin, rotary_dim=rd, eps=eps,
                              backend="reference")
    # correctness: the written 72 bytes per token against the reference, from equal caches
    k0, pos0, slot0 = inputs[0]
    ref_cache = cache.clone()
    fast(k0, pos0, slot0)
    sync(dev)
    why = ctx.ref_allowed(0)
    if why is None:
        _ref_time(ctx, rec, lambda: ni.insert_index_k(ref_cache, k0, pos0, slot0, weight,
                                                      cos_sin, rotary_dim=rd, eps=eps,
                                                      backend="reference"))
        blocks, offs = slot0 // PAGE_SIZE, slot0 % PAGE_SIZE
        got = read_blocks(cache, blocks)
        exp = read_blocks(ref_cache, blocks)
        ar = torch.arange(len(offs), device=dev)
        same = (got[0][ar, offs] == exp[0][ar, offs]).all(-1) & \
            (got[1][ar, offs].view(torch.uint8) == exp[1][ar, offs].view(torch.uint8)).all(-1)
        rec["tokens_equal_reference"] = float(same.float().mean())
    else:
        rec["ref_skipped"] = why
    t = ctx.time_capturable([lambda x=x: fast(*x) for x in inputs])
    api = ctx.time_uncapturable([lambda x=x: ni.insert_index_k(
        cache, x[0], x[1], x[2], weight, cos_sin, rotary_dim=rd, eps=eps,
        backend=ctx.fast_backend) for x in inputs], max_samples=5)
    rec["api_us"] = api.us
    return _finish(ctx, rec, t, tr.bytes_moved, 0, written_bytes("insert", tr.parts))


# ---------------------------------------------------------------------------------------------
# Suites

def _case_fields(case) -> dict:
    return {"name": case.name}


def run_suite(ctx: Context, suite: str, cases: list, fn: Callable) -> list[dict]:
    """Run ``fn(ctx, case)`` per case; errors and skips become records, never exceptions."""
    recs: list[dict] = []
    for i, case in enumerate(cases):
        base = {"suite": suite, **_case_fields(case)}
        if ctx.cuda_broken:
            recs.append({**base, "status": "skipped: CUDA context failed earlier"})
            continue
        if ctx.time_left() <= 0:
            recs.append({**base, "status": "skipped: time budget (--budget-s)"})
            continue
        t0 = time.monotonic()
        try:
            rec = {**base, **fn(ctx, case), "status": "ok"}
        except Exception as e:  # noqa: BLE001 - one broken case must not end the run
            ctx.errors += 1
            tb = traceback.format_exc(limit=6)
            rec = {**base, "status": "error", "error": f"{type(e).__name__}: {e}",
                   "traceback": tb}
            ctx.log(f"  ERROR {suite}/{case.name}: {type(e).__name__}: {str(e)[:300]}")
            ctx.check_cuda()
        rec["wall_s"] = round(time.monotonic() - t0, 3)
        recs.append(rec)
        ctx.log(f"  [{i + 1}/{len(cases)}] {suite}/{case.name}: {one_line(rec)}")
        ctx.on_case(suite, recs)
        if ctx.cuda:
            torch.cuda.empty_cache()
    return recs


def one_line(rec: dict) -> str:
    if rec.get("status") != "ok":
        return rec.get("status", "?")
    s = f"{rec['us']:.2f} us, {rec['gbps']:.0f} GB/s"
    if rec.get("copy_ratio") is not None:
        s += f" ({100 * rec['copy_ratio']:.0f}% copy"
        if rec.get("mix_ratio") is not None:
            s += f", {100 * rec['mix_ratio']:.0f}% mix"
        s += ")"
    if rec.get("tflops"):
        s += f", {rec['tflops']:.1f} TFLOP/s"
        if rec.get("matmul_ratio") is not None:
            s += f" ({100 * rec['matmul_ratio']:.0f}% fp8 mm"
            if rec.get("mm16_ratio") is not None:
                s += f", {100 * rec['mm16_ratio']:.0f}% 16-bit mm"
            s += ")"
    if rec.get("speedup"):
        s += f", {rec['speedup']:.1f}x vs reference"
    s += f" [{rec['timing']['method']}, {rec['wall_s']:.1f}s]"
    return s


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(suite: str, recs: list[dict], ctx: Context, expected: int) -> dict:
    """Suite-level numbers: weighted means, flags, target status, reference speedups."""
    ok = [r for r in recs if r.get("status") == "ok"]
    s = {"cases": len(recs), "ok": len(ok), "errors": sum(r.get("status") == "error"
                                                          for r in recs),
         "skipped": sum(str(r.get("status", "")).startswith("skipped") for r in recs),
         "complete": len(ok) == expected and expected > 0,
         "speedup_geomean": _geomean([r.get("speedup") for r in ok])}
    if suite in ("decode-full", "decode-variants"):
        groups = {}
        for r in ok:
            groups.setdefault(f"q{r['query_len']}_h{r['num_heads']}", []).append(r)
        s["groups"] = {}
        for key, rs in groups.items():
            wsum = sum(r["weight"] for r in rs)
            g = {"cases": len(rs), "weight_sum": wsum}
            if wsum:
                g["weighted_mean_gbps"] = sum(r["weight"] * r["gbps"] for r in rs) / wsum
                g["aggregate_gbps"] = (sum(r["weight"] * r["bytes_moved"] for r in rs)
                                       / sum(r["weight"] * r["us"] for r in rs) / 1e3)
                if ctx.copy_gbps:
                    g["weighted_mean_copy_ratio"] = g["weighted_mean_gbps"] / ctx.copy_gbps
                    g["aggregate_copy_ratio"] = g["aggregate_gbps"] / ctx.copy_gbps
            big = [r for r in rs if r["pages_bytes"] >= wl.FLAG_PAGES_BYTES]
            g["big_cases"] = len(big)
            g["big_cases_under_75pct"] = [r["name"] for r in big
                                          if r.get("copy_ratio") is not None
                                          and r["copy_ratio"] < TARGET_DECODE_BIG_CASE]
            g["full_grid"] = len(rs) == len(wl.full_cases()) and wsum == 10_000
            if ctx.copy_gbps and wsum and not ctx.smoke:
                g["target_weighted_085"] = g["weighted_mean_copy_ratio"] >= TARGET_DECODE_WEIGHTED
                g["target_no_big_case_under_075"] = not g["big_cases_under_75pct"]
            s["groups"][key] = g
    elif suite == "decode-lowlat":
        s["us"] = {r["name"]: r["us"] for r in ok}
        tgt = next((r for r in ok if r["name"] == TARGET_LOWLAT_CASE), None)
        if tgt is not None and not ctx.smoke:
            s["target_case"] = TARGET_LOWLAT_CASE
            s["target_case_us"] = tgt["us"]
            s["target_le_6us"] = tgt["us"] <= TARGET_LOWLAT_US
    elif suite == "prefill":
        ratios = [r["matmul_ratio"] for r in ok if r.get("matmul_ratio") is not None]
        if ratios:
            top = max(ok, key=lambda r: r["flops"])
            s["matmul_ratio_max"] = max(ratios)
            s["largest_case"] = top["name"]
            s["largest_case_matmul_ratio"] = top.get("matmul_ratio")
            s["cases_at_or_above_50pct"] = sum(x >= TARGET_PREFILL_MATMUL for x in ratios)
        mm16 = [r["mm16_ratio"] for r in ok if r.get("mm16_ratio") is not None]
        if mm16:  # share of the 16-bit matmul rate (the exact path's fp16 tensor cores)
            s["mm16_ratio_max"] = max(mm16)
            s["largest_case_mm16_ratio"] = max(ok, key=lambda r: r["flops"]).get("mm16_ratio")
    elif suite in ("gather", "insert"):
        ratios = [r["copy_ratio"] for r in ok if r.get("copy_ratio") is not None]
        if ratios:
            top = max(ok, key=lambda r: r["bytes_moved"])
            s["largest_case"] = top["name"]
            s["largest_case_copy_ratio"] = top.get("copy_ratio")
            s["largest_case_mix_ratio"] = top.get("mix_ratio")  # an extra column, no target
            s["cases_at_or_above_80pct"] = sum(x >= TARGET_COPY_GATHER_INSERT for x in ratios)
    return s


SUITE_ORDER = ("decode-full", "decode-lowlat", "prefill", "gather", "insert", "decode-variants",
               "engine")


def _engine_case(ctx: Context, case) -> dict:
    from .engine_suite import engine_case
    return engine_case(ctx, case)


SUITE_FUNCS = {"decode-full": decode_case, "decode-lowlat": decode_case,
               "decode-variants": decode_case, "prefill": prefill_case,
               "gather": gather_case, "insert": insert_case, "engine": _engine_case}


def suite_cases(suite: str, *, quick: bool, smoke: bool) -> list:
    """The cases of ``suite`` for this mode (WORKLOADS.md sizes; tiny ones in smoke)."""
    if smoke:
        return wl.smoke_cases()[suite]
    if suite == "engine":
        from . import engine_suite as es
        return es.quick_cases() if quick else es.engine_cases()
    cases = {"decode-full": wl.full_cases, "decode-lowlat": wl.lowlat_cases,
             "decode-variants": wl.variant_cases, "prefill": wl.prefill_cases,
             "gather": wl.prefill_cases, "insert": wl.insert_cases}[suite]()
    return wl.quick_filter(cases, suite) if quick else cases


def pool_pages_for(cases_by_suite: dict[str, list], l2: int, graph_calls: int) -> int:
    """Pages the shared pool needs so every case gets its rotation slots (>= 1 page)."""
    need = 1
    for suite, cases in cases_by_suite.items():
        for c in cases:
            if isinstance(c, wl.DecodeCase):
                sl = c.seq_lens()
                tr = wl.decode_traffic(sl, c.query_len, c.num_heads)
                slots = rotation_slots(tr.pages_bytes, l2, graph_calls)
            elif hasattr(c, "pool_pages"):  # engine steps: one block table
                need = max(need, c.pool_pages())
                continue
            elif isinstance(c, wl.PrefillCase):
                sl, slots = c.seq_lens(), 2
                if suite == "gather":
                    slots = gather_slots(c, l2, graph_calls)
            else:
                continue
            need = max(need, slots * sum(wl.pages_needed(s) for s in sl))
    return need
