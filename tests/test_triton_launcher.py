"""``triton.launcher.CachedLaunch``: eager launches with little host work (issue 14).

CPU (interpreter): every launch goes through the JIT and gives its result; the specialization
key separates what Triton's own specialization separates (tensor dtype and 16-byte alignment,
ints equal to 1 / divisible by 16 / wider than 32 bits). GPU: a direct launch after the first
one of each specialization gives the JIT's result, a misaligned view gets its own compiled
kernel, and a launch captured in a CUDA graph replays with fresh inputs.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from nvfp4_indexer.triton.launcher import CachedLaunch, _arg_key

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, B: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) * a + B, mask=m)


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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_direct_launches_per_specialization_and_in_graphs():
    launch = CachedLaunch(_axpb_kernel, B=-7, BLOCK=64, num_warps=1)
    assert launch.direct
    base = torch.arange(512, dtype=torch.int32, device=DEV)
    y = torch.empty(256, dtype=torch.int32, device=DEV)
    for off in (0, 0, 1, 1):  # second launch of each specialization is direct
        _run(launch, base[off:off + 256], y, 3)
        assert torch.equal(y, base[off:off + 256] * 3 - 7)
    assert len(launch.compiled) == 2
    with pytest.raises(TypeError, match="expected 4 runtime arguments"):
        launch((1,), base, y, 256)
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
