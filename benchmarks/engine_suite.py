"""WORKLOADS.md "Engine steps" (SPEC 8.1): ``Indexer.plan`` host time and ``forward`` device
time per step of a continuous-batching trace, against the kernels alone.

Steps: decode batches of 1, 8, 64, 256 requests (Q = 1 and 4; seq lens drawn as in the decode
suite around 8_000 / 32_000 / 128_000; these batch sizes are CUDA-graph sizes, so no padding
row is added) and mixed steps of 64 decodes (Q = 1, around 32_000) plus one or two prefill
requests (2_048 / 8_192 new tokens on 0 / 32_768 / 131_072 cached).

Per step: ``plan_us`` = host wall clock of ``Indexer.plan`` (median of 50 after 10 untimed
plans of the same step: an engine plans every step, so the steady state is what counts; on
the H200's host the first plans after other work ran 90-135 us, then settled within ~10);
``plan_in_place_us`` (decode-only steps) = the same with the step's block table and seq lens
kept in the indexer's own decode buffers (``Indexer.decode_block_table`` / ``decode_seq_lens``:
``plan`` then issues no device op);
``us`` = device time of ``forward`` (graph replay for decode-only steps, events around one
eager call after an L2 flush for mixed steps); ``step_us`` = their sum; ``kernels_us`` = the
kernels alone (the bare ``DecodeIndexerWrapper.run`` replayed in a graph for decode-only steps;
for mixed steps the whole planned forward captured in a CUDA graph, i.e. without host launch
overhead, one replay after an L2 flush, the eager call's cache state; ``kernels_warm_us``:
the same graph replayed back to back, L2-warm);
``forward_over_kernels`` = us / kernels_us (targets: decode-only 1.0, mixed <= 1.10).
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import TOPK

from . import workloads as wl
from .context import POISON, finish, traffic_fields
from .pool import random_index_q

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PLAN_REPEATS = 50
PLAN_WARMUP = 10
TARGET_MIXED_OVER_KERNELS = 1.10


def step_metadata(q_lens: list[int], seq_lens: list[int], block_table: torch.Tensor,
                  num_decodes: int, dev: torch.device) -> ni.StepMetadata:
    """The ``StepMetadata`` of requests with ``q_lens`` query tokens and ``seq_lens`` tokens
    each (the first ``num_decodes`` of them decodes): int32 query start locations and seq
    lens on ``dev`` and on the host (pinned where ``dev`` is a GPU)."""
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    pin = dev.type == "cuda"
    return ni.StepMetadata(qsl.to(dev), qsl.pin_memory() if pin else qsl, seq.to(dev),
                           seq.pin_memory() if pin else seq, block_table, num_decodes)


def engine_case(ctx, case: wl.EngineCase) -> dict:
    """Time one engine step (module docstring); returns its record."""
    dev, cache = ctx.device, ctx.pool.cache
    h, q = case.num_heads, case.query_len
    sl = case.seq_lens()
    b = case.batch
    new = [n for n, _ in case.prefills]
    q_lens = [q] * b + new
    rows = sum(q_lens)
    max_len = max(sl)
    config = ni.IndexerConfig(h, max_len, max(rows, 1), max(b + len(new), 1),
                              max_decode_query_len=max(q, 1),
                              cudagraph_batch_sizes=GRAPH_SIZES if not ctx.smoke else (1, 2),
                              device=dev, allow_fp8_mma=ctx.allow_fp8_mma)
    ix = ni.Indexer(config, backend=ctx.fast_backend)
    tr = wl.engine_traffic(case)
    width = config.max_pages
    bt = ctx.pool.block_tables(sl, 1, width)[0]
    step = step_metadata(q_lens, sl, bt, b, dev)
    index_q = random_index_q(rows, h, dev, ctx.gen(case.name))
    out = torch.full((rows, h, TOPK), POISON, dtype=torch.int32, device=dev)
    rec = {"batch": b, "query_len": q, "nominal": case.nominal, "num_heads": h,
           "prefills": [list(p) for p in case.prefills], "rows": rows, "width": width,
           **traffic_fields(tr), "memory_bytes": ix.memory_bytes(),
           "path": f"Indexer(backend={ctx.fast_backend!r}"
                   + (", allow_fp8_mma=True" if ctx.allow_fp8_mma else "") + ").plan/forward"}
    md = ix.plan(step)  # first use of (b, q): builds (and on a GPU compiles) the wrapper
    rec["prefill_chunks"] = len(md.prefill_chunks)
    ix.forward(index_q, cache, md, out)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    rec["out_fully_written"] = bool((out != POISON).all())
    why = ctx.ref_allowed(tr.pages_bytes, tr.flops)
    if why is None:
        ref = []
        if b:
            ref.append(ni.decode_indexer(index_q[:b * q], cache, bt[:b], step.seq_lens[:b], q,
                                         backend="reference"))
        if new:
            ref.append(ni.prefill_indexer(index_q[b * q:], cache, bt[b:],
                                          step.query_start_loc[b:] - step.query_start_loc[b],
                                          step.seq_lens[b:],
                                          backend="reference"))
        ref = torch.cat(ref)
        rec["rows_equal_reference"] = float((out == ref).all(dim=-1).float().mean())
    else:
        rec["rows_equal_reference"] = None
        rec["reference_skipped"] = why
    # plan: host wall clock (median of PLAN_REPEATS after PLAN_WARMUP); no sync inside plan
    rec["plan_us"], rec["plan_samples_us"] = _plan_times(ix, step, ctx.smoke)
    if not case.prefills:  # the engine keeps its decode metadata in the indexer's buffers
        inplace = ni.StepMetadata(step.query_start_loc, step.query_start_loc_cpu,
                                  ix.decode_seq_lens[:b], step.seq_lens_cpu,
                                  ix.decode_block_table[:b], b)
        ix.decode_block_table[:b, :bt.shape[1]].copy_(bt[:b])
        ix.decode_seq_lens[:b].copy_(step.seq_lens[:b])
        rec["plan_in_place_us"] = _plan_times(ix, inplace, ctx.smoke)[0]
    md = ix.plan(step)

    def fwd():
        ix.forward(index_q, cache, md, out)
    if not case.prefills:
        t = ctx.time_capturable([fwd])
        wrapper = md.decoder
        kern = ctx.time_capturable([lambda: wrapper.run(index_q[:b * q], cache, out[:b * q])])
        rec["kernels_path"] = "DecodeIndexerWrapper.run (bare)"
    else:
        t = ctx.time_uncapturable([fwd])  # one eager call after an L2 flush
        # the same launches without host overhead, in the same cache state: one replay of the
        # captured forward after an L2 flush (back-to-back replays, the L2-warm
        # ``kernels_warm_us``, also overlap one call's tail with the next one's start)
        kern = ctx.time_capturable_single([fwd])
        rec["kernels_warm_us"] = ctx.time_capturable([fwd]).us
        rec["kernels_path"] = ("planned forward captured in a CUDA graph, one replay after an "
                               "L2 flush")
    rec["kernels_us"] = kern.us
    rec["forward_over_kernels"] = t.us / kern.us if kern.us else None
    rec["step_us"] = rec["plan_us"] + t.us
    return finish(ctx, rec, t, tr.bytes_moved, tr.flops)


def _plan_times(ix, step, smoke: bool) -> tuple[float, list[float]]:
    """(median, samples) of the host microseconds of ``ix.plan(step)``, after warm-up plans."""
    for _ in range(1 if smoke else PLAN_WARMUP):
        ix.plan(step)
    samples = []
    for _ in range(2 if smoke else PLAN_REPEATS):
        t0 = time.perf_counter()
        ix.plan(step)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples), [round(s, 2) for s in samples]
