"""What the device can run: the probes every launcher and dispatch rule asks.

``interpreting`` (Triton's CPU interpreter is on), ``portable_default`` (the ``PORTABLE``
constexpr a launch passes), ``device_guard`` (make a device current for a launch),
``num_sms``, ``capability`` (what a dispatch rule takes: None for a portable device), and the
Gluon probes ``gluon_available``, ``wgmma_available`` (SM90) / ``mma_available`` (SM89+).
Pure host functions of the device; none reads tensor values.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch
import triton

DEFAULT_NUM_SMS = 132  # off CUDA (interpreter), and for sizes computed without a GPU


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def portable_default(device) -> bool:
    """The ``PORTABLE`` constexpr launchers pass for tensors on ``device``: True under the
    interpreter or off CUDA (integer-only encoders), False on a CUDA GPU (native fp8 casts)."""
    return interpreting() or torch.device(device).type != "cuda"


def rows_per_program(n_rows: int, gpu_rows: int = 8) -> int:
    """Rows per program of a row-tiled launch: ``gpu_rows`` on a GPU; under the interpreter
    the next power of two of ``n_rows`` up to 64 (fewer, vectorized programs)."""
    if interpreting():
        return max(1, min(64, triton.next_power_of_2(max(n_rows, 1))))
    return gpu_rows


def launch_rows(kernel, device, portable: bool | None, n_rows: int, block: int, *args,
                **kwargs) -> None:
    """``kernel[(cdiv(n_rows, block),)](*args, PORTABLE=..., **kwargs)`` with ``device``
    current; ``portable`` None passes ``portable_default(device)``."""
    portable = portable_default(device) if portable is None else portable
    with device_guard(device):
        kernel[(triton.cdiv(n_rows, block),)](*args, PORTABLE=portable, **kwargs)


_NO_GUARD = contextlib.nullcontext()  # reentrant: shared by every no-op guard


def device_guard(device):
    """Context manager making ``device`` current for a launch (multi-GPU safety); a no-op off
    CUDA and when ``device`` already is current (entering ``torch.cuda.device`` costs ~2 us of
    host time per launch on the H200's host; reading the current device ~0.3 us)."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type != "cuda" or device.index is None \
            or device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(device)


def num_sms(device=None) -> int:
    """SMs of ``device`` (default: the current CUDA device); ``DEFAULT_NUM_SMS`` off CUDA."""
    if device is not None and torch.device(device).type != "cuda":
        return DEFAULT_NUM_SMS
    if not torch.cuda.is_available():
        return DEFAULT_NUM_SMS
    idx = torch.device(device).index if device is not None else None
    if idx is None:
        idx = torch.cuda.current_device()
    return torch.cuda.get_device_properties(idx).multi_processor_count


def capability(device) -> tuple[int, int] | None:
    """The compute capability ``(major, minor)`` of a CUDA ``device``, or None where launches
    are portable (``portable_default``: the interpreter, or off CUDA)."""
    if portable_default(device):
        return None
    return tuple(torch.cuda.get_device_capability(torch.device(device)))


def gluon_available() -> bool:
    """True when ``triton.experimental.gluon`` imports (the Gluon kernels can be built)."""
    return _gluon_importable()


@functools.lru_cache(maxsize=None)
def _gluon_importable() -> bool:
    try:
        importlib.import_module("triton.experimental.gluon")  # ImportError: no Gluon
    except ImportError:
        return False
    return True


def wgmma_available(device) -> bool:
    """True when the Gluon wgmma kernels can run on ``device``: a CUDA SM90 GPU (wgmma is a
    Hopper instruction), not under the interpreter, with Gluon importable."""
    device = torch.device(device)
    if portable_default(device) or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return _gluon_importable()


def mma_available(device) -> bool:
    """True when the Gluon ``mma.sync`` scorer can run on ``device``: a CUDA GPU with
    ``mma.sync`` and E4M3 (SM89+; compiled offline for sm_90a and sm_100a, run on SM90), not
    under the interpreter, with Gluon importable."""
    device = torch.device(device)
    if portable_default(device) or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    return _gluon_importable()
