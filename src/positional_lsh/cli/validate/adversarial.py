"""``plsh validate --adversarial``: the uniform theorem's bound against the worst inputs found, as a table and plot.

For each ``n`` and ``T`` (one head, ``sigma = adversarial_sigma``, the ``"discrete"`` scheme), the masks are
drawn once (seeded by :func:`derive_seed`), and :func:`positional_lsh.theory.adversarial.adversarial_search`
reports the worst ``max_i |out_i - out~_i|`` it finds, the Gaussian-input error and the bound. An input whose
error exceeds the bound would contradict the theorem: it is saved (``adversarial_violation_*.pt``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from positional_lsh.cli.validate.report import write_csv
from positional_lsh.cli.validate.settings import ValidateConfig, derive_seed
from positional_lsh.ops.errors import format_seconds
from positional_lsh.ops.partitions.partition import sample_partitions
from positional_lsh.theory.adversarial import adversarial_search

__all__ = ["ADVERSARIAL_FIELDS", "adversarial_row", "quick_adversarial", "run_adversarial", "save_violation"]

ADVERSARIAL_FIELDS = [
    "n", "T", "sigma", "score_bound", "radius", "head_dim", "seed", "gaussian", "worst", "worst_by",
    "equal_keys", "aligned_key", "bound_vertex", "row_pgd", "full_pgd", "bound_tight", "bound_simple",
    "worst_over_gaussian", "worst_over_bound", "violation", "seconds",
]  # fmt: skip


def adversarial_row(cfg: ValidateConfig, n: int, t: int, slope: float, seed: int) -> tuple[dict[str, Any], Any]:
    """One (n, T) cell: masks drawn with ``seed`` for one head of ``slope``, then :func:`adversarial_search`.

    Returns the CSV row and the :class:`~positional_lsh.theory.adversarial.AdversarialResult`.
    """
    t0 = time.perf_counter()
    parts = sample_partitions(n, [slope], t, generator=seed)
    res = adversarial_search(
        parts, 0, score_bound=cfg.adversarial_score_bound, head_dim=cfg.adversarial_head_dim,
        causal=cfg.causal, rows=cfg.adversarial_rows, pgd_max_len=cfg.adversarial_pgd_max_len, seed=seed % 2**31,
    )  # fmt: skip
    f = res.found
    row = {
        "n": n, "T": t, "sigma": 1.0 / slope if slope > 0 else float("inf"), "score_bound": res.score_bound,
        "radius": res.radius, "head_dim": res.head_dim, "seed": seed, "gaussian": res.gaussian, "worst": res.worst,
        "worst_by": res.worst_by, "equal_keys": f.get("equal keys"), "aligned_key": f.get("aligned key"),
        "bound_vertex": f.get("bound vertex"), "row_pgd": f.get("row PGD"), "full_pgd": f.get("full PGD"),
        "bound_tight": res.bound_tight, "bound_simple": res.bound_simple,
        "worst_over_gaussian": _ratio(res.worst, res.gaussian), "worst_over_bound": _ratio(res.worst, res.bound_tight),
        "violation": res.violation, "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    return row, (res, parts)


def _ratio(a: float, b: float) -> float:
    """``a / b``; 0 when both are 0 (a slope so small or large that every mask is exact: no error, bound 0)."""
    if b == 0:
        return 0.0 if a == 0 else float("inf")
    return a / b


def save_violation(path: Path, res: Any, parts: Any, row: dict[str, Any]) -> Path:
    """Save an input above the bound with its masks (``q, k, v, pitch, shift, slopes, row``)."""
    torch.save({"q": res.input[0], "k": res.input[1], "v": res.input[2], "pitch": parts.pitch,
                "shift": parts.shift, "slopes": parts.slopes, "row": row}, path)  # fmt: skip
    return path


def run_adversarial(cfg: ValidateConfig, out: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """Run the study; write ``adversarial.csv``, ``adversarial.md``, ``adversarial.png``. Returns (files, findings)."""
    rows: list[dict[str, Any]] = []
    files: dict[str, Path] = {}
    cells = [(n, t) for n in cfg.adversarial_lengths for t in cfg.adversarial_samples]
    seconds, _ = cfg.adversarial_seconds()
    print(f"plsh validate: adversarial study: {len(cells)} cell{'s' if len(cells) > 1 else ''}, about "
          f"{format_seconds(seconds)} (estimated for 1 thread on a 2-core CPU; a busier machine takes longer)",
          file=sys.stderr)  # fmt: skip
    for n, t in tqdm(cells, desc="adversarial", disable=not cfg.progress, file=sys.stderr):
        seed = derive_seed(cfg.seed, "adversarial", n, t, cfg.adversarial_sigma)
        row, (res, parts) = adversarial_row(cfg, n, t, 1.0 / cfg.adversarial_sigma, seed)
        rows.append(row)
        if res.violation:
            path = save_violation(out / f"adversarial_violation_n{n}_T{t}.pt", res, parts, row)
            files[path.stem] = path
    files["adversarial_csv"] = out / "adversarial.csv"
    write_csv(files["adversarial_csv"], rows, ADVERSARIAL_FIELDS)
    files["adversarial_md"] = out / "adversarial.md"
    files["adversarial_md"].write_text(_markdown(cfg, rows))
    if cfg.plots:
        files["adversarial_png"] = _plot(rows, out / "adversarial.png")
    found = {
        "adversarial_violations": sum(bool(r["violation"]) for r in rows),
        "adversarial_max_worst_over_bound": max(r["worst_over_bound"] for r in rows),
        "adversarial_min_worst_over_gaussian": min(r["worst_over_gaussian"] for r in rows),
    }
    return files, found


def quick_adversarial(
    cfg: ValidateConfig, slope_sets: dict[str, torch.Tensor], heads: list[int], out: Path, bar: Any = None
) -> tuple[list[dict[str, Any]], dict[str, Path]]:
    """The report's small adversarial study: every distinct slope of the selected heads (the ``"model"`` slope set
    when present, else the first), ``n`` in ``report_adversarial_lengths``, ``T`` in ``report_adversarial_samples``.

    Rows as :data:`ADVERSARIAL_FIELDS` plus ``slope_set``, ``heads`` (the heads sharing the slope) and ``slope``.
    Inputs above the bound are saved (``adversarial_violation_*.pt``) and returned as files.
    """
    rows: list[dict[str, Any]] = []
    files: dict[str, Path] = {}
    if not cfg.report_adversarial_lengths or not cfg.report_adversarial_samples or not slope_sets:
        return rows, files
    mode = "model" if "model" in slope_sets else next(iter(slope_sets))
    by_slope: dict[float, list[int]] = {}
    for h in heads:
        by_slope.setdefault(float(slope_sets[mode][h]), []).append(h)
    for slope, hs in by_slope.items():
        for n in cfg.report_adversarial_lengths:
            for t in cfg.report_adversarial_samples:
                seed = derive_seed(cfg.seed, "report-adversarial", n, t, slope)
                row, (res, parts) = adversarial_row(cfg, n, t, slope, seed)
                row = {"slope_set": mode, "heads": " ".join(map(str, hs)), "slope": slope, **row}
                rows.append(row)
                if res.violation:
                    path = save_violation(out / f"adversarial_violation_slope{slope:.6g}_n{n}_T{t}.pt", res, parts, row)
                    files[path.stem] = path
                if bar is not None:
                    bar.update(len(hs))  # one head-cell per head sharing the slope
    return rows, files


def _markdown(cfg: ValidateConfig, rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Adversarial inputs vs the uniform bound",
        "",
        f"One head, sigma = {cfg.adversarial_sigma:g}, scheme `discrete`, head_dim = {cfg.adversarial_head_dim}, "
        f"|scale q.k| <= c = {cfg.adversarial_score_bound:g}, |v| <= 1, {'causal' if cfg.causal else 'bidirectional'}."
        " Errors are max_i |out_i - out~_i| (Euclidean), measured with the dense float64 oracles.",
        "",
        "| n | T | Gaussian | worst found | by | worst / Gaussian | bound (tight) | bound (simple) | worst / bound |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['T']} | {r['gaussian']:.4g} | {r['worst']:.4g} | {r['worst_by']} | "
            f"{r['worst_over_gaussian']:.3g}x | {r['bound_tight']:.4g} | {r['bound_simple']:.4g} | "
            f"{r['worst_over_bound']:.3g} |"
        )
    bad = [r for r in rows if r["violation"]]
    lines += ["", f"Inputs above the bound: {len(bad)} (saved as adversarial_violation_*.pt)." if bad
              else "No input above the bound."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, n in enumerate(sorted({r["n"] for r in rows})):
        sub = sorted((r for r in rows if r["n"] == n), key=lambda r: r["T"])
        t = [r["T"] for r in sub]
        color = f"C{i}"
        ax.plot(t, [r["bound_tight"] for r in sub], "-", color=color, label=f"n={n}: bound (tight)")
        ax.plot(t, [r["worst"] for r in sub], "o--", color=color, label=f"n={n}: worst found")
        ax.plot(t, [r["gaussian"] for r in sub], "x:", color=color, label=f"n={n}: Gaussian")
    ax.axhline(2.0, color="gray", lw=0.8, label="trivial bound 2")
    ax.set(xscale="log", yscale="log", xlabel="T (samples)", ylabel="max_i |out_i - out~_i|",
           title="Uniform theorem: bound vs adversarial and Gaussian inputs")  # fmt: skip
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
