"""CPU lab: host time of CachedLaunch's key and direct launch, against a revision.

The current ``nvfp4_indexer/triton/launcher.py`` against the one at a git revision (``--against``).

Runs without a GPU: the compiled kernel is a stand-in whose ``run`` does nothing, the device
and stream come from a stand-in driver (their real cost on a GPU host is not in these numbers;
the current code reads them through ``driver.active`` once, the old one through
``torch.cuda.current_device`` and ``driver.active``). Per case, median over repeats of
``timeit`` (microseconds per call):

- ``key``: what a direct launch computes as its key (the revision's ``_launch_key``; now the
  per-launch typed key, ``CachedLaunch.key``);
- ``call``: a whole direct ``CachedLaunch.__call__`` (key, lookup, grid, stream, hooks, run);
- ``call+hook``: the same with a launch-enter hook installed (launch metadata, hook chains).

Cases: 12 runtime arguments (7 tensors, 5 ints: a decode scorer's size) and the select
kernel's (4 arguments, 3 tensors).

    python -m benchmarks.labs.launch_key_cpu [--against HEAD] [--repeat 15] [--number 20000]

``--against ''`` times the current code only.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import timeit
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from triton import knobs

from nvfp4_indexer.triton import launcher as current
from .cli import lab_parser

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "HEAD"  # the committed launcher: time an edit of it against the last commit


@triton.jit
def _twelve(t0, i0, i1, t1, i2, i3, t2, i4, t3, t4, t5, t6, C: tl.constexpr):
    pass


@triton.jit
def _four(scores, seq_lens, width, out, Q: tl.constexpr):
    pass


class _Compiled:
    """``CompiledKernel``'s interface; ``run`` does nothing."""
    function, packed_metadata = 0, 0

    def __init__(self):
        self.run = lambda *a: None

    def _init_handles(self):
        pass

    def launch_metadata(self, grid, stream, *args):
        return None


class _Jit:
    """A JIT function's stand-in: its parameters; ``fn[grid](...)`` returns the stand-in."""
    __name__ = "stand_in"

    def __init__(self, fn):
        self.params, self.kernel = current._params(fn), _Compiled()

    def __getitem__(self, grid):
        return lambda *a, **k: self.kernel


class _Driver:
    """``triton.runtime.driver.driver``'s stand-in (``active`` a property, as Triton's)."""
    _active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 0)

    @property
    def active(self):
        return self._active


def load(ref: str):
    """``launcher.py`` at git revision ``ref`` as a module of the package (relative imports
    work); None when git or the revision is not there."""
    try:
        src = subprocess.run(["git", "show", f"{ref}:nvfp4_indexer/triton/launcher.py"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    name = f"nvfp4_indexer.triton._launcher_at_{ref.replace('-', '_').replace('.', '_')}"
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    mod.__package__ = "nvfp4_indexer.triton"
    exec(compile(src, f"{ref}:launcher.py", "exec"), mod.__dict__)
    return mod


@contextmanager
def stand_in_device(mod):
    saved = mod.driver, torch.cuda.current_device
    mod.driver, torch.cuda.current_device = _Driver(), lambda: 0
    try:
        yield
    finally:
        mod.driver, torch.cuda.current_device = saved


def cases() -> dict:
    """name -> (kernel, grid, runtime arguments)."""
    t = [torch.zeros(64, dtype=d) for d in (torch.float8_e4m3fn, torch.uint8, torch.int32,
                                             torch.int32, torch.uint8, torch.float32,
                                             torch.int32)]
    return {"12 args (7 tensors)": (_twelve, (64, 4), (t[0], 512, 128, t[1], 8192, 4096, t[2],
                                                       256, t[3], t[4], t[5], t[6])),
            "4 args (3 tensors)": (_four, (64, 16), (t[5], t[3], 256, t[6]))}


def per_call_us(fn, number: int, repeat: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure(mod, kernel, grid, args, number: int, repeat: int) -> dict:
    """The three timings of one case with the launcher module ``mod``."""
    with stand_in_device(mod):
        launch = mod.CachedLaunch(_Jit(kernel), **{p.name: 1 for p in _Jit(kernel).params
                                                   if p.is_constexpr})
        launch.direct = True
        launch(grid, *args)  # the JIT launch: keeps the stand-in
        launch(grid, *args)
        key = getattr(launch, "key", None)
        if key is not None:
            key_fn = lambda: key(0, args)  # noqa: E731
        else:
            key_fn = lambda: mod._launch_key(0, args)  # noqa: E731
        out = {"key": per_call_us(key_fn, number, repeat),
               "call": per_call_us(lambda: launch(grid, *args), number, repeat)}
        hook = lambda *a: None  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            out["call+hook"] = per_call_us(lambda: launch(grid, *args), number, repeat)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert len(launch.compiled) == 1
    return out


def main(argv=None) -> int:
    ap = lab_parser(__doc__)
    ap.add_argument("--against", default=BEFORE, help="git revision to compare with ('' none)")
    ap.add_argument("--number", type=int, default=20000, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=15, help="timings (the median is printed)")
    args = ap.parse_args(argv)
    mods = {"now": current}
    if args.against:
        old = load(args.against)
        if old is None:
            print(f"launch_key_cpu: no launcher.py at {args.against!r}: timing the current code")
        else:
            mods = {args.against: old, "now": current}
    print(f"us per call, median of {args.repeat} x {args.number} (CPU, stand-in kernel)")
    print(f"{'case':22} {'what':10} " + " ".join(f"{m:>9}" for m in mods)
          + ("   ratio" if len(mods) == 2 else ""))
    for name, (kernel, grid, call_args) in cases().items():
        res = {m: measure(mod, kernel, grid, call_args, args.number, args.repeat)
               for m, mod in mods.items()}
        for what in ("key", "call", "call+hook"):
            vals = [res[m][what] for m in mods]
            ratio = f"   {vals[0] / vals[1]:5.2f}x" if len(vals) == 2 else ""
            print(f"{name:22} {what:10} " + " ".join(f"{v:9.2f}" for v in vals) + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
