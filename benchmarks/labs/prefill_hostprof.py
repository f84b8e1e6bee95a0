"""Host time against device time of one eager ``triton.prefill.prefill_indexer`` call.

Usage (one GPU)::

    python -m benchmarks.labs.prefill_hostprof                 # 1024 new tokens, 0 / 131072 cached
    python -m benchmarks.labs.prefill_hostprof --cases 16384:0:1,1024:32768:1 --calls 50

Per case (``NEW:CONTEXT:REQUESTS`` as WORKLOADS.md's prefill cases; H = 4, the API's default
gather budget) it prints the median host wall clock of the call (the call returns when its
launches are enqueued; the device is synced between samples, not inside), the CUDA-event time
of one call, the kernels' device times (``torch.profiler``, three calls) and the top host
functions by own time (``cProfile``, twenty calls). Exits with status 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from .cli import gpu_args, lab_parser


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``NEW:CONTEXT:REQUESTS,...`` -> a list of int triples (argparse type)."""
    try:
        cases = [tuple(int(x) for x in c.split(":")) for c in text.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 3 for c in cases):
        raise argparse.ArgumentTypeError(f"expected NEW:CONTEXT:REQUESTS,..., got {text!r}")
    return cases


def profile_case(dev, new: int, context: int, reqs: int, calls: int) -> None:
    import nvfp4_indexer as ni
    from nvfp4_indexer.constants import PAGE_SIZE, TOPK
    from nvfp4_indexer.triton import prefill as tp

    from benchmarks import workloads as wl
    from benchmarks.pool import PagePool, random_index_q
    case = wl.PrefillCase(new, context, reqs)
    sl = case.seq_lens()
    width = max(wl.pages_needed(s) for s in sl)
    pool = PagePool(sum(wl.pages_needed(s) for s in sl) + 8, dev, seed=1)
    bt = pool.block_tables(sl, 1, width)[0]
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    cu = torch.tensor(case.cu_seqlens_q(), dtype=torch.int32, device=dev)
    q = random_index_q(new, case.num_heads, dev, torch.Generator(device=dev).manual_seed(0))
    out = torch.empty((new, case.num_heads, TOPK), dtype=torch.int32, device=dev)
    mgp = ni.max_gather_pages(width * PAGE_SIZE, new)

    def call():
        tp.prefill_indexer(q, pool.cache, bt, cu, seq, mgp, out)

    for _ in range(5):
        call()
    torch.cuda.synchronize(dev)
    host = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize(dev)
    host.sort()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize(dev)
    print(f"== {case.name}: host median {host[len(host) // 2]:.1f} us (min {host[0]:.1f}), "
          f"CUDA events {start.elapsed_time(end) * 1e3:.1f} us", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            call()
        torch.cuda.synchronize(dev)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        call()
    pr.disable()
    torch.cuda.synchronize(dev)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue(), flush=True)


def main(argv=None) -> int:
    ap = lab_parser(__doc__)
    ap.add_argument("--cases", type=parse_cases, default=[(1024, 0, 1), (1024, 131072, 1)],
                    help="NEW:CONTEXT:REQUESTS,... (default 1024:0:1,1024:131072:1)")
    ap.add_argument("--calls", type=int, default=50, help="host-time samples (default 50)")
    args = gpu_args(ap, argv, "prefill_hostprof")
    dev = torch.device("cuda", torch.cuda.current_device())
    for new, context, reqs in args.cases:
        profile_case(dev, new, context, reqs, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
