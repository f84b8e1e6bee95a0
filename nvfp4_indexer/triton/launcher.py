"""Low host-overhead launches of Triton / Gluon kernels (issue 14: eager engine steps, SPEC 8.1).

``kernel[grid](*args, **constexprs)`` spends 20-25 us of host time per launch on the H200's host
(binding the arguments, hashing the specialization, Gluon layout constexprs included) before the
driver call; a compiled kernel's own launch costs 6-9 us (``docs/benchmarks.md``, "Issue 14,
eager launches"). ``CachedLaunch`` fixes a kernel's constexprs and options once, goes through
Triton's JIT on the first launch of each argument *specialization* (which compiles, or finds
the compiled kernel, and launches it), keeps the compiled kernel, and launches it directly
afterwards.

The specialization key is at least as fine as Triton's own (``native_specialize_impl``): per
tensor its dtype and whether its address is a multiple of 16 bytes, per int whether it is 1,
a multiple of 16 and which integer type it needs, per float / bool / None its type, plus the
current CUDA device and the two compile options the JIT reads from ``triton.knobs`` at every
launch (``runtime.debug``, ``compilation.instrumentation_mode``). So a launch never reuses a
kernel compiled for a different specialization. Under the interpreter
(``TRITON_INTERPRET=1``) or without CUDA every launch goes through the JIT, after the same
checks (parameter layout, constexprs, argument count and types) as on a GPU: CPU tests see the
errors a GPU launch would raise.
"""

from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import KernelParam

from .numerics import interpreting


def _hooked(hook) -> bool:
    """Whether a launch hook (None, a plain callable, or Triton 3.6's ``HookChain``) would
    call anything."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _arg_key(a):
    """The part of one runtime argument's specialization a compiled kernel depends on."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if type(a) is int:
        return ("i", a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31, a < 2 ** 63)
    if a is None or isinstance(a, (bool, float)):
        return type(a)
    raise TypeError(f"CachedLaunch: unsupported runtime argument type {type(a).__name__}")


def _launch_key(device: int, args: tuple) -> tuple:
    """What the compiled kernel of a launch depends on besides the fixed constexprs and
    options: the CUDA device, the compile options ``JITFunction.run`` reads from the knobs at
    every launch (``runtime.debug``, ``compilation.instrumentation_mode``: part of its cache
    key) and each runtime argument's specialization."""
    return (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            *map(_arg_key, args))


def _params(fn) -> list:
    """``fn``'s parameters as ``KernelParam`` (a JIT function's own; the interpreter's
    ``InterpretedFunction`` has none: built from the signature, with the same annotations)."""
    params = getattr(fn, "params", None)
    if params is None:
        sig = inspect.signature(fn.fn)
        params = [KernelParam(i, p, False, False) for i, p in enumerate(sig.parameters.values())]
    return params


class CachedLaunch:
    """A kernel with fixed constexprs and launch options, launched with little host work.

    Args:
        fn: a ``triton.jit`` or ``gluon.jit`` function whose runtime parameters all come before
            its constexpr parameters (the layout of every kernel in this package).
        **constexprs_and_options: every constexpr parameter by name (those with defaults may
            be left out) and the launch options (``num_warps``, ``maxnreg``, ``launch_pdl``...).
    Call the instance as ``launch(grid, *args)`` (``grid``: a tuple of 1 to 3 ints) with the
    runtime arguments in parameter order. No allocation, no sync: CUDA-graph capturable (the
    current stream is read at every launch). The checks below run on a GPU and under the
    interpreter alike.

    Raises:
        ValueError: a constexpr parameter before a runtime one, or a missing constexpr.
        TypeError (at launch): a number of runtime arguments other than the kernel's, or one
        that is not a tensor, Python int, float, bool or None (a numpy integer, which
        the interpreter would take and Triton's GPU launch refuses).
    """

    def __init__(self, fn, **constexprs_and_options):
        self.fn = fn
        self.kwargs = constexprs_and_options
        self.compiled: dict = {}
        self.direct = not interpreting() and torch.cuda.is_available()
        params = _params(fn)
        runtime = [p for p in params if not p.is_constexpr]
        if any(p.is_constexpr for p in params[:len(runtime)]):
            raise ValueError(f"CachedLaunch({fn.__name__}): constexpr parameters must follow "
                             "the runtime ones")
        self.num_runtime = len(runtime)
        tail = []
        for p in params[len(runtime):]:
            if p.name in constexprs_and_options:
                tail.append(constexprs_and_options[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                raise ValueError(f"CachedLaunch({fn.__name__}): constexpr {p.name!r} not given")
        self.tail = tuple(tail)  # constexpr values in parameter order (the launcher skips them)

    def __call__(self, grid, *args) -> None:
        if len(args) != self.num_runtime:
            raise TypeError(f"CachedLaunch({self.fn.__name__}): expected {self.num_runtime} "
                            f"runtime arguments, got {len(args)}")
        if not self.direct:  # the interpreter: the GPU path's argument type check, the JIT
            for a in args:
                _arg_key(a)
            self.fn[grid](*args, **self.kwargs)
            return
        device = torch.cuda.current_device()
        key = _launch_key(device, args)
        k = self.compiled.get(key)
        if k is None:  # Triton's JIT: compile (or find) and launch; keep the compiled kernel
            k = self.fn[grid](*args, **self.kwargs)
            if k is None:  # the JIT skipped the launch (a ``jit_cache_hook`` said so): so do we
                return
            if hasattr(k, "result"):
                k = k.result()
            k._init_handles()
            self.compiled[key] = k
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = driver.active.get_current_stream(device)  # what the JIT reads
        full = args + self.tail
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _hooked(enter) or _hooked(leave):  # a profiler's hooks get what the JIT gives them
            k.run(grid[0], g1, g2, stream, k.function, k.packed_metadata,
                  k.launch_metadata(grid, stream, *full), enter, leave, *full)
        else:  # no hook to call: no launch metadata to build (host time)
            k.run(grid[0], g1, g2, stream, k.function, k.packed_metadata, None, None, None,
                  *full)
