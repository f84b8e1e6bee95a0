"""GPU lab: the fixed cost of a page-score launch against its grid shape (issue 13).

The "mma" scorer's time at small batches fits a fixed ~8 us plus a per-page part (docs/
benchmarks.md, issue 13, tenth step); its call with no page to score took 3.4 us under ncu with
the SMs busy for a third of it. This lab times, in CUDA-graph replays of back-to-back launches
(so the host is out of the numbers):

- an empty Triton kernel on P one-warp programs and on P / 4 four-warp programs;
- the "mma" score kernel on a batch whose rows score no page (its prologue only: the flat
  partition's seq-len loads and scan, the shared-memory ring, exit) at P programs;
- the same kernel on a b8 x 100K batch at P programs (P = 132 x 12 is the default).

for P = 132 x k, k in ``--per-sm``. With ``--select B:W,...`` it times instead, per batch of B
requests whose rows all score W - 1 pages (Q = 8, H = 4, the default grid): the score kernel
alone, the select kernel alone (on the scores the score kernel wrote) and both launches as
``PageScoreLaunch`` runs them, so the select's share of a call and the gap between the two.
Run::

    python -m benchmarks.labs.launch_shape_lab [--per-sm 1,3,6,12]
    python -m benchmarks.labs.launch_shape_lab --select 8:391,8:782,8:1563,32:782
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.timing import time_graph


@triton.jit
def _empty_kernel(x_ptr, flag):
    if flag != 0:  # never true: the launch and an exit, nothing else
        tl.store(x_ptr, 1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-sm", default="1,3,6,12")
    ap.add_argument("--calls", type=int, default=40, help="launches per graph")
    ap.add_argument("--select", default="", help="B:W,... time score / select / both")
    args = ap.parse_args(argv)
    if args.select:
        return _select_share(args)
    dev = torch.device("cuda")
    from nvfp4_indexer.triton import decode_wgmma as wg
    from nvfp4_indexer.triton.heuristics import block_rows
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x = torch.zeros(4, device=dev)
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; us per launch, graph replays of "
          f"{args.calls} back-to-back launches")

    def timed(fn) -> float:
        return time_graph([fn], dev, graph_calls=args.calls).us

    b, q_len, heads, pages = 8, 8, 4, 782  # b8 x 100K: W = 782 pages of 128 tokens
    q, cache, bt, out, scores = _batch(b, pages, q_len, heads, dev)
    full = torch.full((b,), pages * 128, dtype=torch.int32, device=dev)
    none = torch.ones((b,), dtype=torch.int32, device=dev)

    for k in (int(v) for v in args.per_sm.split(",")):
        p = k * sms
        e1 = timed(lambda p=p: _empty_kernel[(p,)](x, 0, num_warps=1))
        e4 = timed(lambda p=p: _empty_kernel[(max(1, p // 4),)](x, 0, num_warps=4))
        launch = wg.PageScoreLaunch("mma", width=pages, query_len=q_len, num_heads=heads,
                                    rows=block_rows(q_len, heads), num_splits=1, num_reqs=b,
                                    programs=p)
        runs = {name: timed(lambda sl=sl: launch.run_score(q, cache, bt, sl, scores,
                                                            num_blocks=cache.shape[0]))
                for name, sl in (("no page", none), ("b8x100K", full))}
        print(f"P = {k:2d} x {sms} = {p:5d}: empty 1-warp {e1:6.2f} us, empty 4-warp "
              f"(P/4) {e4:6.2f} us, mma no page {runs['no page']:6.2f} us, "
              f"mma b8x100K (score kernel) {runs['b8x100K']:7.2f} us", flush=True)
    return 0


def _batch(b: int, pages: int, q_len: int, heads: int, dev):
    """A batch of b requests of ``pages`` distinct random pages each (Q = q_len, H = heads):
    ``(q, cache, block_table, out, scores)``; scale bytes <= 0x3F (positive, finite, at most
    1.875), one spare cache block."""
    from nvfp4_indexer.triton import decode_wgmma as wg
    from nvfp4_indexer.triton.heuristics import block_rows
    num_blocks = b * pages + 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.randint(0, 256, (num_blocks, 128 * 72), dtype=torch.uint8, generator=gen)
    cache[:, 128 * 64:] &= 0x3F
    bt = torch.randperm(num_blocks - 1, generator=gen)[: b * pages].view(b, pages)
    q = torch.randint(0, 0x7E, (b * q_len, heads, 128), dtype=torch.uint8, generator=gen)
    out = torch.empty((b * q_len, heads, 16), dtype=torch.int32, device=dev)
    scores = torch.empty(wg.scratch_elems(b, pages, block_rows(q_len, heads)),
                         dtype=torch.float32, device=dev)
    return (q.to(dev).view(torch.float8_e4m3fn), cache.to(dev), bt.to(torch.int32).to(dev),
            out, scores)


def _select_share(args) -> int:
    """``--select``: score kernel, select kernel and both, per ``B:W`` batch (module doc)."""
    dev = torch.device("cuda")
    from nvfp4_indexer.triton import decode_wgmma as wg
    from nvfp4_indexer.triton.heuristics import MMA_PROGRAMS_PER_SM, block_rows
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    q_len, heads = 8, 4
    rows = block_rows(q_len, heads)
    print(f"{torch.cuda.get_device_name(dev)}; us per launch, graph replays of {args.calls} "
          "back-to-back launches (pages partly L2-warm)")
    for spec in args.select.split(","):
        b, pages = (int(v) for v in spec.split(":"))
        q, cache, bt, out, scores = _batch(b, pages, q_len, heads, dev)
        sl = torch.full((b,), pages * 128, dtype=torch.int32, device=dev)
        launch = wg.PageScoreLaunch("mma", width=pages, query_len=q_len, num_heads=heads,
                                    rows=rows, num_splits=1, num_reqs=b,
                                    programs=MMA_PROGRAMS_PER_SM * sms)
        n_blk = cache.shape[0]

        def score():
            launch.run_score(q, cache, bt, sl, scores, num_blocks=n_blk)

        def select():
            launch.select((b, launch.select_grid_y), scores, sl, pages, out)

        def both():
            launch(q, cache, bt, sl, out, scores, num_blocks=n_blk)

        t = {n: time_graph([f], dev, graph_calls=args.calls).us
             for n, f in (("score", score), ("select", select), ("both", both))}
        print(f"B {b:3d} x W {pages:5d} ({b * q_len * heads} rows): score {t['score']:7.2f} us, "
              f"select {t['select']:6.2f} us, both {t['both']:7.2f} us (gap "
              f"{t['both'] - t['score'] - t['select']:+5.2f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
