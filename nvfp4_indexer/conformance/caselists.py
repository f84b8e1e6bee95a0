"""The case list of every op for a (profile, seed): ``builder(profile, seed, device)`` yields
:class:`~conformance.generator.Case` objects lazily, each seeded by
``case_seed(seed, tag, i)`` so that a case's name and seed reproduce it anywhere;
``conformance.ops`` pairs each builder with its op and its case count."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from nvfp4_indexer.constants import HEAD_DIM

from . import generator as G

#: Query lengths of the random decode cases, in turn.
_QS = (1, 8, 2, 4, 3, 1, 6, 5, 7, 8)
#: Distributions of the quantize cases ("corrupt" is a cache property: not a vector one).
QUANT_DISTRIBUTIONS = tuple(d for d in G.DISTRIBUTIONS if d != "corrupt")


def _rng(seed: int, tag: str, i: int) -> tuple[np.random.Generator, int]:
    s = G.case_seed(seed, tag, i)
    return np.random.default_rng(s), s


def encode_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    """E4M3 encode of all 256 values, every rounding boundary, all fp16 / bf16 bit patterns,
    random fp32 (flat and 3-D) (SPEC 1.1)."""
    yield G.Case("encode_e4m3", "encode/all-bytes", seed, {"x": G.e4m3_all_values()})
    yield G.Case("encode_e4m3", "encode/edges", seed, {"x": G.e4m3_edge_inputs()})
    yield G.Case("encode_e4m3", "encode/all-fp16", seed, {"x": G.all_16bit(torch.float16)})
    yield G.Case("encode_e4m3", "encode/all-bf16", seed, {"x": G.all_16bit(torch.bfloat16)})
    rng, s = _rng(seed, "encode", 0)
    x = G.random_f32_bits(rng, profile.codec_random)
    yield G.Case("encode_e4m3", "encode/random-f32", s, {"x": x})
    yield G.Case("encode_e4m3", "encode/shaped-3d", s, {"x": x[:4 * 5 * 7].reshape(4, 5, 7)})


def dequant_table_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``codes uint8 [256, 64]`` (each group holds codes 0..15 in order) and ``scales uint8
    [256, 8]`` (row b: every scale byte = b): dequantizing them yields the 16 x 256 table."""
    c = torch.arange(16, dtype=torch.uint8)
    byte = (c[0::2] | (c[1::2] << 4)).repeat(8)  # 64 bytes
    codes = byte[None, :].expand(256, 64).contiguous()
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(256, 8)
    return codes, scales.contiguous()


def dequantize_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    """Dequantize the 16 x 256 table and random bytes to both output dtypes (SPEC 1.4)."""
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


def quantize_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    """Quantizer edge groups, then vectors of every distribution in fp32 and in bf16 / fp16
    (SPEC 1.3)."""
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


def _paged(make, tag: str, n: int, profile, seed, device) -> Iterator[G.Case]:
    """``n`` cases of ``make`` named ``{tag}/{dist}/{i:03d}``, distributions in turn."""
    for i in range(n):
        rng, s = _rng(seed, tag, i)
        dist = G.DISTRIBUTIONS[i % len(G.DISTRIBUTIONS)]
        yield make(rng, profile, f"{tag}/{dist}/{i:03d}", s, dist, device=device)


def write_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    yield from _paged(G.write_case, "write", profile.write_cases, profile, seed, device)


#: NaN edge cases per insert / query check (after the random ones).
NAN_CASES = 1


def _with_nan_edges(kind: str, build, build_nan, profile: G.Profile, seed: int,
                    device) -> Iterator[G.Case]:
    """``profile.insert_cases`` random ``kind`` cases, then ``NAN_CASES`` NaN / inf edges."""
    yield from _paged(build, kind, profile.insert_cases, profile, seed, device)
    for i in range(NAN_CASES):
        rng, s = _rng(seed, f"{kind}-nan", i)
        yield build_nan(rng, profile, f"{kind}/nan/{i:03d}", s, device=device)


def insert_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    """Random fused inserts, then NaN / inf edges (``generator.nan_insert_case``)."""
    yield from _with_nan_edges("insert", G.insert_case, G.nan_insert_case, profile, seed, device)


def query_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    """Random query prepares, then NaN / inf edges (``generator.nan_query_case``)."""
    yield from _with_nan_edges("query", G.query_case, G.nan_query_case, profile, seed, device)


def gather_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    yield from _paged(G.gather_case, "gather", profile.gather_cases, profile, seed, device)


def num_scores_cases(profile: G.Profile) -> int:
    return max(2, profile.prefill_cases // 2)


def scores_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    yield from _paged(G.scores_case, "scores", num_scores_cases(profile), profile, seed, device)


def decode_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    """The designed contract cases, then random batches (Q, heads and distributions in turn;
    the last one at the profile's largest batch)."""
    yield from G.contract_cases(device)
    for i in range(profile.decode_cases):
        rng, s = _rng(seed, "decode", i)
        dist = G.DISTRIBUTIONS[i % len(G.DISTRIBUTIONS)]
        q = _QS[i % len(_QS)]
        h = G.HEADS[i % len(G.HEADS)]
        batch = profile.max_batch if i == profile.decode_cases - 1 else None
        yield G.decode_case(rng, profile, f"decode/{dist}/{i:03d}", s, dist, batch=batch,
                            q=q, heads=h, device=device)


def prefill_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    yield from _paged(G.prefill_case, "prefill", profile.prefill_cases, profile, seed, device)


def mixed_cases(profile: G.Profile, seed: int, device=None) -> Iterator[G.Case]:
    yield from _paged(G.mixed_case, "mixed", profile.mixed_cases, profile, seed, device)
