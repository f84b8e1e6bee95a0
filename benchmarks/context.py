"""What every benchmark suite shares: the ``Context`` (device, protocol, ceilings, page
pool), the output poison and the per-case record fields (``finish``: GB/s, TFLOP/s, ratios
to the ceilings; ``ref_time``: the PyTorch reference's time)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from nvfp4_indexer.conformance.fixtures import OUT_POISON

from . import workloads as wl
from .pool import PagePool
from .timing import (L2Flush, Timing, mix_ceiling_gbps, time_eager, time_graph,
                     time_graph_single, time_host)

POISON = OUT_POISON  # never a valid output value (outputs are >= -1)

# The parts of workloads.Traffic.parts that a gather / insert call writes; every other part is
# read. Traffic keeps no read / write split, so the split is derived here from the part names
# (gather: the FP8 workspace; insert: the 72 B per token written into the pages).
WRITTEN_PARTS = {"gather": ("workspace",), "insert": ("writes",)}


@dataclass
class Context:
    """Everything a suite needs: device, mode, protocol, ceilings, pool and the sinks."""

    device: torch.device
    smoke: bool
    fast_backend: str  # "triton" (GPU) or "reference" (CPU smoke)
    l2_bytes: int
    graph_calls: int
    warmup: int
    replays: int
    deadline: float  # time.monotonic() past which cases are skipped
    reference: bool = True
    ref_max_pages_bytes: int = 64_000_000
    ref_max_flops: float = 2.5e12
    copy_gbps: float | None = None
    matmul_tflops: float | None = None  # FP8 _scaled_mm ceiling
    mm16_tflops: float | None = None  # 16-bit (fp16 / bf16) matmul ceiling
    read_gbps: float | None = None  # read-only DRAM ceiling (stream_ceilings)
    write_gbps: float | None = None  # write-only DRAM ceiling
    pool: PagePool | None = None
    flush: L2Flush | None = None
    seed: int = 0
    allow_fp8_mma: bool = False  # decode / prefill / engine suites: opt-in FP8 MMA (SPEC 9 b = 5)
    log: Callable[[str], None] = print
    on_case: Callable[[str, list], None] = lambda suite, recs: None
    cuda_broken: bool = False
    errors: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def gen(self, name: str) -> torch.Generator:
        """A device generator seeded from the case name (same inputs on every run)."""
        seed = self.seed * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name))
        return torch.Generator(device=self.device).manual_seed(seed)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def ref_allowed(self, pages_bytes: int, flops: float = 0.0) -> str | None:
        """None when the reference may be timed on this case, else why not."""
        if not self.reference:
            return "reference timing off (--no-reference)"
        if pages_bytes > self.ref_max_pages_bytes:
            return f"pages > {self.ref_max_pages_bytes / 1e6:.0f} MB (reference cap)"
        if flops > self.ref_max_flops:
            return f"flops > {self.ref_max_flops:.1e} (reference cap)"
        if self.time_left() < 30:
            return "time budget"
        return None

    def check_cuda(self) -> None:
        """After an error: is the CUDA context still usable? (Sticky errors end GPU work.)"""
        if not self.cuda:
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001
            self.cuda_broken = True
            self.log(f"CUDA context unusable after an error ({type(e).__name__}: {e}); "
                     "remaining GPU cases are skipped")

    # -- timing helpers -----------------------------------------------------------------------

    def _cpu_eager(self, calls: list[Callable]):
        # CPU smoke: the reference is slow on CPU; one call proves the path, no claims
        return time_eager(calls, self.device, warmup=0, max_samples=1, min_samples=1)

    def time_capturable(self, calls: list[Callable]) -> Timing:
        """Graph replay timing on CUDA (eager + flush if capture fails); eager on CPU."""
        if not self.cuda:
            return self._cpu_eager(calls)
        try:
            return time_graph(calls, self.device, graph_calls=self.graph_calls,
                              warmup=self.warmup, replays=self.replays)
        except Exception as e:  # noqa: BLE001 - fall back, but say so
            self.check_cuda()
            if self.cuda_broken:
                raise
            t = self.time_uncapturable(calls)
            t.note = f"graph capture failed ({type(e).__name__}: {str(e)[:160]})"
            return t

    def time_capturable_single(self, calls: list[Callable]) -> Timing:
        """One graph replay per sample after an L2 flush (``timing.time_graph_single``): the
        kernels of an eager call without its host overhead, in the same cache state."""
        if not self.cuda:
            return self._cpu_eager(calls)
        return time_graph_single(calls, self.device, flush=self.flush, warmup=2,
                                 max_samples=20, min_samples=5)

    def time_uncapturable(self, calls: list[Callable], max_samples: int = 20) -> Timing:
        if not self.cuda:
            return self._cpu_eager(calls)
        return time_eager(calls, self.device, flush=self.flush, warmup=2,
                          max_samples=max_samples, min_samples=5)


# ---------------------------------------------------------------------------------------------
# Per-case records

def _gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def written_bytes(suite: str, parts: dict) -> int:
    """Bytes a ``suite`` ("gather" / "insert") call writes: the sum of its ``WRITTEN_PARTS``
    of ``Traffic.parts`` (bytes); the rest of ``bytes_moved`` is read.

    Raises:
        KeyError: a written part missing from ``parts`` (the traffic model was renamed).
    """
    return sum(parts[k] for k in WRITTEN_PARTS[suite])


def finish(ctx: Context, rec: dict, t, nbytes: int, flops: int,
            bytes_written: int | None = None) -> dict:
    """Timing, GB/s, TFLOP/s and the ratios to the ceilings. ``bytes_written`` (of
    ``nbytes``; gather / insert) adds the read / write split and the mix ceiling."""
    rec["us"] = t.us
    rec["timing"] = t.as_dict()
    rec["gbps"] = _gbps(nbytes, t.us)
    rec["copy_ratio"] = rec["gbps"] / ctx.copy_gbps if ctx.copy_gbps else None
    rec["tflops"] = flops / (t.us * 1e-6) / 1e12 if flops else 0.0
    rec["matmul_ratio"] = (rec["tflops"] / ctx.matmul_tflops
                           if flops and ctx.matmul_tflops else None)
    rec["mm16_ratio"] = rec["tflops"] / ctx.mm16_tflops if flops and ctx.mm16_tflops else None
    if bytes_written is not None:
        rec["bytes_read"], rec["bytes_written"] = nbytes - bytes_written, bytes_written
        mix = (mix_ceiling_gbps(nbytes - bytes_written, bytes_written, ctx.read_gbps,
                                ctx.write_gbps) if ctx.read_gbps and ctx.write_gbps else None)
        rec["mix_ceiling_gbps"] = mix
        rec["mix_ratio"] = rec["gbps"] / mix if mix else None
    if rec.get("ref_us"):
        rec["speedup"] = rec["ref_us"] / t.us
    return rec


def traffic_fields(tr: wl.Traffic) -> dict:
    return {"history_pages": tr.history_pages, "pages_bytes": tr.pages_bytes,
            "bytes_moved": tr.bytes_moved, "bytes_parts": tr.parts, "flops": tr.flops,
            "intensity_flop_per_byte": tr.flops / tr.bytes_moved if tr.bytes_moved else 0.0}


def compare_rows(ctx: Context, rec: dict, out: torch.Tensor, flops: float, pages_bytes: int,
                 ref_fn: Callable[[], torch.Tensor], single: bool = False) -> torch.Tensor:
    """After the first fast call wrote ``out`` [rows, H, 16]: record ``out_fully_written`` (no
    POISON left) and, where ``ctx.ref_allowed``, the reference's time and the share of rows
    equal to its output (``rows_equal_reference``); else why it was skipped (``ref_skipped``).
    Returns a copy of ``out`` (later timed calls overwrite it)."""
    rec["out_fully_written"] = bool((out != POISON).all())
    out0 = out.clone()
    why = ctx.ref_allowed(pages_bytes, flops)
    if why is None:
        ref = ref_time(ctx, rec, ref_fn, flops, single=single)
        rec["rows_equal_reference"] = float((ref == out0).all(dim=-1).float().mean())
    else:
        rec["ref_skipped"] = why
    return out0


def ref_time(ctx: Context, rec: dict, fn: Callable[[], object], est_flops: float = 0.0,
              single: bool = False):
    """Time the PyTorch reference on the case's inputs and return its result (for the
    comparison). Light cases: median of 3 after a warm-up; heavy ones, the CPU smoke and
    ``single``: one call."""
    holder = {}

    def call():
        holder["out"] = fn()
    light = est_flops <= 2e11 and not ctx.smoke and not single
    t = time_host(call, ctx.device, warmup=1 if light else 0, repeats=3 if light else 1,
                  max_seconds=3.0)
    rec["ref_us"] = t.us
    rec["ref_timing"] = t.as_dict()
    return holder["out"]
