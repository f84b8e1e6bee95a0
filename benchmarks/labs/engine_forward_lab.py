"""GPU lab: a mixed engine step's eager ``forward`` against its kernels, in isolation.

For each mixed step of the engine suite (64 decodes of ~32K tokens + one or two prefill
requests), the planned step runs eagerly ``--samples`` times, each call after an L2 flush
(``timing.time_eager``, CUDA events), against the same forward captured in a CUDA graph
(``time_graph_single``: the kernels without host gaps). The engine suite measures the same
ratio inside a long run, after other work on the host; this lab times it alone.

    python -m benchmarks.labs.engine_forward_lab [--samples 30]
"""

from __future__ import annotations


import torch

import nvfp4_indexer as ni
from nvfp4_indexer.constants import TOPK

from ..engine_suite import GRAPH_SIZES
from ..workloads import engine_cases
from ..pool import random_index_q
from ..timing import time_eager, time_graph_single
from .knob_lab import ensure_pool, log, make_context
from .cli import gpu_args, lab_parser, print_markdown


def main(argv=None) -> int:
    ap = lab_parser(__doc__)
    ap.add_argument("--samples", type=int, default=30)
    args = gpu_args(ap, argv, "engine_forward_lab")
    ctx = make_context()
    cases = [c for c in engine_cases() if c.prefills]
    ensure_pool(ctx, max(c.pool_pages() for c in cases) * 3)
    dev, cache = ctx.device, ctx.pool.cache
    rows_out = []
    for case in cases:
        sl, q = case.seq_lens(), case.query_len
        q_lens = [q] * case.batch + [n for n, _ in case.prefills]
        rows = sum(q_lens)
        config = ni.IndexerConfig(case.num_heads, max(sl), rows, len(q_lens),
                                  max_decode_query_len=q, cudagraph_batch_sizes=GRAPH_SIZES,
                                  device=dev)
        ix = ni.Indexer(config)
        bt = ctx.pool.block_tables(sl, 1, config.max_pages)[0]
        qsl = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))],
                           dtype=torch.int32)
        seq = torch.tensor(sl, dtype=torch.int32)
        step = ni.StepMetadata(qsl.to(dev), qsl, seq.to(dev), seq, bt, case.batch)
        index_q = random_index_q(rows, case.num_heads, dev, ctx.gen(case.name))
        out = torch.empty((rows, case.num_heads, TOPK), dtype=torch.int32, device=dev)
        md = ix.plan(step)

        def fwd():
            ix.forward(index_q, cache, md, out)
        eager = time_eager([fwd], dev, flush=ctx.flush, warmup=2, max_samples=args.samples,
                           min_samples=args.samples)
        kern = time_graph_single([fwd], dev, flush=ctx.flush, warmup=2, max_samples=20,
                                 min_samples=10)
        rows_out.append((case.name, kern.us, eager.us))
        log(f"{case.name:42s} kernels {kern.us:8.1f}  eager {eager.us:8.1f} "
            f"({eager.us / kern.us:.3f})")
        ix = md = None  # free the step's buffers before the next
    print_markdown(["step", "kernels us", "eager forward us (ratio)"],
                   [[name, f"{k:.1f}", f"{e:.1f} ({e / k:.3f})"] for name, k, e in rows_out],
                   ["---", "---:", "---:"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
