"""``plsh validate``'s outputs: the CSVs and ``report.md`` (findings, then the paper-shaped tables)."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from positional_lsh.cli.validate.findings import base_scheme, mean, unique_mask_rows
from positional_lsh.cli.validate.settings import SLOPE_RANGE, ValidateConfig, command_line
from positional_lsh.cli.validate.slope_grad import slope_grad_finding_lines, slope_grad_section
from positional_lsh.ops.partitions.schemes import get_scheme

__all__ = ["ReportData", "report", "write_csv"]


def write_csv(path: Path, rows: list[dict[str, Any]], fields: Sequence[str] | None = None) -> None:
    """Write ``rows`` (floats in full precision) with ``fields`` (default: the first row's keys)."""
    fields = list(fields) if fields is not None else (list(rows[0]) if rows else [])
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt_csv(r.get(k, "")) for k in fields})


def _fmt_csv(v: Any) -> Any:
    if isinstance(v, float):
        return repr(v)
    return v


def _fmt(x: Any, digits: int = 3) -> str:
    """A number for a Markdown table: 3 significant digits, scientific when tiny or huge, — for NaN/None."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    x = float(x)
    if math.isnan(x):
        return "—"
    if math.isinf(x):
        return "∞"
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (strings as they are, numbers through :func:`_fmt`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(x) if not isinstance(x, str) else x for x in r) + " |")
    return "\n".join(lines)


@dataclass
class ReportData:
    """Everything ``report.md`` is written from."""

    cfg: ValidateConfig
    desc: dict[str, Any]
    rows: list[dict[str, Any]]
    cmp_rows: list[dict[str, Any]]
    len_rows: list[dict[str, Any]]
    unb_rows: list[dict[str, Any]]
    findings: dict[str, Any]
    skipped: list[str]
    plots: dict[str, Path]
    elapsed: float
    block_rows: list[dict[str, Any]] = field(default_factory=list)
    adv_rows: list[dict[str, Any]] = field(default_factory=list)
    slope_grad_rows: list[dict[str, Any]] = field(default_factory=list)


def report(d: ReportData) -> str:
    """``report.md``: one section after another."""
    out: list[str] = []
    for section, ran in _SECTIONS:
        if ran is None or ran(d):
            out += section(d)
    return "\n".join(out) + "\n"


def _header_section(d: ReportData) -> list[str]:
    """Title, command, inputs and the bounds used."""
    cfg, desc, elapsed = d.cfg, d.desc, d.elapsed
    out = ["# Positional LSH: theory validation report", ""]
    out.append(f"Command: `{command_line(cfg)}`  ")
    src = ", ".join(f"{k}={v}" for k, v in desc.items())
    out.append(
        f"Inputs: {src}. Lengths {list(cfg.seq_lens)}, {cfg.num_inputs} input(s) per length, "
        f"{'causal' if cfg.causal else 'bidirectional'} output metrics. Base seed {cfg.seed} "
        f"(every draw's seed is in the CSVs). Run time {elapsed:.0f} s."
    )
    out.append("")
    out.append(
        "Errors are relative to ||A||_2 (exact) unless marked absolute. The bounds are the paper's "
        "(authors' code): expectation bound Psi(sigma)(sqrt(log n/s) + log n/s), tail-bound eps at "
        f"delta={cfg.delta}, suggested s = ceil(sigma^2 log n / eps^2) with eps = {cfg.eps} * ||A||_2; "
        "Psi(sigma) = 1 + sigma + (e^(1/sigma)+1)/(e^(1/sigma)-1)."
    )
    return out


def _findings_section(d: ReportData) -> list[str]:
    """The findings as a bullet list."""
    cfg, findings = d.cfg, d.findings
    fits = findings.get("fits", [])
    out = ["", "## Findings", ""]
    out += _fit_findings(fits)
    out += _study_bullets(d, "under_expected_bound", "unbiased")
    out += _variance_findings(findings, cfg)
    out += _samples_needed_findings(fits, cfg)
    out += _study_bullets(d, "blocks_within_bound", "adversarial_violations")
    out += slope_grad_finding_lines(findings, cfg)
    if d.skipped:
        out.append(f"- Skipped as too expensive: {', '.join(d.skipped)}.")
    return out


def _fit_findings(fits: list[dict[str, Any]]) -> list[str]:
    """One bullet per fitted slope of the relative spectral error vs s (judged for the independent schemes)."""
    out: list[str] = []
    for x in fits:
        if x["independent"]:
            verdict = "within" if x["in_range"] else "OUTSIDE"
            out.append(
                f"- Fitted slope of the relative spectral error vs s, {x['scheme']} (independent), n={x['seq_len']}, "
                f"slopes={x['slope_set']}: **{x['slope']:.3f}** ({verdict} [{SLOPE_RANGE[0]}, {SLOPE_RANGE[1]}]; "
                f"per head {x['head_slope_min']:.3f} to {x['head_slope_max']:.3f}). Monte Carlo rate is -1/2."
            )
        else:
            out.append(
                f"- Fitted slope, {x['scheme']}, n={x['seq_len']}, slopes={x['slope_set']}: **{x['slope']:.3f}** "
                f"(per head {x['head_slope_min']:.3f} to {x['head_slope_max']:.3f})."
            )
    return out


def _bound_bullet(d: ReportData) -> str:
    """The empirical ``||Mbar - A||_2`` against the expectation bound and the tail-bound eps."""
    f = d.findings
    return (
        "- Empirical ||Mbar - A||_2 under the expectation bound in "
        f"**{100 * f['under_expected_bound']:.1f}%** "
        f"of {len(unique_mask_rows(d.rows))} mask measurements; the bound exceeds the error by a factor "
        f"{f['bound_over_error_min']:.1f} to {f['bound_over_error_max']:.1f} "
        f"(median {f['bound_over_error_median']:.1f}). Under the tail-bound eps in "
        f"{100 * f['under_tail_eps']:.1f}% (eps / error median {f['tail_over_error_median']:.1f})."
    )


def _unbiasedness_bullet(d: ReportData) -> str:
    """The unbiasedness verdict per scheme, flagging any that differs from the scheme's declaration."""
    parts = []
    for s, ok in d.findings["unbiased"].items():
        expected = get_scheme(s).unbiased
        parts.append(f"{s}: {'unbiased' if ok else 'bias detected'}{'' if ok == expected else ' (UNEXPECTED)'}")
    return (
        "- Unbiasedness test (every mask index, per pair, binomial z-scores, Bonferroni at level 1e-3): "
        + "; ".join(parts)
        + ". `fixed` is biased by design (negative control)."
    )


def _variance_findings(findings: dict[str, Any], cfg: ValidateConfig) -> list[str]:
    """One bullet per compared scheme: its error ratio against its base scheme at equal T."""
    out: list[str] = []
    if findings.get("variance_reduction_summary"):
        t = cfg.compare_samples
        for scheme, summ in findings["variance_reduction_summary"].items():
            out.append(
                f"- {scheme} vs {base_scheme(scheme)} at T={t} (error ratio, geometric mean over heads [min]): "
                f"spectral {summ['relative_spectral']['geomean']:.2f}x [{summ['relative_spectral']['min']:.2f}], "
                f"softmax output {summ['softmax_rel']['geomean']:.2f}x [{summ['softmax_rel']['min']:.2f}], "
                f"max {summ['max_abs']['geomean']:.2f}x, exp-weighted {summ['exp_rel']['geomean']:.2f}x."
            )
    return out


def _samples_needed_findings(fits: list[dict[str, Any]], cfg: ValidateConfig) -> list[str]:
    """The samples each fit needs for a relative spectral error of ``cfg.eps`` (finite ones only)."""
    need = [x for x in fits if math.isfinite(x["samples_for_eps"])]
    if not need:
        return []
    return [
        f"- Samples needed for a relative spectral error of {cfg.eps} (from the fitted power law): "
        + "; ".join(f"{x['scheme']} (n={x['seq_len']}, {x['slope_set']}): {x['samples_for_eps']:.0f}" for x in need)
        + "."
    ]


def _block_bullet(d: ReportData) -> str:
    """How often the largest block stays within the high-probability bound."""
    f, delta = d.findings, d.cfg.block_delta
    return (
        f"- Largest block of a head's s samples within the delta = {delta:g} bound in "
        f"**{100 * f['blocks_within_bound']:.1f}%** of {f['blocks_judged']} (head, draw) pairs "
        f"(at least {100 * (1 - delta):g}% expected); largest block of all: {f['largest_block']}."
    )


def _adversarial_bullet(d: ReportData) -> str:
    """The small adversarial study's summary: violations, worst / bound and worst / Gaussian."""
    f = d.findings
    return (
        f"- Small adversarial study: {f['adversarial_violations']} input(s) above the uniform bound; the "
        f"worst input found reaches {f['adversarial_max_worst_over_bound']:.2f} of the bound and at least "
        f"{f['adversarial_min_worst_over_gaussian']:.1f}x the Gaussian-input error."
    )


_STUDY_BULLETS: dict[str, Callable[[ReportData], str]] = {
    "under_expected_bound": _bound_bullet,
    "unbiased": _unbiasedness_bullet,
    "blocks_within_bound": _block_bullet,
    "adversarial_violations": _adversarial_bullet,
}
"""The bullets of the optional studies, each keyed by the finding that is there only when its study ran."""


def _study_bullets(d: ReportData, *keys: str) -> list[str]:
    """The bullets of :data:`_STUDY_BULLETS` under ``keys``, in that order, of the studies that ran."""
    return [_STUDY_BULLETS[key](d) for key in keys if key in d.findings]


# Columns of the metrics-vs-samples table: (header, row field), mask metrics then output metrics.
_MASK_COLUMNS = (
    ("‖M̄−A‖₂", "spectral"),
    ("rel. spectral", "relative_spectral"),
    ("max abs", "max_abs"),
    ("E-bound (abs)", "bound_expected"),
    ("E-bound (rel)", "bound_expected_relative"),
    ("tail eps (rel)", "tail_eps_relative"),
    ("suggested s", "suggested_samples"),
)
_OUTPUT_COLUMNS = (
    ("exp-form rel", "exp_rel"),
    ("softmax rel", "softmax_rel"),
    ("row median", "row_median"),
    ("row p90", "row_p90"),
    ("row p99", "row_p99"),
    ("cosine", "cosine_mean"),
)


def _column_means(rows: Sequence[dict[str, Any]], fields: Iterable[str]) -> list[float]:
    """The mean of each field over ``rows`` (finite values only)."""
    return [mean(r[f] for r in rows) for f in fields]


def _samples_section(d: ReportData) -> list[str]:
    """Metrics vs samples per (n, slope set, scheme), and the relative spectral error per head."""
    cfg, rows = d.cfg, d.rows
    out = ["", "## Metrics vs samples (mean over heads, inputs, layers and repeats)", ""]
    mask_rows = unique_mask_rows(rows)
    for n in cfg.seq_lens:
        for mode in cfg.slopes:
            for scheme in cfg.schemes:
                key = (n, mode, scheme)
                msub = [r for r in mask_rows if (r["seq_len"], r["slope_set"], r["scheme"]) == key]
                if not msub:
                    continue
                sub = [r for r in rows if (r["seq_len"], r["slope_set"], r["scheme"]) == key]
                out += [f"### n={n}, slopes={mode}, scheme={scheme}", ""]
                out += [_samples_table(msub, sub), ""]
                out += ["Relative spectral error per head:", "", _per_head_table(msub), ""]
    return out


def _samples_table(mask_rows: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """One row per number of samples: the mask metrics' means, then the output metrics' means."""
    table = []
    for s in sorted({r["samples"] for r in mask_rows}):
        m = [r for r in mask_rows if r["samples"] == s]
        o = [r for r in rows if r["samples"] == s]
        table.append(
            [s, *_column_means(m, (f for _, f in _MASK_COLUMNS)), *_column_means(o, (f for _, f in _OUTPUT_COLUMNS))]
        )
    return _table(["s", *(h for h, _ in _MASK_COLUMNS + _OUTPUT_COLUMNS)], table)


def _per_head_table(mask_rows: list[dict[str, Any]]) -> str:
    """The relative spectral error per number of samples (rows) and head (columns, with the head's σ)."""
    heads = sorted({r["head"] for r in mask_rows})
    slope_of = {r["head"]: r["slope"] for r in mask_rows}
    header = ["s", *[f"h{h} (σ={1 / slope_of[h]:.3g})" if slope_of[h] > 0 else f"h{h} (σ=∞)" for h in heads]]
    table = [
        [s, *[mean(r["relative_spectral"] for r in mask_rows if r["samples"] == s and r["head"] == h) for h in heads]]
        for s in sorted({r["samples"] for r in mask_rows})
    ]
    return _table(header, table)


def _lengths_section(d: ReportData) -> list[str]:
    """Error vs length at fixed s."""
    cfg, len_rows = d.cfg, d.len_rows
    out = [f"## Error vs length at s={cfg.length_samples} (matrix-free; mean over heads)", ""]
    fields = ("relative_spectral", "max_abs", "bound_expected_relative", "seconds")
    table = []
    for n in sorted({r["seq_len"] for r in len_rows}):
        for mode in cfg.slopes:
            for scheme in cfg.schemes:
                m = [r for r in len_rows if r["seq_len"] == n and r["slope_set"] == mode and r["scheme"] == scheme]
                if m:
                    table.append([n, mode, scheme, *_column_means(m, fields)])
    out.append(_table(["n", "slopes", "scheme", "rel. spectral", "max abs", "E-bound (rel)", "seconds/head"], table))
    out.append("")
    return out


def _variance_section(d: ReportData) -> list[str]:
    """Variance reduction at equal T: per-head ratios and per-scheme means."""
    cfg, cmp_rows, findings = d.cfg, d.cmp_rows, d.findings
    out = [
        f"## Variance reduction at T={cfg.compare_samples} ({cfg.compare_repeats} seeds, n={cfg.seq_lens[0]})",
        "",
        "Error ratio independent / coupled (higher is better), per head:",
        "",
    ]
    slope_of = {r["head"]: r["slope"] for r in cmp_rows}
    out.append(
        _table(
            ["scheme", "slopes", "head", "σ", "spectral", "softmax", "max", "exp-form"],
            [
                [
                    r["scheme"],
                    r["slope_set"],
                    r["head"],
                    1 / slope_of[r["head"]] if slope_of[r["head"]] > 0 else math.inf,
                    r["relative_spectral"],
                    r["softmax_rel"],
                    r["max_abs"],
                    r["exp_rel"],
                ]
                for r in findings["variance_reduction"]
            ],
        )
    )
    out.append("")
    out.append("Mean errors per scheme (over heads and seeds):")
    out.append("")
    fields = ("relative_spectral", "max_abs", "softmax_rel", "exp_rel")
    table = []
    for mode in cfg.slopes:
        for scheme in cfg.compare_schemes:
            m = [r for r in cmp_rows if r["scheme"] == scheme and r["slope_set"] == mode]
            if m:
                table.append([scheme, mode, *_column_means(m, fields)])
    out.append(_table(["scheme", "slopes", "rel. spectral", "max abs", "softmax rel", "exp-form rel"], table))
    out.append("")
    return out


# Columns of the unbiasedness table: (header, row field).
_UNBIASEDNESS_COLUMNS = (
    ("scheme", "scheme"),
    ("slope", "slope"),
    ("T", "num_samples"),
    ("replicates", "replicates"),
    ("max |z| per mask", "max_z"),
    ("max |z| of Mbar", "mean_max_z"),
    ("threshold", "threshold"),
    ("passed", "passed"),
    ("declared unbiased", "declared_unbiased"),
)


def _unbiasedness_section(d: ReportData) -> list[str]:
    """The unbiasedness test, one row per (scheme, slope)."""
    out = ["## Unbiasedness test", ""]
    header = [h for h, _ in _UNBIASEDNESS_COLUMNS]
    out.append(_table(header, [[r[f] for _, f in _UNBIASEDNESS_COLUMNS] for r in d.unb_rows]))
    out.append("")
    return out


def _blocks_section(d: ReportData) -> list[str]:
    """Largest block per head vs the high-probability bound, and the work, per (n, slope set, scheme)."""
    cfg, brows = d.cfg, d.block_rows
    out = [
        "## Block sizes (docs/theory.md §9)",
        "",
        "The masks of the main sweep (same seeds). Largest block of each head over its s samples (max over repeats) "
        f"/ the bound `block_size_bound(n, sigma, s, delta={cfg.block_delta:g})`: with probability >= 1 - delta no "
        "block of the head's s samples is longer. Work: sum over samples and blocks of len^2 (query-key pairs "
        "scored, bidirectional; causal about half), summed over heads and as a fraction of dense (s n^2 per head); "
        "the fast path's time is O(d work) <= O(n max_block s d).",
        "",
    ]
    for n in cfg.seq_lens:
        for mode in cfg.slopes:
            for scheme in cfg.schemes:
                sub = [r for r in brows if (r["seq_len"], r["slope_set"], r["scheme"]) == (n, mode, scheme)]
                if not sub:
                    continue
                samples = sorted({r["samples"] for r in sub})
                heads = sorted({r["head"] for r in sub})
                sigma = {r["head"]: r["sigma"] for r in sub}
                table = []
                for h in heads:
                    cells = []
                    for s in samples:
                        m = [r for r in sub if r["head"] == h and r["samples"] == s]
                        bound = m[0]["bound"]
                        cells.append(f"{max(r['largest'] for r in m)} / {int(bound) if math.isfinite(bound) else '—'}")
                    table.append([h, _fmt(sigma[h]), *cells])
                out += [f"### n={n}, slopes={mode}, scheme={scheme}: largest block / bound", ""]
                out += [_table(["head", "σ", *(f"s={s}" for s in samples)], table), ""]
                work = []
                for s in samples:
                    m = [r for r in sub if r["samples"] == s]
                    reps = len({r["repeat"] for r in m})
                    work.append([s, sum(r["work"] for r in m) / reps, sum(r["causal_work"] for r in m) / reps,
                                 mean(r["work_over_dense"] for r in m)])  # fmt: skip
                out += [_table(["s", "work (all heads)", "causal work (all heads)", "work / dense"], work), ""]
    return out


def _adversarial_section(d: ReportData) -> list[str]:
    """The small adversarial study of the uniform theorem on the measured heads' slopes."""
    cfg, arows = d.cfg, d.adv_rows
    bad = [r for r in arows if r["violation"]]
    out = [
        "## Adversarial inputs vs the uniform bound (docs/theory.md §11)",
        "",
        f"One head per distinct slope of the slope set `{arows[0]['slope_set']}` (the heads sharing it listed), "
        f"scheme `discrete`, head_dim = {cfg.adversarial_head_dim}, "
        f"|scale q.k| <= c = {cfg.adversarial_score_bound:g}, |v| <= 1, "
        f"{'causal' if cfg.causal else 'bidirectional'}. Errors are max_i |out_i - out~_i|, re-measured with the "
        "dense float64 oracles; the bound holds for every input in that set. The full study (n up to 4096): "
        "`plsh validate --out DIR --adversarial`.",
        "",
    ]
    table = [
        [r["heads"], _fmt(r["sigma"]), r["n"], r["T"], r["gaussian"], r["worst"], r["worst_by"],
         f"{r['worst_over_gaussian']:.3g}x", r["bound_tight"], r["bound_simple"], r["worst_over_bound"]]
        for r in arows
    ]  # fmt: skip
    out.append(_table(["heads", "σ", "n", "T", "Gaussian", "worst found", "by", "worst / Gaussian",
                       "bound (tight)", "bound (simple)", "worst / bound"], table))  # fmt: skip
    out += ["", f"Inputs above the bound: {len(bad)} (saved as adversarial_violation_*.pt)." if bad
            else "No input above the bound.", ""]  # fmt: skip
    return out


def _slope_grad_section(d: ReportData) -> list[str]:
    """The slope-gradient section (``cli/validate/slope_grad.py``)."""
    return slope_grad_section(d.slope_grad_rows, d.cfg)


def _plots_section(d: ReportData) -> list[str]:
    """The PNG plots, inline."""
    out = ["## Plots", ""]
    for name, path in d.plots.items():
        out.append(f"![{name}]({path.name})")
        out.append("")
    return out


_SECTIONS: tuple[tuple[Callable[[ReportData], list[str]], Callable[[ReportData], object] | None], ...] = (
    (_header_section, None),
    (_findings_section, None),
    (_samples_section, None),
    (_lengths_section, lambda d: d.len_rows),
    (_variance_section, lambda d: d.findings.get("variance_reduction")),
    (_unbiasedness_section, lambda d: d.unb_rows),
    (_blocks_section, lambda d: d.block_rows),
    (_adversarial_section, lambda d: d.adv_rows),
    (_slope_grad_section, lambda d: d.slope_grad_rows),
    (_plots_section, lambda d: d.plots),
)
"""``report.md``'s sections in order, each with the test that its study ran (``None``: always there): a section
is written only when it holds, so it never starts from empty rows."""
