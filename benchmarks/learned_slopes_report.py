"""Tables and the figure of docs/experiments.md ("Learned slopes") from the outputs of benchmarks/learned_slopes.sh.

    python benchmarks/learned_slopes_report.py [--runs runs/slopes] [--figures docs/figures]

Prints Markdown tables (validation perplexity at the end of training; test perplexity of each model with its own
attention and with exact ALiBi at 1x-16x the training length; the seed yardstick) and writes
``lm_learned_slopes.png``: the learned slopes per layer and head against the ones they started from.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from positional_lsh.lm.eval_results import read_results, read_slopes

PAIRS = (("exact ALiBi", "alibi"), ("plsh T=4", "plsh-t4"), ("plsh T=16", "plsh-t16"))


def final_val_ppl(runs: Path, name: str) -> float:
    recs = [json.loads(line) for line in (runs / name / "log.jsonl").read_text().splitlines() if line.strip()]
    return math.exp([r for r in recs if "val_loss" in r][-1]["val_loss"])


def ppl_table(runs: Path) -> str:
    rows = read_results(runs / "eval" / "results.csv")
    factors = sorted({r.factor for r in rows})
    by = {(r.model, r.kind, r.factor): r.ppl for r in rows}
    head = "| training | slopes | attention at test | val ppl | " + " | ".join(f"{f:g}x" for f in factors) + " |"
    lines = [head, "|---|---|---|---:|" + "---:|" * len(factors)]
    for label, stem in PAIRS:
        for slopes in ("fixed", "learned"):
            name = f"{stem}-{slopes}"
            kinds = sorted({r.kind for r in rows if r.model == name}, key=lambda k: k != "own")
            for kind in kinds:
                att = next(r.attention for r in rows if r.model == name and r.kind == kind)
                cells = " | ".join(f"{by[(name, kind, f)]:.2f}" for f in factors if (name, kind, f) in by)
                lines.append(f"| {label} | {slopes} | {att} | {final_val_ppl(runs, name):.2f} | {cells} |")
    return "\n".join(lines)


def yardstick(runs: Path) -> str:
    """Exact ALiBi trained with seed 0 and seed 1 (initialization, data order), fixed and learned slopes: the
    run-to-run spread that a difference between fixed and learned slopes must exceed."""
    rows = read_results(runs / "eval" / "results.csv")
    test = {(r.model, r.factor): r.ppl for r in rows if r.kind == "own"}
    lines = ["| exact ALiBi | seed | val ppl | test ppl 1x | test ppl 16x |", "|---|---:|---:|---:|---:|"]
    for slopes in ("fixed", "learned"):
        for seed, name in ((0, f"alibi-{slopes}"), (1, f"alibi-{slopes}-seed1")):
            lines.append(f"| {slopes} slopes | {seed} | {final_val_ppl(runs, name):.2f} | {test[(name, 1.0)]:.2f} | "
                         f"{test[(name, 16.0)]:.2f} |")  # fmt: skip
    return "\n".join(lines)


def slope_table(runs: Path) -> str:
    """The learned slopes per layer and head of each learned model, after the slopes they started from."""
    learned = read_slopes(runs / "eval" / "slopes.csv")
    heads = len(learned[0].initial)
    lines = ["| model | layer | " + " | ".join(f"h{h}" for h in range(heads)) + " |", "|---|---:|" + "---:|" * heads]
    lines.append("| initial (fixed) | all | " + " | ".join(f"{m:.4g}" for m in learned[0].initial) + " |")
    for s in learned:
        for layer, row in enumerate(s.slopes):
            lines.append(f"| {s.model} | {layer} | " + " | ".join(f"{m:.4g}" for m in row) + " |")
    return "\n".join(lines)


def plot_slopes(runs: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learned = {s.model: s for s in read_slopes(runs / "eval" / "slopes.csv")}
    layers = max(len(s.slopes) for s in learned.values())
    fig, axes = plt.subplots(1, layers, figsize=(4.2 * layers, 3.6), sharey=True, squeeze=False)
    styles = {"alibi-learned": ("C0", "o"), "alibi-learned-seed1": ("C0", "x"), "plsh-t4-learned": ("C1", "s"),
              "plsh-t16-learned": ("C2", "^")}  # fmt: skip
    for layer, ax in enumerate(axes[0]):
        first = next(iter(learned.values()))
        heads = range(len(first.initial))
        ax.plot(heads, first.initial, "k--", lw=1, label="initial (fixed) slopes")
        for name, s in learned.items():
            color, marker = styles.get(name, ("C3", "d"))
            ax.plot(heads, s.slopes[layer], color=color, marker=marker, lw=1, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("head")
        ax.set_title(f"layer {layer}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("slope m_h (bias -m_h |i - j|)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lm_learned_slopes.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=Path("runs/slopes"))
    ap.add_argument("--figures", type=Path, default=Path("docs/figures"))
    args = ap.parse_args()
    print(ppl_table(args.runs))
    print()
    print(yardstick(args.runs))
    print()
    print(slope_table(args.runs))
    print()
    print(f"wrote {plot_slopes(args.runs, args.figures)}")


if __name__ == "__main__":
    main()
