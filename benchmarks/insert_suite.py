"""Insert suite: ``nvfp4_indexer.triton.insert.insert_index_k`` captured in CUDA graphs over
rotated inputs (eager + flush if capture fails), and the public API call (``api_us``)
(``suites`` runs it)."""

from __future__ import annotations

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import PAGE_SIZE
from nvfp4_indexer.reference.paging import read_blocks

from nvfp4_indexer.conformance.fixtures import rope_cache

from . import workloads as wl
from .context import Context, finish, ref_time, traffic_fields, written_bytes
from .pool import PagePool, random_keys
from .timing import rotation_slots, sync

def insert_inputs(ctx: Context, case: wl.InsertCase):
    """An insert case's traffic, rotation slot count, own page pool and, per rotation slot,
    ``(keys bf16, positions, distinct random slots)``; plus the norm weight and the cos/sin
    cache. Returns ``(traffic, slots, pool, weight, cos_sin, inputs)``."""
    dev = ctx.device
    tr = wl.insert_traffic(case)
    slots = rotation_slots(tr.bytes_moved, ctx.l2_bytes, ctx.graph_calls)
    pool = PagePool(wl.pages_needed(case.cache_tokens), dev, seed=ctx.seed + 5, log=ctx.log)
    gen = ctx.gen(case.name)
    cpu_gen = torch.Generator().manual_seed(ctx.seed + 17)
    weight = (0.1 * torch.randn(128, device=dev, generator=gen)).float()
    cos_sin = rope_cache(case.max_position, case.rotary_dim, torch.bfloat16).to(dev)
    inputs = []
    for _ in range(slots):
        k = random_keys(case.tokens, dev, gen, pool.channel_scale, torch.bfloat16)
        pos = torch.randint(0, case.max_position, (case.tokens,), device=dev, generator=gen)
        slot = torch.randperm(case.cache_tokens, generator=cpu_gen)[:case.tokens].to(dev)
        inputs.append((k, pos, slot))
    return tr, slots, pool, weight, cos_sin, inputs


def insert_case(ctx: Context, case: wl.InsertCase) -> dict:
    dev = ctx.device
    tr, slots, pool, weight, cos_sin, inputs = insert_inputs(ctx, case)
    cache = pool.cache
    rec = {"tokens": case.tokens, "cache_tokens": case.cache_tokens,
           "rotary_dim": case.rotary_dim, **traffic_fields(tr), "slots": slots,
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
        ref_time(ctx, rec, lambda: ni.insert_index_k(ref_cache, k0, pos0, slot0, weight,
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
    return finish(ctx, rec, t, tr.bytes_moved, 0, written_bytes("insert", tr.parts))
