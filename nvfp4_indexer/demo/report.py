"""Demo output: the summary table, a markdown report, a JSON dump and the recall plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from .analysis import LayerResult

COLUMNS = ("layer", "rows", "same 15", "overlap", "recall nvfp4", "recall bf16",
           "recall local", "recall oracle", "decode=prefill", "triton vs ref")


def rows_of(results: list[LayerResult]) -> list[list[str]]:
    out = []
    for r in results:
        out.append([str(r.layer), str(r.rows), f"{r.same_set:.3f}", f"{r.overlap:.3f}",
                    f"{r.recall['nvfp4']:.3f}", f"{r.recall['bf16']:.3f}",
                    f"{r.recall['local']:.3f}", f"{r.recall['oracle']:.3f}",
                    f"{'yes' if r.decode_match else 'NO'} ({r.decode_rows})", r.backend_check])
    return out


def print_table(results: list[LayerResult], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c, justify="right")
    for row in rows_of(results):
        table.add_row(*row)
    Console(width=160).print(table)


def plot_recall(results: list[LayerResult], path: Path, title: str) -> None:
    """Recall vs context position (local page), one panel per layer. NVFP4 and bf16 selection
    often coincide: NVFP4 is a wide translucent band, bf16 a thin dashed line with markers
    drawn over it, so both stay visible where they are equal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False, sharey=True)
    styles = {"oracle": dict(color="k", ls=":"),
              "nvfp4": dict(color="C0", ls="-", lw=4.5, alpha=0.45, zorder=2),
              "bf16": dict(color="C1", ls="--", lw=1.2, marker="o", ms=3, zorder=3),
              "local": dict(color="C2", ls="-.")}
    for ax, r in zip(axes[0], results):
        x = [p * 128 for p in r.recall_by_page["page"]]
        for name, style in styles.items():
            ax.plot(x, r.recall_by_page[name], label=name, **style)
        ax.set_title(f"layer {r.layer}")
        ax.set_xlabel("query position (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("attention mass in the 16 selected pages")
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: list[LayerResult], out_dir: Path, meta: dict) -> Path:
    """Write ``report.md``, ``results.json`` and ``recall.png`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_recall(results, out_dir / "recall.png", meta.get("title", ""))
    (out_dir / "results.json").write_text(json.dumps(
        {"meta": meta, "layers": [asdict(r) for r in results]}, indent=1))
    lines = [f"# {meta.get('title', 'nvfp4_indexer demo')}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "title"]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows_of(results)]
    lines += ["", "Rows are (query token, index head) pairs with at least 16 history pages. "
              "*same 15*: share of rows whose 15 NVFP4-selected history pages equal those "
              "selected by exact scores of unquantized bf16 keys/queries; *overlap*: mean share "
              "of common pages. *recall*: mean share of the model's softmax attention mass (of "
              "the query heads behind each index head) inside the 16 selected pages; *local*: "
              "the last 16 pages; *oracle*: the 16 heaviest pages; full attention is 1.0.",
              "", "![recall vs position](recall.png)", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
