"""``plsh validate``'s measurements: the main sweep over (n, slopes, scheme, s), the scheme comparison at equal
``T``, the error-vs-length sweep and the unbiasedness test. Each returns rows (dicts) for the CSVs."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from positional_lsh import theory
from positional_lsh.cli.validate.inputs import Context
from positional_lsh.cli.validate.settings import UNBIASED_TEST_SLOPES, ValidateConfig, derive_seed
from positional_lsh.ops.partitions.partition import Partitions, sample_partitions
from positional_lsh.ops.partitions.schemes import get_scheme

__all__ = [
    "BLOCK_FIELDS",
    "MEASUREMENT_FIELDS",
    "OUTPUT_FIELDS",
    "SweepInputs",
    "block_sweep",
    "compare_sweep",
    "length_sweep",
    "main_sweep",
    "unbiasedness",
]


OUTPUT_FIELDS = (
    "exp_rel",
    "softmax_rel",
    "exp_row_median",
    "exp_row_p90",
    "exp_row_p99",
    "row_median",
    "row_p90",
    "row_p99",
    "cosine_mean",
    "cosine_min",
)
_HEAD_FIELDS = (
    "seq_len",
    "slope_set",
    "scheme",
    "samples",
    "repeat",
    "seed",
    "head",
    "slope",
    "sigma",
)
"""The columns that name one head of one draw, first in both :data:`MEASUREMENT_FIELDS` and :data:`BLOCK_FIELDS`."""
MEASUREMENT_FIELDS = (
    *_HEAD_FIELDS,
    "input",
    "layer",
    "spectral",
    "spectral_residual",
    "alibi_norm",
    "relative_spectral",
    "max_abs",
    "bound_expected",
    "bound_expected_relative",
    "tail_eps",
    "tail_eps_relative",
    "suggested_samples",
    *OUTPUT_FIELDS,
    "seconds",
)


BLOCK_FIELDS = (
    *_HEAD_FIELDS,
    "largest",
    "bound",
    "delta",
    "within_bound",
    "blocks",
    "work",
    "causal_work",
    "work_over_dense",
)


def _bounds(n: int, slope: float, s: int, norm_a: float, cfg: ValidateConfig) -> dict[str, float]:
    """The paper's bounds for one head (NaN for slope 0)."""
    if slope == 0:
        return dict.fromkeys(
            ("bound_expected", "bound_expected_relative", "tail_eps", "tail_eps_relative", "suggested_samples"),
            math.nan,
        )
    sigma = 1.0 / slope
    be = float(theory.expected_error_bound(n, sigma, s))
    te = float(theory.tail_bound_epsilon(n, sigma, s, cfg.delta))
    return {
        "bound_expected": be,
        "bound_expected_relative": be / norm_a,
        "tail_eps": te,
        "tail_eps_relative": te / norm_a,
        "suggested_samples": float(theory.suggested_samples(n, sigma, cfg.eps * norm_a)),
    }


def _mask_measure(
    parts: Partitions, hi: int, dense: np.ndarray | None, tol: float
) -> tuple[theory.MeanMaskOperator, dict[str, float]]:
    """Spectral and max error of head ``hi``'s mean mask (and the operator, reused for the output errors)."""
    op = theory.MeanMaskOperator(parts, hi)
    # The matrix-free matvec is much cheaper than a dense one, even when the dense Mbar is at hand.
    spec = theory.spectral_error(parts, hi, tol=tol, operator=op)
    norm_a = theory.alibi_spectral_norm(parts.seq_len, op.slope)
    mx = theory.dense_max_error(dense, op.slope) if dense is not None else theory.max_error(parts, hi, operator=op)
    return op, {
        "spectral": spec.value,
        "spectral_residual": spec.residual,
        "alibi_norm": norm_a,
        "relative_spectral": spec.value / norm_a,
        "max_abs": mx,
    }


@dataclass(frozen=True)
class SweepInputs:
    """What every sweep of a run measures: the settings, the loaded inputs (one :class:`Context` per input and
    length), the slope sets by name (each ``(H,)``), the query heads measured and the attention scale (``None``:
    ``1 / sqrt(d)``)."""

    cfg: ValidateConfig
    contexts: list[Context]
    slope_sets: dict[str, torch.Tensor]
    heads: list[int]
    scale: float | None


def _draws(
    run: SweepInputs,
    experiment: str,
    n: int,
    schemes: Sequence[str],
    samples: Sequence[int],
    repeats: int,
    on_skip: Callable[[int], None] | None = None,
) -> Iterator[tuple[dict[str, Any], torch.Tensor, Partitions]]:
    """Every seeded draw of ``experiment`` at length ``n``: for each slope set, scheme, sample count ``s`` and
    repeat (in that order), the row coordinates ``seq_len .. seed``, the set's slopes and the partitions of
    ``run.heads`` (seed :func:`derive_seed` of the coordinates). With ``on_skip``, an ``s`` with ``n * s`` above
    ``cfg.max_work`` is not drawn: ``on_skip(s)`` instead."""
    cfg, heads = run.cfg, run.heads
    for mode, slopes in run.slope_sets.items():
        for scheme in schemes:
            for s in samples:
                if on_skip is not None and n * s > cfg.max_work:
                    on_skip(s)
                    continue
                for rep in range(repeats):
                    seed = derive_seed(cfg.seed, experiment, n, mode, scheme, s, rep)
                    parts = sample_partitions(n, slopes[heads], s, scheme=scheme, generator=seed)
                    coords = {"seq_len": n, "slope_set": mode, "scheme": scheme, "samples": s, "repeat": rep,
                              "seed": seed}  # fmt: skip
                    yield coords, slopes, parts


def main_sweep(run: SweepInputs, bar: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Mask and output errors for every (n, slope set, scheme, s, repeat, head); also the skipped (n, s)."""
    cfg, heads = run.cfg, run.heads
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for n in cfg.seq_lens:
        ctxs = [c for c in run.contexts if c.seq_len == n]

        def skip(s: int, n: int = n) -> None:
            skipped.append(f"n={n}, s={s} (n*s > {cfg.max_work:g})")
            bar.update(cfg.repeats * len(heads))

        for coords, slopes, parts in _draws(run, "main", n, cfg.schemes, cfg.samples, cfg.repeats, on_skip=skip):
            for hi, h in enumerate(heads):
                rows += _measure_head(cfg, ctxs, parts, hi, float(slopes[h]), {**coords, "head": h}, run.scale)
                bar.update(1)
    return rows, skipped


def block_sweep(run: SweepInputs) -> list[dict[str, Any]]:
    """Block sizes of the main sweep's draws (same seeds, so the very masks measured there), one row per head.

    ``largest``: the head's largest block over its ``s`` samples (:func:`theory.blocks.block_stats`); ``bound``:
    :func:`theory.blocks.block_size_bound` at ``delta = block_delta`` (no block longer, with probability
    ``>= 1 - delta``; ``n`` for slope 0, NaN for schemes without a known pitch tail); ``work``: ``sum_t
    sum_blocks len^2`` (``causal_work``: ``len (len + 1) / 2``); ``work_over_dense``: ``work / (s n^2)``.
    """
    from positional_lsh.theory.blocks import block_size_bound, block_stats

    cfg, heads = run.cfg, run.heads
    rows: list[dict[str, Any]] = []
    for n in cfg.seq_lens:
        for coords, slopes, parts in _draws(run, "main", n, cfg.schemes, cfg.samples, cfg.repeats,
                                            on_skip=lambda s: None):  # fmt: skip
            s, scheme = coords["samples"], coords["scheme"]
            st = block_stats(parts)
            for hi, h in enumerate(heads):
                slope = float(slopes[h])
                try:
                    bound = float(n if slope == 0 else block_size_bound(n, 1 / slope, s, cfg.block_delta, scheme))
                except ValueError:  # no pitch tail for this scheme
                    bound = math.nan
                largest = int(st.largest_per_head[hi])
                rows.append({
                    **coords, "head": h, "slope": slope, "sigma": 1 / slope if slope > 0 else math.inf,
                    "largest": largest, "bound": bound, "delta": cfg.block_delta,
                    "within_bound": bool(largest <= bound) if math.isfinite(bound) else None,
                    "blocks": int(st.blocks[hi]), "work": float(st.work[hi]), "causal_work": float(st.causal_work[hi]),
                    "work_over_dense": float(st.work[hi]) / (s * st.dense_work),
                })  # fmt: skip
    return rows


def _measure_head(
    cfg: ValidateConfig,
    ctxs: list[Context],
    parts: Partitions,
    hi: int,
    slope: float,
    coords: dict[str, Any],
    scale: float | None,
) -> list[dict[str, Any]]:
    """One head's mask errors and bounds, and its output errors on every input and layer (one row each)."""
    t0 = time.perf_counter()
    n, s, h = coords["seq_len"], coords["samples"], coords["head"]
    dense = theory.MeanMaskOperator(parts, hi).dense() if n <= cfg.max_output_len else None
    op, mask = _mask_measure(parts, hi, dense, cfg.tol)
    base = {
        **coords,
        "slope": slope,
        "sigma": 1.0 / slope if slope > 0 else math.inf,
        **mask,
        **_bounds(n, slope, s, mask["alibi_norm"], cfg),
    }
    outs: list[tuple[int | str, int | str, dict[str, float]]] = []  # (input, layer, errors); "" without inputs
    if dense is not None:
        for ctx in ctxs:
            for lq in ctx.layers:
                q, k, v = lq.head(h)
                oe = theory.output_errors(
                    q, k, v, parts, hi, causal=cfg.causal, scale=scale, operator=op, dense_mbar=dense
                )
                outs.append((ctx.index, lq.layer, oe.as_dict()))
    if not outs:
        outs.append(("", "", dict.fromkeys(OUTPUT_FIELDS, math.nan)))
    dt = time.perf_counter() - t0
    return [{**base, "input": idx, "layer": layer, **oe, "seconds": dt / len(outs)} for idx, layer, oe in outs]


def compare_sweep(run: SweepInputs, bar: Any) -> list[dict[str, Any]]:
    """The schemes compared at equal ``T`` (several seeds) on the first length's first input and layer."""
    cfg, heads = run.cfg, run.heads
    rows: list[dict[str, Any]] = []
    if cfg.compare_samples < 1 or not cfg.compare_schemes:
        return rows
    n = cfg.seq_lens[0]
    ctx = next(c for c in run.contexts if c.seq_len == n)
    lq = ctx.layers[0]
    t = cfg.compare_samples
    for coords, slopes, parts in _draws(run, "compare", n, cfg.compare_schemes, [t], cfg.compare_repeats):
        for hi, h in enumerate(heads):
            dense = theory.MeanMaskOperator(parts, hi).dense() if n <= cfg.max_output_len else None
            op, mask = _mask_measure(parts, hi, dense, cfg.tol)
            row = {**coords, "head": h, "slope": float(slopes[h]), "input": ctx.index, "layer": lq.layer, **mask}
            if dense is not None:
                q, k, v = lq.head(h)
                oe = theory.output_errors(
                    q, k, v, parts, hi, causal=cfg.causal, scale=run.scale, operator=op, dense_mbar=dense
                )
                row.update(softmax_rel=oe.softmax_rel, exp_rel=oe.exp_rel, row_p90=oe.row_p90)
            else:
                row.update(softmax_rel=math.nan, exp_rel=math.nan, row_p90=math.nan)
            rows.append(row)
            bar.update(1)
    return rows


def length_sweep(run: SweepInputs, bar: Any) -> list[dict[str, Any]]:
    """Matrix-free mask errors vs ``n`` at fixed ``s``."""
    cfg, heads = run.cfg, run.heads
    rows: list[dict[str, Any]] = []
    s = cfg.length_samples
    for n in cfg.lengths:
        for coords, slopes, parts in _draws(run, "length", n, cfg.schemes, [s], cfg.repeats):
            for hi, h in enumerate(heads):
                t0 = time.perf_counter()
                _, mask = _mask_measure(parts, hi, None, cfg.tol)
                slope = float(slopes[h])
                bounds = _bounds(n, slope, s, mask["alibi_norm"], cfg)
                rows.append({**coords, "head": h, "slope": slope, **mask, **bounds,
                             "seconds": time.perf_counter() - t0})  # fmt: skip
                bar.update(1)
    return rows


def unbiasedness(cfg: ValidateConfig, bar: Any) -> list[dict[str, Any]]:
    """The statistical unbiasedness test of every scheme used (and ``fixed``, the biased control)."""
    rows: list[dict[str, Any]] = []
    if cfg.unbiasedness_replicates < 1:
        return rows
    schemes = list(dict.fromkeys([*cfg.schemes, *cfg.compare_schemes, "fixed"]))
    for scheme in schemes:
        for slope in UNBIASED_TEST_SLOPES:
            seed = derive_seed(cfg.seed, "unbiasedness", scheme, slope)
            r = theory.unbiasedness_test(
                scheme, slope, replicates=max(100, cfg.unbiasedness_replicates), generator=seed
            )
            rows.append({**asdict(r), "seed": seed, "declared_unbiased": get_scheme(scheme).unbiased})
            bar.update(1)
    return rows
