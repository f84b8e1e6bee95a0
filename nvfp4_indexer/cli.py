"""The ``nvfp4-indexer`` command line: demo (the main job), conformance, golden, info.

Subcommands are argparse subparsers; ``demo``, ``conformance`` and ``golden`` hand their
arguments to their own parsers (``nvfp4-indexer demo --help``). ``--help`` and ``--version``
import neither torch nor Triton.
"""

from __future__ import annotations

import argparse
import sys

# name -> help; demo / conformance / golden parse their own arguments
FORWARDED = {
    "demo": "the main job: a real model's attention through the indexer (--random: synthetic)",
    "conformance": "diff a backend against the reference on random paged batches (SPEC 9); "
                   "quick run: conformance --smoke",
    "golden": "write or verify versioned golden vectors",
}


def _version() -> str:
    from . import __version__  # nvfp4_indexer/__init__.py imports no torch
    from .constants import SPEC_VERSION
    return f"nvfp4-indexer {__version__} (SPEC {SPEC_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="nvfp4-indexer",
        description="NVFP4 sparse-attention page indexer: reference, Triton kernels, "
                    "conformance harness.",
        epilog="Run `nvfp4-indexer COMMAND --help` for a command's options.")
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in FORWARDED.items():
        sub.add_parser(name, help=text, add_help=False)  # its own parser handles --help
    sub.add_parser("info", help='versions, devices and the backend "auto" picks',
                   description='Print versions (package, SPEC, Python, torch, Triton), the CUDA '
                               'device and the backend "auto" picks.')
    return ap


def info() -> int:
    import platform

    import torch

    import nvfp4_indexer
    print(f"nvfp4_indexer {nvfp4_indexer.__version__} (SPEC {nvfp4_indexer.SPEC_VERSION})")
    print(f"python {platform.python_version()}, torch {torch.__version__}")
    try:
        import triton
        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton: not installed")
    if torch.cuda.is_available():
        print(f"cuda: {torch.cuda.get_device_name()} (auto backend: triton)")
    else:
        print("cuda: none (auto backend: reference)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    if argv and argv[0] in FORWARDED:  # everything after the command is the command's
        cmd, rest = argv[0], argv[1:]
    else:
        args = ap.parse_args(argv)  # --help / --version / info [--help] / usage errors
        cmd, rest = args.command, []
    if cmd == "demo":
        from .demo.main import main as demo_main
        return demo_main(rest)
    if cmd in ("conformance", "golden"):
        from .conformance.cli import main as conformance_main
        # usage lines read `nvfp4-indexer conformance run ...` / `nvfp4-indexer golden write ...`
        if cmd == "conformance":
            return conformance_main(rest, prog="nvfp4-indexer conformance")
        return conformance_main(["golden", *rest], prog="nvfp4-indexer")
    return info()


if __name__ == "__main__":
    sys.exit(main())
