"""Results of ``plsh eval``: :class:`EvalRow`, the Markdown table, ``results.csv`` / ``results.md`` and plots."""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EvalRow", "format_table", "plot_results", "read_results", "write_results"]


@dataclass
class EvalRow:
    """One evaluation: a model, an attention variant, an evaluation length."""

    model: str
    attention: str
    kind: str  # "own", "alibi", "plsh", "window"
    train_len: int
    eval_len: int
    factor: float
    stride: int
    samples: int | None
    scheme: str | None
    loss: float
    ppl: float
    bits_per_token: float
    top1: float
    top10: float
    tokens: int
    seconds: float
    cost_per_query: float | None = None  # causal score entries per query per head (mean over heads)


_COLUMNS = [f.name for f in dataclasses.fields(EvalRow)]


def format_table(rows: Sequence[EvalRow]) -> str:
    """A Markdown table of the rows."""
    head = ["model", "attention", "L", "L/train", "loss", "ppl", "bits/tok", "top-1", "top-10", "cost/query", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        cost = "" if r.cost_per_query is None else f"{r.cost_per_query:.1f}"
        cells = [r.model, r.attention, str(r.eval_len), f"{r.factor:g}x", f"{r.loss:.4f}", f"{r.ppl:.2f}",
                 f"{r.bits_per_token:.3f}", f"{r.top1:.4f}", f"{r.top10:.4f}", cost, f"{r.seconds:.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(rows: Sequence[EvalRow], out_dir: str | os.PathLike[str], *, plots: bool = True) -> list[Path]:
    """Write ``results.csv``, ``results.md`` and (with matplotlib) ``extrapolation.png`` and ``sweep.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))
    written.append(out / "results.csv")
    (out / "results.md").write_text(format_table(rows) + "\n", encoding="utf-8")
    written.append(out / "results.md")
    if plots:
        written += plot_results(rows, out)
    return written


def read_results(path: str | os.PathLike[str]) -> list[EvalRow]:
    """Read rows back from a ``results.csv``."""
    rows = []
    types = {f.name: f.type for f in dataclasses.fields(EvalRow)}
    with open(path, newline="", encoding="utf-8") as f:
        for rec in csv.DictReader(f):
            kw: dict[str, Any] = {}
            for k, v in rec.items():
                t = str(types[k])
                if v == "":
                    kw[k] = None
                elif "int" in t and "float" not in t:
                    kw[k] = int(v)
                elif "float" in t:
                    kw[k] = float(v)
                else:
                    kw[k] = v
            rows.append(EvalRow(**kw))
    return rows


def plot_results(rows: Sequence[EvalRow], out_dir: str | os.PathLike[str]) -> list[Path]:
    """``extrapolation.png`` (perplexity vs L / training length, one line per model and attention, without the
    sweep) and ``sweep.png`` (perplexity vs T per evaluation length: schemes, equal-cost windowed ALiBi and exact
    ALiBi); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [_plot_extrapolation(plt, rows, out / "extrapolation.png")]
    sweep = [r for r in rows if r.kind in ("plsh", "window")]
    if sweep:
        written.append(_plot_sweep(plt, rows, sweep, out / "sweep.png"))
    return written


def _plot_extrapolation(plt: Any, rows: Sequence[EvalRow], path: Path) -> Path:
    """Perplexity vs evaluation length / training length, one line per (model, attention) outside the sweep."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves: dict[tuple[str, str], list[EvalRow]] = {}
    for r in rows:
        if r.kind in ("own", "alibi"):
            curves.setdefault((r.model, r.attention), []).append(r)
    for (model, att), rs in curves.items():
        rs = sorted(rs, key=lambda r: r.factor)
        ax.plot([r.factor for r in rs], [r.ppl for r in rs], marker="o", label=f"{model} — {att}")
    ax.set_yscale("log")
    _style_axes(ax, "Length extrapolation", "evaluation length / training length", "perplexity (sliding window)", 7)
    return _save(plt, fig, path)


def _plot_sweep(plt: Any, rows: Sequence[EvalRow], sweep: list[EvalRow], path: Path) -> Path:
    """One panel per (model, evaluation length): perplexity vs T per scheme, equal-cost windows, exact ALiBi."""
    models = list(dict.fromkeys(r.model for r in sweep))
    lengths = sorted({r.eval_len for r in sweep})
    fig, axes = plt.subplots(len(models), len(lengths), figsize=(3.6 * len(lengths), 3.2 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            sub = [r for r in sweep if r.model == model and r.eval_len == length]
            for scheme in dict.fromkeys(r.scheme for r in sub if r.kind == "plsh"):
                pts = sorted((r for r in sub if r.kind == "plsh" and r.scheme == scheme), key=lambda r: r.samples)
                ax.plot([r.samples for r in pts], [r.ppl for r in pts], marker="o", label=f"plsh {scheme}")
            pts = sorted((r for r in sub if r.kind == "window"), key=lambda r: r.samples)
            if pts:
                ax.plot([r.samples for r in pts], [r.ppl for r in pts], marker="s", label="windowed ALiBi, equal cost")
            exact = [r for r in rows if r.model == model and r.eval_len == length and _is_exact_alibi(r)]
            if exact:
                ax.axhline(exact[0].ppl, color="k", ls="--", lw=1, label="exact ALiBi")
            _style_axes(ax, f"{model}, L={length}", "T (windows: equal cost)", "perplexity", 6, title_size=9)
    return _save(plt, fig, path)


def _is_exact_alibi(r: EvalRow) -> bool:
    return r.kind == "alibi" or (r.kind == "own" and r.attention.startswith("own: alibi"))


def _style_axes(
    ax: Any, title: str, xlabel: str, ylabel: str, legend_size: int, *, title_size: int | None = None
) -> None:
    """Log2 x axis, labels, grid and legend, as both plots draw them."""
    ax.set_xscale("log", base=2)
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))  # else the axes' title size
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
