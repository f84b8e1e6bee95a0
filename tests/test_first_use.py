"""First use: packaging, the Triton interpreter on current numpy, the command lines (the
demo, the conformance CLI, ``python -m benchmarks``): optional dependencies and arguments
checked before any work, one line of error each. ``nvfp4-indexer`` itself: test_cli.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import nvfp4_indexer as ni  # noqa: E402


def _py(code: str, cwd=REPO, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=300)


# ----------------------------------------------------------------------------- packaging

def test_packaging_metadata():
    """py.typed and an Apache-2.0 LICENSE ship; the version is written once (pyproject reads
    ``nvfp4_indexer.__version__``); the Triton range is the tested one."""
    assert (REPO / "nvfp4_indexer" / "py.typed").is_file()
    lic = (REPO / "LICENSE").read_text()
    assert "Apache License" in lic and "Version 2.0, January 2004" in lic
    assert "END OF TERMS AND CONDITIONS" in lic
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    proj = meta["project"]
    assert "version" not in proj and "version" in proj["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "nvfp4_indexer.__version__"}
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["nvfp4_indexer"]
    # one top-level import package: no generic names (conformance, benchmarks) in site-packages
    assert meta["tool"]["setuptools"]["packages"]["find"]["include"] == ["nvfp4_indexer*"]
    assert proj["license"] == "Apache-2.0" and proj["license-files"] == ["LICENSE"]
    triton_dep = next(d for d in proj["dependencies"] if d.startswith("triton"))
    assert ">=3.6" in triton_dep and "<3.7" in triton_dep
    assert importlib.metadata.version("nvfp4-indexer") == ni.__version__


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter")
def test_interpreter_kernels_raise_no_numpy_deprecation():
    """Triton 3.6's interpreter converted reduced scalars with int(1-d array): numpy 1.25-2.3
    warned (~1500 DeprecationWarnings per `make test`), numpy >= 2.4 raised. With the fix a
    decode launch under warnings-as-errors runs and matches the reference."""
    g = torch.Generator().manual_seed(0)
    cache = ni.new_index_cache(24)
    ni.write_index_k(cache, torch.randn(24 * 128, 128, generator=g), torch.arange(24 * 128))
    bt = torch.randperm(24, generator=g)[:20].to(torch.int32)[None]
    seq = torch.tensor([2500], dtype=torch.int32)
    q = torch.randn(1, 2, 128, generator=g).to(torch.float8_e4m3fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        got = ni.decode_indexer(q, cache, bt, seq, 1, backend="triton")
    assert torch.equal(got, ni.decode_indexer(q, cache, bt, seq, 1, backend="reference"))


# ----------------------------------------------------------------------------- demo

DEMO_ERRORS = [
    (["--tokens", "-5"], "--tokens: expected an int in 256..8192"),
    (["--tokens", "9000"], "8192 (the model maximum), got 9000"),
    (["--layers", "99"], "--layers: expected layer ids in 0..29"),
    (["--layers", ","], "--layers: expected at least one layer id"),
    (["--layers", "a,b"], "--layers: expected comma-separated ints"),
    (["--activations", "/nonexistent/acts.pt"], "--activations: no such file"),
    (["--out", "/proc/nvfp4-no"], "--out: cannot write to '/proc/nvfp4-no'"),
    (["--device", "nosuch"], "--device: expected"),
]
if not torch.cuda.is_available():
    DEMO_ERRORS += [(["--device", "cuda"], "--device cuda: this torch build has no usable CUDA"),
                    (["--backend", "triton", "--device", "cpu"], "--backend triton: needs a CUDA")]


@pytest.mark.parametrize("argv,msg", DEMO_ERRORS)
def test_demo_rejects_bad_arguments_before_work(argv, msg, capsys, monkeypatch):
    from nvfp4_indexer.demo import main as demo
    monkeypatch.setattr(demo, "missing_dependencies", lambda model: [])
    monkeypatch.setattr(demo, "capture_model", lambda *a: pytest.fail("worked before checking"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1] and err[-1].startswith("nvfp4-indexer demo: error:"), err


def test_demo_checks_optional_dependencies_first(capsys, monkeypatch, tmp_path):
    from nvfp4_indexer.demo import main as demo
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tokenizers", "matplotlib")
                        else real(name, *a))
    monkeypatch.setattr(demo, "synthetic", lambda *a: pytest.fail("worked before checking"))
    for argv, want in ((["--random"], "matplotlib>=3.7;"),
                       ([], "tokenizers>=0.20")):
        with pytest.raises(SystemExit) as e:
            demo.main([*argv, "--out", str(tmp_path / "o")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "missing optional dependencies" in err and want in err
        assert "pip install 'nvfp4-indexer[demo]'" in err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- conformance

def test_conformance_cli_messages(capsys, tmp_path, monkeypatch):
    from nvfp4_indexer.conformance import golden
    from nvfp4_indexer.conformance.cli import main
    assert main(["run", "--backend", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("--backend") == 1 and "'nosuch'" in err  # the option named once
    assert main(["replay", str(tmp_path / "case.npz")]) == 2
    err = capsys.readouterr().err
    assert "case.npz" in err and "no such file" in err
    d = tmp_path / "gold"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    calls = []
    monkeypatch.setattr(golden, "write_golden", lambda dr, seed: calls.append(dr) or {
        "cases": [], "files": {}, "spec_version": "x", "generator": {"seed": seed}})
    monkeypatch.setattr(golden, "golden_size", lambda dr: 0)
    assert main(["golden", "write", str(d)]) == 2  # an existing set is never overwritten
    assert "--force" in capsys.readouterr().err and not calls
    assert main(["golden", "write", str(d), "--force", "--json"]) == 0 and calls == [str(d)]
    assert json.loads(capsys.readouterr().out)["dir"] == str(d)
    assert main(["golden", "write", str(tmp_path / "new")]) == 0  # a new DIR needs no --force


# ----------------------------------------------------------------------------- benchmarks

def test_benchmarks_run_from_the_repo_root():
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage: python -m benchmarks" in r.stdout, r.stderr


def test_benchmarks_without_matplotlib_fail_clearly(capsys, monkeypatch, tmp_path):
    import benchmarks.__main__ as bm
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        bm.main(["--cpu-smoke", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()  # checked before any work


def test_benchmarks_plot_failure_exits_nonzero(capsys, monkeypatch, tmp_path):
    import benchmarks.__main__ as bm
    import benchmarks.report as rp

    def boom(*a, **k):
        raise RuntimeError("no backend")
    monkeypatch.setattr(rp, "roofline", boom)
    rc = bm.main(["--cpu-smoke", "--suite", "insert", "--no-console", "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc == 1 and "error: roofline.png not written: RuntimeError: no backend" in cap.err
    wrote = next(line for line in cap.out.splitlines() if "wrote" in line)
    assert "Error" not in wrote and (tmp_path / "tables.md").exists()


def test_conformance_negative_seed_is_a_usage_error(capsys, tmp_path):
    """``--seed -1`` is refused by the parser in one line (exit 2), before any work: no
    traceback, no folder left behind by ``golden write``."""
    from nvfp4_indexer.conformance.cli import main
    for argv in (["run", "--seed", "-1"], ["golden", "write", str(tmp_path / "g"), "--seed",
                                           "-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--seed" in err and "non-negative" in err and "Traceback" not in err
    assert not (tmp_path / "g").exists()


def test_every_module_the_docs_run_answers_help():
    """Each ``python -m MODULE`` the README and docs/ name exists and prints its usage for
    ``--help`` (exit 0), GPU labs included (they check the GPU after parsing). One process:
    runpy per module."""
    import re
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = sorted({m for d in docs for m in re.findall(r"python -m ((?:benchmarks|nvfp4_indexer\.conformance)"
                                                         r"[\w.]*)", d.read_text())})
    assert "benchmarks.labs.dequant_lab" in named and "nvfp4_indexer.conformance" in named
    code = ("import runpy, sys\n"
            f"for m in {named!r}:\n"
            "    sys.argv = [m, '--help']\n"
            "    try:\n"
            "        runpy.run_module(m, run_name='__main__', alter_sys=True)\n"
            "        print('NOEXIT', m)\n"
            "    except SystemExit as e:\n"
            "        print('EXIT', e.code, m)\n")
    r = _py(code)
    assert r.returncode == 0, r.stderr[-2000:]
    results = [line.split(" ", 2) for line in r.stdout.splitlines()
               if line.startswith(("EXIT ", "NOEXIT "))]
    assert [x[-1] for x in results] == named, r.stdout[-2000:]
    bad = [x for x in results if x[:2] != ["EXIT", "0"]]
    assert not bad, bad
