"""Case files: one failing (or interesting) case saved as ``NAME.npz`` + ``NAME.json`` and
replayed on any backend.

The ``.npz`` holds every tensor input (``in.<name>``) and expected output (``exp.<name>``) as
numpy arrays; dtypes numpy lacks are stored as raw bits (``float8_e4m3fn`` as uint8,
``bfloat16`` as uint16) and named in the JSON. The JSON holds the op, case name, seed, scalar
inputs, the metadata, the failures that were seen (rows, expected vs got) and the sha256 of
every array.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nvfp4_indexer.constants import SPEC_VERSION

from .generator import Case

CASE_FORMAT = "nvfp4-indexer-case"
CASE_FORMAT_VERSION = 1

# torch dtype -> (numpy storage dtype, bits view or None)
_STORE = {torch.float8_e4m3fn: (np.uint8, torch.uint8), torch.bfloat16: (np.uint16, torch.int16)}
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)}


def tensor_to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """(array, torch dtype name) storing ``t`` bit for bit."""
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype in _STORE:
        np_dt, view = _STORE[t.dtype]
        return t.view(view).numpy().view(np_dt), name
    return t.numpy(), name


def numpy_to_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of :func:`tensor_to_numpy`."""
    td = _TORCH_DTYPES[dtype]
    if td in _STORE:
        _, view = _STORE[td]
        raw = torch.from_numpy(np.ascontiguousarray(a).view(
            np.uint8 if view == torch.uint8 else np.int16).copy())
        return raw.view(td)
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def sha256_array(a: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and C-order bytes."""
    h = hashlib.sha256()
    h.update(f"{a.dtype.str}|{tuple(a.shape)}|".encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def case_to_arrays(case: Case, expected: dict | None, prefix: str = "") -> tuple[dict, dict]:
    """Split ``case`` into numpy arrays (keys ``{prefix}in.x`` / ``{prefix}exp.x``) and a JSON
    spec (op, name, seed, meta, scalars, array names with torch dtypes and sha256)."""
    arrays: dict[str, np.ndarray] = {}
    spec: dict[str, Any] = {"op": case.op, "name": case.name, "seed": int(case.seed),
                            "meta": _plain(case.meta), "inputs": {}, "expected": None}

    def array_spec(key: str, v: torch.Tensor) -> dict:
        a, dt = tensor_to_numpy(v)
        arrays[key] = a
        return {"array": key, "dtype": dt, "shape": list(a.shape), "sha256": sha256_array(a)}
    for k, v in case.inputs.items():
        spec["inputs"][k] = (array_spec(f"{prefix}in.{k}", v) if isinstance(v, torch.Tensor)
                             else {"value": _plain(v)})
    if expected is not None:
        spec["expected"] = {k: array_spec(f"{prefix}exp.{k}", v) for k, v in expected.items()}
    return arrays, spec


def case_from_arrays(arrays, spec: dict, device=None) -> Case:
    """Rebuild a :class:`Case` (with ``expected`` when the spec has it)."""
    inputs = {}
    for k, d in spec["inputs"].items():
        inputs[k] = numpy_to_tensor(arrays[d["array"]], d["dtype"]).to(device) \
            if "array" in d else d["value"]
    expected = None
    if spec.get("expected"):
        expected = {k: numpy_to_tensor(arrays[d["array"]], d["dtype"])
                    for k, d in spec["expected"].items()}
    return Case(spec["op"], spec["name"], spec["seed"], inputs, expected, dict(spec["meta"]))


def _plain(x):
    """JSON-friendly copy of metadata."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return x


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def save_case(directory, case: Case, expected: dict | None = None, *, failures=(),
              backend: str | None = None) -> Path:
    """Write ``case`` as ``DIR/<name>.npz`` + ``.json``; returns the ``.npz`` path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stem = d / safe_name(case.name)
    arrays, spec = case_to_arrays(case, expected if expected is not None else case.expected)
    doc = {"format": CASE_FORMAT, "format_version": CASE_FORMAT_VERSION,
           "spec_version": SPEC_VERSION, "backend": backend, **spec,
           "failures": [f.to_json() for f in failures]}
    np.savez_compressed(stem.with_suffix(".npz"), **arrays)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    return stem.with_suffix(".npz")


def load_case(path, device=None, *, verify: bool = True) -> tuple[Case, dict]:
    """Load a case file (``.npz`` or ``.json`` path); returns ``(case, json document)``.

    Raises:
        ValueError: not a case file, or (``verify``) an array whose sha256 does not match.
    """
    p = Path(path)
    stem = p.with_suffix("")
    doc = json.loads(stem.with_suffix(".json").read_text())
    if doc.get("format") != CASE_FORMAT:
        raise ValueError(f"{path}: not a {CASE_FORMAT} file")
    with np.load(stem.with_suffix(".npz")) as z:
        arrays = {k: z[k] for k in z.files}
    if verify:
        for section in ("inputs", "expected"):
            for k, d in (doc.get(section) or {}).items():
                if "array" in d and sha256_array(arrays[d["array"]]) != d["sha256"]:
                    raise ValueError(f"{path}: array {d['array']} does not match its sha256")
    return case_from_arrays(arrays, doc, device), doc


def replay_case(path, backend, *, max_failures: int = 5, oracle: bool = False):
    """Run a saved case on ``backend``. ``oracle``: recompute the expected outputs with the
    reference instead of using the saved ones."""
    from .ops import run_case
    dev = backend.device if torch.device(backend.device).type == "cuda" else None
    case, _ = load_case(path, dev)
    if oracle:
        case.expected = None
    return run_case(case, backend, max_failures=max_failures)
