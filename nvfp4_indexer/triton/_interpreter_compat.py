"""Triton interpreter fix for numpy >= 2.4 (applied only under ``TRITON_INTERPRET=1``).

Triton 3.6's interpreter turns a scalar tensor into a Python int (``range(start, end)`` over
values loaded or reduced in a kernel) with ``int(handle.data)``, where ``data`` may be a
one-element array of ndim 1. numpy 1.25-2.3 warn about that (``DeprecationWarning:
Conversion of an array with ndim > 0 to a scalar``, once per call: ~1500 in the test suite)
and numpy >= 2.4 raises (``InterpreterError: only 0-dimensional arrays can be converted``).
``patch()`` makes that conversion take the single element (``.item()``), the same int; it
wraps Triton's ``_patch_lang_tensor`` and does nothing when a Triton release lacks it.
"""

from __future__ import annotations

import os

_PATCHED = False


def patch() -> bool:
    """Install the fix when the interpreter is on; returns whether it is installed."""
    global _PATCHED
    if _PATCHED:
        return True
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_lang_tensor
    _PATCHED = True
    return True
