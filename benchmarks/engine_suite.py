"""WORKLOADS.md "Engine steps" (SPEC 8.1): ``Indexer.plan`` host time and ``forward`` device
time per step of a continuous-batching trace, against the kernels alone.

Steps: decode batches of 1, 8, 64, 256 requests (Q = 1 and 4; seq lens drawn as in the decode
suite around 8_000 / 32_000 / 128_000; these batch sizes are CUDA-graph sizes, so no padding
row is added) and mixed steps of 64 decodes (Q = 1, around 32_000) plus one or two prefill
requests (2_048 / 8_192 new tokens on 0 / 32_768 / 131_072 cached).

Per step: ``plan_us`` = host wall clock of ``Indexer.plan`` (median of 50 after 10 untimed
plans of the same step: an engine plans every step, so the steady state is what counts; the
first plans after other work ran 90-135 us on the H200's host, then settled within ~10:
``plan_samples_us`` of ``docs/results/bench-h200-engine-session11-b.json``, taken without them);
``plan_in_place_us`` (decode-only steps) = the same with the step's block table and seq lens
kept in the indexer's own decode buffers (``Indexer.decode_block_table`` / ``decode_seq_lens``:
``plan`` then issues no device op);
``us`` = device time of ``forward`` (graph replay for decode-only steps, events around one
eager call after an L2 flush for mixed steps); ``step_us`` = their sum; ``kernels_us`` = the
kernels alone (the bare ``DecodeIndexerWrapper.run`` replayed in a graph for decode-only steps;
for mixed steps the whole planned forward captured in a CUDA graph, i.e. without host launch
overhead, one replay after an L2 flush, the eager call's cache state; ``kernels_warm_us``:
the same graph replayed back to back, L2-warm, as recorded before 2026-12-01's fifth session);
``forward_over_kernels`` = us / kernels_us (targets: decode-only 1.0, mixed <= 1.10).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import TOPK

from . import workloads as wl
from .pool import random_index_q

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENGINE_HEADS = 4
PLAN_REPEATS = 50
PLAN_WARMUP = 10
TARGET_MIXED_OVER_KERNELS = 1.10


@dataclass(frozen=True)
class EngineCase:
    """One engine step: ``batch`` decodes of ``query_len`` around ``nominal`` tokens and
    ``prefills`` ((new tokens, cached tokens) per prefill request)."""

    batch: int
    query_len: int
    nominal: int
    prefills: tuple = ()
    num_heads: int = ENGINE_HEADS

    @property
    def name(self) -> str:
        s = f"b{self.batch}_q{self.query_len}_s{self.nominal}"
        for n, c in self.prefills:
            s += f"+p{n}c{c}"
        return s

    def decode_lens(self) -> list[int]:
        return wl.make_seq_lens(self.batch, self.nominal, self.query_len)

    def seq_lens(self) -> list[int]:
        return self.decode_lens() + [n + c for n, c in self.prefills]

    def pool_pages(self) -> int:
        return sum(wl.pages_needed(s) for s in self.seq_lens())


def engine_cases() -> list[EngineCase]:
    """WORKLOADS.md "Engine steps": 24 decode-only steps and 12 mixed steps."""
    cases = [EngineCase(b, q, s) for s in (8_000, 32_000, 128_000) for q in (1, 4)
             for b in (1, 8, 64, 256)]
    for n in (2_048, 8_192):
        for c in (0, 32_768, 131_072):
            cases.append(EngineCase(64, 1, 32_000, ((n, c),)))
            cases.append(EngineCase(64, 1, 32_000, ((n, c), (n, c))))
    return cases


def quick_cases() -> list[EngineCase]:
    return [c for c in engine_cases() if c.nominal == 32_000 and c.batch in (8, 64)
            and (not c.prefills or c.prefills[0][1] == 32_768)]


def smoke_cases() -> list[EngineCase]:
    """Tiny CPU-smoke stand-ins (same code paths)."""
    return [EngineCase(2, 2, 2_100, num_heads=2),
            EngineCase(2, 1, 2_100, ((32, 2_048),), num_heads=2)]


def _traffic(case: EngineCase) -> wl.Traffic:
    """Decode traffic plus each prefill request's (WORKLOADS.md "Bytes moved")."""
    parts = [wl.decode_traffic(case.decode_lens(), case.query_len, case.num_heads)]
    parts += [wl.prefill_traffic(wl.PrefillCase(n, c, 1, case.num_heads))
              for n, c in case.prefills]
    keys = {k for t in parts for k in t.parts}
    merged = {k: sum(t.parts.get(k, 0) for t in parts) for k in sorted(keys)}
    return wl.Traffic(sum(t.history_pages for t in parts), sum(t.pages_bytes for t in parts),
                      sum(merged.values()), sum(t.flops for t in parts), merged)


def engine_case(ctx, case: EngineCase) -> dict:
    from .context import POISON, _finish, _traffic_fields
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
    tr = _traffic(case)
    width = config.max_pages
    bt = ctx.pool.block_tables(sl, 1, width)[0]
    qsl = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))],
                       dtype=torch.int32)
    seq_cpu = torch.tensor(sl, dtype=torch.int32)
    pin = dev.type == "cuda"
    step = ni.StepMetadata(qsl.to(dev), qsl.pin_memory() if pin else qsl, seq_cpu.to(dev),
                           seq_cpu.pin_memory() if pin else seq_cpu, bt, b)
    index_q = random_index_q(rows, h, dev, ctx.gen(case.name))
    out = torch.full((rows, h, TOPK), POISON, dtype=torch.int32, device=dev)
    rec = {"batch": b, "query_len": q, "nominal": case.nominal, "num_heads": h,
           "prefills": [list(p) for p in case.prefills], "rows": rows, "width": width,
           **_traffic_fields(tr), "memory_bytes": ix.memory_bytes(),
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
                                          (qsl[b:] - qsl[b]).to(dev), step.seq_lens[b:],
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
    return _finish(ctx, rec, t, tr.bytes_moved, tr.flops)


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


ENGINE_COLS = [
    ("case", lambda r: r["name"]),
    ("rows", lambda r: str(r["rows"])),
    ("chunks", lambda r: str(r.get("prefill_chunks", 0))),
    ("plan us", lambda r: f"{r['plan_us']:.1f}"),
    ("in place", lambda r: f"{r['plan_in_place_us']:.1f}" if "plan_in_place_us" in r else "-"),
    ("forward us", lambda r: f"{r['us']:.1f}"),
    ("kernels us", lambda r: f"{r['kernels_us']:.1f}"),
    ("warm us", lambda r: f"{r['kernels_warm_us']:.1f}" if "kernels_warm_us" in r else "-"),
    ("fwd/kern", lambda r: "-" if r.get("forward_over_kernels") is None
     else f"{r['forward_over_kernels']:.2f}"),
    ("step us", lambda r: f"{r['step_us']:.1f}"),
    ("method", lambda r: r["timing"]["method"]),
    ("= ref", lambda r: "-" if r.get("rows_equal_reference") is None
     else f"{100 * r['rows_equal_reference']:.0f}%"),
]
