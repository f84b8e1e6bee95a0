#!/usr/bin/env python
"""Host time of ``Indexer.plan`` and of ``Indexer.forward``'s host side, per phase.

Steps as benchmarks/engine_suite.py ``engine_cases`` (H = 4, CUDA-graph sizes 1..256): decode-only
batches of 1 / 8 / 64 / 256 requests, Q = 1 / 4, seq lens ``make_seq_lens`` around 8_000 / 32_000 /
128_000; mixed steps of 64 or 256 decodes (Q = 1, ~32_000) + one or two prefill requests of
2_048 / 8_192 new tokens on 0 / 32_768 / 131_072 cached tokens.

Per step it prints
  plan      median host wall clock of ``Indexer.plan`` (no sync inside; nothing wrapped)
  phases    median per phase of plan (methods wrapped by perf_counter; the wrapped names that
            exist in this checkout are used, the rest skipped; wrapping adds ~0.3 us a phase)
  fwd       median host wall clock of ``Indexer.forward`` (GPU: the launches are enqueued, the
            device is synced between samples, not inside; CPU: every Triton kernel is stubbed to
            a no-op, so it is the Python host path only, without Triton's own launcher)
  fwd phases  per phase of forward (validation, decode run, gather / score / merge launches)

Usage (from a checkout, its venv):
  CPU:  TRITON_INTERPRET=1 python -m benchmarks.labs.engine_hostprof [--all] [--backend triton]
  GPU:  python -m benchmarks.labs.engine_hostprof --all          (device cuda, backend triton)
  --profile NAME   cProfile plan (and forward) of the step NAME, top 25 by tottime
  --launches       GPU: the device ops of one plan / forward (forward's include its plan's)
  --ops            the torch ops of one plan that do work (views left out; any device, CPU
                   too: ``DeviceOps``); on the CPU the staging copy is skipped (host = device)
  --repeats N      samples per median (default 50 on a GPU, 20 on the CPU)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nvfp4_indexer as ni
from nvfp4_indexer import engine as eng

from ..engine_suite import step_metadata

H = 4
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SEED = 1701


def make_seq_lens(batch: int, nominal: int) -> list[int]:
    """The decode suite's seq lens (``benchmarks.workloads.make_seq_lens``, seed 1701)."""
    from benchmarks.workloads import make_seq_lens as suite_seq_lens
    return suite_seq_lens(batch, nominal, 1, seed=SEED)


def cases(full: bool):
    """(name, batch, Q, nominal, prefills)."""
    out = []
    for s in (8_000, 32_000, 128_000):
        for q in (1, 4):
            for b in (1, 8, 64, 256):
                out.append((b, q, s, ()))
    for b in (64, 256):
        for n in (2_048, 8_192):
            for c in (0, 32_768, 131_072):
                out.append((b, 1, 32_000, ((n, c),)))
                out.append((b, 1, 32_000, ((n, c), (n, c))))
    named = []
    for b, q, s, p in out:
        name = f"b{b}_q{q}_s{s}" + "".join(f"+p{n}c{c}" for n, c in p)
        named.append((name, b, q, s, p))
    if full:
        return named
    keep = {"b8_q1_s32000", "b64_q4_s32000", "b256_q1_s32000", "b256_q4_s128000",
            "b64_q1_s32000+p2048c32768", "b64_q1_s32000+p8192c131072+p8192c131072",
            "b256_q1_s32000+p2048c0+p2048c0", "b256_q1_s32000+p8192c131072+p8192c131072"}
    return [c for c in named if c[0] in keep]


def build(case, dev, backend):
    name, b, q, nominal, prefills = case
    sl = make_seq_lens(b, nominal) + [n + c for n, c in prefills]
    q_lens = [q] * b + [n for n, _ in prefills]
    rows = sum(q_lens)
    config = ni.IndexerConfig(H, max(sl), rows, b + len(prefills), max_decode_query_len=q,
                              cudagraph_batch_sizes=GRAPH_SIZES, device=dev)
    ix = ni.Indexer(config, backend=backend)
    nblocks = 64  # forward's host path does not depend on the cache's contents
    gen = torch.Generator().manual_seed(7)
    bt = torch.randint(0, nblocks, (len(sl), config.max_pages), dtype=torch.int32,
                       generator=gen).to(dev)
    step = step_metadata(q_lens, sl, bt, b, dev)
    cache = ni.new_index_cache(nblocks, device=dev)
    index_q = torch.zeros((rows, H, 128), dtype=torch.float8_e4m3fn, device=dev)
    out = torch.empty((rows, H, 16), dtype=torch.int32, device=dev)
    return ix, step, cache, index_q, out


class DeviceOps(TorchDispatchMode):
    """Record the aten ops that do work (not views) while active: ``ops``, their names in
    call order. A plan's device ops on any device (on the CPU its host copies' torch ops
    would show too; ``plan`` reads those through numpy)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def device_ops(fn) -> list[str]:
    """Names of the aten ops (views left out) ``fn()`` issues, in order."""
    with DeviceOps() as mode:
        fn()
    return mode.ops


class Phases:
    """Wrap named callables with perf_counter accumulators (per call of the outer op)."""

    def __init__(self):
        self.acc = defaultdict(float)
        self.samples = defaultdict(list)
        self._undo = []

    def wrap(self, owner, attr, label):
        import inspect
        fn = inspect.getattr_static(owner, attr, None)
        if fn is None:
            return
        own = isinstance(owner, type) and attr in owner.__dict__ or not isinstance(owner, type)
        if isinstance(fn, staticmethod):
            raw = fn.__func__
        else:
            raw = getattr(owner, attr) if isinstance(owner, type) else fn
        acc = self.acc

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return raw(*a, **kw)
            finally:
                acc[label] += time.perf_counter() - t0
        setattr(owner, attr, staticmethod(timed) if isinstance(fn, staticmethod) else timed)
        self._undo.append((owner, attr, fn if own else None))

    def flush(self):
        for k, t in self.acc.items():
            self.samples[k].append(t * 1e6)
        self.acc.clear()

    def medians(self):
        return {k: statistics.median(v) for k, v in self.samples.items()}

    def undo(self):
        for owner, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(owner, attr)  # was inherited
            else:
                setattr(owner, attr, fn)
        self._undo.clear()


PLAN_PHASES = [  # (owner, attribute, label); missing ones are skipped
    (eng.Indexer, "_check_step", "check_step"),
    (eng.Indexer, "decoder", "decoder_lookup"),
    (eng, "plan_prefill_chunks", "chunking"),
    (eng.Indexer, "_plan_prefill", "prefill_plan"),
    (eng.Indexer, "_stage_row_blocks", "  row_blocks"),
    (eng.Indexer, "_launch_template", "  launch_params"),
    (eng._HostPlannedDecodeWrapper, "plan_from_host", "decode_copies"),
    (eng._HostPlannedDecodeWrapper, "plan_eager", "decode_in_place"),
    (eng._Staging, "copy", "  h2d_copy"),
]
FWD_PHASES = [
    (eng.Indexer, "_check_forward", "fwd_checks"),
    (eng.Indexer, "_decode_rows", "decode_rows"),
    (eng.Indexer, "_prefill_rows", "prefill_rows"),
]


def stub_kernels():
    """CPU: every Triton kernel of the package a no-op (the host path alone)."""
    import importlib
    import pkgutil
    import nvfp4_indexer.triton as pkg
    n = 0
    for m in pkgutil.walk_packages(pkg.__path__, "nvfp4_indexer.triton."):
        mod = importlib.import_module(m.name)
        for obj in vars(mod).values():
            if type(obj).__name__ in ("InterpretedFunction", "JITFunction") and \
                    hasattr(obj, "run"):
                obj.run = lambda *a, **kw: None
                n += 1
    return n


def timed_median(fn, repeats, sync):
    s = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        s.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(s), min(s)


def phase_medians(spec, fn, repeats: int, gpu: bool) -> dict:
    """Median host time per phase of ``repeats`` calls of ``fn`` with the methods ``spec``
    ((owner, attribute, label) triples) wrapped by ``Phases``; the device synced between calls."""
    ph = Phases()
    for owner, attr, label in spec:
        ph.wrap(owner, attr, label)
    try:
        for _ in range(repeats):
            if gpu:
                torch.cuda.synchronize()
            fn()
            ph.flush()
    finally:
        ph.undo()
    return ph.medians()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--all", action="store_true",
                   help="every engine_suite case (+ 256-decode mixed)")
    p.add_argument("--backend", default=None, help="triton (default) or reference")
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--profile", default=None, metavar="NAME")
    p.add_argument("--no-forward", action="store_true")
    p.add_argument("--launches", action="store_true",
                   help="GPU: list the device ops (kernels, copies) of one plan and one forward")
    p.add_argument("--ops", action="store_true",
                   help="the torch ops (views left out) of one plan, any device")
    a = p.parse_args()
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = a.backend or "triton"
    gpu = dev.type == "cuda"
    if not gpu:  # one thread: intra-op thread pools on a shared CPU stall the copies
        torch.set_num_threads(1)
    repeats = a.repeats or (50 if gpu else 20)
    if not gpu and backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("CPU with backend triton: run with TRITON_INTERPRET=1")
        print(f"# {stub_kernels()} Triton kernels stubbed (CPU: host path only)")
    print(f"# device {dev}, backend {backend}, repeats {repeats}, torch {torch.__version__}")
    sel = cases(a.all)
    if a.profile:
        sel = [c for c in sel + cases(True) if c[0] == a.profile][:1]
        if not sel:
            sys.exit(f"no case {a.profile!r}")
    for case in sel:
        ix, step, cache, index_q, out = build(case, dev, backend)
        md = ix.plan(step)  # first use: builds (compiles) the decode wrapper
        if not a.no_forward:
            ix.forward(index_q, cache, md, out)
        if gpu:
            torch.cuda.synchronize()
        plan_med, plan_min = timed_median(lambda: ix.plan(step), repeats, gpu)
        pm = phase_medians(PLAN_PHASES, lambda: ix.plan(step), repeats, gpu)
        line = (f"{case[0]:44s} plan {plan_med:7.1f} us (min {plan_min:6.1f}, "
                f"{len(md.prefill_chunks)} chunks) | " +
                " ".join(f"{k.strip()}={v:.1f}" for k, v in pm.items()))
        print(line)
        if a.ops:
            ops = device_ops(lambda: ix.plan(step))
            print(f"{'':44s} plan torch ops ({len(ops)}): " + ", ".join(ops))
        if not a.no_forward:
            md = ix.plan(step)
            f_med, f_min = timed_median(lambda: ix.forward(index_q, cache, md, out), repeats,
                                        gpu)
            fm = phase_medians(FWD_PHASES, lambda: ix.forward(index_q, cache, md, out),
                               repeats, gpu)
            print(f"{'':44s} fwd  {f_med:7.1f} us (min {f_min:6.1f}) | " +
                  " ".join(f"{k}={v:.1f}" for k, v in fm.items()))
        if a.launches and gpu:
            from torch.profiler import ProfilerActivity, profile
            for label, fn in (("plan", lambda: ix.plan(step)),
                              ("forward", lambda: ix.forward(index_q, cache, ix.plan(step), out))):
                if label == "forward" and a.no_forward:
                    continue
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                dev_ops = [e.name for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA]
                print(f"{'':44s} {label} device ops ({len(dev_ops)}): " + ", ".join(
                    n[:40] for n in dev_ops))
        if a.profile:
            for label, fn in (("plan", lambda: ix.plan(step)),
                              ("forward", lambda: ix.forward(index_q, cache, md, out))):
                if label == "forward" and a.no_forward:
                    continue
                md = ix.plan(step)
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(repeats):
                    fn()
                pr.disable()
                print(f"# cProfile {label} x{repeats}")
                pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        if gpu:
            torch.cuda.synchronize()
        ix = md = None  # free the case's buffers before the next


if __name__ == "__main__":
    main()
