"""One decode case on a cold page pool, for a profiler (``ncu``) to attach to.

Usage (one GPU)::

    ncu --clock-control none --set full -k regex:_decode_score_kernel \\
        --launch-skip 2 --launch-count 1 -o decode python -m benchmarks.profile_decode 128 100000
    python -m benchmarks.profile_decode 1 32000 window=1 maxnreg=128   # DecodeRunner knobs

Builds the WORKLOADS.md request lengths for (batch, nominal length) with Q = 8, H = 4, a page
pool of random NVFP4 keys just large enough for the case (far above L2 for long contexts),
one block table, and runs ``DecodeRunner.run`` ``--calls`` times (default 3; the profiler
picks the launch). ``key=value`` arguments are ``DecodeRunner`` keyword arguments (ints, or
strings such as ``dequant=ptx_arith``). Prints the split count and pages. Exit status 2
without a CUDA GPU. The profile recorded in ``docs/results/ncu-decode-h200-2026-11-30.txt``
was taken with these same steps from a session script; this module packages them and has not
itself run on a GPU yet.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("batch", type=int)
    ap.add_argument("nominal", type=int, help="nominal sequence length (tokens)")
    ap.add_argument("knobs", nargs="*", help="DecodeRunner keyword arguments as key=value")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode: needs a CUDA GPU", flush=True)
        return 2
    from benchmarks import workloads as wl
    from benchmarks.pool import PagePool, random_index_q
    from nvfp4_indexer.triton.decode import DecodeRunner
    kw = {}
    for item in args.knobs:
        key, _, val = item.partition("=")
        kw[key] = int(val) if val.lstrip("-").isdigit() else val
    dev = torch.device("cuda")
    q_len, heads = wl.DECODE_QUERY_LEN, wl.DECODE_HEADS
    sl = wl.make_seq_lens(args.batch, args.nominal, q_len)
    need = sum(wl.pages_needed(s) for s in sl)
    width = max(wl.pages_needed(s) for s in sl)
    pool = PagePool(need + 16, dev, seed=3)
    bt = pool.block_tables(sl, 1, width)[0]
    seq = torch.tensor(sl, dtype=torch.int32, device=dev)
    q = random_index_q(args.batch * q_len, heads, dev, torch.Generator(device=dev).manual_seed(5))
    out = torch.empty((args.batch * q_len, heads, 16), dtype=torch.int32, device=dev)
    runner = DecodeRunner(heads, args.batch, width, q_len, dev, **kw)
    for _ in range(args.calls):
        runner.run(q, pool.cache, bt, seq, out)
    torch.cuda.synchronize()
    print(f"splits {runner.num_splits}, window {runner.window}, keep {runner.keep}, "
          f"history pages {sum(wl.history_pages(s) for s in sl)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
