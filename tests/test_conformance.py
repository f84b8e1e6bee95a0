"""The conformance harness: its checks can fail (injected bugs are caught), golden vectors
verify and detect tampering, case files round-trip, the CLI reports and exits correctly."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import nvfp4_indexer as nv
from nvfp4_indexer import reference as ref
from nvfp4_indexer.reference import formats as F

from nvfp4_indexer.conformance import generator as G
from nvfp4_indexer.conformance.backends import Backend, load_backend, reference_backend
from nvfp4_indexer.conformance.cases import load_case, replay_case, save_case
from nvfp4_indexer.conformance.checks import (explain_keys, explain_queries, explain_row, run_case,
                                 tie_aware_check)
from nvfp4_indexer.conformance.cli import main as cli_main
from nvfp4_indexer.conformance.golden import DEFAULT_DIR, check_integrity, load_golden, verify_golden
from nvfp4_indexer.conformance.graphs import wrapper_session

REPO = Path(__file__).resolve().parent.parent
SMOKE = G.PROFILES["smoke"]


def _decode_case(seed=7, dist="gaussian", q=2, heads=2):
    rng = np.random.default_rng(seed)
    return G.decode_case(rng, SMOKE, f"decode/{dist}/t", seed, dist, batch=2, q=q, heads=heads)


def _bounded(backend: Backend, bits=16) -> Backend:
    """The same callables judged as a tie-aware backend (score bound 2^-bits)."""
    return dataclasses.replace(backend, name=f"{backend.name}-b{bits}", score_error_bits=bits)


# --------------------------------------------------------------------------------------------
# tie_aware_check
# --------------------------------------------------------------------------------------------

def _one_row(scores, L):
    s = torch.full((1, 1, L + 2), -math.inf)
    s[0, 0, :L] = torch.tensor(scores, dtype=torch.float32)
    return s


def test_tie_aware_accepts_reference_and_rejects_swaps():
    L = 20
    scores = [float(j) for j in range(L)]  # page j scores j: best pages are 19, 18, ...
    s = _one_row(scores, L)
    mag = torch.tensor([[1000.0]], dtype=torch.float64)
    local = torch.tensor([L])
    good = ref.select_pages(s, local)
    for bits in (None, 16):
        r = tie_aware_check(good, s, mag, local, bits)
        assert r.failed == 0 and int(r.status[0, 0]) == 0
    bad = good.clone()
    bad[0, 0, [0, 14]] = bad[0, 0, [14, 0]]  # scores 19 and 5 swapped: gap 14 >> 2e
    for bits in (None, 16, 8):
        assert tie_aware_check(bad, s, mag, local, bits).failed == 1
    # A page outside the top 15 selected instead of the 15th: caught by the set condition.
    wrong = good.clone()
    wrong[0, 0, 14] = 0
    r = tie_aware_check(wrong, s, mag, local, 16)
    assert r.failed == 1


def test_tie_aware_tolerance_is_counted_and_bounded():
    L = 18
    eps = 1e-3
    scores = [10.0 - j for j in range(L)]
    scores[3] = scores[2] - eps  # pages 2 and 3 nearly tied
    s = _one_row(scores, L)
    local = torch.tensor([L])
    good = ref.select_pages(s, local)
    swapped = good.clone()
    swapped[0, 0, [2, 3]] = swapped[0, 0, [3, 2]]
    mag = torch.tensor([[64.0]], dtype=torch.float64)  # e = 64 * 2^-bits
    # bits = 14: 2e = 2^-7 ~ 7.8e-3 > gap: within tolerance, needed the bound.
    r = tie_aware_check(swapped, s, mag, local, 14)
    assert r.failed == 0 and int(r.status[0, 0]) == 1 and bool(r.needed_bound[0, 0])
    assert float(r.gap_rel[0, 0]) == pytest.approx(
        (np.float32(scores[2]) - np.float32(scores[3])) / 64.0, rel=1e-6)
    # bits = 20: 2e ~ 1.2e-4 < gap: a failure; an exact backend fails too.
    assert tie_aware_check(swapped, s, mag, local, 20).failed == 1
    assert tie_aware_check(swapped, s, mag, local, None).failed == 1


def test_tie_aware_exact_ties_and_structure():
    L = 17
    s = _one_row([1.0] * L, L)
    local = torch.tensor([L])
    mag = torch.ones((1, 1), dtype=torch.float64)
    good = ref.select_pages(s, local)
    assert good[0, 0, :15].tolist() == list(range(15))
    other = good.clone()
    other[0, 0, 0] = 16  # another tied page: fine under a bound, not for an exact backend
    assert tie_aware_check(other, s, mag, local, 16).failed == 0
    assert tie_aware_check(other, s, mag, local, None).failed == 1
    dup = good.clone()
    dup[0, 0, 1] = dup[0, 0, 0]  # duplicate id
    assert tie_aware_check(dup, s, mag, local, 16).failed == 1
    nolocal = good.clone()
    nolocal[0, 0, 15] = 3
    assert tie_aware_check(nolocal, s, mag, local, 16).failed == 1
    # Short rows (L <= 15) and padding rows are fixed: any change fails.
    s2 = _one_row([1.0] * 5, 5)
    loc = torch.tensor([5])
    out = ref.select_pages(s2, loc)
    out[0, 0, 7] = 3
    assert tie_aware_check(out, s2, mag, loc, 16).failed == 1


def _nan_row(vals, L):
    """One row of scores ``vals`` with local page L: (scores, local, magnitudes, the
    reference's selection)."""
    s = _one_row(vals, L)
    local = torch.tensor([L])
    return s, local, torch.full((1, 1), 100.0, dtype=torch.float64), ref.select_pages(s, local)


def test_tie_aware_nan_pages_rank_last():
    L = 17
    vals = [float(j) for j in range(L)]
    vals[16] = float("nan")  # would be the best page if NaN were a number
    s, local, mag, good = _nan_row(vals, L)
    assert 16 not in good[0, 0, :15].tolist()
    bad = good.clone()
    bad[0, 0, 14] = 16  # NaN page instead of the weakest numeric one
    assert tie_aware_check(bad, s, mag, local, 8).failed == 1


def test_tie_aware_nan_pages_by_smaller_id():
    """NaN scores are exact (NaN bytes), so even a tie-aware backend must rank NaN pages among
    themselves by smaller id (SPEC 5)."""
    L = 17
    vals = [float(j) for j in range(L)]
    for j in (2, 5, 9, 12):
        vals[j] = float("nan")  # 13 numeric pages: two NaN pages are selected (2 then 5)
    s, local, mag, good = _nan_row(vals, L)
    assert good[0, 0, 13:].tolist() == [2, 5, L]
    assert tie_aware_check(good, s, mag, local, 8).failed == 0
    swapped = good.clone()
    swapped[0, 0, [13, 14]] = swapped[0, 0, [14, 13]]
    skipped = good.clone()
    skipped[0, 0, 14] = 9  # NaN page 9 kept over NaN page 5
    for bad in (swapped, skipped):
        r = tie_aware_check(bad, s, mag, local, 8)
        assert r.failed == 1
        assert "smaller id" in explain_row(r, 0, 0)


# --------------------------------------------------------------------------------------------
# Injected bugs: every check can fail
# --------------------------------------------------------------------------------------------

def test_reference_passes_a_decode_case():
    r = run_case(_decode_case(), reference_backend())
    assert r.ok and r.rows > 0 and r.exact == r.rows


def _swap_backend():
    def decode(index_q, cache, block_table, seq_lens, query_len, *, out=None):
        res = nv.decode_indexer(index_q, cache, block_table, seq_lens, query_len,
                                backend="reference")
        top = res[..., 15] >= 16  # rows with top-k active
        swapped = res.clone()
        swapped[..., 0], swapped[..., 14] = res[..., 14], res[..., 0]
        res = torch.where(top[..., None], swapped, res)
        return res if out is None else out.copy_(res)
    return dataclasses.replace(_bounded(reference_backend()), name="swap",
                               decode_indexer=decode)


def test_detects_swapped_selected_pages():
    r = run_case(_decode_case(), _swap_backend())
    assert r.failed > 0 and r.failures
    f = r.failures[0]
    assert f.row is not None and f.expected != f.got
    assert "ranked after" in f.detail or "beats" in f.detail
    assert "seed=7" in f.reproducer("swap") and "row=" in f.reproducer("swap")


def test_detects_off_by_one_history_page():
    def decode(index_q, cache, block_table, seq_lens, query_len, *, out=None):
        shifted = block_table.clone()
        shifted[:, :-1] = block_table[:, 1:]  # page j scored with page j+1's block
        # Page j+1 of the last history page is the local page: a valid block.
        res = ref.decode_indexer(index_q, cache, shifted, seq_lens, query_len)
        return res if out is None else out.copy_(res)
    b = dataclasses.replace(_bounded(reference_backend()), name="off-by-one",
                            decode_indexer=decode)
    r = run_case(_decode_case(seed=11, q=1, heads=4), b)
    assert r.failed > 0


def test_detects_flipped_code_byte():
    def quantize(x):
        codes, scales = ref.quantize_nvfp4(x)
        codes = codes.clone()
        codes.view(-1, 64)[-1, 5] ^= 0x10
        return codes, scales
    b = dataclasses.replace(reference_backend(), name="flip", quantize_nvfp4=quantize)
    case = G.Case("quantize_nvfp4", "quantize/t", 0,
                  {"x": G.random_vectors(np.random.default_rng(0), 16, "gaussian")})
    r = run_case(case, b)
    assert r.failed == 1 and r.failures[0].row == 15
    assert run_case(case, reference_backend()).ok


def test_detects_stray_byte_in_cache():
    def write(cache, k, slot_mapping):
        nv.write_index_k(cache, k, slot_mapping, backend="reference")
        s = int(slot_mapping[slot_mapping >= 0][0])
        pages = cache.as_strided((cache.shape[0], 9216), (cache.stride(0), 1))
        blk, off = divmod(s, 128)
        nb = (off + 1) % 128  # the next token's first scale byte
        pages[blk, 8192 + 8 * nb] ^= 0x01
    b = dataclasses.replace(reference_backend(), name="stray", write_index_k=write)
    rng = np.random.default_rng(3)
    case = G.write_case(rng, SMOKE, "write/t", 3, "gaussian")
    case.inputs["slot_mapping"] = torch.arange(0, 40, 2, dtype=torch.int64)  # gaps between
    case.inputs["k"] = case.inputs["k"][:1].expand(20, 128).contiguous()
    r = run_case(case, b)
    assert r.failed >= 1
    assert any("outside the written tokens" in f.detail for f in r.failures)
    assert run_case(case, reference_backend()).ok


def test_detects_wrong_gather_page():
    def gather(cache, block_table, seq_lens):
        ws, off = nv.gather_index_k_fp8(cache, block_table, seq_lens, backend="reference")
        if ws.shape[0] > 1:
            ws = ws.clone()
            ws[[0, 1]] = ws[[1, 0]]
        return ws, off
    b = dataclasses.replace(reference_backend(), name="gather", gather_index_k_fp8=gather)
    rng = np.random.default_rng(5)
    case = G.gather_case(rng, SMOKE, "gather/t", 5, "gaussian")
    r = run_case(case, b)
    assert r.failed >= 2


def test_insert_boundary_explained_and_unexplained():
    # Values exactly on E2M1 thresholds (scale 1) and an amax whose /6 is an E4M3 midpoint:
    # a 1-ulp perturbation flips codes and a scale, each inside SPEC 3's band.
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    v = torch.zeros(4, 128, dtype=torch.float64)
    v[:, 0] = 6.0
    v[:, 1:8] = thresholds
    v[:, 8:15] = -thresholds
    v[:, 16] = 6 * 1.0625  # amax/6 = 1.0625, the midpoint of E4M3 1.0 and 1.125
    v[:, 17] = 1.0
    mag = v.abs() * 1.5  # term magnitudes (e.g. RoPE) a little above |v|
    ref_c, ref_s = F.quantize_nvfp4(v.to(torch.float32))
    up = (v * (1 + 2.0 ** -20)).to(torch.float32)  # a kernel rounding up every value
    got_c, got_s = F.quantize_nvfp4(up)
    assert not torch.equal(got_c, ref_c) and not torch.equal(got_s.view(torch.uint8),
                                                             ref_s.view(torch.uint8))
    ok, proofs = explain_keys(v, mag, got_c, got_s.view(torch.uint8), ref_c,
                              ref_s.view(torch.uint8))
    assert bool(ok.all()) and proofs
    assert any("scale" in p for p in proofs) and any("code" in p for p in proofs)
    # Generic values moved by 3%, far outside 2^-16: unexplained differences.
    g = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 128)))
    gc, gs = F.quantize_nvfp4(g.to(torch.float32))
    bad_c, bad_s = F.quantize_nvfp4((g * 1.03).to(torch.float32))
    assert not torch.equal(bad_c, gc)
    ok2, _ = explain_keys(g, g.abs(), bad_c, bad_s.view(torch.uint8), gc, gs.view(torch.uint8))
    assert not bool(ok2.any())
    ok3, _ = explain_keys(g, g.abs(), gc, gs.view(torch.uint8), gc, gs.view(torch.uint8))
    assert bool(ok3.all())  # the reference's own bytes are always inside the band


def test_query_band_and_signed_zero():
    v = torch.tensor([1.0625, -1e-9, 1e-9, 0.0, 3.0], dtype=torch.float64)  # 1.0625: midpoint
    mag = torch.tensor([1.0625, 1e-4, 1e-12, 0.0, 3.0], dtype=torch.float64)
    b = lambda *x: torch.tensor(x, dtype=torch.uint8)
    # 1.0625 -> 1.0 (0x38) or 1.125 (0x39); -1e-9 within band of 0 -> 0x00 or 0x80.
    assert explain_queries(v, mag, b(0x39, 0x00, 0x00, 0x00, 0x44)).all()
    assert explain_queries(v, mag, b(0x38, 0x80, 0x00, 0x00, 0x44)).all()
    r = explain_queries(v, mag, b(0x3A, 0x80, 0x80, 0x80, 0x45))
    # 0x3A = 1.25 no; 1e-9 with a tiny band cannot give -0; an exact 0 lies within the band of
    # zero (either sign, SPEC 3); 0x45 = 3.5 for 3.0 no.
    assert r.tolist() == [False, True, False, True, False]


def test_band_judges_follow_spec_nan_rules():
    """SPEC 1.3: a group's amax skips NaN (0 when all are NaN: scale 2^-9) and NaN quantizes
    to code 0; SPEC 1.1: NaN encodes as 0x7F."""
    v = torch.zeros(2, 128, dtype=torch.float64)
    v[:, 0] = 6 * 1.0625  # amax / 6 on the E4M3 midpoint of 1.0 and 1.125
    v[:, 1] = 1.0
    v[:, 3] = math.nan  # group 0: one NaN among finite values
    v[1, 16:32] = math.nan  # token 1, group 1: all NaN
    mag = v.abs() * 1.5
    ref_c, ref_s = F.quantize_nvfp4(v.to(torch.float32))
    got_c, got_s = F.quantize_nvfp4((v * (1 + 2.0 ** -20)).to(torch.float32))
    ref_s, got_s = ref_s.view(torch.uint8), got_s.view(torch.uint8)
    assert got_s[0, 0] != ref_s[0, 0] and int(ref_s[1, 1]) == 0x01
    ok, proofs = explain_keys(v, mag, got_c, got_s, ref_c, ref_s)
    assert ok.tolist() == [True, True] and any("scale" in p for p in proofs)
    bad_c = got_c.clone()
    bad_c[0, 1] = (bad_c[0, 1] & 0x0F) | 0x10  # dim 3 (NaN) given code 1
    assert explain_keys(v, mag, bad_c, got_s, ref_c, ref_s)[0].tolist() == [False, True]
    bad_s = got_s.clone()
    bad_s[1, 1] = 0x38  # the all-NaN group's scale must be the 2^-9 floor
    assert explain_keys(v, mag, got_c, bad_s, ref_c, ref_s)[0].tolist() == [True, False]
    qv = torch.tensor([math.nan, math.nan, math.nan, 1.0], dtype=torch.float64)
    got = torch.tensor([0x7F, 0xFF, 0x00, 0x38], dtype=torch.uint8)
    assert explain_queries(qv, qv.abs(), got).tolist() == [True, False, False, True]


def test_insert_case_detects_perturbed_kernel():
    def insert(cache, k, positions, slot_mapping, w, cs, *, rotary_dim=64, eps=1e-6):
        y = ref.norm_rope(k, positions, w, cs, rotary_dim, eps) * 1.001
        c, s = ref.quantize_nvfp4(y)
        ref.write_tokens(cache, c, s, slot_mapping)
    b = dataclasses.replace(reference_backend(), name="ins", insert_index_k=insert,
                            exact_insert=False)
    case = G.insert_case(np.random.default_rng(2), SMOKE, "insert/t", 2, "gaussian")
    r = run_case(case, b)
    assert r.failed > 0 and "band" in r.failures[0].detail
    assert run_case(case, reference_backend()).ok


def test_wrapper_replay_detects_stale_results():
    """A wrapper that ignores in-place buffer changes after its first run fails replays."""
    real = reference_backend()

    class Stale:
        def __init__(self, num_heads, *, block_table_buffer, seq_lens_buffer, use_cuda_graph):
            self.w = real.make_decode_wrapper(num_heads, block_table_buffer=block_table_buffer,
                                              seq_lens_buffer=seq_lens_buffer,
                                              use_cuda_graph=use_cuda_graph)
            self.first = None

        def plan(self, *a, **kw):
            self.w.plan(*a, **kw)

        def run(self, q, cache, out):
            if self.first is None:
                self.first = self.w.run(q, cache, out).clone()
            return out.copy_(self.first)

    small = dataclasses.replace(SMOKE, wrapper_batch=2, wrapper_replays=3)
    good = wrapper_session(real, small, 1, "wrapper/t", 1, 2)
    assert all(r.ok for r in good) and len(good) == small.wrapper_replays + 1
    b = dataclasses.replace(real, name="stale", make_decode_wrapper=Stale)
    res = wrapper_session(b, small, 1, "wrapper/t", 1, 2)
    assert res[0].ok and any(not r.ok for r in res[1:])


def test_backend_exceptions_are_failures_and_missing_ops_skip():
    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    def renamed(*a, **k):  # a launcher module renamed inside the Triton backend
        raise ModuleNotFoundError("No module named 'nvfp4_indexer.triton.decode_v2'")
    case = _decode_case()
    b = dataclasses.replace(reference_backend(), decode_indexer=boom)
    r = run_case(case, b)
    assert r.failed == 1 and "kernel exploded" in r.failures[0].got
    r = run_case(case, dataclasses.replace(reference_backend(), decode_indexer=renamed))
    assert r.failed == 1 and not r.skipped and "nvfp4_indexer.triton" in r.failures[0].got
    r = run_case(case, dataclasses.replace(reference_backend(), decode_indexer=None))
    assert r.skipped and r.ok


def test_op_records_counts_and_backend_callables():
    """Every check's case count is the length of its case list (smoke sizes), every case op
    has one record, and the records name only Backend callables."""
    from nvfp4_indexer.conformance import ops
    from nvfp4_indexer.conformance.backends import OPS
    counts = ops.case_counts(SMOKE)
    for check in ops.CHECKS:
        recs = ops.records_of(check)
        if any(r.session for r in recs):
            continue
        cases = list(ops.build_cases(check, SMOKE, 3))
        assert len(cases) == counts[check], check
        assert {c.op for c in cases} == {r.name for r in recs}, check
        assert all(ops.op_record(c.op).check == check for c in cases)
    assert set(ops.CHECK_DOCS) == set(ops.CHECKS)
    assert {b for r in ops.OPS for b in r.backend} == set(OPS)
    with pytest.raises(ValueError, match="unknown check"):
        list(ops.build_cases("nope", SMOKE, 0))
    with pytest.raises(ValueError, match="unknown op"):
        ops.op_record("nope")


def test_nan_insert_and_query_cases():
    """The generator's NaN cases carry NaN values among finite ones (a NaN norm-weight dim),
    whole NaN rows and a NaN cos/sin row; the reference passes them, and a kernel that gives
    a NaN value a non-zero code (keys) or a byte other than 0x7F (queries) fails."""
    from nvfp4_indexer.conformance import ops
    cases = [c for c in ops.build_cases("insert", SMOKE, 5) if "/nan/" in c.name]
    assert [c.op for c in cases] == ["insert_index_k", "prepare_index_q"]
    for case in cases:
        exp = ops.oracle(case)
        nan = torch.isnan(exp["value"]).reshape(-1, 128)
        assert bool(nan.all(-1).any()) and bool((nan.any(-1) & ~nan.all(-1)).any())
        assert run_case(case, reference_backend()).ok

    def bad_query(q, positions, w, cs, *, rotary_dim=64, eps=1e-6):
        out = ref.prepare_index_q(q, positions, w, cs, rotary_dim, eps).view(torch.uint8)
        return torch.where(out == 0x7F, 0xFF, out).to(torch.uint8).view(torch.float8_e4m3fn)

    def bad_insert(cache, k, positions, slot_mapping, w, cs, *, rotary_dim=64, eps=1e-6):
        y = ref.norm_rope(k, positions, w, cs, rotary_dim, eps)
        c, s = ref.quantize_nvfp4(torch.where(torch.isnan(y), 1.0, y))  # NaN read as 1.0
        ref.write_tokens(cache, c, s, slot_mapping)
    b = dataclasses.replace(reference_backend(), name="nan-bugs", exact_insert=False,
                            prepare_index_q=bad_query, insert_index_k=bad_insert)
    for case in cases:
        assert run_case(case, b).failed > 0, case.name


# --------------------------------------------------------------------------------------------
# Case files
# --------------------------------------------------------------------------------------------

def test_case_file_round_trip(tmp_path):
    case = _decode_case(seed=21)
    bad = _swap_backend()
    r = run_case(case, bad)
    assert not r.ok and r.case_obj is not None
    path = save_case(tmp_path, r.case_obj, r.expected, failures=r.failures, backend="swap")
    loaded, doc = load_case(path)
    assert doc["failures"][0]["row"] == r.failures[0].row
    for k, v in case.inputs.items():
        w = loaded.inputs[k]
        if isinstance(v, torch.Tensor):
            assert v.dtype == w.dtype and torch.equal(v.view(torch.uint8) if v.dtype ==
                                                      torch.float8_e4m3fn else v,
                                                      w.view(torch.uint8) if w.dtype ==
                                                      torch.float8_e4m3fn else w)
        else:
            assert v == w
    again = replay_case(path, bad)
    assert [(f.row, f.head) for f in again.failures] == [(f.row, f.head) for f in r.failures]
    assert replay_case(path, reference_backend()).ok
    assert replay_case(path, reference_backend(), oracle=True).ok
    # The CLI replays it too (exit 1 for a failing backend is covered by run above).
    assert cli_main(["replay", str(path), "--backend", "reference", "--no-progress"]) == 0


# --------------------------------------------------------------------------------------------
# Golden vectors
# --------------------------------------------------------------------------------------------

def test_in_repo_golden_set_verifies_with_reference():
    size = sum(p.stat().st_size for p in DEFAULT_DIR.iterdir())
    assert size < 3_000_000
    results, manifest = verify_golden(DEFAULT_DIR, reference_backend(), oracle_check=True)
    bad = [f.reproducer() for r in results for f in r.failures]
    assert not bad, "\n".join(bad[:5])
    assert not any(r.skipped for r in results)
    checks = {r.check for r in results}
    assert {"integrity", "tables", "oracle", "codec", "write", "insert", "gather", "decode",
            "prefill", "mixed", "scores"} <= checks
    ops = {c["op"] for c in manifest["cases"]}
    assert {"encode_e4m3", "dequantize_nvfp4", "quantize_nvfp4", "insert_index_k",
            "prepare_index_q", "decode", "prefill"} <= ops


def test_golden_detects_tampered_array(tmp_path):
    d = tmp_path / "g"
    shutil.copytree(DEFAULT_DIR, d)
    manifest, data = load_golden(d)
    arrays = dict(data["decode.npz"])
    name = next(k for k in arrays if k.endswith("exp.selection"))
    a = arrays[name].copy()
    a.flat[0] ^= 1
    arrays[name] = a
    np.savez_compressed(d / "decode.npz", **arrays)
    manifest, data = load_golden(d)
    r = check_integrity(manifest, data)
    assert r.failed == 1 and name in r.failures[0].detail
    assert cli_main(["golden", "verify", str(d), "--case", "decode/contract/L16",
                     "--no-progress", "--json"]) == 1


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def test_cli_json_and_exit_codes(tmp_path, monkeypatch, capsys):
    assert cli_main(["--smoke", "--checks", "codec,write", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "nvfp4-indexer-conformance-report/1" and doc["ok"] is True
    assert [c["check"] for c in doc["checks"]] == ["codec", "write"]
    assert doc["checks"][0]["rows"] > 100_000 and doc["backend"]["name"] == "reference"
    # A third-party backend by module:attr with an injected bug: exit 1, case files saved.
    mod = tmp_path / "buggy_backend_mod.py"
    mod.write_text(textwrap.dedent("""
        import dataclasses
        from nvfp4_indexer import reference as ref
        from nvfp4_indexer.conformance.backends import reference_backend

        def make_backend(device="cpu"):
            def quantize(x):
                c, s = ref.quantize_nvfp4(x)
                c = c.clone()
                c.view(-1, 64)[0, 0] ^= 1
                return c, s
            return dataclasses.replace(reference_backend(device), name="buggy",
                                       quantize_nvfp4=quantize)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    save = tmp_path / "fails"
    rc = cli_main(["run", "--smoke", "--checks", "codec", "--backend",
                   "buggy_backend_mod:make_backend", "--save-failures", str(save),
                   "--no-progress", "--case", "quantize/*"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "replay" in out and "seed=" in out
    files = sorted(save.glob("*.npz"))
    assert files and all(f.with_suffix(".json").exists() for f in files)
    assert cli_main(["replay", str(files[0]), "--backend", "buggy_backend_mod:make_backend",
                     "--no-progress"]) == 1
    assert cli_main(["run", "--checks", "nope"]) == 2
    assert cli_main(["run", "--backend", "nomodule_xyz:f"]) == 2


def test_cli_record_markdown(tmp_path):
    out = tmp_path / "rec.md"
    assert cli_main(["--smoke", "--checks", "gather", "--record", str(out),
                     "--no-progress"]) == 0
    text = out.read_text()
    assert "Commit" in text and "GPU" in text and "| gather |" in text


# --------------------------------------------------------------------------------------------
# Triton (interpreter on CPU, in a subprocess so TRITON_INTERPRET is set before import)
# --------------------------------------------------------------------------------------------

def _cli_json(args, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="1") if "--interpret" in args else dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "nvfp4_indexer.conformance", *args, "--json", "--no-progress"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.stdout, p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def test_triton_interpreter_passes_golden_set():
    """CI gate: the Triton backend passes the whole in-repo golden set under the interpreter
    (no op skipped)."""
    rc, doc = _cli_json(["golden", "verify", "--backend", "triton", "--interpret", "--strict"])
    assert rc == 0, json.dumps(doc["failures"][:3], indent=1)
    assert doc["backend"]["name"] == "triton" and doc["environment"]["triton_interpret"]
    dec = next(c for c in doc["checks"] if c["check"] == "decode")
    assert dec["cases"] == 16 and dec["cases_skipped"] == 0 and dec["rows"] > 100


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_smoke_suite(backend):
    """CI gate: the --smoke suite (every check, random engine states) passes."""
    args = ["run", "--smoke", "--strict", "--backend", backend]
    if backend == "triton":
        args.append("--interpret")
    rc, doc = _cli_json(args)
    assert rc == 0, json.dumps(doc["failures"][:3], indent=1)
    assert {c["check"] for c in doc["checks"]} == {"codec", "write", "insert", "gather",
                                                   "scores", "decode", "prefill", "mixed",
                                                   "wrapper", "engine"}


@pytest.mark.gpu
def test_cuda_graph_replays_triton():
    b = load_backend("triton", "cuda")
    res = wrapper_session(b, SMOKE, 3, "wrapper/gpu", 4, 2)
    assert all(r.ok for r in res), [f.reproducer() for r in res for f in r.failures]
    assert len(res) == SMOKE.wrapper_replays + 1


def test_golden_integrity_accepts_compatible_spec_versions():
    """Golden sets written under SPEC 1.0 and 1.1 stay valid under 1.2 (no expected output
    changed); any other version is refused before a vector is compared."""
    from nvfp4_indexer.conformance.golden import check_integrity
    from nvfp4_indexer.constants import GOLDEN_COMPATIBLE_SPECS, SPEC_VERSION
    assert SPEC_VERSION in GOLDEN_COMPATIBLE_SPECS
    empty = {"cases": [], "files": {}, "tables": {}}
    for version, failed in (("1.0", 0), ("1.1", 0), ("1.2", 0), ("0.9", 1), ("2.0", 1),
                            (None, 1)):
        assert check_integrity({**empty, "spec_version": version}, {}).failed == failed, version


def test_engine_check_uses_backend_make_indexer():
    """The engine check builds its indexers through ``Backend.make_indexer``: a backend of
    another name with one runs (its configs pass through); one without is skipped; the
    built-ins provide it, and ``triton-fp8``'s turns on ``allow_fp8_mma``."""
    from nvfp4_indexer.conformance.engine_trace import engine_results
    seen = []

    def make_indexer(config):
        seen.append(config)
        return nv.Indexer(config, backend="reference")
    b = dataclasses.replace(reference_backend(), name="mine", make_indexer=make_indexer)
    res = engine_results(b, SMOKE, 5)
    assert res and all(r.ok and not r.skipped for r in res)
    assert seen and all(isinstance(c, nv.IndexerConfig) for c in seen)
    bare = dataclasses.replace(reference_backend(), name="mine", make_indexer=None)
    assert all(r.skipped and "make_indexer" in r.skipped for r in engine_results(bare, SMOKE, 5))
    cfg = nv.IndexerConfig(4, 4096, 64, 2, device="cpu")
    assert reference_backend().make_indexer(cfg).backend == "reference"
    made = []
    monkey = pytest.MonkeyPatch()
    monkey.setattr(nv, "Indexer", lambda config, backend: made.append((config, backend)))
    try:
        load_backend("triton-fp8", "cpu").make_indexer(cfg)
        load_backend("triton", "cpu").make_indexer(cfg)
    finally:
        monkey.undo()
    assert [(c.allow_fp8_mma, be) for c, be in made] == [(True, "triton"), (False, "triton")]
    assert dataclasses.replace(made[0][0], allow_fp8_mma=False) == cfg
