"""Repeated device-to-device copies replayed from CUDA graphs (host time of ``Indexer.plan``).

A decode-only engine step copies the step's block table and seq lens into the decode
wrapper's buffers (SPEC 8.1: what the wrapper's CUDA graphs read). Engines keep those two
tensors at fixed addresses from step to step (vLLM's persistent input buffers), so the same
copy, between the same addresses, repeats every step (a mixed step's decode rows take the
same copy when its block table is narrower than the buffers). ``CopyGraphs`` replays such a
copy from a CUDA graph captured once: a decode-only plan's copy takes a median 6.7 us of host
time on one H200 host against 12.2 us with ``torch._foreach_copy_`` (~5 against ~7.9 us on a
faster host).

Exactness: a graph's copy reads its source addresses when it is replayed, so it copies what
the current step's tensors hold. The caller's key must determine the copy (the sources'
addresses, shapes and strides, and anything else not fixed by its own checks; one cache serves
one fixed list of destination tensors); a key without a graph copies eagerly.

Limits: CUDA builds of torch >= 2.6 only (``supported``: older releases set up RNG state on
every capture and replay; ROCm syncs when a graph is destroyed); at most ``capacity`` graphs,
and no capture past ``max_captures`` (an engine that passes fresh tensors every step keeps
the eager copy instead of capturing each step); a capture that fails turns the cache off
with a warning (the copy itself was done eagerly first). Not for use inside a CUDA-graph
capture (``Indexer.plan`` runs outside capture).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

__all__ = ["CopyGraphs"]


def _torch_at_least(major: int, minor: int) -> bool:
    try:
        v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:  # an unparsable local build: assume recent
        return True
    return v >= (major, minor)


class CopyGraphs:
    """Device-to-device copies ``dst[i].copy_(src[i])`` into fixed destination tensors, from
    CUDA graphs for the keys seen ``capture_after`` times (CUDA only: ``supported``).

    Args:
        device: the CUDA device of the copies, to make the capture stream at construction
            (the first stream of a process waits for the device; made at the first capture
            when None).
        capacity: graphs kept (the least recently used dropped past it), >= 1.
        capture_after: copies of one key run eagerly before it is captured (>= 1; the
            capture, a few hundred us of host time once, follows that last eager copy).
        max_captures: captures in all (default ``4 * capacity``); past it new keys copy
            eagerly, the graphs kept still replay.
    Raises:
        ValueError: a count < 1.
    """

    def __init__(self, device: torch.device | None = None, capacity: int = 8,
                 capture_after: int = 2, max_captures: int | None = None):
        max_captures = 4 * capacity if max_captures is None else max_captures
        if capacity < 1 or capture_after < 1 or max_captures < 1:
            raise ValueError(f"capacity, capture_after, max_captures: expected >= 1, got "
                             f"{capacity}, {capture_after}, {max_captures}")
        self.capacity = capacity
        self.capture_after = capture_after
        self.max_captures = max_captures
        self._graphs: OrderedDict = OrderedDict()  # key -> torch.cuda.CUDAGraph
        self._seen: OrderedDict = OrderedDict()  # key -> eager copies so far
        # side stream for captures (torch captures off the default one), made now: the first
        # stream torch hands out initializes its stream pool, which waits for the device
        self._stream = None
        if device is not None and torch.device(device).type == "cuda":
            self._stream = torch.cuda.Stream(device)
        self.replays = 0  # statistics (tests, labs)
        self.captures = 0
        self.enabled = True

    @staticmethod
    def supported(device: torch.device) -> bool:
        """True where replays are worth it and safe: a CUDA device, a CUDA (not ROCm) build
        of torch >= 2.6."""
        return device.type == "cuda" and torch.version.hip is None and _torch_at_least(2, 6)

    def __len__(self) -> int:
        return len(self._graphs)

    def copy(self, key, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i], non_blocking=True)`` for every i on the current stream:
        a graph replay when ``key`` has one, else eagerly (one multi-tensor copy), then a
        capture for ``key`` at its ``capture_after``-th eager copy.

        Warns:
            RuntimeWarning: once, when a capture fails; the cache then stays eager (the
            copy itself has been done).
        """
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            g.replay()
            self.replays += 1
            return
        torch._foreach_copy_(dst, src, non_blocking=True)
        if not self.enabled or self.captures >= self.max_captures:
            return
        n = self._seen.pop(key, 0) + 1
        if n < self.capture_after:
            self._seen[key] = n
            if len(self._seen) > 4 * self.capacity:  # keys seen once and never again
                self._seen.popitem(last=False)
            return
        try:
            self._graphs[key] = self._capture(dst, src)
        except Exception as e:  # noqa: BLE001 - the copy is done; stay eager from now on
            self.enabled = False
            self._graphs.clear()
            warnings.warn(f"nvfp4_indexer: copies stay eager, a CUDA-graph capture failed: "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            return
        self.captures += 1
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)

    def _capture(self, dst, src) -> torch.cuda.CUDAGraph:
        """A graph of the same copy, captured on a side stream (nothing runs: the copy was
        just done eagerly on the current stream)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(dst[0].device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream):
            g.capture_begin(capture_error_mode="thread_local")
            try:
                torch._foreach_copy_(dst, src, non_blocking=True)
            finally:
                g.capture_end()
        return g
