"""Gather suite: ``nvfp4_indexer.triton.prefill.gather.gather_into`` captured in CUDA graphs over
rotated block tables, each slot with its own workspace, and the public ``gather_index_k_fp8``
eagerly (``api_us``) (``suites`` runs it)."""

from __future__ import annotations

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import PAGE_SIZE

from . import workloads as wl
from .context import Context, finish, ref_time, traffic_fields, written_bytes
from .prefill_suite import prefill_inputs
from .timing import rotation_slots, sync

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
    sl, width, tables, seq, _ = prefill_inputs(ctx, case, slots)
    reuse = (slots - 1) * tr.bytes_moved
    rec = {"new_tokens": case.new_tokens, "context": case.context, "num_reqs": case.num_reqs,
           "seq_len": sl[0], "width": width, **traffic_fields(tr), "slots": slots,
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
        from nvfp4_indexer.triton.prefill import gather as tg
        tun = tg.resolve_tuning(dev)
        rec["path"] = "nvfp4_indexer.triton.prefill.gather.gather_into"
        rec["tuning"] = {"dequant": tun.dequant, "tok_block": tun.tok_block,
                         "num_warps": tun.num_warps, "page_parts": tun.page_parts,
                         "streaming": tun.streaming,
                         "pages_per_program": tun.pages_for(len(sl), max_pages, width, dev)}

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
        ref_ws, ref_off = ref_time(ctx, rec, lambda: ni.gather_index_k_fp8(
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
    return finish(ctx, rec, t, tr.bytes_moved, 0, written_bytes("gather", tr.parts))
