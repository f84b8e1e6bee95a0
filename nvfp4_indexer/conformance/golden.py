"""Golden vectors: a versioned, checksummed set of inputs and expected outputs.

``write_golden(DIR)`` writes ``manifest.json`` plus one ``.npz`` per check. The manifest holds
the format and SPEC versions, the generator seed and profile, and for every array its file,
shape, dtype (the torch dtype; float8 / bfloat16 are stored as raw bits) and sha256. Content:

* tables: the fp32 value of all 256 E4M3 bytes and the 16 x 256 dequant table (E4M3 bytes
  and exact fp32 products);
* codec cases: E4M3 encode of all 256 values, every rounding boundary, all fp16 / bf16 bit
  patterns and random fp32; dequantize of the table inputs; quantizer edge groups and vectors
  of every distribution;
* write and fused insert / query cases with poisoned caches, their expected caches, and the
  float64 exact values and term magnitudes SPEC 3's band is measured against;
* gather, page-score, decode (random engine states and the designed top-k contract cases),
  prefill and mixed cases with expected selections, exact page scores and row magnitudes.

``verify_golden(DIR, backend)`` checks every sha256, then runs every case on the backend
against the stored expectations (same rules as ``run``). With ``oracle=True`` it also
recomputes every stored expectation with the reference and requires it bit for bit, so a
change of semantics fails until the set is deliberately regenerated.
"""

from __future__ import annotations

import fnmatch
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

import nvfp4_indexer
from nvfp4_indexer.constants import GOLDEN_COMPATIBLE_SPECS, SPEC_VERSION
from nvfp4_indexer.reference import formats as F

from . import generator as G
from . import suite as S
from .backends import Backend
from .cases import case_from_arrays, case_to_arrays, numpy_to_tensor, sha256_array, tensor_to_numpy
from .ops import oracle, run_case
from .results import CaseResult

GOLDEN_FORMAT = "nvfp4-indexer-golden"
GOLDEN_FORMAT_VERSION = 1
GOLDEN_SEED = 20_240_917
#: The in-repo set (package data).
DEFAULT_DIR = Path(__file__).parent / "golden" / "v2"

#: Small sizes: the whole set stays well under 3 MB and verifies quickly under the Triton
#: interpreter.
GOLDEN_PROFILE = G.Profile(
    "golden", codec_random=4096, quant_vectors=32, write_cases=2, write_tokens=40,
    insert_cases=2, insert_tokens=24, gather_cases=1, decode_cases=5, max_batch=3,
    long_lens=(2049, 2200, 2400), case_tokens=2600, prefill_cases=2, max_new_tokens=10,
    mixed_cases=1, wrapper_replays=0, wrapper_batch=2, max_position=160)
_GOLDEN_CHECKS = ("codec", "write", "insert", "gather", "scores", "decode", "prefill", "mixed")


def golden_cases(seed: int = GOLDEN_SEED):
    """(check, case) pairs of the golden set."""
    p = GOLDEN_PROFILE
    for check in _GOLDEN_CHECKS:
        for case in S.build_cases(check, p, seed):
            if check == "scores" and case.name.endswith("001"):
                continue  # one page-score case is enough
            yield check, case


def _tables() -> dict[str, torch.Tensor]:
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8)[:, None].expand(16, 256)
    return {"e4m3_values": F.decode_e4m3(all_bytes),
            "dequant_e4m3": F.dequant_table(),
            "dequant_f32": F.e2m1_value(codes) * F.decode_e4m3(all_bytes)[None, :]}


def write_golden(directory, seed: int = GOLDEN_SEED, *, progress=None) -> dict:
    """Generate the golden set into ``directory`` (created; existing files are replaced).
    Returns the manifest."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict] = {}
    manifest = {"format": GOLDEN_FORMAT, "format_version": GOLDEN_FORMAT_VERSION,
                "spec_version": SPEC_VERSION, "package_version": nvfp4_indexer.__version__,
                "generator": {"function": "conformance.golden.write_golden", "seed": seed,
                              "profile": asdict(GOLDEN_PROFILE)},
                "files": {}, "tables": {}, "cases": []}
    tables = {}
    for k, t in _tables().items():
        a, dt = tensor_to_numpy(t)
        tables[k] = a
        manifest["tables"][k] = {"file": "tables.npz", "array": k, "dtype": dt,
                                 "shape": list(a.shape), "sha256": sha256_array(a)}
    files["tables.npz"] = tables
    counters: dict[str, int] = {}
    for check, case in golden_cases(seed):
        fname = f"{check}.npz"
        i = counters.get(fname, 0)
        counters[fname] = i + 1
        exp = oracle(case)
        arrays, spec = case_to_arrays(case, exp, prefix=f"c{i:03d}.")
        files.setdefault(fname, {}).update(arrays)
        manifest["cases"].append({"check": check, "file": fname, **spec})
        if progress:
            progress(case.name)
    for fname, arrays in files.items():
        path = d / fname
        np.savez_compressed(path, **arrays)
        manifest["files"][fname] = {"bytes": path.stat().st_size, "arrays": len(arrays)}
    (d / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    return manifest


def _entries(manifest):
    """(file, array name, entry) of every array the manifest lists."""
    for k, e in manifest["tables"].items():
        yield e["file"], e["array"], e
    for c in manifest["cases"]:
        for section in ("inputs", "expected"):
            for e in (c.get(section) or {}).values():
                if "array" in e:
                    yield c["file"], e["array"], e


def load_golden(directory):
    """``(manifest, {file: {array: ndarray}})``.

    Raises:
        ValueError: not a golden directory, or an unknown format version.
    """
    d = Path(directory)
    mpath = d / "manifest.json"
    if not mpath.exists():
        raise ValueError(f"{d}: no manifest.json (not a golden set)")
    manifest = json.loads(mpath.read_text())
    if manifest.get("format") != GOLDEN_FORMAT:
        raise ValueError(f"{mpath}: format {manifest.get('format')!r}, expected {GOLDEN_FORMAT!r}")
    if manifest.get("format_version") != GOLDEN_FORMAT_VERSION:
        raise ValueError(f"{mpath}: format_version {manifest.get('format_version')}, this "
                         f"harness reads {GOLDEN_FORMAT_VERSION}")
    data = {}
    for fname in manifest["files"]:
        with np.load(d / fname) as z:
            data[fname] = {k: z[k] for k in z.files}
    return manifest, data


def check_integrity(manifest, data, max_failures: int = 20) -> CaseResult:
    """Every listed array exists with its dtype, shape and sha256; no unlisted arrays; the SPEC
    version is one whose vectors this package's SPEC keeps valid (``GOLDEN_COMPATIBLE_SPECS``)."""
    res = CaseResult(check="integrity", op="sha256", case="golden/integrity", seed=0)
    listed: dict[str, set] = {f: set() for f in data}
    if manifest.get("spec_version") not in GOLDEN_COMPATIBLE_SPECS:
        res.count_failure(max_failures, row=None, head=None,
                          expected=" or ".join(GOLDEN_COMPATIBLE_SPECS),
                          got=manifest.get("spec_version"),
                          detail="golden set made for another SPEC version: regenerate it "
                                 "deliberately")
    for fname, name, e in _entries(manifest):
        res.rows += 1
        listed.setdefault(fname, set()).add(name)
        a = data.get(fname, {}).get(name)
        if a is None:
            res.count_failure(max_failures, row=None, head=None, expected=f"{fname}:{name}",
                              got="missing", detail="array listed in the manifest is missing")
            continue
        digest = sha256_array(a)
        if digest != e["sha256"] or list(a.shape) != e["shape"]:
            res.count_failure(max_failures, row=None, head=None, expected=e["sha256"], got=digest,
                              detail=f"{fname}:{name}: sha256 mismatch (tampered or corrupted "
                                     "array)")
        else:
            res.exact += 1
    for fname, arrays in data.items():
        extra = set(arrays) - listed.get(fname, set())
        for name in sorted(extra)[:max_failures]:
            res.count_failure(max_failures, row=None, head=None, expected="no unlisted arrays",
                              got=f"{fname}:{name}", detail="array not in the manifest")
    return res


def check_tables(manifest, data, max_failures: int = 5) -> CaseResult:
    """The stored E4M3 value table and 16 x 256 dequant tables equal the reference's."""
    res = CaseResult(check="tables", op="tables", case="golden/tables", seed=0)
    now = _tables()
    for k, e in manifest["tables"].items():
        stored = numpy_to_tensor(data[e["file"]][e["array"]], e["dtype"])
        cur = now[k]
        same = _bit_equal(stored, cur)
        res.rows += 1
        if same:
            res.exact += 1
        else:
            res.count_failure(max_failures, row=None, head=None, expected="stored table",
                              got="reference differs", detail=f"table {k} (SPEC 1.1 / 1.4)")
    return res


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits; NaN payloads of float tensors are not compared."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.dtype in (torch.float32, torch.float64):
        return bool(((a == b) & (torch.signbit(a) == torch.signbit(b))
                     | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def check_oracle(case, max_failures: int = 5) -> CaseResult:
    """Recompute ``case``'s expectations with the reference; every array must match bit for
    bit (the reference still reproduces the set)."""
    t0 = time.perf_counter()
    res = CaseResult(check="oracle", op=case.op, case=case.name, seed=case.seed)
    stored = case.expected
    fresh = oracle(G.Case(case.op, case.name, case.seed, case.inputs, None, case.meta))
    for k, v in stored.items():
        res.rows += 1
        if k in fresh and _bit_equal(v, fresh[k].cpu()):
            res.exact += 1
        else:
            res.count_failure(max_failures, row=None, head=None, expected=f"stored {k}",
                              got="reference output differs" if k in fresh else "missing",
                              detail=f"{case.op}: the reference no longer reproduces {k!r}")
    res.seconds = time.perf_counter() - t0
    return res


def verify_golden(directory, backend: Backend, *, oracle_check: bool = False,
                  max_failures: int = 5, on_result=None, case_glob: str | None = None):
    """Verify ``backend`` against a golden set. Returns the list of :class:`CaseResult`
    (integrity and tables first, then every case, then oracle re-derivations)."""
    manifest, data = load_golden(directory)
    results = [check_integrity(manifest, data), check_tables(manifest, data)]
    for r in results:
        if on_result:
            on_result(r)
    dev = backend.device if torch.device(backend.device).type == "cuda" else None
    specs = [c for c in manifest["cases"]
             if not case_glob or fnmatch.fnmatch(c["name"], case_glob)]
    for spec in specs:
        case = case_from_arrays(data[spec["file"]], spec, dev)
        r = run_case(case, backend, max_failures=max_failures, check=spec["check"])
        results.append(r)
        if on_result:
            on_result(r)
    for spec in specs if oracle_check else ():
        o = check_oracle(case_from_arrays(data[spec["file"]], spec), max_failures)
        results.append(o)
        if on_result:
            on_result(o)
    return results, manifest


def golden_size(directory) -> int:
    """Total bytes of a golden set's files."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())
