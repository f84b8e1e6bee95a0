"""The labs' command line: a parser described by the lab's docstring, the GPU check, and
the Markdown table a lab prints at the end."""

from __future__ import annotations

import argparse

import torch


def lab_parser(doc: str) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` described by the first line of the lab's docstring ``doc``."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def gpu_args(ap: argparse.ArgumentParser, argv, lab: str) -> argparse.Namespace:
    """``ap.parse_args(argv)``; without a CUDA GPU, prints ``"<lab>: needs a CUDA GPU"`` and
    exits with status 2."""
    args = ap.parse_args(argv)
    require_gpu(lab)
    return args


def require_gpu(lab: str) -> None:
    """Without a CUDA GPU: prints ``"<lab>: needs a CUDA GPU"`` and exits with status 2."""
    if not torch.cuda.is_available():
        print(f"{lab}: needs a CUDA GPU", flush=True)
        raise SystemExit(2)


def print_markdown(headers: list[str], rows, align: list[str] | None = None) -> None:
    """Prints a blank line and a Markdown table: ``headers``, the ``align`` cells of the
    separator row (default ``---`` each), then ``rows`` (lists of cell strings)."""
    print("\n| " + " | ".join(headers) + " |")
    print("|" + "|".join(align or ["---"] * len(headers)) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
