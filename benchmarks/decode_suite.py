"""Decode suites (decode-full, decode-lowlat, decode-variants, decode-engine-width): the public
``DecodeIndexerWrapper``, ``plan()`` outside, ``run()`` captured in CUDA graphs, one wrapper per
rotation slot (``suites`` runs them)."""

from __future__ import annotations

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import TOPK

from . import workloads as wl
from .context import POISON, Context, compare_rows, finish, traffic_fields
from .pool import random_index_q
from .timing import rotation_slots, sync

def _shared_score_buffer(ctx: Context, b: int, width: int, h: int, q_len: int):
    """One float32 scratch shared by a case's wrappers (they never run at once), sized by
    ``nvfp4_indexer.triton.decode.score_buffer_size``; None for the reference backend or
    when the runner needs none."""
    if ctx.fast_backend != "triton":
        return None
    from nvfp4_indexer.triton import DecodeConfig, score_buffer_size
    from nvfp4_indexer.triton.device import portable_default
    fp8 = ctx.allow_fp8_mma and not portable_default(ctx.device)  # as the wrapper decides
    n = score_buffer_size(b, width, h, q_len, config=DecodeConfig(dot="fp8") if fp8 else None,
                          device=ctx.device)
    return torch.empty(n, dtype=torch.float32, device=ctx.device) if n else None


def decode_case(ctx: Context, case: wl.DecodeCase) -> dict:
    """One decode case: inputs, the first call checked against the reference, then timed.
    An engine-width case (``case.width``) is timed at that block-table width and again on
    the same pages at the contexts' natural width (``natural_us``; ``over_natural`` =
    us / natural_us: what the wide table costs; ``natural_equal``: both outputs equal)."""
    dev = ctx.device
    sl = case.seq_lens()
    b, q_len, h = case.batch, case.query_len, case.num_heads
    tr = wl.decode_traffic(sl, q_len, h)
    natural = case.natural_width()
    width = case.width or natural
    need = sum(wl.pages_needed(s) for s in sl)
    slots = rotation_slots(tr.pages_bytes, ctx.l2_bytes, ctx.graph_calls,
                           max_slots=ctx.pool.num_pages // need)
    reuse = (slots - 1) * tr.pages_bytes
    rec = {"batch": b, "nominal": case.nominal, "query_len": q_len, "num_heads": h,
           "weight": case.weight, "seq_len_min": min(sl), "seq_len_max": max(sl),
           "seq_len_mean": sum(sl) / len(sl), "width": width, **traffic_fields(tr),
           "slots": slots, "reuse_bytes": reuse,
           "reuse_over_l2": reuse / ctx.l2_bytes if ctx.l2_bytes else None,
           "path": f"DecodeIndexerWrapper(backend={ctx.fast_backend!r}"
                   + (", allow_fp8_mma=True" if ctx.allow_fp8_mma else "") + ").run"}
    tables = ctx.pool.block_tables(sl, slots, width)
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    q = random_index_q(b * q_len, h, dev, ctx.gen(case.name))
    t, out0 = _run_tables(ctx, case, q, seq, tables, rec, tr)
    rec = finish(ctx, rec, t, tr.bytes_moved, tr.flops)
    rec["flag_big_under_75"] = bool(case.suite == "decode-full"
                                    and tr.pages_bytes >= wl.FLAG_PAGES_BYTES
                                    and rec["copy_ratio"] is not None
                                    and rec["copy_ratio"] < wl.TARGET_DECODE_BIG_CASE)
    if width != natural:  # the same pages in tables of the natural width
        narrow = [bt[:, :natural].contiguous() for bt in tables]
        tn, out_n = _run_tables(ctx, case, q, seq, narrow, {})
        rec["natural_width"] = natural
        rec["natural_us"] = tn.us
        rec["over_natural"] = t.us / tn.us if tn.us else None
        rec["natural_equal"] = bool(torch.equal(out_n, out0))
    return rec


def _run_tables(ctx: Context, case: wl.DecodeCase, q: torch.Tensor, seq: torch.Tensor,
                tables: list[torch.Tensor], rec: dict, tr: wl.Traffic | None = None):
    """One wrapper per block table (rotation slot) on queries ``q``: the first call's output
    (checked against the reference when the case's traffic ``tr`` is given), then the timing
    of the captured calls. Returns ``(timing.Timing, the first call's output)``."""
    dev, cache = ctx.device, ctx.pool.cache
    b, q_len, h = case.batch, case.query_len, case.num_heads
    width = tables[0].shape[1]
    out = torch.full((b * q_len, h, TOPK), POISON, dtype=torch.int32, device=dev)
    sb = _shared_score_buffer(ctx, b, width, h, q_len)
    rec["shared_score_buffer_elems"] = None if sb is None else sb.numel()
    wrappers = []
    for bt in tables:
        w = ni.DecodeIndexerWrapper(h, block_table_buffer=bt, seq_lens_buffer=seq,
                                    use_cuda_graph=ctx.cuda, backend=ctx.fast_backend,
                                    score_buffer=sb, allow_fp8_mma=ctx.allow_fp8_mma)
        w.plan(bt, seq, q_len, num_blocks=ctx.pool.num_pages)
        wrappers.append(w)
    wrappers[0].run(q, cache, out)
    sync(dev)
    if tr is None:
        out0 = out.clone()
    else:
        out0 = compare_rows(
            ctx, rec, out, tr.flops, tr.pages_bytes,
            lambda: ni.decode_indexer(q, cache, tables[0], seq, q_len, backend="reference"),
            single=case.suite not in ("decode-full", "decode-lowlat"))
    calls = [lambda w=w: w.run(q, cache, out) for w in wrappers]
    t = ctx.time_capturable(calls)
    if t.method == "cuda-graph":
        # the buffer now holds the graph's last call (always the last slot, see
        # timing.graph_sequence); an eager run of that slot must agree
        check = torch.full_like(out, POISON)
        wrappers[-1].run(q, cache, check)
        sync(dev)
        rec["graph_replay_equals_eager"] = bool(torch.equal(check, out))
    return t, out0
