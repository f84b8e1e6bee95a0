"""``nvfp4-indexer`` (nvfp4_indexer/cli.py): subcommands, forwarded parsers' usage lines, help
and version without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nvfp4_indexer as ni
from nvfp4_indexer.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


def test_help_and_version_import_no_torch():
    code = ("import sys\nfrom nvfp4_indexer.cli import main\n"
            "for argv in (['--help'], ['--version']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        print('exit', e.code)\n"
            "print('torch imported:', 'torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(REPO))  # this checkout, from outside it
    r = subprocess.run([sys.executable, "-c", code], cwd="/", env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "usage: nvfp4-indexer" in r.stdout and "quick run: conformance --smoke" in r.stdout
    assert f"nvfp4-indexer {ni.__version__} (SPEC " in r.stdout
    assert r.stdout.count("exit 0") == 2 and "torch imported: False" in r.stdout


def test_info(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["info", "--help"])  # the subcommand's help, not the info itself
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: nvfp4-indexer info" in out and "torch " not in out
    assert cli_main(["info"]) == 0
    assert f"nvfp4_indexer {ni.__version__}" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["nosuch"])
    assert e.value.code == 2 and "invalid choice: 'nosuch'" in capsys.readouterr().err


def _help(capsys, argv) -> str:
    """The stdout of ``nvfp4-indexer <argv> --help`` (exit code 0)."""
    with pytest.raises(SystemExit) as e:
        cli_main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_golden_usage_names_the_mounted_command(capsys):
    assert "usage: nvfp4-indexer golden write" in _help(capsys, ["golden", "write"])


def test_conformance_help_shows_the_smoke_run(capsys):
    """``nvfp4-indexer conformance --help`` names the quick run, not only ``run --help``."""
    out = _help(capsys, ["conformance"])
    assert out.startswith("usage: nvfp4-indexer conformance")
    lines = [line.strip() for line in out.splitlines()]
    assert "nvfp4-indexer conformance --smoke" in lines
    assert "nvfp4-indexer conformance --smoke --backend triton --interpret" in lines
    assert "nvfp4-indexer conformance run --help" in out


def test_conformance_run_help(capsys):
    out = _help(capsys, ["conformance", "run"])
    assert "usage: nvfp4-indexer conformance run" in out
    flat = " ".join(out.split())  # the default backend is the reference: no interpreter
    assert "interpreter included" not in flat and "only with --backend triton --interpret" in flat
