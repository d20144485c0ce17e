"""``plsh validate``'s PNG plots: error vs s, error vs n, and the schemes at equal T."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from positional_lsh.cli.validate.findings import geomean, mean, unique_mask_rows
from positional_lsh.cli.validate.settings import ValidateConfig

__all__ = ["plots"]


def _loglog(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """Log-log axes with labels, a title and a grid."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.25)


def _save(fig: Any, legend_ax: Any, path: Path, fontsize: float = 6.5) -> Path:
    """Legend, layout, save, close; return ``path``."""
    import matplotlib.pyplot as plt

    legend_ax.legend(fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plots(
    out: Path,
    rows: list[dict[str, Any]],
    len_rows: list[dict[str, Any]],
    cmp_rows: list[dict[str, Any]],
    cfg: ValidateConfig,
) -> dict[str, Path]:
    """Write the plots that have data into ``out``; return ``{name: path}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    files: dict[str, Path] = {}
    for name, draw in (
        ("error_vs_samples", lambda: _error_vs_samples(out, rows, cfg, colors)),
        ("error_vs_length", lambda: _error_vs_length(out, len_rows, cfg, colors)),
        ("schemes", lambda: _schemes(out, cmp_rows, colors)),
    ):
        path = draw()
        if path is not None:
            files[name] = path
    return files


def _error_vs_samples(out: Path, rows: list[dict[str, Any]], cfg: ValidateConfig, colors: list[str]) -> Path | None:
    """Relative spectral and softmax-output error vs s next to the bounds, one panel per (n, slope set)."""
    import matplotlib.pyplot as plt

    mask_rows = [r for r in unique_mask_rows(rows) if r["slope"] > 0]
    keys = sorted({(r["seq_len"], r["slope_set"]) for r in mask_rows})
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.9), squeeze=False, dpi=90)
        for ax, (n, mode) in zip(axes[0], keys, strict=True):
            sub = [r for r in mask_rows if r["seq_len"] == n and r["slope_set"] == mode]
            ss = sorted({r["samples"] for r in sub})
            for ci, scheme in enumerate(cfg.schemes):
                ys = [
                    geomean([r["relative_spectral"] for r in sub if r["scheme"] == scheme and r["samples"] == s])
                    for s in ss
                ]
                ax.plot(ss, ys, "o-", color=colors[ci % len(colors)], label=f"{scheme}: ||Mbar-A|| / ||A||")
                outs = [
                    mean(
                        r2["softmax_rel"]
                        for r2 in rows
                        if r2["seq_len"] == n
                        and r2["slope_set"] == mode
                        and r2["scheme"] == scheme
                        and r2["samples"] == s
                    )
                    for s in ss
                ]
                if any(math.isfinite(o) for o in outs):
                    ax.plot(
                        ss, outs, "s:", color=colors[ci % len(colors)], alpha=0.7, label=f"{scheme}: softmax output"
                    )
            be = [geomean([r["bound_expected_relative"] for r in sub if r["samples"] == s]) for s in ss]
            te = [geomean([r["tail_eps_relative"] for r in sub if r["samples"] == s]) for s in ss]
            ax.plot(ss, be, "k--", label="expectation bound / ||A||")
            ax.plot(ss, te, "k-.", alpha=0.6, label=f"tail-bound eps (delta={cfg.delta}) / ||A||")
            y0 = geomean(
                [r["relative_spectral"] for r in sub if r["samples"] == ss[0] and r["scheme"] == cfg.schemes[0]]
            )
            ax.plot(ss, [y0 * (s / ss[0]) ** -0.5 for s in ss], color="gray", lw=0.8, label="slope -1/2")
            _loglog(ax, "samples s", "relative error (geo-mean over heads)", f"n={n}, slopes={mode}")
        return _save(fig, axes[0][0], out / "error_vs_samples.png", 6.5)
    return None


def _error_vs_length(out: Path, len_rows: list[dict[str, Any]], cfg: ValidateConfig, colors: list[str]) -> Path | None:
    """Spectral and max error vs n at fixed s, one panel per slope set."""
    import matplotlib.pyplot as plt

    lrows = [r for r in len_rows if r["slope"] > 0]
    if lrows:
        modes = sorted({r["slope_set"] for r in lrows})
        fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 3.9), squeeze=False, dpi=90)
        for ax, mode in zip(axes[0], modes, strict=True):
            sub = [r for r in lrows if r["slope_set"] == mode]
            ns = sorted({r["seq_len"] for r in sub})
            for ci, scheme in enumerate(cfg.schemes):
                c = colors[ci % len(colors)]
                ys = [
                    geomean([r["relative_spectral"] for r in sub if r["scheme"] == scheme and r["seq_len"] == n])
                    for n in ns
                ]
                ms = [geomean([r["max_abs"] for r in sub if r["scheme"] == scheme and r["seq_len"] == n]) for n in ns]
                ax.plot(ns, ys, "o-", color=c, label=f"{scheme}: ||Mbar-A|| / ||A||")
                ax.plot(ns, ms, "^:", color=c, label=f"{scheme}: max|Mbar-A|")
            be = [geomean([r["bound_expected_relative"] for r in sub if r["seq_len"] == n]) for n in ns]
            ax.plot(ns, be, "k--", label="expectation bound / ||A||")
            _loglog(ax, "sequence length n", "error (geo-mean over heads)", f"s={cfg.length_samples}, slopes={mode}")
        return _save(fig, axes[0][0], out / "error_vs_length.png", 6.5)
    return None


def _schemes(out: Path, cmp_rows: list[dict[str, Any]], colors: list[str]) -> Path | None:
    """Per-head bars of the spectral and softmax-output errors of each compared scheme."""
    import matplotlib.pyplot as plt

    crows = [r for r in cmp_rows if r["slope"] > 0]
    if crows:
        mode = crows[0]["slope_set"]
        crows = [r for r in crows if r["slope_set"] == mode]
        heads = sorted({r["head"] for r in crows})
        schemes = list(dict.fromkeys(r["scheme"] for r in crows))
        fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.7), dpi=90)
        width = 0.8 / len(schemes)
        for ax, metric, title in (
            (axes[0], "relative_spectral", "||Mbar-A|| / ||A||"),
            (axes[1], "softmax_rel", "softmax output error"),
        ):
            for si, scheme in enumerate(schemes):
                ys = [mean(r[metric] for r in crows if r["scheme"] == scheme and r["head"] == h) for h in heads]
                ax.bar(np.arange(len(heads)) + si * width, ys, width, label=scheme, color=colors[si % len(colors)])
            ax.set_xticks(np.arange(len(heads)) + 0.4 - width / 2)
            slope_of = {r["head"]: r["slope"] for r in crows}
            ax.set_xticklabels([f"h{h}\nσ={1 / slope_of[h]:.3g}" for h in heads], fontsize=7)
            ax.set_yscale("log")
            ax.set_title(f"{title}, T={crows[0]['samples']}, n={crows[0]['seq_len']}", fontsize=9)
            ax.grid(True, axis="y", which="both", alpha=0.25)
        return _save(fig, axes[0], out / "schemes.png", 7)
    return None
