"""``plsh validate``'s findings: power-law fits, the bounds check, unbiasedness and variance reduction."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from positional_lsh import theory
from positional_lsh.cli.validate.settings import SLOPE_RANGE, ValidateConfig
from positional_lsh.ops.partitions.schemes import get_scheme, scheme_names

__all__ = ["base_scheme", "findings", "geomean", "mean", "unique_mask_rows"]


def unique_mask_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mask measurement (rows are repeated over inputs and layers)."""
    seen = set()
    out = []
    for r in rows:
        key = (r["seq_len"], r["slope_set"], r["scheme"], r["samples"], r["repeat"], r["head"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def geomean(x: Sequence[float]) -> float:
    """Geometric mean of the finite positive values (NaN if none)."""
    a = np.asarray(x, dtype=np.float64)
    a = a[np.isfinite(a) & (a > 0)]
    return float(np.exp(np.log(a).mean())) if a.size else math.nan


def mean(x: Iterable[float]) -> float:
    """Mean of the finite values (NaN if none)."""
    a = np.asarray(list(x), dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def base_scheme(scheme: str) -> str | None:
    """The independent scheme a coupled (variance-reduced) scheme derives from; ``None`` for independent ones."""
    s = get_scheme(scheme)
    return s.base if s.coupled else None


def findings(
    cfg: ValidateConfig,
    rows: list[dict[str, Any]],
    cmp_rows: list[dict[str, Any]],
    unb_rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """The run's findings (recorded in ``config.json`` and summarized in the report)."""
    mask_rows = unique_mask_rows(rows)
    f: dict[str, Any] = {}
    f.update(_fit_findings(cfg, mask_rows))
    f.update(_bound_findings(mask_rows))
    if unb_rows:
        f.update(_unbiased_findings(unb_rows))
    if cmp_rows:
        f.update(_variance_findings(cmp_rows))
    return f


def _fit_findings(cfg: ValidateConfig, mask_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """1. Fitted slope of the relative spectral error vs s, per (n, slope set, scheme) and per head."""
    f: dict[str, Any] = {}
    fits = []
    groups: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    per_head: dict[tuple, dict[int, dict[int, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for r in mask_rows:
        if r["slope"] == 0:
            continue
        key = (r["seq_len"], r["slope_set"], r["scheme"])
        groups[key][r["samples"]].append(r["relative_spectral"])
        per_head[key][r["head"]][r["samples"]].append(r["relative_spectral"])
    for key, by_s in sorted(groups.items()):
        ss = sorted(by_s)
        if len(ss) < 2:
            continue
        ys = [geomean(by_s[s]) for s in ss]
        slope, intercept = theory.fit_power_law(ss, ys)
        head_slopes = []
        for by_hs in per_head[key].values():
            hs = sorted(by_hs)
            if len(hs) >= 2:
                head_slopes.append(theory.fit_power_law(hs, [mean(by_hs[s]) for s in hs])[0])
        independent = key[2] in scheme_names(unbiased=True, coupled=False)
        needed = theory.samples_for_error(ss, ys, cfg.eps)
        fits.append(
            {
                "seq_len": key[0],
                "slope_set": key[1],
                "scheme": key[2],
                "slope": slope,
                "intercept": intercept,
                "head_slope_min": min(head_slopes) if head_slopes else math.nan,
                "head_slope_max": max(head_slopes) if head_slopes else math.nan,
                "independent": independent,
                "in_range": SLOPE_RANGE[0] <= slope <= SLOPE_RANGE[1] if independent else None,
                "samples_for_eps": needed,
            }
        )
    f["fits"] = fits
    checked = [x for x in fits if x["independent"]]
    f["slope_check"] = all(x["in_range"] for x in checked) if checked else None
    return f


def _bound_findings(mask_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """2. How often the empirical error is under the expectation bound and the tail bound's eps."""
    f: dict[str, Any] = {}
    valid = [r for r in mask_rows if math.isfinite(r["bound_expected"])]
    if valid:
        ratio = np.array([r["bound_expected"] / max(r["spectral"], 1e-300) for r in valid])
        f["under_expected_bound"] = float(np.mean([r["spectral"] <= r["bound_expected"] for r in valid]))
        f["under_tail_eps"] = float(np.mean([r["spectral"] <= r["tail_eps"] for r in valid]))
        f["bound_over_error_min"] = float(ratio.min())
        f["bound_over_error_median"] = float(np.median(ratio))
        f["bound_over_error_max"] = float(ratio.max())
        tail_ratio = np.array([r["tail_eps"] / max(r["spectral"], 1e-300) for r in valid])
        f["tail_over_error_median"] = float(np.median(tail_ratio))
        f["bound_check"] = f["under_expected_bound"] == 1.0
    return f


def _unbiased_findings(unb_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """3. Which schemes passed the unbiasedness test, and whether that matches their declaration."""
    f: dict[str, Any] = {}
    by_scheme: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in unb_rows:
        by_scheme[r["scheme"]].append(r)
    f["unbiased"] = {s: all(r["passed"] for r in rs) for s, rs in by_scheme.items()}
    f["unbiased_check"] = all(ok == get_scheme(s).unbiased for s, ok in f["unbiased"].items())
    return f


def _variance_findings(cmp_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """4. Error ratios of the variance-reduced schemes to their independent base at equal T, per head."""
    f: dict[str, Any] = {}
    agg: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in cmp_rows:
        for m in ("relative_spectral", "max_abs", "softmax_rel", "exp_rel"):
            agg[(r["slope_set"], r["scheme"], r["head"])][m].append(r[m])
    ratios = []
    for (mode, scheme, head), metrics in sorted(agg.items()):
        base = base_scheme(scheme)
        if base is None or (mode, base, head) not in agg:
            continue
        bm = agg[(mode, base, head)]
        ratios.append(
            {
                "slope_set": mode,
                "scheme": scheme,
                "base": base,
                "head": head,
                **{m: mean(bm[m]) / mean(metrics[m]) for m in metrics},
            }
        )
    f["variance_reduction"] = ratios
    summary = {}
    for scheme in sorted({r["scheme"] for r in ratios}):
        rs = [r for r in ratios if r["scheme"] == scheme]
        summary[scheme] = {
            m: {"geomean": geomean([r[m] for r in rs]), "min": min(r[m] for r in rs)}
            for m in ("relative_spectral", "max_abs", "softmax_rel", "exp_rel")
        }
    f["variance_reduction_summary"] = summary
    return f
