"""Tables and figures of docs/experiments.md from the outputs of benchmarks/lm_experiment.sh.

    python benchmarks/lm_report.py [--runs runs/lm] [--figures docs/figures]

Prints Markdown tables (training, extrapolation, sweeps) and writes small PNGs: the validation-loss curves
(lm_training.png), perplexity vs evaluation length (lm_extrapolation.png) and the positional-LSH sweep of the
ALiBi-trained model (lm_sweep_alibi.png).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from positional_lsh.lm.eval_results import EvalRow, plot_results, read_results

MODELS = ("alibi", "plsh-t1", "plsh-t4", "plsh-fixed", "rope", "nope")


def training_table(runs: Path) -> tuple[str, dict[str, list[dict]]]:
    logs = {}
    for m in MODELS:
        f = runs / m / "log.jsonl"
        if f.is_file():
            logs[m] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    steps = sorted({r["step"] for recs in logs.values() for r in recs if "val_loss" in r})
    head = "| model | " + " | ".join(f"val loss @{s}" for s in steps) + " | final val ppl | train tokens | wall time |"
    lines = [head, "|---|" + "---:|" * (len(steps) + 3)]
    for m, recs in logs.items():
        val = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
        train = [r for r in recs if "loss" in r]
        cells = [f"{val[s]:.3f}" if s in val else "" for s in steps]
        last = val[max(val)] if val else float("nan")
        wall = train[-1]["elapsed"] / 60 if train else float("nan")
        tokens = train[-1]["tokens"] if train else 0
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {math.exp(last):.1f} | {tokens:,} | {wall:.0f} min |")
    return "\n".join(lines), logs


def plot_training(logs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for m, recs in logs.items():
        val = [(r["tokens"] if "tokens" in r else None, r) for r in recs]
        pts = [(r["step"], r["val_loss"]) for _, r in val if "val_loss" in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=m)
    ax.set_xlabel("optimizer step (4,096 tokens each)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Training at 256 tokens, equal budget")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def pivot(rows: list[EvalRow], key: str = "ppl") -> str:
    factors = sorted({r.factor for r in rows})
    lines = ["| model | attention | " + " | ".join(f"{f:g}x ({rows[0].train_len * f:.0f})" for f in factors) + " |"]
    lines.append("|---|---|" + "---:|" * len(factors))
    seen: dict[tuple[str, str], dict[float, EvalRow]] = {}
    for r in rows:
        seen.setdefault((r.model, r.attention), {})[r.factor] = r
    for (model, att), by in seen.items():
        cells = [f"{getattr(by[f], key):.2f}" if f in by else "" for f in factors]
        lines.append(f"| {model} | {att} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_table(rows: list[EvalRow]) -> str:
    lines = ["| model | attention | L | loss | bits/token | top-1 | top-10 |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.factor in (1, 16):
            lines.append(
                f"| {r.model} | {r.attention} | {r.eval_len} | {r.loss:.3f} | {r.bits_per_token:.3f} | "
                f"{r.top1:.3f} | {r.top10:.3f} |"
            )
    return "\n".join(lines)


def sweep_table(rows: list[EvalRow]) -> str:
    lengths = sorted({r.eval_len for r in rows})
    lines = ["| model | attention | " + " | ".join(f"L={n}: ppl (cost)" for n in lengths) + " |"]
    lines.append("|---|---|" + "---:|" * len(lengths))
    seen: dict[tuple[str, str], dict[int, EvalRow]] = {}
    for r in rows:
        seen.setdefault((r.model, r.attention), {})[r.eval_len] = r
    for (model, att), by in seen.items():
        cells = []
        for n in lengths:
            r = by.get(n)
            cells.append("" if r is None else f"{r.ppl:.2f} ({r.cost_per_query:.0f})")
        lines.append(f"| {model} | {att} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="runs/lm")
    p.add_argument("--figures", default="docs/figures")
    args = p.parse_args()
    runs, figs = Path(args.runs), Path(args.figures)
    figs.mkdir(parents=True, exist_ok=True)
    table, logs = training_table(runs)
    print("## training\n\n" + table + "\n")
    plot_training(logs, figs / "lm_training.png")
    ext = runs / "eval-extrapolation" / "results.csv"
    if ext.is_file():
        rows = read_results(ext)
        print("## extrapolation: perplexity\n\n" + pivot(rows) + "\n")
        print("## extrapolation: loss, bits, accuracy at 1x and 16x\n\n" + accuracy_table(rows) + "\n")
        tmp = runs / "eval-extrapolation" / "figs"
        plot_results(rows, tmp)
        (figs / "lm_extrapolation.png").write_bytes((tmp / "extrapolation.png").read_bytes())
    for name, fig in (("eval-sweep-alibi", "lm_sweep_alibi.png"), ("eval-sweep-plsh", "lm_sweep_plsh.png")):
        f = runs / name / "results.csv"
        if f.is_file():
            rows = read_results(f)
            print(f"## {name}\n\n" + sweep_table(rows) + "\n")
            tmp = runs / name / "figs"
            plot_results(rows, tmp)
            if (tmp / "sweep.png").is_file():
                (figs / fig).write_bytes((tmp / "sweep.png").read_bytes())


if __name__ == "__main__":
    main()
