"""The benchmark suite (``benchmarks/``): workloads exactly as WORKLOADS.md defines them, the
traffic/FLOP model, cold-cache rotation, the pool, suite summaries, and an end-to-end
``python -m benchmarks --cpu-smoke`` run (every code path on CPU, reference backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is a top-level folder, not an installed package
    sys.path.insert(0, str(REPO))

import nvfp4_indexer as ni  # noqa: E402
from benchmarks import workloads as wl  # noqa: E402
from benchmarks.pool import PagePool  # noqa: E402
from benchmarks.report import markdown, summary_lines  # noqa: E402
from benchmarks.context import Context, finish, written_bytes  # noqa: E402
from benchmarks.suites import summarize  # noqa: E402
from benchmarks.timing import (Timing, graph_sequence, mix_ceiling_gbps,  # noqa: E402
                               mm16_matmul_ceiling, rotation_slots, stream_ceilings,
                               time_eager)


# ----------------------------------------------------------------------------- workloads

def test_full_suite_cases_and_weights():
    cases = wl.full_cases()
    assert len(cases) == 28
    assert sum(c.weight for c in cases) == 10_000
    by = {(c.batch, c.nominal): c.weight for c in cases}
    assert by[(8, 100_000)] == 1260 and by[(128, 200_000)] == 28 and by[(64, 10_000)] == 490
    assert all(c.query_len == 8 and c.num_heads == 4 for c in cases)
    low = wl.lowlat_cases()
    assert {(c.batch, c.nominal) for c in low} == {
        (b, s) for b in (1, 2, 4) for s in (1_000, 4_000, 8_000, 32_000)}
    assert all(c.weight == 0 for c in low)
    var = wl.variant_cases()
    assert len(var) == 3 * 28
    assert {(c.query_len, c.num_heads) for c in var} == {(1, 4), (8, 1), (8, 2)}
    assert len({c.name for c in cases + low + var}) == 28 + 12 + 84


@pytest.mark.parametrize("case", wl.full_cases() + wl.lowlat_cases(), ids=lambda c: c.name)
def test_seq_lens_rules(case):
    """WORKLOADS.md: batch//2 deltas in [max(1, n//20), max(that, n//4)], pairs n-d / n+d, an
    odd batch adds one request at n; mean exactly n."""
    n, b = case.nominal, case.batch
    lens = case.seq_lens()
    assert len(lens) == b and sum(lens) == b * n
    lo = max(1, n // 20)
    hi = max(lo, n // 4)
    deltas = sorted(abs(s - n) for s in lens)
    if b % 2:
        assert deltas[0] == 0
        deltas = deltas[1:]
    assert all(lo <= d <= hi for d in deltas)
    # every delta appears once below and once above the nominal
    below = sorted(n - s for s in lens if s < n)
    above = sorted(s - n for s in lens if s > n)
    assert below == above and len(below) == b // 2
    assert lens == case.seq_lens()  # deterministic


def test_seq_lens_pinned():
    """MSA make_seq_lens (torch CPU generator, seed 1701 + batch*1009 + nominal), pinned."""
    assert wl.make_seq_lens(8, 1_000) == [1234, 766, 1188, 750, 773, 1227, 812, 1250]
    assert wl.make_seq_lens(3, 4_000) == [4000, 3270, 4730]
    assert wl.make_seq_lens(1, 32_000) == [32_000]


def test_decode_traffic_counts_by_hand():
    lens, q, h = [129, 256, 1000, 2], 2, 3
    tr = wl.decode_traffic(lens, q, h)
    # history pages (s - 1) // 128: 1, 1, 7, 0
    assert tr.history_pages == 9 and tr.pages_bytes == 9 * 9216
    assert tr.parts == {"pages": 9 * 9216, "queries": 4 * q * h * 128,
                        "outputs": 4 * q * h * 16 * 4, "block_table": 9 * 4, "seq_lens": 16}
    assert tr.bytes_moved == sum(tr.parts.values())
    # tokens scored per row = 128 * local page of the row's position s - q + i
    local = [(s - q + i) // 128 for s in lens for i in range(q)]
    assert tr.flops == 2 * 128 * h * 128 * sum(local)


def test_prefill_and_gather_traffic():
    c = wl.PrefillCase(1_024, 32_768, 4)
    assert c.q_len == 256 and c.seq_lens() == [33_024] * 4
    assert c.cu_seqlens_q() == [0, 256, 512, 768, 1024]
    tr = wl.prefill_traffic(c)
    assert tr.history_pages == 4 * (33_023 // 128)
    rows = sum((32_768 + i) // 128 for i in range(256)) * 4
    assert tr.flops == 2 * 128 * 4 * 128 * rows
    g = wl.gather_traffic(c)
    assert g.parts["workspace"] == tr.history_pages * 16_384
    assert g.bytes_moved == tr.history_pages * (9216 + 16_384 + 4) + 4 * 4 + 5 * 4
    assert len(wl.prefill_cases()) == 18


def test_quick_subsets():
    assert len(wl.quick_filter(wl.full_cases(), "decode-full")) == 6
    low = wl.quick_filter(wl.lowlat_cases(), "decode-lowlat")
    assert "b1_s32000_q8_h4" in {c.name for c in low}
    assert len(wl.quick_filter(wl.prefill_cases(), "prefill")) == 5
    wide = wl.quick_filter(wl.engine_width_cases(), "decode-engine-width")
    assert {c.name for c in wide} == {"b1_s32000_q8_h4_w8192", "b8_s4000_q8_h4_w8192",
                                      "b128_s1000_q8_h4_w8192", "b8_s100000_q8_h4_w8192"}
    assert all(c.width == 8192 and c.natural_width() < 8192 for c in wl.engine_width_cases())


# ----------------------------------------------------------------------------- rotation

@pytest.mark.parametrize("nbytes", [64_500, 9216 * 58, 8_600_000, 115_000_000, 1_842_000_000])
def test_rotation_slots_reuse_distance(nbytes):
    l2, calls = 60 * 2**20, 120
    s = rotation_slots(nbytes, l2, calls)
    assert (s - 1) * nbytes > 2 * l2  # a slot is re-read after > 2x L2 of other slots
    assert calls % s == 0 if s <= calls else s % calls == 0
    seq = graph_sequence(s, calls)
    flat = [i for g in seq for i in g]
    counts = torch.bincount(torch.tensor(flat), minlength=s)
    assert bool((counts == counts[0]).all()) and flat[-1] == s - 1
    assert all(len(g) <= calls for g in seq)
    assert rotation_slots(nbytes, l2, calls, max_slots=2) <= 2


def test_time_eager_cpu():
    calls = [lambda: torch.ones(1000).sum() for _ in range(3)]
    t = time_eager(calls, torch.device("cpu"), warmup=1, max_samples=4, min_samples=4)
    assert t.method == "cpu-wall-clock" and len(t.samples_us) == 4 and t.us > 0


# ----------------------------------------------------------------------------- ceilings

def test_mix_ceiling_gbps():
    """Reads and writes share the bus: times add, a bytes-weighted harmonic mean of R, W."""
    assert mix_ceiling_gbps(1e9, 1e9, 4000.0, 4000.0) == pytest.approx(4000.0)
    assert mix_ceiling_gbps(5e8, 0, 4204.0, 4564.0) == pytest.approx(4204.0)  # all reads
    assert mix_ceiling_gbps(0, 7, 4204.0, 4564.0) == pytest.approx(4564.0)  # all writes
    # 1 GB read at 4000 GB/s (0.25 ms) + 3 GB written at 6000 GB/s (0.5 ms): 4 GB / 0.75 ms
    assert mix_ceiling_gbps(1e9, 3e9, 4000.0, 6000.0) == pytest.approx(16_000 / 3)
    # between R and W, and not the byte-weighted arithmetic mean (4750 here)
    m = mix_ceiling_gbps(1e9, 1e9, 4000.0, 5500.0)
    assert 4000.0 < m < 4750.0 and m == pytest.approx(2 / (1 / 4000 + 1 / 5500))
    for bad in ((0, 0, 1.0, 1.0), (-1, 2, 1.0, 1.0), (1, 1, 0.0, 1.0), (1, 1, 1.0, None)):
        with pytest.raises((ValueError, TypeError)):
            mix_ceiling_gbps(*bad)


def test_stream_and_mm16_ceilings_cpu():
    """The read-only / write-only and 16-bit matmul ceilings run on CPU, shaped as recorded."""
    st = stream_ceilings(torch.device("cpu"), 1 << 18)
    assert st["bytes"] == 1 << 18 and st["read_gbps"] > 0 and st["write_gbps"] > 0
    assert st["read"]["gbps"] == st["read_gbps"] and st["method"]["write"] in ("graph", "eager")
    mm = mm16_matmul_ceiling(torch.device("cpu"), 32)
    assert (mm["m"], mm["n"], mm["k"]) == (32, 32, 32) and mm["tflops"] > 0
    assert set(mm["variants"]) == {"float16", "bfloat16"}
    ran = {k: v["tflops"] for k, v in mm["variants"].items() if "tflops" in v}
    if ran:
        assert not mm["stand_in"] and mm["tflops"] == max(ran.values())
    else:  # neither 16-bit matmul ran on this CPU: the fp32 stand-in, marked
        assert mm["stand_in"] and mm["best"] == "fp32-matmul"


def test_matmul_rates_interleaved_rounds_keep_each_best():
    """The matmul ceilings time their variants in interleaved rounds and keep each variant's
    fastest (the GPU's clocks move between rounds); a variant failing in a later round keeps
    its earlier rounds, one failing at once is recorded with its error."""
    import benchmarks.timing as T
    order = []
    times = {"a": [2.0, 1.0, 4.0], "b": [3.0, 0.5, 5.0], "c": [1.0]}  # us per round

    def fake_time(fn, device, calls, replays):
        k = fn.key
        order.append(k)
        i = order.count(k) - 1
        if k == "c" and i > 0:
            raise RuntimeError("later failure")
        us = times[k][i]
        return Timing(us, [us], 0.0, "fake", 1)

    def mk(k, ok=True):
        def f():
            if not ok:
                raise RuntimeError("no such matmul")
            return torch.zeros(4, 4)
        f.key = k
        return f
    fns = {"a": mk("a"), "b": mk("b"), "c": mk("c"), "d": mk("d", ok=False)}
    r = T._matmul_rates(fns, 4, torch.device("cpu"), None, rounds=3, time_fn=fake_time)
    assert order == ["a", "b", "c"] * 3  # interleaved, every round
    flops = 2 * 4 ** 3
    v = r["variants"]
    assert v["a"]["us"] == 1.0 and v["b"]["us"] == 0.5 and v["c"]["us"] == 1.0
    assert v["a"]["rounds_tflops"] == pytest.approx([flops / (u * 1e-6) / 1e12
                                                     for u in (2.0, 1.0, 4.0)])
    assert len(v["c"]["rounds_tflops"]) == 1 and "error" in v["d"]
    assert r["best"] == "b" and r["tflops"] == pytest.approx(flops / 0.5e-6 / 1e12)
    assert T.MATMUL_ROUNDS >= 2  # the CUDA default (CPU smoke runs one round)


# ----------------------------------------------------------------------------- pool

def test_pool_pages_and_block_tables():
    pool = PagePool(40, torch.device("cpu"), seed=3)
    raw = pool.cache.as_strided((40, 9216), (9216, 1))
    assert (raw != 0).float().mean() > 0.5  # random NVFP4 keys, not zeros
    codes, scales = ni.read_index_k(pool.cache, 7)
    keys = ni.dequantize_nvfp4(codes, scales, torch.float32)
    assert torch.isfinite(keys).all() and keys.abs().amax() > 0
    lens = [300, 129, 1]
    tables = pool.block_tables(lens, 4)
    need = [3, 2, 1]
    seen = []
    for bt in tables:
        assert bt.dtype == torch.int32 and bt.shape == (3, 3) and bt.is_contiguous()
        assert bt.data_ptr() % 256 == tables[0].data_ptr() % 256
        for r, n in enumerate(need):
            assert (bt[r, n:] == -1).all()
            seen += bt[r, :n].tolist()
    assert len(seen) == 4 * 6 == len(set(seen))  # disjoint across requests and sets
    assert all(0 <= p < 40 for p in seen)
    with pytest.raises(ValueError, match="num_sets"):
        pool.block_tables(lens, 7)


# ----------------------------------------------------------------------------- summaries

def _ctx(**kw):
    return Context(device=torch.device("cpu"), smoke=False, fast_backend="reference",
                   l2_bytes=60 * 2**20, graph_calls=120, warmup=5, replays=20, deadline=0,
                   copy_gbps=4000.0, matmul_tflops=1000.0, **kw)


def test_decode_summary_weighted_mean_and_flags():
    recs = []
    for i, c in enumerate(wl.full_cases()):
        tr = wl.decode_traffic(c.seq_lens(), 8, 4)
        gbps = 3000.0 + 10 * i
        recs.append({"status": "ok", "name": c.name, "weight": c.weight, "query_len": 8,
                     "num_heads": 4, "gbps": gbps, "copy_ratio": gbps / 4000.0,
                     "pages_bytes": tr.pages_bytes, "bytes_moved": tr.bytes_moved,
                     "us": tr.bytes_moved / (gbps * 1e3)})
    recs[-1]["gbps"], recs[-1]["copy_ratio"] = 2000.0, 0.5  # b128 x 200K: big and slow
    recs[-1]["us"] = recs[-1]["bytes_moved"] / 2e6
    s = summarize("decode-full", recs, _ctx(), 28)
    g = s["groups"]["q8_h4"]
    want = sum(r["weight"] * r["gbps"] for r in recs) / 10_000
    assert g["weighted_mean_gbps"] == pytest.approx(want)
    assert g["weighted_mean_copy_ratio"] == pytest.approx(want / 4000.0)
    agg = sum(r["weight"] * r["bytes_moved"] for r in recs) / sum(
        r["weight"] * r["us"] for r in recs) / 1e3
    assert g["aggregate_gbps"] == pytest.approx(agg)
    assert g["big_cases_under_75pct"] == ["b128_s200000_q8_h4"]
    assert g["full_grid"] and s["complete"]
    assert g["target_weighted_085"] == (want / 4000.0 >= 0.85)
    assert any("b128_s200000_q8_h4" in line for line in summary_lines("decode-full", s, {}))


def test_finish_ratios_and_mix_split():
    """``finish``: the 16-bit matmul share next to the FP8 one, and for gather / insert the
    read / write split of the traffic parts and the share of the mix ceiling."""
    ctx = _ctx(mm16_tflops=500.0, read_gbps=4000.0, write_gbps=5000.0)
    t = Timing(us=100.0, samples_us=[100.0], cv=0.0, method="cuda-graph", calls_per_sample=1)
    rec = finish(ctx, {}, t, nbytes=10**8, flops=5 * 10**10)  # 500 TFLOP/s, 1000 GB/s
    assert rec["tflops"] == pytest.approx(500.0)
    assert rec["matmul_ratio"] == pytest.approx(0.5) and rec["mm16_ratio"] == pytest.approx(1.0)
    assert "mix_ratio" not in rec
    tr = wl.gather_traffic(wl.PrefillCase(1_024, 32_768, 4))
    w = written_bytes("gather", tr.parts)
    assert w == tr.parts["workspace"] == tr.history_pages * 16_384
    rec = finish(ctx, {}, t, tr.bytes_moved, 0, w)
    assert rec["bytes_read"] + rec["bytes_written"] == tr.bytes_moved
    assert rec["bytes_read"] == tr.bytes_moved - w and rec["mm16_ratio"] is None
    mix = (tr.bytes_moved) / ((tr.bytes_moved - w) / 4000.0 + w / 5000.0)
    assert rec["mix_ceiling_gbps"] == pytest.approx(mix)
    assert rec["mix_ratio"] == pytest.approx(rec["gbps"] / mix)
    assert written_bytes("insert", wl.insert_traffic(wl.InsertCase()).parts) == 16_384 * 72
    no_ceiling = finish(_ctx(), {}, t, tr.bytes_moved, 0, w)
    assert no_ceiling["mix_ratio"] is None and no_ceiling["mix_ceiling_gbps"] is None


def test_prefill_summary_mm16_ratio():
    recs = [{"status": "ok", "name": "small", "flops": 10, "matmul_ratio": 0.4,
             "mm16_ratio": 0.8},
            {"status": "ok", "name": "big", "flops": 99, "matmul_ratio": 0.3, "mm16_ratio": 0.6}]
    s = summarize("prefill", recs, _ctx(mm16_tflops=500.0), 2)
    assert s["largest_case"] == "big" and s["largest_case_mm16_ratio"] == 0.6
    assert s["mm16_ratio_max"] == 0.8 and s["matmul_ratio_max"] == 0.4
    line = next(x for x in summary_lines("prefill", s, {}) if x.startswith("largest"))
    assert "30% of the FP8 matmul rate (60% of the 16-bit matmul rate)" in line
    assert "best 40% (80% of 16-bit)" in line


def test_lowlat_summary_target():
    recs = [{"status": "ok", "name": "b1_s32000_q8_h4", "us": 5.5},
            {"status": "error", "name": "b2_s32000_q8_h4", "error": "x"}]
    s = summarize("decode-lowlat", recs, _ctx(), 12)
    assert s["target_case_us"] == 5.5 and s["target_le_6us"] and s["errors"] == 1
    assert not s["complete"]


def test_engine_width_summary():
    recs = [{"status": "ok", "name": "a_w8192", "us": 2.1, "over_natural": 1.05},
            {"status": "ok", "name": "b_w8192", "us": 4.8, "over_natural": 2.4},
            {"status": "ok", "name": "c_w8192", "us": 3.0, "over_natural": 0.98}]
    s = summarize("decode-engine-width", recs, _ctx(), 3)
    assert s["worst_case"] == "b_w8192" and s["over_natural_max"] == 2.4
    assert s["within_5pct"] == 2 and s["cases_compared"] == 3 and s["complete"]


# ----------------------------------------------------------------------------- end to end

def test_cpu_smoke_end_to_end(tmp_path):
    """``python -m benchmarks --cpu-smoke`` runs every suite on CPU and writes JSON, Markdown
    tables and the roofline PNG; every case must succeed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--cpu-smoke", "--no-console",
                        "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["mode"] == "cpu-smoke" and data["errors"] == 0
    assert data["env"]["torch"] == torch.__version__ and data["env"]["date_utc"]
    assert data["ceilings"]["copy"]["gbps"] > 0 and data["ceilings"]["fp8_matmul"]["tflops"] > 0
    stream, mm16 = data["ceilings"]["stream"], data["ceilings"]["mm16_matmul"]
    assert stream["read_gbps"] > 0 and stream["write_gbps"] > 0 and mm16["tflops"] > 0
    assert set(data["suites"]) == set(wl.smoke_cases())
    for suite, cases in wl.smoke_cases().items():
        recs = data["suites"][suite]["cases"]
        assert [r["name"] for r in recs] == [c.name for c in cases]
        for rec in recs:
            assert rec["status"] == "ok", rec
            assert rec["us"] > 0 and rec["bytes_moved"] == sum(rec["bytes_parts"].values())
            assert rec["pages_bytes"] == rec["history_pages"] * 9216
            if suite.startswith("decode"):
                assert rec["out_fully_written"] and rec["rows_equal_reference"] == 1.0
                assert rec["reuse_over_l2"] > 2
                if suite == "decode-engine-width":  # the same pages at the natural width
                    assert rec["width"] == 64 and rec["natural_width"] == 18
                    assert rec["natural_equal"] and rec["natural_us"] > 0
                    assert rec["over_natural"] == pytest.approx(rec["us"] / rec["natural_us"])
            elif suite == "prefill":
                assert rec["out_fully_written"] and rec["rows_equal_reference"] == 1.0
                # n16_c0_r1 scores no history token: no FLOPs, no ratio
                assert (rec["mm16_ratio"] > 0) if rec["flops"] else rec["mm16_ratio"] is None
                # the same requests as one Indexer step: same rows, both timings
                assert rec["indexer_rows_equal"] == 1.0 and rec["indexer_chunks"] >= 1
                assert rec["indexer_us"] > 0 and rec["indexer_kernels_us"] > 0
            elif suite == "gather":
                assert rec["equal_reference"] and rec["workspace_pages"] == rec["history_pages"]
            elif suite == "engine":
                assert rec["out_fully_written"] and rec["rows_equal_reference"] == 1.0
                assert rec["plan_us"] > 0 and rec["kernels_us"] > 0
            else:
                assert rec["tokens_equal_reference"] == 1.0
            if suite in ("gather", "insert"):
                assert rec["bytes_read"] + rec["bytes_written"] == rec["bytes_moved"]
                assert rec["bytes_read"] > 0 and rec["bytes_written"] > 0
                assert rec["mix_ceiling_gbps"] == pytest.approx(mix_ceiling_gbps(
                    rec["bytes_read"], rec["bytes_written"], stream["read_gbps"],
                    stream["write_gbps"]))
                assert rec["mix_ratio"] == pytest.approx(rec["gbps"] / rec["mix_ceiling_gbps"])
    prefill = data["suites"]["prefill"]["summary"]
    assert prefill["mm16_ratio_max"] > 0 and prefill["largest_case_mm16_ratio"] > 0
    md = (tmp_path / "tables.md").read_text()
    assert "CPU SMOKE RUN" in md and md.count("### ") == len(wl.smoke_cases())
    header = next(line for line in md.splitlines() if line.startswith("ceilings:"))
    assert "read-only" in header and "write-only" in header and "16-bit matmul" in header
    assert "| % fp8 mm | % 16-bit mm |" in md and md.count("| % copy | % mix |") == 2
    assert markdown(data) in md
    png = (tmp_path / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "wrote" in r.stdout and "[" in r.stdout.splitlines()[0]  # timestamped progress


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_run_without_gpu_says_so(capsys, tmp_path):
    from benchmarks.__main__ import main
    assert main(["--suite", "insert", "--out", str(tmp_path)]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize("extra", [[], ["--allow-fp8-mma"]])
def test_cpu_smoke_triton_interpreter(tmp_path, extra):
    """The same pipeline with the timed paths on the Triton kernels (TRITON_INTERPRET=1):
    the suites' calls into ``nvfp4_indexer.triton`` and the wrapper's shared score buffer
    match the kernels' signatures, and the kernels agree with the reference on these inputs
    (gather bit for bit, SPEC 9; decode / prefill / insert up to SPEC 9 / SPEC 3 ties);
    ``--allow-fp8-mma`` reaches every suite's calls and changes nothing off CUDA."""
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--cpu-smoke", "--smoke-backend",
                        "triton", "--no-console", "--out", str(tmp_path)] + extra, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    for suite, body in data["suites"].items():
        for rec in body["cases"]:
            assert rec["status"] == "ok", rec
            assert "triton" in rec["path"]
            if suite == "gather":
                assert rec["equal_reference"]
            elif suite == "insert":
                assert rec["tokens_equal_reference"] >= 0.9
            else:
                assert rec["out_fully_written"] and rec["rows_equal_reference"] >= 0.9
            if suite.startswith("decode"):
                assert rec["shared_score_buffer_elems"] is None or \
                    rec["shared_score_buffer_elems"] > 0
