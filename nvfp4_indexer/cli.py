"""The ``nvfp4-indexer`` command line: demo (the main job), conformance, golden, info."""

from __future__ import annotations

import sys

USAGE = """usage: nvfp4-indexer COMMAND [ARGS...]

commands:
  demo         the main job: a real model's attention through the indexer (--random: synthetic)
  conformance  diff a backend against the reference on random paged batches (SPEC 9)
  golden       write or verify versioned golden vectors
  info         versions, devices and the backend "auto" picks

Run `nvfp4-indexer COMMAND --help` for a command's options."""


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
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo.main import main as demo_main
        return demo_main(rest)
    if cmd in ("conformance", "golden"):
        from conformance.cli import main as conformance_main
        return conformance_main(rest if cmd == "conformance" else ["golden", *rest])
    if cmd == "info":
        return info()
    print(f"nvfp4-indexer: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
