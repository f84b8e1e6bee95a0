"""Timing, measured ceilings and the environment record (WORKLOADS.md "How to measure").

- ``time_graph``: CUDA-graph replay timing. The calls (one per cold-cache rotation slot) are
  captured ``graph_calls`` at a time; a sample is one replay of every graph, timed with CUDA
  events; the result is the median per-call time over ``replays`` samples after ``warmup``
  replays (MiniMax-AI/MSA protocol: 120 calls per graph, 5 warm-up, 20 timed replays).
- ``time_eager``: for calls that cannot be captured (they sync on device values): each call is
  timed alone with CUDA events, after a write of ``flush_bytes`` (>= 2x L2) that evicts the
  cache (as ``triton.testing.do_bench`` does); median over the samples.
- ``time_host``: wall clock with a device sync, for the slow PyTorch reference.
- ``copy_ceiling``: device-to-device copy, bytes read + bytes written per second.
- ``stream_ceilings``: read-only (``x.sum()``) and write-only (``y.fill_``) DRAM bandwidth,
  bytes / time each; ``mix_ceiling_gbps`` combines them for a kernel's read / write split.
- ``fp8_matmul_ceiling``: ``torch._scaled_mm`` E4M3 x E4M3 -> bf16 (cuBLAS), 2*M*N*K / time.
- ``mm16_matmul_ceiling``: ``torch.matmul`` fp16 and bf16 (cuBLAS, 16-bit tensor cores, half
  the FP8 peak), 2*M*N*K / time.
- ``environment``: GPU, driver, versions, commit, date.

On a CPU device (``--cpu-smoke``) the same functions run with ``time.perf_counter`` and no
graphs; such numbers prove the code paths work and are never reported as measurements.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

GRAPH_CALLS = 120
WARMUP = 5
REPLAYS = 20
MAX_CV = 0.03  # a sample set with a larger coefficient of variation is re-measured once
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Timing:
    """Per-call time of one timed function. ``us`` is the median of ``samples_us``."""

    us: float
    samples_us: list[float]
    cv: float
    method: str  # "cuda-graph" | "cuda-graph-single[+flush]" | "cuda-events-eager+flush" | ...
    calls_per_sample: int
    graphs: int = 0
    note: str = ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["samples_us"] = [round(s, 4) for s in self.samples_us]
        return d


def _cv(samples: list[float]) -> float:
    mean = statistics.fmean(samples)
    return statistics.pstdev(samples) / mean if mean > 0 else float("inf")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rotation_slots(bytes_per_call: int, l2_bytes: int, graph_calls: int = GRAPH_CALLS,
                   max_slots: int | None = None) -> int:
    """Disjoint input sets ("slots") so that a slot's bytes are re-read only after >= 2x L2 of
    other slots' traffic: at least ``2 * L2 // bytes + 2``, rounded to a divisor of
    ``graph_calls`` (each slot runs equally often in a graph) or up to a multiple of it
    (several graphs). ``max_slots`` (pool capacity) caps the result; the caller reports the
    reuse distance actually reached."""
    minimum = (2 * l2_bytes) // max(1, bytes_per_call) + 2
    if minimum <= graph_calls:
        slots = next(d for d in range(minimum, graph_calls + 1) if graph_calls % d == 0)
    else:
        slots = -(-minimum // graph_calls) * graph_calls
    if max_slots is not None and slots > max_slots:
        slots = max(1, max_slots)
    return slots


def graph_sequence(num_slots: int, graph_calls: int) -> list[list[int]]:
    """Slot indices per graph: one graph of ``graph_calls`` calls cycling the slots when they
    fit, else consecutive chunks of ``graph_calls`` slots (every slot once per sample)."""
    if num_slots <= graph_calls:
        reps = -(-graph_calls // num_slots)
        return [[i % num_slots for i in range(reps * num_slots)]]
    return [list(range(g, min(g + graph_calls, num_slots)))
            for g in range(0, num_slots, graph_calls)]


def _run_on_side_stream(calls: list[Callable[[], object]], device: torch.device) -> None:
    """Run every call once eagerly on a side stream (as torch recommends before capture), so
    compilation and lazy initialization stay out of the capture and the numbers."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def _capture(calls: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``calls`` in order."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def time_graph(calls: list[Callable[[], object]], device: torch.device, *,
               graph_calls: int = GRAPH_CALLS, warmup: int = WARMUP,
               replays: int = REPLAYS) -> Timing:
    """Median per-call time of CUDA-graph replays of ``calls`` (one per rotation slot).

    Every call runs once eagerly first (on a side stream, as torch recommends before capture),
    so compilation and lazy initialization stay out of the capture and the numbers.

    Raises:
        RuntimeError (or the capture's own error): a call that cannot be captured.
    """
    _run_on_side_stream(calls, device)
    seq = graph_sequence(len(calls), graph_calls)
    graphs = [_capture([calls[i] for i in chunk]) for chunk in seq]
    total = sum(len(chunk) for chunk in seq)
    best: list[float] | None = None
    for _attempt in range(2):  # re-measure once when the spread is large
        for _ in range(warmup):
            for g in graphs:
                g.replay()
        torch.cuda.synchronize(device)
        samples = []
        for _ in range(replays):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for g in graphs:
                g.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / total)
        if best is None or _cv(samples) < _cv(best):
            best = samples
        if _cv(best) <= MAX_CV:
            break
    del graphs
    return Timing(statistics.median(best), best, _cv(best), "cuda-graph", total, len(seq))


def time_graph_single(calls: list[Callable[[], object]], device: torch.device, *,
                      flush: "L2Flush | None" = None, warmup: int = 2, max_samples: int = 20,
                      min_samples: int = 5, max_seconds: float = 1.5) -> Timing:
    """Median device time of one CUDA-graph replay of a call, each after an L2 flush, with
    events around the replay: ``time_eager``'s protocol and cache state on each call's
    captured graph, so no host launch overhead inside (the baseline an eager call is
    compared with).

    Raises:
        RuntimeError (or the capture's own error): a call that cannot be captured.
    """
    _run_on_side_stream(calls, device)
    graphs = [_capture([c]) for c in calls]
    t = time_eager([g.replay for g in graphs], device, flush=flush, warmup=warmup,
                   max_samples=max_samples, min_samples=min_samples, max_seconds=max_seconds)
    t.method = "cuda-graph-single+flush" if flush is not None else "cuda-graph-single"
    return t


class L2Flush:
    """A scratch buffer whose overwrite evicts the L2 before an eagerly timed call."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device = device
        self.buf = torch.empty(max(nbytes, 1) // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.fill_(0x5A5A5A5A)


def time_eager(calls: list[Callable[[], object]], device: torch.device, *,
               flush: L2Flush | None = None, warmup: int = 2, max_samples: int = 20,
               min_samples: int = 5, max_seconds: float = 1.5) -> Timing:
    """Median time of single eager calls (cycling ``calls``), each after an L2 flush.

    CUDA: events around each call (host work and syncs inside the call count). CPU:
    ``perf_counter``. Takes ``min_samples``..``max_samples`` samples, stopping after
    ``max_seconds`` of timed calls.
    """
    cuda = device.type == "cuda"
    for i in range(warmup):
        calls[i % len(calls)]()
    sync(device)
    samples: list[float] = []
    spent = 0.0
    i = 0
    while len(samples) < max_samples and (len(samples) < min_samples or spent < max_seconds):
        c = calls[i % len(calls)]
        i += 1
        if flush is not None:
            flush()
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            c()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3
        else:
            t0 = time.perf_counter()
            c()
            us = (time.perf_counter() - t0) * 1e6
        samples.append(us)
        spent += us * 1e-6
    method = "cuda-events-eager+flush" if cuda else "cpu-wall-clock"
    return Timing(statistics.median(samples), samples, _cv(samples), method, 1)


def time_host(fn: Callable[[], object], device: torch.device, *, warmup: int = 1,
              repeats: int = 3, max_seconds: float = 3.0) -> Timing:
    """Wall-clock time of ``fn`` with a device sync after each call (the PyTorch reference:
    it syncs internally and is never graph-captured). Stops early past ``max_seconds``."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples, spent = [], 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t0
        samples.append(dt * 1e6)
        spent += dt
        if spent > max_seconds:
            break
    return Timing(statistics.median(samples), samples, _cv(samples), "host-wall-clock+sync", 1)


# ---------------------------------------------------------------------------------------------
# Ceilings

def _time_ceiling(fn: Callable[[], object], device: torch.device, calls: int,
                  replays: int) -> Timing:
    """Graph-replay timing of a ceiling workload; eager events if capture fails; CPU clock."""
    if device.type != "cuda":
        return time_eager([fn], device, warmup=1, max_samples=3, min_samples=2)
    try:
        return time_graph([fn], device, graph_calls=calls, warmup=2, replays=replays)
    except Exception as e:  # noqa: BLE001 - fall back to eager timing, and say so
        torch.cuda.synchronize(device)
        t = time_eager([fn], device, warmup=2, max_samples=replays, min_samples=replays)
        t.note = f"graph capture failed ({type(e).__name__}: {str(e)[:160]})"
        return t


def copy_ceiling(device: torch.device, nbytes: int | None = None) -> dict:
    """Device-to-device copy bandwidth: ``dst.copy_(src)`` of ``nbytes`` random bytes,
    GB/s = 2 * nbytes (read + written) / median time.

    CUDA: timed twice, captured in a CUDA graph and eagerly with events; the ceiling is the
    faster of the two. On an H200 the graph-captured copy becomes a memcpy node
    that ran at 2.76 TB/s while the same ``copy_`` launched eagerly ran at 4.1-4.3 TB/s (five
    runs), so a graph-only ceiling would flatter every ratio by 1.5x. CPU: perf_counter.
    """
    cuda = device.type == "cuda"
    nbytes = nbytes or ((2 << 30) if cuda else (8 << 20))
    gen = torch.Generator(device=device).manual_seed(7)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)
    dst = torch.empty_like(src)
    res = _bandwidth(lambda: dst.copy_(src), device, 2 * nbytes)
    if not torch.equal(dst[:4096], src[:4096]):
        raise RuntimeError("copy ceiling: the copy did not copy")
    return {"bytes_per_copy": nbytes, **res}


def _bandwidth(fn: Callable[[], object], device: torch.device, nbytes: int) -> dict:
    """GB/s = ``nbytes`` / median time of ``fn``: captured in a CUDA graph and (CUDA only)
    eagerly with events, the faster of the two (see ``copy_ceiling``); CPU: perf_counter.
    Returns ``{"gbps", "method", "gbps_by_method", "timing"}``."""
    timings = {"graph": _time_ceiling(fn, device, calls=4, replays=15)}
    if device.type == "cuda":
        timings["eager"] = time_eager([fn], device, warmup=2, max_samples=15, min_samples=15,
                                      max_seconds=1.0)
    gbps = {k: nbytes / (t.us * 1e-6) / 1e9 for k, t in timings.items()}
    best = max(gbps, key=gbps.get)
    return {"gbps": gbps[best], "method": best, "gbps_by_method": gbps,
            "timing": timings[best].as_dict()}


def stream_ceilings(device: torch.device, nbytes: int | None = None) -> dict:
    """Read-only and write-only DRAM bandwidth over a float32 buffer of ``nbytes`` bytes
    (2 GiB on CUDA, 1 MiB on CPU): read = ``x.sum()`` of uniform random values, write =
    ``y.fill_(1.5)``, each GB/s = ``nbytes`` / median time, timed as ``copy_ceiling`` (faster
    of graph and eager). On an H200 read ran at 4204 GB/s and write at 4564 GB/s
    against a 4139-4249 GB/s copy, so kernels that mostly write can beat "100 % of copy".

    Returns:
        ``{"bytes", "read_gbps", "write_gbps", "method": {"read", "write"}, "read": {...},
        "write": {...}}``; the last two as ``_bandwidth`` returns them.
    Raises:
        RuntimeError: the sum or the fill gave a wrong result (the timed op did not run).
    """
    cuda = device.type == "cuda"
    nbytes = nbytes or ((2 << 30) if cuda else (1 << 20))
    n = nbytes // 4
    gen = torch.Generator(device=device).manual_seed(13)
    x = torch.rand(n, dtype=torch.float32, device=device, generator=gen)
    y = torch.empty(n, dtype=torch.float32, device=device)
    read = _bandwidth(lambda: x.sum(), device, 4 * n)
    write = _bandwidth(lambda: y.fill_(1.5), device, 4 * n)
    mean = float(x.sum()) / n  # uniform [0, 1): 0.5 to ~1e-3 already at 2^18 values
    if abs(mean - 0.5) > 0.01:
        raise RuntimeError(f"stream ceiling: sum / n = {mean}, expected about 0.5")
    if not (bool((y[:4096] == 1.5).all()) and float(y[-1]) == 1.5):
        raise RuntimeError("stream ceiling: the fill did not fill")
    return {"bytes": 4 * n, "read_gbps": read["gbps"], "write_gbps": write["gbps"],
            "method": {"read": read["method"], "write": write["method"]},
            "read": read, "write": write}


def mix_ceiling_gbps(read_bytes: float, write_bytes: float, read_gbps: float,
                     write_gbps: float) -> float:
    """Bandwidth ceiling (GB/s) of a kernel that reads ``read_bytes`` and writes
    ``write_bytes``: reads and writes share the DRAM bus, so their times add,
    ``(r + w) / (r / read_gbps + w / write_gbps)`` (a bytes-weighted harmonic mean).

    Raises:
        ValueError: no bytes at all, negative bytes, or a non-positive rate.
    """
    if read_bytes < 0 or write_bytes < 0 or read_bytes + write_bytes <= 0:
        raise ValueError(f"bytes: expected >= 0 and not both 0, got read {read_bytes}, "
                         f"write {write_bytes}")
    if not (read_gbps > 0 and write_gbps > 0):
        raise ValueError(f"rates: expected > 0 GB/s, got read {read_gbps}, write {write_gbps}")
    return (read_bytes + write_bytes) / (read_bytes / read_gbps + write_bytes / write_gbps)


def _scaled_mm(a, b, scale_a, scale_b, fast_accum: bool):
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                           use_fast_accum=fast_accum)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)


# Interleaved timing rounds of the matmul ceilings on CUDA (each variant's best is kept): one
# round per variant gave 657 then 763 TFLOP/s for the same fp16 matmul minutes apart on one
# H200; the GPU's clocks settle while it runs.
MATMUL_ROUNDS = 3


def _matmul_rates(fns: dict, n: int, device: torch.device, make_fallback,
                  rounds: int | None = None, time_fn: Callable[..., Timing] | None = None) -> dict:
    """Time each ``fns[key]()`` (an [n, n] matmul; checked for shape and finite values first)
    as a ceiling, in ``rounds`` interleaved rounds (every variant once per round; default
    ``MATMUL_ROUNDS`` on CUDA, 1 on CPU), keeping each variant's fastest round; a variant that
    raises is recorded with its error. Returns ``{"m", "n", "k", "variants", "best", "tflops",
    "stand_in"}`` with the fastest variant (each variant also lists ``rounds_tflops``); on
    CPU, when none ran, ``make_fallback()()`` (an fp32 matmul) stands in, marked
    ``stand_in``. ``time_fn(fn, device, calls, replays) -> Timing`` times one round
    (default: the ceiling protocol)."""
    flops = 2 * n ** 3
    time_fn = time_fn or _time_ceiling
    rounds = rounds or (MATMUL_ROUNDS if device.type == "cuda" else 1)
    results, timed = {}, {}  # timed: key -> its Timing per round
    for key, fn in fns.items():
        try:
            ref = fn()
            if ref.shape != (n, n) or not torch.isfinite(ref.float()).all():
                raise RuntimeError("unexpected output")
            timed[key] = []
        except Exception as e:  # noqa: BLE001 - record why a variant is unavailable
            results[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    for _ in range(rounds):
        for key in list(timed):
            try:
                timed[key].append(time_fn(fns[key], device, calls=5, replays=10))
            except Exception as e:  # noqa: BLE001 - a later round's failure keeps the earlier
                if not timed[key]:
                    results[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    del timed[key]
    for key, ts in timed.items():
        t = min(ts, key=lambda x: x.us)
        results[key] = {"tflops": flops / (t.us * 1e-6) / 1e12, "us": t.us, "method": t.method,
                        "cv": t.cv, "note": t.note,
                        "rounds_tflops": [flops / (x.us * 1e-6) / 1e12 for x in ts]}
    best = max(timed, key=lambda k: results[k]["tflops"], default=None)
    out = {"m": n, "n": n, "k": n, "variants": results, "best": best,
           "tflops": results[best]["tflops"] if best else None, "stand_in": False}
    if best is None and device.type != "cuda":
        t = time_eager([make_fallback()], device, warmup=1, max_samples=3, min_samples=2)
        out.update(tflops=flops / (t.us * 1e-6) / 1e12, best="fp32-matmul", stand_in=True)
    return out


def fp8_matmul_ceiling(device: torch.device, size: int | None = None) -> dict:
    """cuBLAS FP8 matmul rate through ``torch._scaled_mm``: E4M3 [M, K] x E4M3 [K, N]
    (column-major) -> bf16, random operands, M = N = K = ``size`` (8192 on CUDA). Tries
    tensor-wise (scalar) scales, then row-wise scales, each with and without fast
    accumulation; the ceiling is the fastest variant that ran. Variants that raise are
    recorded with their error. On CPU (smoke) a failed ``_scaled_mm`` falls back to an fp32
    matmul, marked ``stand_in``."""
    cuda = device.type == "cuda"
    n = size or (8192 if cuda else 64)
    gen = torch.Generator(device=device).manual_seed(11)
    a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn).t()
    one = torch.ones((), dtype=torch.float32, device=device)
    variants = {
        "tensorwise": (one, one),
        "rowwise": (torch.ones(n, 1, dtype=torch.float32, device=device),
                    torch.ones(1, n, dtype=torch.float32, device=device)),
    }
    fns = {f"{name}{'+fast_accum' if fast else ''}":
           functools.partial(_scaled_mm, a, b, sa, sb, fast)
           for name, (sa, sb) in variants.items() for fast in (False, True)}
    def fallback():
        af, bf = a.float(), b.float()
        return lambda: af @ bf
    return _matmul_rates(fns, n, device, fallback)


def mm16_matmul_ceiling(device: torch.device, size: int | None = None) -> dict:
    """cuBLAS 16-bit matmul rate through ``torch.matmul``: [M, K] x [K, N] random operands in
    float16 and in bfloat16 (fp32 accumulation on the 16-bit tensor cores, whose peak is half
    the FP8 one), M = N = K = ``size`` (8192 on CUDA, 64 on CPU); TFLOP/s = 2*M*N*K / time.
    The ceiling is the faster dtype; a dtype that raises is recorded with its error. On CPU
    (smoke), when neither ran, an fp32 matmul stands in, marked ``stand_in``. Shaped like
    ``fp8_matmul_ceiling``'s result (variants keyed ``float16`` / ``bfloat16``)."""
    cuda = device.type == "cuda"
    n = size or (8192 if cuda else 64)
    gen = torch.Generator(device=device).manual_seed(12)
    a32 = torch.randn(n, n, device=device, generator=gen)
    b32 = torch.randn(n, n, device=device, generator=gen)
    fns = {str(dt).removeprefix("torch."): functools.partial(torch.matmul, a32.to(dt), b32.to(dt))
           for dt in (torch.float16, torch.bfloat16)}
    return _matmul_rates(fns, n, device, lambda: lambda: a32 @ b32)


# ---------------------------------------------------------------------------------------------
# Environment

def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def source_digest() -> str:
    """sha256 over the library's and the benchmarks' Python sources (path + bytes), so a run
    without git metadata can still be tied to a source tree."""
    h = hashlib.sha256()
    for sub in ("nvfp4_indexer", "benchmarks"):
        for p in sorted((REPO_ROOT / sub).rglob("*.py")):
            h.update(str(p.relative_to(REPO_ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes (CUDA properties; 60 MB if torch does not say)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 60 * 1024 * 1024)


def environment(device: torch.device) -> dict:
    """GPU name, driver, versions, commit, date (WORKLOADS.md: recorded with every table)."""
    import nvfp4_indexer
    from nvfp4_indexer.provenance import git_state
    commit, dirty = git_state(REPO_ROOT)
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvfp4_indexer": nvfp4_indexer.__version__,
        "spec_version": nvfp4_indexer.SPEC_VERSION,
        "argv": sys.argv,
        "source_sha256_16": source_digest(),
        "git_commit": os.environ.get("NVFP4_BENCH_COMMIT") or commit,
        "git_dirty": dirty,
        "device_type": device.type,
    }
    for module in ("triton", "numpy"):
        try:
            env[module] = importlib.import_module(module).__version__
        except ImportError:
            env[module] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update({
            "gpu": p.name,
            "gpu_capability": f"{p.major}.{p.minor}",
            "gpu_sms": p.multi_processor_count,
            "gpu_memory_bytes": p.total_memory,
            "gpu_l2_bytes": l2_bytes(device),
            "gpu_uuid": str(getattr(p, "uuid", "")),
        })
        q = _run(["nvidia-smi", f"--id={device.index or 0}",
                  "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
                  "power.limit,temperature.gpu", "--format=csv,noheader"])
        if q:
            keys = ("driver", "clock_sm", "clock_sm_max", "clock_mem", "power_limit",
                    "temperature_c")
            env.update({f"nvsmi_{k}": v.strip() for k, v in zip(keys, q.split(","))})
            env["driver"] = env.pop("nvsmi_driver")
        else:
            env["driver"] = None
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["cpu_threads"] = torch.get_num_threads()
    return env

