"""``plsh validate``'s slope-gradient section: positional LSH's slope gradients against the exact one.

:func:`positional_lsh.theory.slope_grad.slope_gradient_study` on two inputs at ``n = slope_grad_len`` (default 64):
Gaussian ``q, k, v`` (``synthetic_heads`` heads of ``synthetic_head_dim``, the standard ALiBi slopes) and, unless
the source is synthetic, the run's own model: the last captured layer on the first ``n`` positions of the longest
context (the shipped model by default, with its own slopes). For each ``T`` in ``slope_grad_samples`` it draws
``slope_grad_replicates`` independent partitions per head and compares the surrogate gradient, the score-function
estimator and the finite difference of ``E[L_plsh]`` with the exact gradient of ``L = sum(out * W)``. Rows in
``slope_grad.csv`` (:data:`SLOPE_GRAD_FIELDS`), the plot ``slope_grad.png`` (relative bias and RMSE vs ``T``,
log-log), a finding line and a report section. ``--slope-grad-only`` runs only this section.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from positional_lsh.cli.validate.inputs import Context
from positional_lsh.cli.validate.settings import ValidateConfig, derive_seed
from positional_lsh.ops.partitions.slopes import alibi_slopes
from positional_lsh.theory.capture import synthetic_qkv
from positional_lsh.theory.slope_grad import SlopeGradRow, slope_gradient_study

__all__ = [
    "SLOPE_GRAD_FIELDS",
    "SlopeGradInput",
    "slope_grad_finding_lines",
    "slope_grad_findings",
    "slope_grad_inputs",
    "slope_grad_plot",
    "slope_grad_section",
    "slope_grad_sweep",
]

SLOPE_GRAD_FIELDS = [f.name for f in dataclasses.fields(SlopeGradRow)]
"""The columns of ``slope_grad.csv``: the fields of :class:`~positional_lsh.theory.slope_grad.SlopeGradRow`."""

_REPORTED_T = (4, 16, 256)  # the T values the finding line quotes (those measured)


@dataclass(frozen=True)
class SlopeGradInput:
    """One input of the section: its label, ``q (1, H, n, d)``, ``k, v``, slopes ``(H,)`` and score scale."""

    label: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slopes: torch.Tensor
    scale: float | None


def slope_grad_inputs(
    cfg: ValidateConfig, contexts: list[Context], model_slopes: torch.Tensor | None, scale: float | None
) -> list[SlopeGradInput]:
    """Gaussian inputs, then (unless ``cfg.source`` is synthetic) the run's model: its last captured layer on the
    first ``slope_grad_len`` positions of the longest context (all positions if it is shorter), with the model's
    slopes (the standard ALiBi schedule for a model without ALiBi)."""
    n = cfg.slope_grad_len
    gauss = synthetic_qkv(1, cfg.synthetic_heads, n, cfg.synthetic_head_dim,
                          generator=derive_seed(cfg.seed, "slope-grad", "gaussian"))[0]  # fmt: skip
    out = [SlopeGradInput("gaussian", gauss.q, gauss.k, gauss.v, alibi_slopes(cfg.synthetic_heads).double(), None)]
    if cfg.source != "synthetic" and contexts:
        ctx = max(contexts, key=lambda c: c.seq_len)
        layer = ctx.layers[-1]
        h = layer.num_heads
        slopes = model_slopes if model_slopes is not None and model_slopes.numel() == h else alibi_slopes(h)
        q, k, v = (x[:, :, :n].contiguous() for x in (layer.q, layer.k, layer.v))
        out.append(SlopeGradInput(cfg.source, q, k, v, slopes.double(), scale))
    return out


def slope_grad_sweep(cfg: ValidateConfig, inputs: list[SlopeGradInput], bar: Any = None) -> list[dict[str, Any]]:
    """The study on every input (seed ``derive_seed(cfg.seed, "slope-grad", label)``); rows as dicts with the
    input's layer-free fields of :data:`SLOPE_GRAD_FIELDS`. ``bar`` advances by the heads of each ``T``."""
    rows: list[dict[str, Any]] = []
    for x in inputs:
        study = slope_gradient_study(
            x.q, x.k, x.v, x.slopes, samples=cfg.slope_grad_samples, replicates=cfg.slope_grad_replicates,
            scheme=cfg.slope_grad_scheme, causal=cfg.causal, scale=x.scale,
            seed=derive_seed(cfg.seed, "slope-grad", x.label), fd_step=cfg.slope_grad_fd_step,
            method="multiplicity", label=x.label,
        )  # fmt: skip
        rows += [r.as_dict() for r in study.rows]
        if bar is not None:
            bar.update(len(cfg.slope_grad_samples) * x.q.shape[1])
    return rows


def _norm_rows(rows: list[dict[str, Any]], label: str, estimator: str) -> dict[int, dict[str, Any]]:
    """``{T: row}`` of the norm-over-heads rows of one input and estimator."""
    return {r["T"]: r for r in rows if r["inputs"] == label and r["estimator"] == estimator and r["head"] == -1}


def slope_grad_findings(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per input: the norm-over-heads relative bias (with its standard error) and RMSE of each estimator per ``T``,
    and how many score-function cells lie within 3 standard errors of their finite-difference target."""
    if not rows:
        return {}
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["inputs"] for r in rows):
        cur: dict[str, Any] = {}
        for est in ("surrogate", "score", "fd"):
            by_t = _norm_rows(rows, label, est)
            if by_t:
                cur[est] = {t: {"rel_bias": r["rel_bias"], "rel_bias_se": r["rel_bias_se"], "rel_rmse": r["rel_rmse"]}
                            for t, r in sorted(by_t.items())}  # fmt: skip
        score = _norm_rows(rows, label, "score")
        judged = [r for r in score.values() if math.isfinite(r["rel_bias_vs_fd"])]
        if judged:
            cur["score_within_3se_of_fd"] = sum(r["rel_bias_vs_fd"] <= 3 * r["rel_bias_vs_fd_se"] for r in judged)
            cur["score_cells"] = len(judged)
        out[label] = cur
    return {"slope_grad": out}


def _pm(x: float, se: float) -> str:
    return f"{x:.3g} ± {se:.2g}" if math.isfinite(x) else "—"


def slope_grad_finding_lines(found: dict[str, Any], cfg: ValidateConfig) -> list[str]:
    """The report's finding bullet: the surrogate's bias at T = 4, 16, 256 and the score function's RMSE against
    the surrogate's, per input."""
    sg = found.get("slope_grad")
    if not sg:
        return []
    parts = []
    for label, cur in sg.items():
        sur, sco = cur.get("surrogate", {}), cur.get("score", {})
        ts = [t for t in _REPORTED_T if t in sur] or list(sur)[:3]
        bias = ", ".join(f"T={t}: {_pm(sur[t]['rel_bias'], sur[t]['rel_bias_se'])}" for t in ts)
        ratio = [f"T={t}: {sco[t]['rel_rmse'] / sur[t]['rel_rmse']:.2g}x" for t in ts if t in sco and
                 sur[t]["rel_rmse"] > 0]  # fmt: skip
        text = f"{label}: surrogate relative bias {bias}"
        if ratio:
            text += f"; score-function RMSE / surrogate RMSE {', '.join(ratio)}"
        if "score_cells" in cur:
            text += (f"; score function within 3 SE of its target d E[L_plsh]/dm (finite differences) in "
                     f"{cur['score_within_3se_of_fd']} of {cur['score_cells']} T")  # fmt: skip
        parts.append(text)
    return [
        f"- Slope gradient (n={cfg.slope_grad_len}, {cfg.slope_grad_replicates} replicates, scheme "
        f"{cfg.slope_grad_scheme}; norm over heads, relative to the exact ||dL/dm||): " + "; ".join(parts) + "."
    ]


def slope_grad_section(rows: list[dict[str, Any]], cfg: ValidateConfig) -> list[str]:
    """The report's section: per input, one table over ``T`` (norm over heads) and the surrogate's bias per head."""
    if not rows:
        return []
    out = [
        "## Learning the slopes: slope-gradient bias and variance (docs/theory.md)",
        "",
        f"Loss L = sum(out * W), W standard normal; n = {cfg.slope_grad_len}, {cfg.slope_grad_replicates} "
        f"independent partition draws per T, scheme `{cfg.slope_grad_scheme}`, "
        f"{'causal' if cfg.causal else 'bidirectional'}. Relative to the exact gradient g = dL/dm (alibi_attention): "
        "bias |E[g_hat] - g| / |g| ± its standard error, RMSE sqrt(E|g_hat - g|^2) / |g|, norm over heads. "
        "The score function is unbiased for d E[L_plsh]/dm, not for dL/dm: 'score - FD' is its distance to that "
        f"target, measured by finite differences (step {cfg.slope_grad_fd_step:g} m, common random numbers).",
        "",
    ]
    for label in dict.fromkeys(r["inputs"] for r in rows):
        sur, sco, fd = (_norm_rows(rows, label, e) for e in ("surrogate", "score", "fd"))
        out += [f"### {label}", "",
                "| T | surrogate bias | surrogate RMSE | score bias | score RMSE | score − FD | FD bias | seconds |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for t, r in sorted(sur.items()):
            s, f = sco.get(t), fd.get(t)
            out.append(
                f"| {t} | {_pm(r['rel_bias'], r['rel_bias_se'])} | {r['rel_rmse']:.3g} | "
                + (f"{_pm(s['rel_bias'], s['rel_bias_se'])} | {s['rel_rmse']:.3g} | "
                   f"{_pm(s['rel_bias_vs_fd'], s['rel_bias_vs_fd_se'])} | " if s else "— | — | — | ")
                + (f"{_pm(f['rel_bias'], f['rel_bias_se'])} | " if f else "— | ")
                + f"{r['seconds']:.2f} |"
            )  # fmt: skip
        heads = sorted({r["head"] for r in rows if r["inputs"] == label and r["head"] >= 0})
        slope = {r["head"]: r["slope"] for r in rows if r["inputs"] == label and r["head"] >= 0}
        out += ["", "Surrogate relative bias per head:", "",
                "| T | " + " | ".join(f"h{h} (σ={1 / slope[h]:.3g})" for h in heads) + " |",
                "|" + " --- |" * (len(heads) + 1)]  # fmt: skip
        per = {(r["T"], r["head"]): r for r in rows
               if r["inputs"] == label and r["estimator"] == "surrogate" and r["head"] >= 0}  # fmt: skip
        for t in sorted(sur):
            out.append(f"| {t} | " + " | ".join(_pm(per[t, h]["rel_bias"], per[t, h]["rel_bias_se"]) for h in heads)
                       + " |")  # fmt: skip
        out.append("")
    return out


def slope_grad_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """``slope_grad.png``: relative bias (its standard error dotted: a bias below it is not resolved) and RMSE vs
    ``T``, log-log, norm over heads: the surrogate and the score function (and the finite difference of
    ``E[L_plsh]``, thin, in the bias panel) for every input."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.0), dpi=90)
    styles = ("o-", "s--", "^:", "d-.")
    colors = {"surrogate": "C0", "score": "C3", "fd": "C2"}
    names = {"surrogate": "surrogate", "score": "score function", "fd": "FD of E[L_plsh]"}
    ts_all: list[int] = []
    for li, label in enumerate(dict.fromkeys(r["inputs"] for r in rows)):
        for est in ("surrogate", "score", "fd"):
            by_t = _norm_rows(rows, label, est)
            if not by_t:
                continue
            ts = sorted(by_t)
            ts_all += ts
            kw: dict[str, Any] = dict(color=colors[est], lw=0.8 if est == "fd" else 1.6,
                                      alpha=0.6 if est == "fd" else 1.0, label=f"{label}: {names[est]}")  # fmt: skip
            style = styles[li % len(styles)]
            axes[0].plot(ts, [by_t[t]["rel_bias"] for t in ts], style, **kw)
            axes[0].plot(ts, [by_t[t]["rel_bias_se"] for t in ts], ":", color=colors[est], lw=0.7, alpha=0.7)
            if est != "fd":
                axes[1].plot(ts, [by_t[t]["rel_rmse"] for t in ts], style, **kw)
    if ts_all:
        t0, t1 = min(ts_all), max(ts_all)
        sur = [r for r in rows if r["estimator"] == "surrogate" and r["head"] == -1 and r["T"] == t0]
        if sur:
            y0 = max(r["rel_bias"] for r in sur)
            axes[0].plot([t0, t1], [y0, y0 * t0 / t1], color="gray", lw=0.8, label="slope -1")
            y1 = max(r["rel_rmse"] for r in sur)
            axes[1].plot([t0, t1], [y1, y1 * (t0 / t1) ** 0.5], color="gray", lw=0.8, label="slope -1/2")
    axes[0].plot([], [], ":", color="gray", lw=0.7, label="dotted: standard error of the bias")
    for ax, ylabel, title, where in ((axes[0], "||E[g_hat] - g|| / ||g||", "relative bias", "lower left"),
                                     (axes[1], "sqrt(E||g_hat - g||^2) / ||g||", "relative RMSE", "best")):  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("T (samples)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"slope gradient vs exact dL/dm: {title}", fontsize=9)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=6.5, loc=where)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
