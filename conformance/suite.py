"""Case lists per check for a (profile, seed), and the loop that runs them on a backend."""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterator

import numpy as np
import torch

from nvfp4_indexer.constants import HEAD_DIM

from . import generator as G
from .backends import Backend
from .checks import CaseResult, run_case

#: Checks in run order. "wrapper" is the decode wrapper replayed after in-place changes of its
#: planned buffers: captured in a CUDA graph on a GPU, eager otherwise.
CHECKS = ("codec", "write", "insert", "gather", "scores", "decode", "prefill", "mixed",
          "wrapper", "engine")
CHECK_DOCS = {
    "codec": "E4M3 encode (all fp16/bf16 patterns, every rounding boundary, random fp32), "
             "NVFP4 quantize (edge groups, every distribution, fp32/bf16/fp16), dequantize "
             "(16 x 256 table, both dtypes): bit-exact (SPEC 1)",
    "write": "write_index_k into a poisoned cache with scattered / skipped slots and padded "
             "page strides: token bytes bit-exact, nothing else touched (SPEC 1.3, 2)",
    "insert": "fused norm + RoPE + quantize + write, and query prepare: bit-exact or every "
              "difference proved inside SPEC 3's band",
    "gather": "FP8 workspace and page offsets, bit-exact (SPEC 7)",
    "scores": "page_scores (when the backend has it): exact, or within e (SPEC 4, 9)",
    "decode": "decode_indexer on random engine states and designed contract cases: output "
              "structure exact, ranking tie-aware (SPEC 5, 6, 9)",
    "prefill": "prefill_indexer with cached context and small gather budgets (SPEC 5, 7, 9)",
    "mixed": "decode-first batch into one shared output, each op only its rows (SPEC 8)",
    "wrapper": "DecodeIndexerWrapper: plan/run (CUDA-graph capture + replay on a GPU) after "
               "in-place changes of q, seq lens, block tables and padding rows (SPEC 6)",
    "engine": "Indexer plan/forward over a seeded continuous-batching trace (arrivals, chunked "
              "prefill with cached context, decode Q 1..8 padded to CUDA-graph sizes, "
              "finishes, block reuse); decode-only steps replay captured graphs on a GPU "
              "(SPEC 8.1)",
}
_QS = (1, 8, 2, 4, 3, 1, 6, 5, 7, 8)


def _rng(seed: int, check: str, i: int) -> tuple[np.random.Generator, int]:
    s = G.case_seed(seed, check, i)
    return np.random.default_rng(s), s


def codec_cases(profile: G.Profile, seed: int) -> Iterator[G.Case]:
    """Encode / quantize / dequantize cases (SPEC 1)."""
    yield G.Case("encode_e4m3", "encode/all-bytes", seed, {"x": G.e4m3_all_values()})
    yield G.Case("encode_e4m3", "encode/edges", seed, {"x": G.e4m3_edge_inputs()})
    yield G.Case("encode_e4m3", "encode/all-fp16", seed, {"x": G.all_16bit(torch.float16)})
    yield G.Case("encode_e4m3", "encode/all-bf16", seed, {"x": G.all_16bit(torch.bfloat16)})
    rng, s = _rng(seed, "encode", 0)
    x = G.random_f32_bits(rng, profile.codec_random)
    yield G.Case("encode_e4m3", "encode/random-f32", s, {"x": x})
    yield G.Case("encode_e4m3", "encode/shaped-3d", s, {"x": x[:4 * 5 * 7].reshape(4, 5, 7)})
    codes, scales = dequant_table_inputs()
    for dt in ("float8_e4m3fn", "float32"):
        yield G.Case("dequantize_nvfp4", f"dequant/table-{dt}", seed,
                     {"codes": codes, "scales": scales, "dtype": dt})
    rng, s = _rng(seed, "dequant", 0)
    n = max(8, profile.quant_vectors // 4)
    rc = torch.from_numpy(rng.integers(0, 256, size=(n, 3, 64), dtype=np.uint8))
    rs = torch.from_numpy(rng.integers(0, 256, size=(n, 3, 8), dtype=np.uint8))
    for dt in ("float8_e4m3fn", "float32"):
        yield G.Case("dequantize_nvfp4", f"dequant/random-{dt}", s,
                     {"codes": rc, "scales": rs, "dtype": dt})
    yield G.Case("quantize_nvfp4", "quantize/edges", seed, {"x": G.quantizer_edge_groups()})
    for i, dist in enumerate(G.DISTRIBUTIONS):
        if dist == "corrupt":
            continue
        rng, s = _rng(seed, "quantize", i)
        x = G.random_vectors(rng, profile.quant_vectors, dist)
        yield G.Case("quantize_nvfp4", f"quantize/{dist}", s, {"x": x}, meta={"dist": dist})
        dt = (torch.bfloat16, torch.float16)[i % 2]
        yield G.Case("quantize_nvfp4", f"quantize/{dist}-{str(dt)[6:]}", s,
                     {"x": x.to(dt).reshape(-1, 2, HEAD_DIM) if len(x) % 2 == 0 else x.to(dt)},
                     meta={"dist": dist, "dtype": str(dt)[6:]})


def dequant_table_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``codes uint8 [256, 64]`` (each group holds codes 0..15 in order) and ``scales uint8
    [256, 8]`` (row b: every scale byte = b): dequantizing them yields the 16 x 256 table."""
    c = torch.arange(16, dtype=torch.uint8)
    byte = (c[0::2] | (c[1::2] << 4)).repeat(8)  # 64 bytes
    codes = byte[None, :].expand(256, 64).contiguous()
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(256, 8)
    return codes, scales.contiguous()


def _paged(make, check: str, n: int, profile, seed, device) -> Iterator[G.Case]:
    for i in range(n):
        rng, s = _rng(seed, check, i)
        dist = G.DISTRIBUTIONS[i % len(G.DISTRIBUTIONS)]
        yield make(rng, profile, f"{check}/{dist}/{i:03d}", s, dist, device=device)


def build_cases(check: str, profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    """The cases of ``check`` (not "wrapper", see ``graphs``) for ``(profile, seed)``."""
    if check == "codec":
        yield from codec_cases(profile, seed)
    elif check == "write":
        yield from _paged(G.write_case, "write", profile.write_cases, profile, seed, device)
    elif check == "insert":
        yield from _paged(G.insert_case, "insert", profile.insert_cases, profile, seed, device)
        yield from _paged(G.query_case, "query", profile.insert_cases, profile, seed, device)
    elif check == "gather":
        yield from _paged(G.gather_case, "gather", profile.gather_cases, profile, seed, device)
    elif check == "scores":
        yield from _paged(G.scores_case, "scores", max(2, profile.prefill_cases // 2), profile,
                          seed, device)
    elif check == "decode":
        yield from G.contract_cases(device)
        for i in range(profile.decode_cases):
            rng, s = _rng(seed, "decode", i)
            dist = G.DISTRIBUTIONS[i % len(G.DISTRIBUTIONS)]
            q = _QS[i % len(_QS)]
            h = G.HEADS[i % len(G.HEADS)]
            batch = profile.max_batch if i == profile.decode_cases - 1 else None
            yield G.decode_case(rng, profile, f"decode/{dist}/{i:03d}", s, dist, batch=batch,
                                q=q, heads=h, device=device)
    elif check == "prefill":
        yield from _paged(G.prefill_case, "prefill", profile.prefill_cases, profile, seed,
                          device)
    elif check == "mixed":
        yield from _paged(G.mixed_case, "mixed", profile.mixed_cases, profile, seed, device)
    else:
        raise ValueError(f"unknown check {check!r}; expected one of {', '.join(CHECKS)}")


def case_counts(profile: G.Profile) -> dict[str, int]:
    """Number of cases each check runs (progress totals)."""
    from .engine_trace import engine_steps
    from .graphs import wrapper_sessions
    n_dist = len([d for d in G.DISTRIBUTIONS if d != "corrupt"])
    return {"codec": 6 + 4 + 1 + 2 * n_dist,
            "write": profile.write_cases, "insert": 2 * profile.insert_cases,
            "gather": profile.gather_cases, "scores": max(2, profile.prefill_cases // 2),
            "decode": profile.decode_cases + G.NUM_CONTRACT_CASES,
            "prefill": profile.prefill_cases, "mixed": profile.mixed_cases,
            "wrapper": len(wrapper_sessions(profile)) * (profile.wrapper_replays + 1),
            "engine": engine_steps(profile)}


def run_suite(backend: Backend, profile: G.Profile, seed: int, checks=CHECKS, *,
              case_glob: str | None = None, max_failures: int = 5,
              on_result: Callable[[CaseResult], None] | None = None,
              on_check: Callable[[str, int], None] | None = None) -> list[CaseResult]:
    """Run ``checks`` on ``backend``; cases are generated lazily on the backend's device.

    ``case_glob`` keeps only cases whose name matches (fnmatch). ``on_check(check, n)`` is
    called before each check with its case count, ``on_result`` after each case.
    """
    from .graphs import wrapper_results
    results: list[CaseResult] = []
    dev = backend.device if torch.device(backend.device).type == "cuda" else None
    counts = case_counts(profile)
    for check in checks:
        if on_check:
            on_check(check, counts.get(check, 0))
        if check == "engine":
            from .engine_trace import engine_results
            for r in engine_results(backend, profile, seed, max_failures=max_failures,
                                    case_glob=case_glob):
                results.append(r)
                if on_result:
                    on_result(r)
            continue
        if check == "wrapper":
            for r in wrapper_results(backend, profile, seed, max_failures=max_failures,
                                     case_glob=case_glob):
                results.append(r)
                if on_result:
                    on_result(r)
            continue
        for case in build_cases(check, profile, seed, dev):
            if case_glob and not fnmatch.fnmatch(case.name, case_glob):
                continue
            r = run_case(case, backend, max_failures=max_failures, check=check)
            results.append(r)
            if on_result:
                on_result(r)
    return results
