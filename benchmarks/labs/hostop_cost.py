"""GPU lab: host time of each device op an engine step issues (``Indexer.plan`` /
``forward`` host time).

Calls are queued behind a sleeping kernel, so the GPU never waits and ``perf_counter`` over
``n`` calls measures host work only. Prints microseconds per call of:

- the decode metadata copy of a decode-only ``plan`` (B x W block table + seq lens,
  ``torch._foreach_copy_``), and the same bytes through a small Triton copy kernel launched
  by ``CachedLaunch`` and by its compiled launcher handed addresses (ints: what
  ``CachedLaunch`` passes) or tensors (Triton's launcher then calls ``data_ptr()`` and
  ``cuPointerGetAttribute`` per pointer): the launcher's own host cost;
- ``DecodeRunner.run`` ("mma", B x W) eagerly and one replay of it captured in a CUDA graph;
- the prefill staging copy of a mixed ``plan`` (``n`` int32): ``tensor.copy_(non_blocking=
  True)`` from pinned (``pin_memory``), pageable and ``cudaHostRegister``-ed host memory, the
  driver's ``cuMemcpyHtoDAsync`` through ctypes, ``Event.record`` and ``Event.query`` (a copy
  that synchronizes with the stream would show as ~50 us per call: the sleeping kernel);
- ``torch.cuda.device(dev)`` entered and left, ``torch.cuda.current_device()``.

    python -m benchmarks.labs.hostop_cost [--calls 200]
"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch
import triton
import triton.language as tl

from .cli import gpu_args, lab_parser


@triton.jit
def _copy_rows_kernel(src, src_stride, dst, dst_stride, cols, src_seq, dst_seq,
                      BLOCK: tl.constexpr):
    b = tl.program_id(0)
    tl.store(dst_seq + b, tl.load(src_seq + b))
    for c0 in range(0, cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < cols
        tl.store(dst + b * dst_stride + c, tl.load(src + b * src_stride + c, mask=m), mask=m)


def per_call_us(fn, n: int = 200, rounds: int = 5) -> float:
    """Median over ``rounds`` of the host microseconds per call of ``fn`` (``n`` calls queued
    behind a sleeping kernel)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    got = []
    for _ in range(rounds):
        torch.cuda._sleep(int(2e9 * 0.00005 * n))  # ~50 us per call at 2 GHz: never drains
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        got.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(got)


def _raw_run(launch, grid, args):
    """A ``CachedLaunch``'s compiled kernel called with ``args`` as given (no key, no hooks)."""
    (run, function, packed, _k), = launch.compiled.values()
    stream = torch.cuda.current_stream().cuda_stream
    tail = launch.tail
    g = tuple(grid) + (1,) * (3 - len(grid))
    return lambda: run(*g, stream, function, packed, None, None, None, *args, *tail)


def main(argv=None) -> int:
    ap = lab_parser(__doc__)
    ap.add_argument("--calls", type=int, default=200)
    args = gpu_args(ap, argv, "hostop_cost")
    import nvfp4_indexer as ni
    from nvfp4_indexer.triton.config import DecodeConfig
    from nvfp4_indexer.triton.decode import DecodeRunner
    from nvfp4_indexer.triton.launcher import CachedLaunch
    n = args.calls
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, host us per call")
    rows = []

    for b, w in ((64, 256), (256, 1250)):
        src_bt = torch.randint(0, 1 << 20, (b, w), dtype=torch.int32, device=dev)
        src_sl = torch.randint(1, 1 << 20, (b,), dtype=torch.int32, device=dev)
        dst_bt = torch.full((256, w), -1, dtype=torch.int32, device=dev)
        dst_sl = torch.full((256,), -1, dtype=torch.int32, device=dev)
        dst = [dst_bt[:b], dst_sl[:b]]
        rows.append((f"decode copy B{b} x W{w}: torch._foreach_copy_", per_call_us(
            lambda: torch._foreach_copy_(dst, [src_bt, src_sl], non_blocking=True), n)))
        launch = CachedLaunch(_copy_rows_kernel, BLOCK=256, num_warps=1)
        targs = (src_bt, src_bt.stride(0), dst[0], dst[0].stride(0), w, src_sl, dst[1])
        dst[0].fill_(-1)
        launch((b,), *targs)
        launch((b,), *targs)
        torch.cuda.synchronize()
        assert torch.equal(dst[0], src_bt) and torch.equal(dst[1], src_sl)
        rows.append((f"decode copy B{b} x W{w}: Triton kernel, CachedLaunch", per_call_us(
            lambda: launch((b,), *targs), n)))
        iargs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in targs)
        rows.append((f"decode copy B{b} x W{w}: compiled launch, 4 tensors",
                     per_call_us(_raw_run(launch, (b,), targs), n)))
        rows.append((f"decode copy B{b} x W{w}: compiled launch, 4 addresses",
                     per_call_us(_raw_run(launch, (b,), iargs), n)))

    b, w, h = 64, 256, 4
    cache = ni.new_index_cache(4096, device=dev)
    bt = torch.randint(0, 4096, (b, w), dtype=torch.int32, device=dev)
    sl = torch.full((b,), 128 * w - 100, dtype=torch.int32, device=dev)
    q = torch.zeros((b, h, 128), dtype=torch.float8_e4m3fn, device=dev)
    out = torch.empty((b, h, 16), dtype=torch.int32, device=dev)
    runner = DecodeRunner(h, b, w, 1, dev, config=DecodeConfig(dequant="mma"))
    rows.append((f"DecodeRunner.run mma B{b} x W{w}, eager",
                 per_call_us(lambda: runner.run(q, cache, bt, sl, out), n)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        runner.run(q, cache, bt, sl, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        runner.run(q, cache, bt, sl, out)
    rows.append((f"DecodeRunner.run mma B{b} x W{w}, CUDAGraph.replay",
                 per_call_us(g.replay, n)))

    for k in (64, 1024):
        devbuf = torch.empty(k, dtype=torch.int32, device=dev)
        hosts = {"pinned": torch.arange(k, dtype=torch.int32).pin_memory(),
                 "pageable": torch.arange(k, dtype=torch.int32)}
        reg = torch.arange(k, dtype=torch.int32)
        rc = torch.cuda.cudart().cudaHostRegister(reg.data_ptr(), 4 * k, 0)
        if int(rc) == 0:
            hosts["registered"] = reg
        for name, host in hosts.items():
            devbuf.zero_()
            devbuf.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(devbuf.cpu(), host)
            rows.append((f"staging H2D {4 * k} B: copy_(non_blocking) from {name}",
                         per_call_us(lambda: devbuf.copy_(host, non_blocking=True), n)))
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            fn = cuda.cuMemcpyHtoDAsync_v2
            fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            host = hosts["pinned"]
            dptr, hptr, nb = devbuf.data_ptr(), host.data_ptr(), 4 * k

            def raw():
                rc = fn(dptr, hptr, nb, torch.cuda.current_stream().cuda_stream)
                if rc:
                    raise RuntimeError(f"cuMemcpyHtoDAsync: CUresult {rc}")
            rows.append((f"staging H2D {4 * k} B: cuMemcpyHtoDAsync pinned (ctypes)",
                         per_call_us(raw, n)))
        except OSError as e:
            rows.append((f"staging H2D: cuMemcpyHtoDAsync unavailable ({e})", float("nan")))
    ev = torch.cuda.Event()
    rows.append(("Event.record", per_call_us(ev.record, n)))
    ev.record()
    torch.cuda.synchronize()
    rows.append(("Event.query (done)", per_call_us(ev.query, n)))

    def guard():
        with torch.cuda.device(dev):
            pass
    rows.append(("with torch.cuda.device(dev)", per_call_us(guard, n)))
    rows.append(("torch.cuda.current_device()", per_call_us(torch.cuda.current_device, n)))
    width = max(len(r[0]) for r in rows)
    for name, us in rows:
        print(f"{name:{width}s} {us:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
