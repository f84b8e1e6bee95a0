"""``triton.launcher.CachedLaunch``: eager launches with little host work.

CPU (interpreter): every launch goes through the JIT and gives its result, after the GPU
path's checks (parameter layout, constexprs, argument count and types); the specialization
key separates what Triton's own specialization separates (tensor dtype and 16-byte alignment,
ints equal to 1 / divisible by 16 / wider than 32 bits), checked against Triton's
``native_specialize_impl`` itself, and the per-launch typed key separates what that key
separates; the direct path's bookkeeping (JIT first, then ``CompiledKernel.run`` with the
padded grid, stream, hooks, arguments and constexprs; a new JIT launch for every change of
specialization, device or compile knob; the same errors) on a stand-in kernel. GPU: a direct
launch after the first one of each specialization gives the JIT's result, a misaligned view
gets its own compiled kernel, and a launch captured in a CUDA graph replays with fresh inputs.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from triton import knobs

from nvfp4_indexer.triton import device as DV
from nvfp4_indexer.triton import launcher
from nvfp4_indexer.triton.launcher import (CachedLaunch, _arg_key, _launch_key, _params,
                                           _typed_key)

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, B: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) * a + B, mask=m)


@triton.jit
def _constexpr_first_kernel(x_ptr, B: tl.constexpr, n):
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros([16], tl.int32) + B + n)


@triton.jit
def _tail_kernel(x_ptr, n, A: tl.constexpr, B: tl.constexpr = 5):
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros([16], tl.int32) + A + B + n)


@triton.jit
def _three_kernel(x_ptr, n, f, A: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, 16), tl.zeros([16], tl.float32) + A + n * f)


class _StandInCompiled:
    """Records what ``CachedLaunch`` hands a compiled kernel (``CompiledKernel``'s interface)."""
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.runs, self.inits = [], 0

    def _init_handles(self):
        self.inits += 1

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream, args)

    def run(self, *a):
        self.runs.append(a)


class _StandInJit:
    """A JIT function's stand-in on CPU: its real parameters; ``fn[grid](...)`` records the JIT
    launch and returns ``kernel`` (None: the JIT skipped it, as a ``jit_cache_hook`` makes it)."""
    __name__ = "stand_in"

    def __init__(self, fn, kernel):
        self.params, self.kernel, self.jit = _params(fn), kernel, []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.jit.append((grid, args, kw))
            return self.kernel
        return run


def _stand_in_driver(monkeypatch) -> SimpleNamespace:
    """Triton's driver on CPU: the current device is ``state.device`` (0), its stream 77 + it."""
    state = SimpleNamespace(device=0)
    monkeypatch.setattr(launcher, "driver", SimpleNamespace(active=SimpleNamespace(
        get_current_device=lambda: state.device, get_current_stream=lambda d: 77 + d)))
    return state


def _direct_stand_in(monkeypatch, kernel, **constexprs):
    """A ``CachedLaunch`` of ``kernel``'s stand-in on the direct path (what a CUDA host
    decides) over the stand-in driver: (driver state, compiled stand-in, JIT stand-in,
    launch)."""
    state = _stand_in_driver(monkeypatch)
    kern = _StandInCompiled()
    fn = _StandInJit(kernel, kern)
    launch = CachedLaunch(fn, **constexprs)
    launch.direct = True
    return state, kern, fn, launch


def _run(launch, x, y, a):
    n = x.numel()
    launch((triton.cdiv(n, 64),), x, y, n, a)


def test_results_equal_the_jit_launch():
    """Every launch (the first through the JIT, later ones direct on a GPU) writes
    ``x * a + B``; views of other alignments, lengths and factors included."""
    launch = CachedLaunch(_axpb_kernel, B=3, BLOCK=64)
    base = torch.arange(300, dtype=torch.int32, device=DEV)
    for off, n, a in ((0, 256, 2), (0, 256, 5), (1, 200, 2), (4, 17, 1), (0, 300, 16)):
        x = base[off:off + n]
        y = torch.full((n,), -1, dtype=torch.int32, device=DEV)
        _run(launch, x, y, a)
        assert torch.equal(y, x * a + 3), (off, n, a)


def test_key_separates_triton_specializations():
    t = torch.zeros(8, dtype=torch.int32)
    assert _arg_key(t) != _arg_key(t[1:])  # 16-byte aligned or not
    assert _arg_key(t) != _arg_key(t.float())  # dtype
    assert len({_arg_key(v) for v in (1, 2, 16, 17, 2 ** 31, -(2 ** 31) - 1, 2 ** 63)}) == 6
    assert _arg_key(2) == _arg_key(3) and _arg_key(32) == _arg_key(48)
    assert _arg_key(True) != _arg_key(1) and _arg_key(None) != _arg_key(0.5)
    with pytest.raises(TypeError, match="unsupported runtime argument"):
        _arg_key("x")


def _specialization_battery():
    """Runtime arguments around every boundary of Triton's specialization: ints near 0, 1,
    multiples of 16 and the i32 / i64 / u64 limits, bools, floats, None, tensors of several
    dtypes at every byte offset 0..32, 0-size and non-contiguous views."""
    ints = {v + d for v in (0, 16, 2 ** 31, -(2 ** 31), 2 ** 32, 2 ** 63, -(2 ** 63))
            for d in (-17, -16, -1, 0, 1, 2, 15, 16)}
    ints |= {2 ** 64 - 16, 2 ** 64 - 1}
    ints = {v for v in ints if -(2 ** 63) <= v < 2 ** 64}
    vals = sorted(ints) + [True, False, 0.0, 1.0, -2.5, 1e300, float("inf"), np.float64(1.0),
                           None]
    raw = torch.zeros(256, dtype=torch.uint8)
    for dtype in (torch.uint8, torch.int32, torch.float32, torch.float8_e4m3fn):
        for off in range(0, 33, dtype.itemsize):
            vals.append(raw[off:].view(dtype)[:8])
    vals += [raw[:0], raw.view(torch.int32)[::3], raw.view(torch.int32).view(8, 8).t(),
             torch.empty(0, dtype=torch.float16)]
    return vals


def test_key_is_at_least_as_fine_as_triton():
    """Two arguments with one key get one Triton specialization (``native_specialize_impl``,
    what ``JITFunction.run`` keys its compiled kernels on), for every parameter flag
    combination (const pointer, ``do_not_specialize``, ``do_not_specialize_on_alignment``):
    a direct launch never reuses a kernel compiled for other assumptions."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    vals = _specialization_battery()
    flags = list(itertools.product((False, True), repeat=3))
    by_key: dict = {}
    for v in vals:
        by_key.setdefault(_arg_key(v), []).append(v)
    assert len(by_key) > 12  # the battery spans many keys
    for key, group in by_key.items():
        for is_const, spec, align in flags:
            got = {repr(native_specialize_impl(backend, v, is_const, spec, align))
                   for v in group}
            assert len(got) == 1, (key, (is_const, spec, align), got)


def test_key_follows_device_and_jit_compile_knobs(monkeypatch):
    """The JIT keys its kernels on ``debug`` and ``instrumentation_mode`` read from the knobs
    at every launch (``JITFunction.run``): turning either on after a first launch must not
    reuse the kernel compiled without it; the device separates too."""
    args = (torch.zeros(4), 3, None)
    k0 = _launch_key(0, args)
    assert _launch_key(0, args) == k0 and _launch_key(1, args) != k0
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    k1 = _launch_key(0, args)
    assert k1 != k0
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    assert _launch_key(0, args) not in (k0, k1)


def test_direct_path_on_a_stand_in_kernel(monkeypatch):
    """The GPU path's bookkeeping, on CPU: the first launch of a key goes through the JIT
    (constexprs and options as keywords), later ones call ``CompiledKernel.run`` with the grid
    padded to 3, the current stream, the launch metadata and hooks, then the runtime arguments
    and the constexprs in parameter order (defaults included); a launch the JIT skips (it
    returned no kernel) is not kept."""
    _, kern, fn, launch = _direct_stand_in(monkeypatch, _tail_kernel, A=2, num_warps=1)
    x = torch.zeros(8, dtype=torch.int32)
    launch((3,), x, 7)
    assert fn.jit == [((3,), (x, 7), {"A": 2, "num_warps": 1})] and kern.inits == 1
    launch((4, 2), x, 9)  # same key (9, 7: i32, not 1, not a multiple of 16): direct
    assert len(fn.jit) == 1 and len(kern.runs) == 1
    (run,) = kern.runs
    assert run[:6] == (4, 2, 1, 77, "function", "packed")
    assert run[6:9] == (None, None, None)  # no hook installed: no metadata, no hook call
    assert run[9] == x.data_ptr() and run[10:] == (9, 2, 5)  # the address, not the tensor
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:  # a profiler's hook: the JIT's metadata and the hook chains, as the JIT passes them
        launch((4, 2), x, 9)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    run = kern.runs[-1]
    assert run[6] == ("meta", (4, 2), 77, (x, 9, 2, 5))
    assert run[7] is knobs.runtime.launch_enter_hook and run[8] is knobs.runtime.launch_exit_hook
    kern.runs.pop()
    launch((3,), x, 1)  # another specialization: the JIT again
    launch((3,), x[1:], 9)
    assert len(fn.jit) == 3 and len(launch.compiled) == 3 and len(kern.runs) == 1
    skipped = CachedLaunch(_StandInJit(_tail_kernel, None), A=2)
    skipped.direct = True
    skipped((1,), x, 7)
    skipped((1,), x, 7)
    assert skipped.compiled == {} and len(skipped.fn.jit) == 2


def test_checks_run_under_the_interpreter_too():
    """The parameter layout, constexpr, argument count and type checks hold on CPU as on a
    GPU, before any launch (the output stays poisoned)."""
    with pytest.raises(ValueError, match="constexpr parameters must follow"):
        CachedLaunch(_constexpr_first_kernel, B=1)
    with pytest.raises(ValueError, match="constexpr 'BLOCK' not given"):
        CachedLaunch(_axpb_kernel, B=1)
    launch = CachedLaunch(_axpb_kernel, B=3, BLOCK=64)
    x = torch.arange(64, dtype=torch.int32, device=DEV)
    y = torch.full((64,), -1, dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="expected 4 runtime arguments, got 3"):
        launch((1,), x, y, 64)
    with pytest.raises(TypeError, match="unsupported runtime argument type int64"):
        launch((1,), x, y, np.int64(64), 2)
    assert torch.all(y == -1)
    launch((1,), x, y, 64, 2)
    assert torch.equal(y, 2 * x + 3)


def test_typed_key_is_as_fine_as_the_generic_key():
    """The key a direct launch computes (``_typed_key``, made for the first launch's argument
    types) is equal for two arguments of those types only where ``_arg_key`` (checked against
    Triton above) is, at every position of a mixed argument list; it is None (the generic key
    then) for any other type; ints get the same key from the int cache, computed afresh and
    with the cache full."""
    vals = _specialization_battery()
    by_type: dict = {}
    for v in vals:
        by_type.setdefault(type(v), []).append(v)
    assert _typed_key((np.float64(1.0),)) is None  # a float subclass: the generic key's
    del by_type[np.float64]
    base = (torch.zeros(8, dtype=torch.int32), 7, None, 0.5, True, torch.zeros(4), 3)
    typed = _typed_key(base)
    assert typed is _typed_key(tuple(base))  # shared by launches of the same types

    def key(device, args):
        got = typed(device, args)
        if got is None:
            return None
        k, passed = got  # the launch's arguments: each tensor's address in its place
        assert passed == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                               for a in args)
        return k
    assert key(0, base) == key(0, base) and key(1, base) != key(0, base)
    for pos, a in enumerate(base):
        group = by_type[type(a)]
        keys: dict = {}
        for v in group:
            args = base[:pos] + (v,) + base[pos + 1:]
            k = key(0, args)
            assert k is not None and k == key(0, args)
            keys.setdefault(k, set()).add(_arg_key(v))
        assert all(len(g) == 1 for g in keys.values()), (pos, keys)
        assert len(keys) == len({_arg_key(v) for v in group})
        for t, other in by_type.items():
            if t is not type(a):
                assert key(0, base[:pos] + (other[0],) + base[pos + 1:]) is None, (pos, t)
    ints = by_type[int]
    one = _typed_key((0,))
    cached = [one(0, (v,))[0] for v in ints]
    saved = dict(launcher._INT_CODES)
    launcher._INT_CODES.clear()
    try:
        launcher._INT_CODES_MAX, size = 0, launcher._INT_CODES_MAX
        assert [one(0, (v,))[0] for v in ints] == cached and not launcher._INT_CODES
    finally:
        launcher._INT_CODES_MAX = size
        launcher._INT_CODES.update(saved)


def test_direct_launch_rekeys_on_every_specialization_change(monkeypatch):
    """On the direct path a change of tensor dtype or alignment, int class (1, a multiple of 16,
    beyond i32, beyond i64), None / bool / float / int type at a float's place, device or JIT
    compile knob goes through the JIT once, then direct; a change within a class stays direct."""
    state, kern, fn, launch = _direct_stand_in(monkeypatch, _three_kernel, A=2)
    raw = torch.zeros(64, dtype=torch.uint8)
    x = raw[:32].view(torch.int32)
    base = (x, 7, 0.5)
    launch((1,), *base)
    assert len(fn.jit) == 1
    same = [(raw[16:48].view(torch.int32), 9, 1e300), (x, -17, float("inf")),
            (x, 2 ** 31 - 1, 0.0)]
    for args in same:
        launch((1,), *args)
        assert len(fn.jit) == 1 and kern.runs[-1][9:] == (args[0].data_ptr(), *args[1:], 2)
    changes = [(x.float(), 7, 0.5), (raw[4:36].view(torch.int32), 7, 0.5),
               (x.to(torch.int64), 7, 0.5), (x, 1, 0.5), (x, 16, 0.5),
               (x, 2 ** 31, 0.5), (x, -2 ** 31 - 1, 0.5), (x, 2 ** 63, 0.5), (x, 7, None),
               (x, 7, True), (x, 7, 3), (x, True, 0.5), (x, 7.0, 0.5)]
    for i, args in enumerate(changes):
        launch((1,), *args)
        assert len(fn.jit) == 2 + i and fn.jit[-1][1] == args, args
        runs = len(kern.runs)
        launch((1,), *args)
        assert len(fn.jit) == 2 + i and len(kern.runs) == runs + 1, args
    jits = len(fn.jit)
    state.device = 1
    launch((1,), *base)
    launch((1,), *base)
    assert len(fn.jit) == jits + 1 and kern.runs[-1][3] == 78
    state.device = 0
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    launch((1,), *base)
    launch((1,), *base)
    assert len(fn.jit) == jits + 2
    monkeypatch.setattr(knobs.compilation, "instrumentation_mode", "consan")
    launch((1,), *base)
    launch((1,), *base)
    assert len(fn.jit) == jits + 3
    monkeypatch.undo()
    _stand_in_driver(monkeypatch)
    runs = len(kern.runs)
    launch((1,), *base)  # back to the first key: direct
    assert len(fn.jit) == jits + 3 and len(kern.runs) == runs + 1
    assert kern.runs[-1][:4] == (1, 1, 1, 77) and kern.inits == len(fn.jit)


def test_direct_launch_refuses_what_the_jit_path_refuses(monkeypatch):
    """The direct path's errors are the interpreter path's, before the typed key exists and
    after: a wrong argument count, a numpy integer, a string (nothing launched)."""
    _, kern, fn, launch = _direct_stand_in(monkeypatch, _three_kernel, A=2)
    x = torch.zeros(8, dtype=torch.int32)
    for ready in (False, True):
        with pytest.raises(TypeError, match="expected 3 runtime arguments, got 2"):
            launch((1,), x, 7)
        with pytest.raises(TypeError, match="unsupported runtime argument type int64"):
            launch((1,), x, np.int64(7), 0.5)
        with pytest.raises(TypeError, match="unsupported runtime argument type str"):
            launch((1,), x, 7, "0.5")
        assert len(fn.jit) == int(ready) and len(kern.runs) == 0
        assert (launch.key is launcher._untyped) != ready
        launch((1,), x, 7, 0.5)  # builds the typed key
    assert len(fn.jit) == 1 and len(kern.runs) == 1


@pytest.mark.gpu
def test_direct_launches_per_specialization_and_in_graphs():
    launch = CachedLaunch(_axpb_kernel, B=-7, BLOCK=64, num_warps=1)
    assert launch.direct
    base = torch.arange(512, dtype=torch.int32, device=DEV)
    y = torch.empty(256, dtype=torch.int32, device=DEV)
    for off, a in ((0, 3), (0, 5), (1, 3), (1, 5)):  # the second of each key is direct
        y.fill_(-1)
        _run(launch, base[off:off + 256], y, a)
        assert torch.equal(y, base[off:off + 256] * a - 7), (off, a)
    assert len(launch.compiled) == 2
    with pytest.raises(TypeError, match="expected 4 runtime arguments"):
        launch((1,), base, y, 256)
    # a CPU tensor where a CUDA one was: another key, so the JIT's launcher checks the
    # pointer and refuses it (the direct path hands the kernel addresses unchecked)
    with pytest.raises(ValueError, match="cpu tensor"):
        _run(launch, base[:256].cpu(), y, 3)
    x = base[:256].clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(launch, x, y, 3)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        _run(launch, x, y, 3)
    x.add_(1000)
    y.fill_(0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 3 - 7)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter path (no CUDA)")
def test_interpreter_launches_through_the_jit():
    launch = CachedLaunch(_axpb_kernel, B=0, BLOCK=64)
    assert not launch.direct
    x = torch.arange(70, dtype=torch.int32)
    y = torch.empty_like(x)
    _run(launch, x, y, 2)
    assert torch.equal(y, 2 * x) and launch.compiled == {}


def test_device_guard_is_a_no_op_only_when_nothing_would_change():
    """``device.device_guard``: the shared no-op for CPU devices (str or torch.device), a
    CUDA device without an index (torch.cuda.device would pick the current one) and the
    current CUDA device; a ``torch.cuda.device`` that switches for any other GPU."""
    from nvfp4_indexer.triton import numerics
    noop = DV._NO_GUARD
    assert DV.device_guard("cpu") is noop
    assert DV.device_guard(torch.device("cpu")) is noop
    assert DV.device_guard(torch.device("cuda")) is noop
    with DV.device_guard("cpu"), DV.device_guard("cpu"):  # reentrant
        pass
    if HAS_CUDA:
        cur = torch.cuda.current_device()
        assert DV.device_guard(torch.device("cuda", cur)) is noop
        assert DV.device_guard(f"cuda:{cur}") is noop
        if torch.cuda.device_count() > 1:
            other = (cur + 1) % torch.cuda.device_count()
            g = DV.device_guard(torch.device("cuda", other))
            assert isinstance(g, torch.cuda.device)
            with g:
                assert torch.cuda.current_device() == other
            assert torch.cuda.current_device() == cur
