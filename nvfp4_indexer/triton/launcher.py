"""Low host-overhead launches of Triton / Gluon kernels (eager engine steps, SPEC 8.1).

``kernel[grid](*args, **constexprs)`` spends 20-25 us of host time per launch on the H200's host
(binding the arguments, hashing the specialization, Gluon layout constexprs included) before the
driver call; a compiled kernel's own launch costs 6-9 us (``docs/performance.md``). ``CachedLaunch`` fixes a kernel's constexprs and options once, goes through
Triton's JIT on the first launch of each argument *specialization* (which compiles, or finds
the compiled kernel, and launches it), keeps the compiled kernel, and launches it directly
afterwards.

The specialization key is at least as fine as Triton's own (``native_specialize_impl``): per
tensor its dtype and whether its address is a multiple of 16 bytes, per int whether it is 1,
a multiple of 16 and which integer type it needs, per float / bool / None its type, plus the
current CUDA device and the two compile options the JIT reads from ``triton.knobs`` at every
launch (``runtime.debug``, ``compilation.instrumentation_mode``). So a launch never reuses a
kernel compiled for a different specialization. A direct launch builds that key with a function
made for the argument types of the first one (``_typed_key``: one pass of straight-line code,
a type guard per argument, ints' classes cached), falling back to the generic ``_launch_key``
when the types differ: 3.7 against 10.6 us for 12 arguments on the CI CPU
(``benchmarks/labs/launch_key_cpu.py``). The same pass reads each tensor's address once and
hands the compiled kernel that int: Triton's launcher then skips its own ``data_ptr()`` call
and ``cuPointerGetAttribute`` check per pointer argument (a tensor's device type is part of
the key, so a CPU tensor still takes the JIT path and its error). Under the interpreter
(``TRITON_INTERPRET=1``) or without CUDA every launch goes through the JIT, after the same
checks (parameter layout, constexprs, argument count and types) as on a GPU: CPU tests see the
errors a GPU launch would raise.
"""

from __future__ import annotations

import functools
import inspect

import torch
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.runtime.jit import KernelParam

from .device import interpreting


def _arg_key(a):
    """The part of one runtime argument's specialization a compiled kernel depends on (any
    argument type: the reference the per-launch key below is checked against)."""
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
    key) and each runtime argument's specialization. Any argument types (the fallback of
    ``_typed_key``); raises ``TypeError`` on an unsupported one."""
    return (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            *map(_arg_key, args))


def _untyped(device, args):
    """``CachedLaunch.key`` before the first direct launch: no key (``_typed_key`` builds it)."""
    return None


_INT_CODES: dict = {}  # int value -> _int_code(value); bounded (ints such as lengths vary)
_INT_CODES_MAX = 4096


def _int_code(a: int) -> int:
    """An exact int's specialization class as one small int, never 0: the fields of
    ``_arg_key`` (equal to 1, a multiple of 16, within i32, below 2 ** 63) as bits. Kept in
    ``_INT_CODES`` while it holds fewer than ``_INT_CODES_MAX`` values."""
    c = 16 | (a == 1) | (a % 16 == 0) << 1 | (-2 ** 31 <= a < 2 ** 31) << 2 | (a < 2 ** 63) << 3
    if len(_INT_CODES) < _INT_CODES_MAX:
        _INT_CODES[a] = c
    return c


def _typed_key(args: tuple):
    """A key function for the launches whose runtime arguments have the exact types of
    ``args`` (None if one is unsupported: the generic key raises for it).

    ``key(device, args)`` returns None when an argument's type differs from those (the caller
    falls back to ``_launch_key``), else ``(key, launch_args)``. ``key`` is a flat tuple: the
    device, the two knobs of ``_launch_key``, per tensor its dtype and whether it is a CUDA
    tensor, per tensor whether its address is a multiple of 16, per int its ``_int_code``.
    None / bool / float arguments add nothing: with their type fixed, so is their
    specialization. ``launch_args`` is ``args`` with each tensor replaced by its address (an
    int: what the compiled kernel's launcher takes without a driver query). As fine as
    ``_launch_key`` for those types, in one pass of straight-line code (as Triton builds its
    argument binder): no Python call per argument but ``data_ptr`` and the int cache's
    ``get``."""
    types = tuple(map(type, args))
    if all(issubclass(t, torch.Tensor) or t in (int, float, bool, type(None)) for t in types):
        return _key_function(types)
    return None


@functools.lru_cache(maxsize=256)
def _key_function(types: tuple):
    """``_typed_key``'s function for the argument types ``types`` (shared by launches)."""
    names = [f"a{i}" for i in range(len(types))]
    tensors = [n for n, t in zip(names, types) if issubclass(t, torch.Tensor)]
    ints = [n for n, t in zip(names, types) if t is int]
    ptr = {n: f"p{n}" for n in tensors}  # each tensor's address, read once
    fields = ["device", "knobs.runtime.debug", "knobs.compilation.instrumentation_mode",
              *(f"{n}.dtype" for n in tensors), *(f"{n}.is_cuda" for n in tensors),
              *(f"{ptr[n]} & 15 == 0" for n in tensors),
              *(f"(codes_get({n}) or int_code({n}))" for n in ints)]
    passed = [ptr.get(n, n) for n in names]
    guard = " and ".join(f"type({n}) is t{i}" for i, n in enumerate(names)) or "True"
    unpack = f"    {', '.join(names)}, = args\n" if names else ""
    reads = "".join(f"        {ptr[n]} = {n}.data_ptr()\n" for n in tensors)
    src = (f"def key(device, args):\n{unpack}"
           f"    if {guard}:\n{reads}"
           f"        return ({', '.join(fields)},), ({''.join(p + ', ' for p in passed)})\n"
           f"    return None\n")
    scope = {"knobs": knobs, "codes_get": _INT_CODES.get, "int_code": _int_code,
             **{f"t{i}": t for i, t in enumerate(types)}}
    exec(compile(src, "<CachedLaunch key>", "exec"), scope)
    return scope["key"]


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
        self.compiled: dict = {}  # key -> (launcher, function, packed metadata, CompiledKernel)
        self.key = _untyped  # the argument types' key function, set at the first direct launch
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
        drv = driver.active  # what the JIT reads the device and the stream from
        device = drv.get_current_device()
        got = self.key(device, args)
        if got is None:  # the first direct launch, or argument types other than its
            if self.key is _untyped:
                typed = _typed_key(args)
                if typed is not None:
                    self.key = typed
                    got = typed(device, args)
        if got is None:  # raises TypeError on an unsupported argument type
            key, launch_args = ("any types", *_launch_key(device, args)), args
        else:
            key, launch_args = got
        entry = self.compiled.get(key)
        if entry is None:  # Triton's JIT: compile (or find) and launch; keep the compiled kernel
            k = self.fn[grid](*args, **self.kwargs)
            if k is None:  # the JIT skipped the launch (a ``jit_cache_hook`` said so): so do we
                return
            if hasattr(k, "result"):
                k = k.result()
            k._init_handles()
            self.compiled[key] = (k.run, k.function, k.packed_metadata, k)
            return
        run, function, packed, k = entry
        n = len(grid)
        g1 = grid[1] if n > 1 else 1
        g2 = grid[2] if n > 2 else 1
        stream = drv.get_current_stream(device)  # at every launch (CUDA graphs)
        rt = knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        if ((enter.calls if type(enter) is HookChain else enter is not None)
                or (leave.calls if type(leave) is HookChain else leave is not None)):
            full = args + self.tail  # a profiler's hooks get what the JIT gives them
            run(grid[0], g1, g2, stream, function, packed, k.launch_metadata(grid, stream, *full),
                enter, leave, *launch_args, *self.tail)
        else:  # no hook to call: no launch metadata to build (host time)
            run(grid[0], g1, g2, stream, function, packed, None, None, None, *launch_args,
                *self.tail)
