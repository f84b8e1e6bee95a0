"""Prefill suite: ``nvfp4_indexer.triton.prefill.prefill_indexer`` timed eagerly with an L2
flush before each call, the public API call (``api_us``), and the engine path: the same
requests as one prefill-only step of an ``Indexer`` (``plan`` outside the timing, ``forward``
eagerly after an L2 flush: ``indexer_us``; the planned forward captured in a CUDA graph, one
replay after an L2 flush, i.e. its kernels without host overhead: ``indexer_kernels_us``)
(``suites`` runs it).

The stateless entry points read the metadata back from the device and plan on the host while
the device idles (SPEC 7 allows the sync): 0.2-1 ms per call on the H200's host, which is what
separates ``us`` from ``indexer_us`` on all but the largest cases."""

from __future__ import annotations

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import PAGE_SIZE, TOPK

from . import workloads as wl
from .context import POISON, Context, compare_rows, finish, traffic_fields
from .pool import random_index_q
from .timing import sync

def prefill_inputs(ctx: Context, case: wl.PrefillCase, slots: int):
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
    sl, width, tables, seq, cu = prefill_inputs(ctx, case, slots)
    h, t_rows = case.num_heads, case.new_tokens
    q = random_index_q(t_rows, h, dev, ctx.gen(case.name))
    out = torch.full((t_rows, h, TOPK), POISON, dtype=torch.int32, device=dev)
    mgp = ni.max_gather_pages(width * PAGE_SIZE, t_rows)  # the API's default budget
    rec = {"new_tokens": case.new_tokens, "context": case.context, "num_reqs": case.num_reqs,
           "num_heads": h, "q_len": case.q_len, "seq_len": sl[0], "width": width,
           "max_gather_pages": mgp, **traffic_fields(tr), "slots": slots}
    if ctx.fast_backend == "triton":
        from nvfp4_indexer.api import _prefill_config
        from nvfp4_indexer.triton import prefill as tp
        cfg = _prefill_config(ctx.allow_fp8_mma, dev)  # as prefill_indexer(allow_fp8_mma=)
        rec["path"] = "nvfp4_indexer.triton.prefill.prefill_indexer" + (
            "(config=PrefillConfig(dot='fp8'))" if cfg is not None else "")

        def fast(bt):
            tp.prefill_indexer(q, cache, bt, cu, seq, mgp, out, config=cfg)
    else:
        rec["path"] = "prefill_indexer(backend='reference')"

        def fast(bt):
            ni.prefill_indexer(q, cache, bt, cu, seq, max_gather_pages=mgp, out=out,
                               backend="reference")
    fast(tables[0])
    sync(dev)
    out0 = compare_rows(ctx, rec, out, tr.flops, tr.pages_bytes, lambda: ni.prefill_indexer(
        q, cache, tables[0], cu, seq, max_gather_pages=mgp, backend="reference"))
    t = ctx.time_uncapturable([lambda bt=bt: fast(bt) for bt in tables])
    api = ctx.time_uncapturable([lambda bt=bt: ni.prefill_indexer(
        q, cache, bt, cu, seq, max_gather_pages=mgp, out=out, backend=ctx.fast_backend,
        allow_fp8_mma=ctx.allow_fp8_mma) for bt in tables], max_samples=5)
    rec["api_us"] = api.us
    _indexer_times(ctx, case, rec, q, tables[0], sl, out0)
    return finish(ctx, rec, t, tr.bytes_moved, tr.flops)


def _indexer_times(ctx: Context, case: wl.PrefillCase, rec: dict, q, block_table, sl,
                   expect) -> None:
    """``indexer_us`` / ``indexer_kernels_us`` (and their 16-bit matmul ratios) of the case as
    one prefill-only ``Indexer`` step; ``indexer_rows_equal``: its rows against ``expect``."""
    dev, cache = ctx.device, ctx.pool.cache
    cu = case.cu_seqlens_q()
    config = ni.IndexerConfig(case.num_heads, max(sl), case.new_tokens, case.num_reqs,
                              device=dev, allow_fp8_mma=ctx.allow_fp8_mma)
    ix = ni.Indexer(config, backend=ctx.fast_backend)
    qsl = torch.tensor(cu, dtype=torch.int32)
    seq_cpu = torch.tensor(sl, dtype=torch.int32)
    pin = dev.type == "cuda"
    # the case's block table is config.max_pages wide already (both from max(sl))
    step = ni.StepMetadata(qsl.to(dev), qsl.pin_memory() if pin else qsl, seq_cpu.to(dev),
                           seq_cpu.pin_memory() if pin else seq_cpu, block_table, 0)
    out = torch.full((case.new_tokens, case.num_heads, TOPK), POISON, dtype=torch.int32,
                     device=dev)
    md = ix.plan(step)

    def fwd():
        ix.forward(q, cache, md, out)
    fwd()
    sync(dev)
    rec["indexer_rows_equal"] = float((out == expect).all(dim=-1).float().mean())
    rec["indexer_chunks"] = len(md.prefill_chunks)
    t = ctx.time_uncapturable([fwd])
    k = ctx.time_capturable_single([fwd])
    rec["indexer_us"], rec["indexer_kernels_us"] = t.us, k.us
    for key, us in (("indexer_mm16_ratio", t.us), ("indexer_kernels_mm16_ratio", k.us)):
        rec[key] = (rec["flops"] / (us * 1e-6) / 1e12 / ctx.mm16_tflops
                    if ctx.mm16_tflops and us else None)
