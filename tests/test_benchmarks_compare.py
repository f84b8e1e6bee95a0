"""``benchmarks.compare``: per-case A/B of two bench.json records (CPU, synthetic records)."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare import compare, main


def _record(gpu: str, times: dict) -> dict:
    suites: dict = {}
    for (suite, name), us in times.items():
        suites.setdefault(suite, {"cases": []})["cases"].append({"name": name, "us": us})
    return {"env": {"gpu": gpu}, "suites": suites}


def _write(tmp_path, name, record):
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return str(path)


def test_rows_are_the_cases_both_records_timed():
    base = _record("H200", {("decode-full", "b8"): 10.0, ("prefill", "4k"): 100.0,
                            ("gather", "only-base"): 1.0})
    new = _record("H200", {("decode-full", "b8"): 12.0, ("prefill", "4k"): 90.0,
                           ("insert", "only-new"): 1.0})
    assert compare(base, new) == [("decode-full", "b8", 10.0, 12.0, 1.2),
                                  ("prefill", "4k", 100.0, 90.0, 0.9)]


def test_exit_status_gates_on_tolerance(tmp_path, capsys):
    base = _write(tmp_path, "a.json", _record("H200", {("s", "x"): 10.0, ("s", "y"): 10.0}))
    new = _write(tmp_path, "b.json", _record("H200", {("s", "x"): 10.2, ("s", "y"): 9.0}))
    assert main([base, new]) == 0  # 1.02x is within the default 3 %
    assert "0 slower than 1.03x" in capsys.readouterr().out
    assert main([base, new, "--tolerance", "0.01"]) == 1
    out = capsys.readouterr().out
    assert "slower: s x 1.020" in out and "slower: s y" not in out


@pytest.mark.parametrize("gpus,cases,words", [
    (("H200", "H100"), ({("s", "x"): 1.0}, {("s", "x"): 1.0}), "not comparable"),
    (("H200", "H200"), ({("s", "x"): 1.0}, {("s", "z"): 1.0}), "no case is timed in both"),
])
def test_unusable_pairs_are_refused(tmp_path, capsys, gpus, cases, words):
    a = _write(tmp_path, "a.json", _record(gpus[0], cases[0]))
    b = _write(tmp_path, "b.json", _record(gpus[1], cases[1]))
    assert main([a, b]) == 2
    assert words in capsys.readouterr().err
