"""GPU lab: host time per eager launch (issue 14) -- Triton's JIT against ``CachedLaunch``.

Launches are queued behind a sleeping kernel, so the GPU never waits and ``perf_counter``
over 200 launches measures host work only. Prints, for a decode batch (B x W, Q = 1, H = 4):
``DecodeRunner.run`` per dequant mode ("mma", "wgmma", "ptx"), and the mma scorer and the
select kernel launched through ``kernel[grid](...)`` and through ``CachedLaunch``.

    python -m benchmarks.labs.launch_hostcost [--batch 64] [--width 256]

The numbers of docs/results/launch-hostcost-h200-2026-12-01.txt came from the same
measurement in scratch scripts (this lab was written after that run).
"""

from __future__ import annotations

import argparse
import time

import torch


def per_launch_us(fn, n: int = 200) -> float:
    """Host microseconds per call of ``fn`` (launches queued behind a sleeping kernel)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 0.003 * n / 10))  # ~0.6 ms per 200 launches at 2 GHz
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_hostcost: needs a CUDA GPU")
        return 2
    import nvfp4_indexer as ni
    from nvfp4_indexer.triton import decode_wgmma as wg
    from nvfp4_indexer.triton.config import DecodeConfig
    from nvfp4_indexer.triton.decode import DecodeRunner
    from nvfp4_indexer.triton.heuristics import MMA_MAXNREG, MMA_STAGES
    from nvfp4_indexer.triton.launcher import CachedLaunch
    from nvfp4_indexer.triton.mma_scorer import mma_score_kernel

    dev = torch.device("cuda", torch.cuda.current_device())
    b, w, q_len, h = args.batch, args.width, 1, 4
    cache = ni.new_index_cache(4096, device=dev)
    bt = torch.randint(0, 4096, (b, w), dtype=torch.int32, device=dev)
    sl = torch.full((b,), 128 * w - 100, dtype=torch.int32, device=dev)
    q = torch.zeros((b * q_len, h, 128), dtype=torch.float8_e4m3fn, device=dev)
    out = torch.empty((b * q_len, h, 16), dtype=torch.int32, device=dev)
    print(f"{torch.cuda.get_device_name(dev)}, B {b} x W {w}, Q {q_len}, H {h}")
    for dq in ("mma", "wgmma", "ptx"):
        r = DecodeRunner(h, b, w, q_len, dev, config=DecodeConfig(dequant=dq))
        us = per_launch_us(lambda r=r: r.run(q, cache, bt, sl, out))
        print(f"DecodeRunner.run {dq:5s} (splits {r.num_splits}): {us:6.1f} us")
    r = DecodeRunner(h, b, w, q_len, dev, config=DecodeConfig(dequant="mma"))
    q8 = q.view(torch.uint8)
    cl, mma, ql, scl = wg.mma_layouts(r.block_m)
    rt = (q8, q8.stride(0), q8.stride(1), cache, cache.stride(0) // 16, cache.shape[0], bt,
          bt.stride(0), w, sl, wg._device_table(dev), r.win)
    kw = dict(Q=q_len, H=h, N=r.block_m, NUM_SPLITS=r.num_splits, CL=cl, MMA=mma, QL=ql,
              SCL=scl, STAGES=MMA_STAGES, num_warps=1, maxnreg=MMA_MAXNREG)
    grid = (b, r.num_splits)
    cached = CachedLaunch(mma_score_kernel, **kw)
    jit_us = per_launch_us(lambda: mma_score_kernel[grid](*rt, **kw))
    print(f"mma scorer, kernel[grid]:  {jit_us:6.1f} us")
    print(f"mma scorer, CachedLaunch:  {per_launch_us(lambda: cached(grid, *rt)):6.1f} us")
    chunk, group = wg._select_blocks(w)
    skw = dict(Q=q_len, H=h, N=r.block_m, CHUNK=chunk, GROUP=group, num_warps=wg.SELECT_WARPS)
    sargs, sgrid = (r.win, sl, w, out), (b, q_len * h)
    select = CachedLaunch(wg._select_kernel, **skw)
    jit_us = per_launch_us(lambda: wg._select_kernel[sgrid](*sargs, **skw))
    print(f"select, kernel[grid]:      {jit_us:6.1f} us")
    print(f"select, CachedLaunch:      {per_launch_us(lambda: select(sgrid, *sargs)):6.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
