"""``plsh validate``: the paper's §5.2 theory validation as a command, at scale, with reports.

For each context length ``n``, slope set, sampling scheme, sample count ``s`` and repeat, the masks of
every selected head are drawn once (seeded, see :func:`derive_seed`) and measured:

* mask errors, matrix-free (:mod:`positional_lsh.theory`): ``||Mbar - A||_2``, relative spectral error,
  ``max |Mbar - A|``, next to the expectation bound, the tail bound's ``eps`` at ``delta``, and the
  suggested ``s`` for a relative error ``eps``;
* output errors on captured Q/K/V of every selected layer and input: exp-weighted and softmax forms,
  row-wise relative error (median, p90, p99), cosine similarity (for ``n <= max_output_len``).

The same masks serve every input and layer of one (n, slopes, scheme, s, repeat): mask errors do not
depend on the activations. Three further experiments: variance-reduced vs independent schemes at equal
``T`` (default 64, several seeds), the spectral/max error vs ``n`` at fixed ``s`` (matrix-free, up to
long lengths), and a statistical unbiasedness test of every scheme. The output directory receives
``measurements.csv``, ``schemes.csv``, ``lengths.csv``, ``unbiasedness.csv``, ``config.json`` (every
setting and seed), ``report.md`` (findings and the paper-shaped tables) and PNG plots.

Inputs: the project's shipped model and corpus (:func:`load_shipped`, the default), synthetic Gaussian Q/K/V,
or a local transformers checkpoint with a text file.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import platform
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from positional_lsh import theory
from positional_lsh.ops import sampling
from positional_lsh.ops.sampling import sample_partitions
from positional_lsh.ops.slopes import alibi_slopes
from positional_lsh.theory.capture import (
    LayerQKV,
    capture_qkv,
    load_checkpoint,
    model_alibi_slopes,
    synthetic_qkv,
    tokenize_contexts,
)

__all__ = [
    "ValidateConfig",
    "ValidationResult",
    "command_line",
    "derive_seed",
    "load_shipped",
    "register_cli",
    "run_validation",
]

DEFAULT_SAMPLES = (1, 10, 100, 1000, 10000)
DEFAULT_SCHEMES = ("discrete", "discrete-strat")
COMPARE_SCHEMES = ("discrete", "discrete-strat", "gamma", "gamma-strat", "discrete-antithetic")
SLOPE_RANGE = (-0.6, -0.4)  # expected fitted slope of relative spectral error vs s (independent sampling)
UNBIASED_TEST_SLOPES = (0.5, 0.05)


@dataclass
class ValidateConfig:
    """Settings of one validation run (every field is recorded in ``config.json``).

    Attributes:
        out_dir: output directory (created).
        source: ``"synthetic"`` (Gaussian Q/K/V), ``"checkpoint"`` (a local transformers model + ``text``)
            or ``"shipped"`` (the project's own model and corpus, see :func:`load_shipped`).
        checkpoint: checkpoint directory for ``source="checkpoint"``.
        tokenizer: tokenizer directory (default: the checkpoint's).
        text: text file to tokenize (``source="checkpoint"``; optional for ``"shipped"``).
        seq_lens: context lengths ``n``.
        num_inputs: contexts per length.
        layers: layers to capture (negative counts from the end); ``None`` = all.
        heads: query heads to measure; ``None`` = all.
        slopes: slope sets: ``"standard"`` (the ALiBi schedule applied synthetically, as the paper),
            ``"model"`` (the model's own ALiBi slopes) or ``"sigma=X"`` (one ``sigma = 1/slope`` for all
            heads, as the paper's training used).
        schemes: sampling schemes of the main sweep.
        samples: sample counts ``s``.
        repeats: independent draws per (n, slopes, scheme, s).
        causal: causal masking in the output metrics.
        seed: base seed; every draw's seed is :func:`derive_seed` of it and the draw's coordinates.
        eps: target *relative* spectral error for the sample-count columns.
        delta: failure probability of the tail bound's ``eps``.
        tol: Lanczos tolerance of the spectral norms.
        max_output_len: output metrics (``O(n^2)`` time) only up to this ``n``.
        max_work: skip (n, s) pairs with ``n * s`` above this (the report lists them).
        compare_samples: ``T`` of the scheme comparison (0 disables it).
        compare_repeats: seeds per scheme in the comparison.
        compare_schemes: schemes compared.
        lengths: lengths of the error-vs-``n`` sweep (matrix-free; empty disables it).
        length_samples: ``s`` of the error-vs-``n`` sweep.
        unbiasedness_replicates: replicates of the unbiasedness test (0 disables it).
        synthetic_layers, synthetic_heads, synthetic_head_dim: shape of the synthetic Q/K/V.
        plots: write PNG plots.
        progress: show progress bars.
        threads: torch intra-op threads during the run (restored afterwards). 1 is fastest for the many
            small operations here, and by far on a machine shared with other jobs.
    """

    out_dir: str
    source: str = "shipped"
    checkpoint: str | None = None
    tokenizer: str | None = None
    text: str | None = None
    seq_lens: tuple[int, ...] = (1024,)
    num_inputs: int = 1
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    slopes: tuple[str, ...] = ("standard",)
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    samples: tuple[int, ...] = DEFAULT_SAMPLES
    repeats: int = 1
    causal: bool = True
    seed: int = 0
    eps: float = 0.1
    delta: float = 0.05
    tol: float = 1e-6
    max_output_len: int = 8192
    max_work: float = 1e9
    compare_samples: int = 64
    compare_repeats: int = 10
    compare_schemes: tuple[str, ...] = COMPARE_SCHEMES
    lengths: tuple[int, ...] = (1024, 4096, 16384, 65536)
    length_samples: int = 100
    unbiasedness_replicates: int = 2000
    synthetic_layers: int = 2
    synthetic_heads: int = 8
    synthetic_head_dim: int = 64
    plots: bool = True
    progress: bool = True
    threads: int = 1

    def __post_init__(self) -> None:
        if self.source not in ("synthetic", "checkpoint", "shipped"):
            raise ValueError(f"source must be 'synthetic', 'checkpoint' or 'shipped', got {self.source!r}")
        if self.source == "checkpoint" and not self.checkpoint:
            raise ValueError("source='checkpoint' needs checkpoint (a local transformers directory)")
        if self.source == "checkpoint" and not self.text:
            raise ValueError("source='checkpoint' needs text (a text file to tokenize)")
        for name in ("seq_lens", "samples"):
            vals = getattr(self, name)
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {vals}")
        if any(n < 2 for n in self.seq_lens) or any(n < 2 for n in self.lengths):
            raise ValueError("sequence lengths must be >= 2")
        for s in (*self.schemes, *self.compare_schemes):
            if s not in sampling.SCHEMES:
                raise ValueError(f"unknown scheme {s!r}; expected one of {list(sampling.SCHEMES)}")
        for mode in self.slopes:
            _parse_slope_mode(mode)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {self.eps}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        for name in ("num_inputs", "repeats", "length_samples", "synthetic_layers", "synthetic_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ValidationResult:
    """What :func:`run_validation` wrote and found."""

    out_dir: Path
    files: dict[str, Path]
    findings: dict[str, Any]
    measurements: list[dict[str, Any]] = field(repr=False)
    schemes: list[dict[str, Any]] = field(repr=False)
    lengths: list[dict[str, Any]] = field(repr=False)
    unbiasedness: list[dict[str, Any]] = field(repr=False)


def derive_seed(base: int, *parts: object) -> int:
    """A reproducible 62-bit seed from a base seed and the coordinates of a draw."""
    h = hashlib.blake2b(repr((int(base), *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


def _parse_slope_mode(mode: str) -> tuple[str, float | None]:
    if mode in ("standard", "model"):
        return mode, None
    if mode.startswith("sigma="):
        try:
            sigma = float(mode[len("sigma=") :])
        except ValueError:
            raise ValueError(f"bad slope set {mode!r}: expected sigma=<positive float>") from None
        if not sigma > 0 or not math.isfinite(sigma):
            raise ValueError(f"bad slope set {mode!r}: sigma must be positive and finite")
        return "sigma", sigma
    raise ValueError(f"slope set must be 'standard', 'model' or 'sigma=X', got {mode!r}")


# ----------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Context:
    index: int
    seq_len: int
    layers: list[LayerQKV]


def load_shipped() -> tuple[torch.nn.Module, Callable[[str], Sequence[int]], str, dict[str, Any]]:
    """The project's shipped model and corpus: ``(model, encode, text, description)``.

    The model is ``positional_lsh.lm.model.load_shipped_model()`` (a small ALiBi decoder, captured through its
    fused ``qkv`` projections, see :mod:`positional_lsh.theory.capture`); the text is the longest document of the
    shipped corpus' test split (``positional_lsh.lm.data.corpus_splits()["test"]``), cut into consecutive
    contexts. It is the default source of ``plsh validate``.
    """
    try:
        from positional_lsh.lm.data import corpus_splits
        from positional_lsh.lm.model import load_shipped_model
    except ImportError as exc:
        raise NotImplementedError(
            f"the project's shipped model and corpus are not available ({exc}); use --source synthetic, or "
            "--source checkpoint --checkpoint DIR --text FILE"
        ) from None
    ckpt = load_shipped_model()
    if ckpt.tokenizer is None:
        raise FileNotFoundError("the shipped model has no tokenizer")
    doc = max(corpus_splits()["test"], key=lambda d: len(d.text))
    desc = {
        "source": "shipped model (positional_lsh.lm.model.load_shipped_model)",
        "position": getattr(ckpt.model.cfg, "position", "?"),
        "text": f"shipped corpus, test split: {doc.title}",
    }
    return ckpt.model, ckpt.tokenizer.encode, doc.text, desc


def _read_text(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file not found: {p}")
    return p.read_text(encoding="utf-8", errors="replace")


def _load_contexts(cfg: ValidateConfig) -> tuple[list[_Context], torch.Tensor | None, float | None, dict[str, Any]]:
    """Contexts with captured Q/K/V, the model's ALiBi slopes (or None), the score scale, and a description."""
    layers = None if cfg.layers is None else list(cfg.layers)
    if cfg.source == "synthetic":
        contexts = []
        for n in cfg.seq_lens:
            for i in range(cfg.num_inputs):
                qkv = synthetic_qkv(
                    cfg.synthetic_layers,
                    cfg.synthetic_heads,
                    n,
                    cfg.synthetic_head_dim,
                    generator=derive_seed(cfg.seed, "synthetic", n, i),
                )
                if layers is not None:
                    keep = {(li if li >= 0 else cfg.synthetic_layers + li) for li in layers}
                    bad = [li for li in layers if not -cfg.synthetic_layers <= li < cfg.synthetic_layers]
                    if bad:
                        raise ValueError(f"layers {bad} out of range for {cfg.synthetic_layers} synthetic layers")
                    qkv = [x for x in qkv if x.layer in keep]
                contexts.append(_Context(i, n, qkv))
        desc = {
            "source": "synthetic Gaussian Q/K/V",
            "layers": cfg.synthetic_layers,
            "heads": cfg.synthetic_heads,
            "head_dim": cfg.synthetic_head_dim,
        }
        return contexts, None, None, desc
    if cfg.source == "checkpoint":
        assert cfg.checkpoint is not None and cfg.text is not None
        model, tok = load_checkpoint(cfg.checkpoint, tokenizer=cfg.tokenizer)
        encode: Callable[[str], Sequence[int]] = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        text = _read_text(cfg.text)
        desc = {
            "source": "checkpoint",
            "checkpoint": str(cfg.checkpoint),
            "model_type": model.config.model_type,
            "text": str(cfg.text),
        }
    else:
        model, encode, text, desc = load_shipped()
        if cfg.text:
            text = _read_text(cfg.text)
            desc["text"] = str(cfg.text)
    contexts = []
    for n in cfg.seq_lens:
        ids = tokenize_contexts(encode, text, n, cfg.num_inputs)
        for i in range(cfg.num_inputs):
            contexts.append(_Context(i, n, capture_qkv(model, ids[i : i + 1], layers=layers)))
    return contexts, model_alibi_slopes(model), _model_scale(model), desc


def _model_scale(model: torch.nn.Module) -> float | None:
    """The model's own score scale when it is not ``1/sqrt(d)`` (MPT's ``softmax_scale``)."""
    attn = getattr(getattr(model, "config", None), "attn_config", None)
    scale = getattr(attn, "softmax_scale", None)
    return float(scale) if scale is not None else None


def _slope_sets(cfg: ValidateConfig, num_heads: int, model_slopes: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out = {}
    for mode in cfg.slopes:
        kind, sigma = _parse_slope_mode(mode)
        if kind == "standard":
            out[mode] = alibi_slopes(num_heads).double()
        elif kind == "model":
            if model_slopes is None:
                raise ValueError("slope set 'model' needs a model with ALiBi (BLOOM, MPT, Falcon alibi=True, ...)")
            if model_slopes.numel() != num_heads:
                raise ValueError(f"the model has {model_slopes.numel()} slopes for {num_heads} heads")
            out[mode] = model_slopes.double()
        else:
            assert sigma is not None
            out[mode] = torch.full((num_heads,), 1.0 / sigma, dtype=torch.float64)
    return out


# ----------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------

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
MEASUREMENT_FIELDS = (
    "seq_len",
    "slope_set",
    "scheme",
    "samples",
    "repeat",
    "seed",
    "head",
    "slope",
    "sigma",
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


def _bounds(n: int, slope: float, s: int, norm_a: float, cfg: ValidateConfig) -> dict[str, float]:
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
    parts: sampling.Partitions, hi: int, dense: np.ndarray | None, tol: float
) -> tuple[theory.MeanMaskOperator, dict[str, float]]:
    op = theory.MeanMaskOperator(parts, hi)
    # The matrix-free matvec is much cheaper than a dense one, even when the dense Mbar is at hand.
    spec = theory.spectral_error(parts, hi, tol=tol, operator=op)
    norm_a = theory.alibi_spectral_norm(parts.seq_len, op.slope)
    mx = theory._dense_max_error(dense, op.slope) if dense is not None else theory.max_error(parts, hi, operator=op)
    return op, {
        "spectral": spec.value,
        "spectral_residual": spec.residual,
        "alibi_norm": norm_a,
        "relative_spectral": spec.value / norm_a,
        "max_abs": mx,
    }


def _main_sweep(
    cfg: ValidateConfig,
    contexts: list[_Context],
    slope_sets: dict[str, torch.Tensor],
    heads: list[int],
    scale: float | None,
    bar: Any,
) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for n in cfg.seq_lens:
        ctxs = [c for c in contexts if c.seq_len == n]
        for mode, slopes in slope_sets.items():
            for scheme in cfg.schemes:
                for s in cfg.samples:
                    if n * s > cfg.max_work:
                        skipped.append(f"n={n}, s={s} (n*s > {cfg.max_work:g})")
                        bar.update(cfg.repeats * len(heads))
                        continue
                    for rep in range(cfg.repeats):
                        seed = derive_seed(cfg.seed, "main", n, mode, scheme, s, rep)
                        parts = sample_partitions(n, slopes[heads], s, scheme=scheme, generator=seed)
                        for hi, h in enumerate(heads):
                            t0 = time.perf_counter()
                            slope = float(slopes[h])
                            dense = None
                            if n <= cfg.max_output_len:
                                dense = theory.MeanMaskOperator(parts, hi).dense()
                            op, mask = _mask_measure(parts, hi, dense, cfg.tol)
                            base = {
                                "seq_len": n,
                                "slope_set": mode,
                                "scheme": scheme,
                                "samples": s,
                                "repeat": rep,
                                "seed": seed,
                                "head": h,
                                "slope": slope,
                                "sigma": 1.0 / slope if slope > 0 else math.inf,
                                **mask,
                                **_bounds(n, slope, s, mask["alibi_norm"], cfg),
                            }
                            outs = []
                            if dense is not None:
                                for ctx in ctxs:
                                    for lq in ctx.layers:
                                        q, k, v = lq.head(h)
                                        oe = theory.output_errors(
                                            q,
                                            k,
                                            v,
                                            parts,
                                            hi,
                                            causal=cfg.causal,
                                            scale=scale,
                                            operator=op,
                                            dense_mbar=dense,
                                        )
                                        outs.append((ctx.index, lq.layer, oe.as_dict()))
                            if not outs:
                                outs.append(("", "", dict.fromkeys(OUTPUT_FIELDS, math.nan)))
                            dt = time.perf_counter() - t0
                            for idx, layer, oe in outs:
                                rows.append({**base, "input": idx, "layer": layer, **oe, "seconds": dt / len(outs)})
                            bar.update(1)
    return rows, skipped


def _compare_sweep(
    cfg: ValidateConfig,
    contexts: list[_Context],
    slope_sets: dict[str, torch.Tensor],
    heads: list[int],
    scale: float | None,
    bar: Any,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if cfg.compare_samples < 1 or not cfg.compare_schemes:
        return rows
    n = cfg.seq_lens[0]
    ctx = next(c for c in contexts if c.seq_len == n)
    lq = ctx.layers[0]
    t = cfg.compare_samples
    for mode, slopes in slope_sets.items():
        for scheme in cfg.compare_schemes:
            for rep in range(cfg.compare_repeats):
                seed = derive_seed(cfg.seed, "compare", n, mode, scheme, t, rep)
                parts = sample_partitions(n, slopes[heads], t, scheme=scheme, generator=seed)
                for hi, h in enumerate(heads):
                    dense = theory.MeanMaskOperator(parts, hi).dense() if n <= cfg.max_output_len else None
                    op, mask = _mask_measure(parts, hi, dense, cfg.tol)
                    row = {
                        "seq_len": n,
                        "slope_set": mode,
                        "scheme": scheme,
                        "samples": t,
                        "repeat": rep,
                        "seed": seed,
                        "head": h,
                        "slope": float(slopes[h]),
                        "input": ctx.index,
                        "layer": lq.layer,
                        **mask,
                    }
                    if dense is not None:
                        q, k, v = lq.head(h)
                        oe = theory.output_errors(
                            q, k, v, parts, hi, causal=cfg.causal, scale=scale, operator=op, dense_mbar=dense
                        )
                        row.update(softmax_rel=oe.softmax_rel, exp_rel=oe.exp_rel, row_p90=oe.row_p90)
                    else:
                        row.update(softmax_rel=math.nan, exp_rel=math.nan, row_p90=math.nan)
                    rows.append(row)
                    bar.update(1)
    return rows


def _length_sweep(
    cfg: ValidateConfig, slope_sets: dict[str, torch.Tensor], heads: list[int], bar: Any
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    s = cfg.length_samples
    for n in cfg.lengths:
        for mode, slopes in slope_sets.items():
            for scheme in cfg.schemes:
                for rep in range(cfg.repeats):
                    seed = derive_seed(cfg.seed, "length", n, mode, scheme, s, rep)
                    parts = sample_partitions(n, slopes[heads], s, scheme=scheme, generator=seed)
                    for hi, h in enumerate(heads):
                        t0 = time.perf_counter()
                        _, mask = _mask_measure(parts, hi, None, cfg.tol)
                        slope = float(slopes[h])
                        rows.append(
                            {
                                "seq_len": n,
                                "slope_set": mode,
                                "scheme": scheme,
                                "samples": s,
                                "repeat": rep,
                                "seed": seed,
                                "head": h,
                                "slope": slope,
                                **mask,
                                **_bounds(n, slope, s, mask["alibi_norm"], cfg),
                                "seconds": time.perf_counter() - t0,
                            }
                        )
                        bar.update(1)
    return rows


def _unbiasedness(cfg: ValidateConfig, bar: Any) -> list[dict[str, Any]]:
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
            rows.append({**asdict(r), "seed": seed, "declared_unbiased": scheme in sampling.UNBIASED_SCHEMES})
            bar.update(1)
    return rows


# ----------------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------------


def _unique_mask_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mask measurement (rows are repeated over inputs and layers)."""
    seen = set()
    out = []
    for r in rows:
        key = (r["seq_len"], r["slope_set"], r["scheme"], r["samples"], r["repeat"], r["head"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _geomean(x: Sequence[float]) -> float:
    a = np.asarray(x, dtype=np.float64)
    a = a[np.isfinite(a) & (a > 0)]
    return float(np.exp(np.log(a).mean())) if a.size else math.nan


def _mean(x: Iterable[float]) -> float:
    a = np.asarray(list(x), dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def _base_scheme(scheme: str) -> str | None:
    if scheme in ("discrete-strat", "discrete-antithetic"):
        return "discrete"
    if scheme == "gamma-strat":
        return "gamma"
    return None


def _findings(
    cfg: ValidateConfig,
    rows: list[dict[str, Any]],
    cmp_rows: list[dict[str, Any]],
    unb_rows: list[dict[str, Any]],
) -> dict[str, Any]:
    mask_rows = _unique_mask_rows(rows)
    f: dict[str, Any] = {}
    # 1. fitted slope of relative spectral error vs s
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
        ys = [_geomean(by_s[s]) for s in ss]
        slope, intercept = theory.fit_power_law(ss, ys)
        head_slopes = []
        for by_hs in per_head[key].values():
            hs = sorted(by_hs)
            if len(hs) >= 2:
                head_slopes.append(theory.fit_power_law(hs, [_mean(by_hs[s]) for s in hs])[0])
        independent = key[2] in sampling.UNBIASED_SCHEMES and key[2] not in sampling.VARIANCE_REDUCED_SCHEMES
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
    # 2. empirical error under the bounds
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
    # 3. unbiasedness
    if unb_rows:
        by_scheme: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in unb_rows:
            by_scheme[r["scheme"]].append(r)
        f["unbiased"] = {s: all(r["passed"] for r in rs) for s, rs in by_scheme.items()}
        f["unbiased_check"] = all(ok == (s in sampling.UNBIASED_SCHEMES) for s, ok in f["unbiased"].items())
    # 4. variance reduction at equal T
    if cmp_rows:
        agg: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in cmp_rows:
            for m in ("relative_spectral", "max_abs", "softmax_rel", "exp_rel"):
                agg[(r["slope_set"], r["scheme"], r["head"])][m].append(r[m])
        ratios = []
        for (mode, scheme, head), metrics in sorted(agg.items()):
            base = _base_scheme(scheme)
            if base is None or (mode, base, head) not in agg:
                continue
            bm = agg[(mode, base, head)]
            ratios.append(
                {
                    "slope_set": mode,
                    "scheme": scheme,
                    "base": base,
                    "head": head,
                    **{m: _mean(bm[m]) / _mean(metrics[m]) for m in metrics},
                }
            )
        f["variance_reduction"] = ratios
        summary = {}
        for scheme in sorted({r["scheme"] for r in ratios}):
            rs = [r for r in ratios if r["scheme"] == scheme]
            summary[scheme] = {
                m: {"geomean": _geomean([r[m] for r in rs]), "min": min(r[m] for r in rs)}
                for m in ("relative_spectral", "max_abs", "softmax_rel", "exp_rel")
            }
        f["variance_reduction_summary"] = summary
    return f


# ----------------------------------------------------------------------------------------------------
# Output: CSV, plots, report
# ----------------------------------------------------------------------------------------------------


def _write_csv(path: Path, rows: list[dict[str, Any]], fields: Sequence[str] | None = None) -> None:
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
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(x) if not isinstance(x, str) else x for x in r) + " |")
    return "\n".join(lines)


def _loglog(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.25)


def _save(fig: Any, legend_ax: Any, path: Path, fontsize: float = 6.5) -> Path:
    import matplotlib.pyplot as plt

    legend_ax.legend(fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plots(
    out: Path,
    rows: list[dict[str, Any]],
    len_rows: list[dict[str, Any]],
    cmp_rows: list[dict[str, Any]],
    cfg: ValidateConfig,
) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files: dict[str, Path] = {}
    mask_rows = [r for r in _unique_mask_rows(rows) if r["slope"] > 0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # error vs s
    keys = sorted({(r["seq_len"], r["slope_set"]) for r in mask_rows})
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.9), squeeze=False, dpi=90)
        for ax, (n, mode) in zip(axes[0], keys, strict=True):
            sub = [r for r in mask_rows if r["seq_len"] == n and r["slope_set"] == mode]
            ss = sorted({r["samples"] for r in sub})
            for ci, scheme in enumerate(cfg.schemes):
                ys = [
                    _geomean([r["relative_spectral"] for r in sub if r["scheme"] == scheme and r["samples"] == s])
                    for s in ss
                ]
                ax.plot(ss, ys, "o-", color=colors[ci % len(colors)], label=f"{scheme}: ||Mbar-A|| / ||A||")
                outs = [
                    _mean(
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
            be = [_geomean([r["bound_expected_relative"] for r in sub if r["samples"] == s]) for s in ss]
            te = [_geomean([r["tail_eps_relative"] for r in sub if r["samples"] == s]) for s in ss]
            ax.plot(ss, be, "k--", label="expectation bound / ||A||")
            ax.plot(ss, te, "k-.", alpha=0.6, label=f"tail-bound eps (delta={cfg.delta}) / ||A||")
            y0 = _geomean(
                [r["relative_spectral"] for r in sub if r["samples"] == ss[0] and r["scheme"] == cfg.schemes[0]]
            )
            ax.plot(ss, [y0 * (s / ss[0]) ** -0.5 for s in ss], color="gray", lw=0.8, label="slope -1/2")
            _loglog(ax, "samples s", "relative error (geo-mean over heads)", f"n={n}, slopes={mode}")
        files["error_vs_samples"] = _save(fig, axes[0][0], out / "error_vs_samples.png", 6.5)
    # error vs n
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
                    _geomean([r["relative_spectral"] for r in sub if r["scheme"] == scheme and r["seq_len"] == n])
                    for n in ns
                ]
                ms = [_geomean([r["max_abs"] for r in sub if r["scheme"] == scheme and r["seq_len"] == n]) for n in ns]
                ax.plot(ns, ys, "o-", color=c, label=f"{scheme}: ||Mbar-A|| / ||A||")
                ax.plot(ns, ms, "^:", color=c, label=f"{scheme}: max|Mbar-A|")
            be = [_geomean([r["bound_expected_relative"] for r in sub if r["seq_len"] == n]) for n in ns]
            ax.plot(ns, be, "k--", label="expectation bound / ||A||")
            _loglog(ax, "sequence length n", "error (geo-mean over heads)", f"s={cfg.length_samples}, slopes={mode}")
        files["error_vs_length"] = _save(fig, axes[0][0], out / "error_vs_length.png", 6.5)
    # schemes
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
                ys = [_mean(r[metric] for r in crows if r["scheme"] == scheme and r["head"] == h) for h in heads]
                ax.bar(np.arange(len(heads)) + si * width, ys, width, label=scheme, color=colors[si % len(colors)])
            ax.set_xticks(np.arange(len(heads)) + 0.4 - width / 2)
            slope_of = {r["head"]: r["slope"] for r in crows}
            ax.set_xticklabels([f"h{h}\nσ={1 / slope_of[h]:.3g}" for h in heads], fontsize=7)
            ax.set_yscale("log")
            ax.set_title(f"{title}, T={crows[0]['samples']}, n={crows[0]['seq_len']}", fontsize=9)
            ax.grid(True, axis="y", which="both", alpha=0.25)
        files["schemes"] = _save(fig, axes[0], out / "schemes.png", 7)
    return files


def _report(
    cfg: ValidateConfig,
    desc: dict[str, Any],
    rows: list[dict[str, Any]],
    cmp_rows: list[dict[str, Any]],
    len_rows: list[dict[str, Any]],
    unb_rows: list[dict[str, Any]],
    findings: dict[str, Any],
    skipped: list[str],
    plots: dict[str, Path],
    elapsed: float,
) -> str:
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
    out += ["", "## Findings", ""]
    fits = findings.get("fits", [])
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
    if "under_expected_bound" in findings:
        out.append(
            "- Empirical ||Mbar - A||_2 under the expectation bound in "
            f"**{100 * findings['under_expected_bound']:.1f}%** "
            f"of {len(_unique_mask_rows(rows))} mask measurements; the bound exceeds the error by a factor "
            f"{findings['bound_over_error_min']:.1f} to {findings['bound_over_error_max']:.1f} "
            f"(median {findings['bound_over_error_median']:.1f}). Under the tail-bound eps in "
            f"{100 * findings['under_tail_eps']:.1f}% (eps / error median {findings['tail_over_error_median']:.1f})."
        )
    if "unbiased" in findings:
        parts = []
        for s, ok in findings["unbiased"].items():
            expected = s in sampling.UNBIASED_SCHEMES
            parts.append(f"{s}: {'unbiased' if ok else 'bias detected'}{'' if ok == expected else ' (UNEXPECTED)'}")
        out.append(
            "- Unbiasedness test (every mask index, per pair, binomial z-scores, Bonferroni at level 1e-3): "
            + "; ".join(parts)
            + ". `fixed` is biased by design (negative control)."
        )
    if findings.get("variance_reduction_summary"):
        t = cfg.compare_samples
        for scheme, summ in findings["variance_reduction_summary"].items():
            out.append(
                f"- {scheme} vs {_base_scheme(scheme)} at T={t} (error ratio, geometric mean over heads [min]): "
                f"spectral {summ['relative_spectral']['geomean']:.2f}x [{summ['relative_spectral']['min']:.2f}], "
                f"softmax output {summ['softmax_rel']['geomean']:.2f}x [{summ['softmax_rel']['min']:.2f}], "
                f"max {summ['max_abs']['geomean']:.2f}x, exp-weighted {summ['exp_rel']['geomean']:.2f}x."
            )
    need = [x for x in fits if math.isfinite(x["samples_for_eps"])]
    if need:
        out.append(
            f"- Samples needed for a relative spectral error of {cfg.eps} (from the fitted power law): "
            + "; ".join(f"{x['scheme']} (n={x['seq_len']}, {x['slope_set']}): {x['samples_for_eps']:.0f}" for x in need)
            + "."
        )
    if skipped:
        out.append(f"- Skipped as too expensive: {', '.join(skipped)}.")
    # paper-shaped tables
    out += ["", "## Metrics vs samples (mean over heads, inputs, layers and repeats)", ""]
    mask_rows = _unique_mask_rows(rows)
    for n in cfg.seq_lens:
        for mode in cfg.slopes:
            for scheme in cfg.schemes:
                sub = [r for r in rows if r["seq_len"] == n and r["slope_set"] == mode and r["scheme"] == scheme]
                msub = [r for r in mask_rows if r["seq_len"] == n and r["slope_set"] == mode and r["scheme"] == scheme]
                if not msub:
                    continue
                out += [f"### n={n}, slopes={mode}, scheme={scheme}", ""]
                table = []
                for s in sorted({r["samples"] for r in msub}):
                    m = [r for r in msub if r["samples"] == s]
                    o = [r for r in sub if r["samples"] == s]
                    table.append(
                        [
                            s,
                            _mean(r["spectral"] for r in m),
                            _mean(r["relative_spectral"] for r in m),
                            _mean(r["max_abs"] for r in m),
                            _mean(r["bound_expected"] for r in m),
                            _mean(r["bound_expected_relative"] for r in m),
                            _mean(r["tail_eps_relative"] for r in m),
                            _mean(r["suggested_samples"] for r in m),
                            _mean(r["exp_rel"] for r in o),
                            _mean(r["softmax_rel"] for r in o),
                            _mean(r["row_median"] for r in o),
                            _mean(r["row_p90"] for r in o),
                            _mean(r["row_p99"] for r in o),
                            _mean(r["cosine_mean"] for r in o),
                        ]
                    )
                out.append(
                    _table(
                        [
                            "s",
                            "‖M̄−A‖₂",
                            "rel. spectral",
                            "max abs",
                            "E-bound (abs)",
                            "E-bound (rel)",
                            "tail eps (rel)",
                            "suggested s",
                            "exp-form rel",
                            "softmax rel",
                            "row median",
                            "row p90",
                            "row p99",
                            "cosine",
                        ],
                        table,
                    )
                )
                out.append("")
                heads = sorted({r["head"] for r in msub})
                slope_of = {r["head"]: r["slope"] for r in msub}
                ss = sorted({r["samples"] for r in msub})
                out.append("Relative spectral error per head:")
                out.append("")
                out.append(
                    _table(
                        [
                            "s",
                            *[f"h{h} (σ={1 / slope_of[h]:.3g})" if slope_of[h] > 0 else f"h{h} (σ=∞)" for h in heads],
                        ],
                        [
                            [
                                s,
                                *[
                                    _mean(r["relative_spectral"] for r in msub if r["samples"] == s and r["head"] == h)
                                    for h in heads
                                ],
                            ]
                            for s in ss
                        ],
                    )
                )
                out.append("")
    if len_rows:
        out += [f"## Error vs length at s={cfg.length_samples} (matrix-free; mean over heads)", ""]
        table = []
        for n in sorted({r["seq_len"] for r in len_rows}):
            for mode in cfg.slopes:
                for scheme in cfg.schemes:
                    m = [r for r in len_rows if r["seq_len"] == n and r["slope_set"] == mode and r["scheme"] == scheme]
                    if m:
                        table.append(
                            [
                                n,
                                mode,
                                scheme,
                                _mean(r["relative_spectral"] for r in m),
                                _mean(r["max_abs"] for r in m),
                                _mean(r["bound_expected_relative"] for r in m),
                                _mean(r["seconds"] for r in m),
                            ]
                        )
        out.append(
            _table(["n", "slopes", "scheme", "rel. spectral", "max abs", "E-bound (rel)", "seconds/head"], table)
        )
        out.append("")
    if findings.get("variance_reduction"):
        out += [
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
        table = []
        for mode in cfg.slopes:
            for scheme in cfg.compare_schemes:
                m = [r for r in cmp_rows if r["scheme"] == scheme and r["slope_set"] == mode]
                if m:
                    table.append(
                        [
                            scheme,
                            mode,
                            _mean(r["relative_spectral"] for r in m),
                            _mean(r["max_abs"] for r in m),
                            _mean(r["softmax_rel"] for r in m),
                            _mean(r["exp_rel"] for r in m),
                        ]
                    )
        out.append(_table(["scheme", "slopes", "rel. spectral", "max abs", "softmax rel", "exp-form rel"], table))
        out.append("")
    if unb_rows:
        out += ["## Unbiasedness test", ""]
        out.append(
            _table(
                [
                    "scheme",
                    "slope",
                    "T",
                    "replicates",
                    "max |z| per mask",
                    "max |z| of Mbar",
                    "threshold",
                    "passed",
                    "declared unbiased",
                ],
                [
                    [
                        r["scheme"],
                        r["slope"],
                        r["num_samples"],
                        r["replicates"],
                        r["max_z"],
                        r["mean_max_z"],
                        r["threshold"],
                        r["passed"],
                        r["declared_unbiased"],
                    ]
                    for r in unb_rows
                ],
            )
        )
        out.append("")
    if plots:
        out += ["## Plots", ""]
        for name, path in plots.items():
            out.append(f"![{name}]({path.name})")
            out.append("")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------


def run_validation(cfg: ValidateConfig) -> ValidationResult:
    """Run the whole validation described by ``cfg`` and write its outputs; see the module docstring."""
    if not isinstance(cfg, ValidateConfig):
        raise TypeError(f"cfg must be a ValidateConfig, got {type(cfg).__name__}")
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cfg.threads))
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(prev_threads)


def _run(cfg: ValidateConfig) -> ValidationResult:
    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    contexts, model_slopes, scale, desc = _load_contexts(cfg)
    num_heads = contexts[0].layers[0].num_heads
    heads = list(range(num_heads)) if cfg.heads is None else list(cfg.heads)
    bad = [h for h in heads if not 0 <= h < num_heads]
    if bad:
        raise ValueError(f"heads {bad} out of range for {num_heads} heads")
    slope_sets = _slope_sets(cfg, num_heads, model_slopes)
    n_sets = len(slope_sets)
    total = (
        len(cfg.seq_lens) * n_sets * len(cfg.schemes) * len(cfg.samples) * cfg.repeats * len(heads)
        + (n_sets * len(cfg.compare_schemes) * cfg.compare_repeats * len(heads) if cfg.compare_samples > 0 else 0)
        + len(cfg.lengths) * n_sets * len(cfg.schemes) * cfg.repeats * len(heads)
        + (
            len(dict.fromkeys([*cfg.schemes, *cfg.compare_schemes, "fixed"])) * len(UNBIASED_TEST_SLOPES)
            if cfg.unbiasedness_replicates > 0
            else 0
        )
    )
    with tqdm(total=total, desc="plsh validate", unit="head", disable=not cfg.progress, file=sys.stderr) as bar:
        rows, skipped = _main_sweep(cfg, contexts, slope_sets, heads, scale, bar)
        cmp_rows = _compare_sweep(cfg, contexts, slope_sets, heads, scale, bar)
        len_rows = _length_sweep(cfg, slope_sets, heads, bar)
        unb_rows = _unbiasedness(cfg, bar)
    findings = _findings(cfg, rows, cmp_rows, unb_rows)
    files = {
        "measurements": out / "measurements.csv",
        "schemes": out / "schemes.csv",
        "lengths": out / "lengths.csv",
        "unbiasedness": out / "unbiasedness.csv",
        "config": out / "config.json",
        "report": out / "report.md",
    }
    _write_csv(files["measurements"], rows, MEASUREMENT_FIELDS)
    _write_csv(files["schemes"], cmp_rows)
    _write_csv(files["lengths"], len_rows)
    _write_csv(files["unbiasedness"], unb_rows)
    plots = _plots(out, rows, len_rows, cmp_rows, cfg) if cfg.plots else {}
    files.update(plots)
    elapsed = time.perf_counter() - t_start
    meta = {
        "config": asdict(cfg),
        "command": command_line(cfg),
        "inputs": desc,
        "seed_rule": "derive_seed(seed, experiment, *coordinates): blake2b of the repr, 62 bits; "
        "per-draw seeds in the CSVs",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "positional_lsh": _version(),
        },
        "elapsed_s": elapsed,
        "findings": findings,
    }
    files["config"].write_text(json.dumps(meta, indent=2, default=_json_default))
    files["report"].write_text(
        _report(cfg, desc, rows, cmp_rows, len_rows, unb_rows, findings, skipped, plots, elapsed)
    )
    return ValidationResult(out, files, findings, rows, cmp_rows, len_rows, unb_rows)


def _version() -> str:
    try:
        from positional_lsh import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    return str(o)


_FLAGS = {
    "out_dir": "--out",
    "source": "--source",
    "checkpoint": "--checkpoint",
    "tokenizer": "--tokenizer",
    "text": "--text",
    "seq_lens": "--seq-lens",
    "num_inputs": "--num-inputs",
    "layers": "--layers",
    "heads": "--heads",
    "slopes": "--slopes",
    "schemes": "--schemes",
    "samples": "--samples",
    "repeats": "--repeats",
    "seed": "--seed",
    "eps": "--eps",
    "delta": "--delta",
    "tol": "--tol",
    "max_output_len": "--max-output-len",
    "max_work": "--max-work",
    "compare_samples": "--compare-samples",
    "compare_repeats": "--compare-repeats",
    "compare_schemes": "--compare-schemes",
    "lengths": "--lengths",
    "length_samples": "--length-samples",
    "unbiasedness_replicates": "--unbiasedness-replicates",
    "synthetic_layers": "--synthetic-layers",
    "synthetic_heads": "--synthetic-heads",
    "synthetic_head_dim": "--synthetic-head-dim",
    "threads": "--threads",
}


def command_line(cfg: ValidateConfig) -> str:
    """The ``plsh validate`` command that reproduces ``cfg`` (options at their defaults are omitted)."""
    default = ValidateConfig(out_dir=cfg.out_dir)
    parts = ["plsh", "validate", "--out", str(cfg.out_dir)]
    for name, flag in _FLAGS.items():
        value = getattr(cfg, name)
        if name == "out_dir" or value == getattr(default, name):
            continue
        if isinstance(value, tuple):
            value = ",".join(map(str, value)) if value else "none"
        parts += [flag, str(value)]
    if not cfg.causal:
        parts.append("--bidirectional")
    if not cfg.plots:
        parts.append("--no-plots")
    return " ".join(parts)


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be a comma-separated list of ints, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"{name} must not be empty")
    return vals


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> ValidateConfig:
    """Build a :class:`ValidateConfig` from ``plsh validate`` arguments."""
    return ValidateConfig(
        out_dir=args.out,
        source=args.source,
        checkpoint=args.checkpoint,
        tokenizer=args.tokenizer,
        text=args.text,
        seq_lens=_int_list(args.seq_lens, "--seq-lens"),
        num_inputs=args.num_inputs,
        layers=None if args.layers == "all" else _int_list(args.layers, "--layers"),
        heads=None if args.heads == "all" else _int_list(args.heads, "--heads"),
        slopes=_str_list(args.slopes),
        schemes=_str_list(args.schemes),
        samples=_int_list(args.samples, "--samples"),
        repeats=args.repeats,
        causal=not args.bidirectional,
        seed=args.seed,
        eps=args.eps,
        delta=args.delta,
        tol=args.tol,
        max_output_len=args.max_output_len,
        max_work=args.max_work,
        compare_samples=args.compare_samples,
        compare_repeats=args.compare_repeats,
        compare_schemes=_str_list(args.compare_schemes),
        lengths=() if args.lengths in ("", "none") else _int_list(args.lengths, "--lengths"),
        length_samples=args.length_samples,
        unbiasedness_replicates=args.unbiasedness_replicates,
        synthetic_layers=args.synthetic_layers,
        synthetic_heads=args.synthetic_heads,
        synthetic_head_dim=args.synthetic_head_dim,
        plots=not args.no_plots,
        progress=not args.quiet,
        threads=args.threads,
    )


def _run_cli(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"plsh validate: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_validation(cfg)
    except (NotImplementedError, FileNotFoundError, ValueError) as exc:
        print(f"plsh validate: error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {result.files['report']}")
    f = result.findings
    for x in f.get("fits", []):
        if x["independent"]:
            print(f"fitted slope ({x['scheme']}, n={x['seq_len']}, {x['slope_set']}): {x['slope']:.3f}")
    if "under_expected_bound" in f:
        print(
            f"under the expectation bound: {100 * f['under_expected_bound']:.1f}% "
            f"(bound/error median {f['bound_over_error_median']:.1f})"
        )
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plsh validate`` to the ``plsh`` command line."""
    p = subparsers.add_parser(
        "validate",
        help="validate the theory (bounds, error metrics, variance reduction) on captured or synthetic Q/K/V",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--source",
        choices=("shipped", "synthetic", "checkpoint"),
        default="shipped",
        help="Q/K/V source: the project's shipped model (default), Gaussian, or a local transformers checkpoint",
    )
    p.add_argument("--checkpoint", help="local transformers checkpoint directory (--source checkpoint)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's)")
    p.add_argument("--text", help="text file to tokenize into contexts")
    p.add_argument("--seq-lens", default="1024", help="context lengths n, comma-separated")
    p.add_argument("--num-inputs", type=int, default=1, help="contexts per length")
    p.add_argument("--layers", default="all", help="layers to capture ('all' or e.g. '0,-1')")
    p.add_argument("--heads", default="all", help="query heads to measure ('all' or e.g. '0,3')")
    p.add_argument(
        "--slopes",
        default="standard",
        help="slope sets: 'standard' (ALiBi schedule), 'model' (the model's own), 'sigma=X' (constant)",
    )
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES), help=f"schemes of the main sweep {sampling.SCHEMES}")
    p.add_argument("--samples", default=",".join(map(str, DEFAULT_SAMPLES)), help="sample counts s")
    p.add_argument("--repeats", type=int, default=1, help="independent draws per (n, slopes, scheme, s)")
    p.add_argument("--bidirectional", action="store_true", help="no causal mask in the output metrics")
    p.add_argument("--seed", type=int, default=0, help="base seed")
    p.add_argument("--eps", type=float, default=0.1, help="target relative spectral error (sample-count columns)")
    p.add_argument("--delta", type=float, default=0.05, help="failure probability of the tail bound")
    p.add_argument("--tol", type=float, default=1e-6, help="Lanczos tolerance (relative)")
    p.add_argument("--max-output-len", type=int, default=8192, help="output metrics only up to this n")
    p.add_argument("--max-work", type=float, default=1e9, help="skip (n, s) with n*s above this")
    p.add_argument("--compare-samples", type=int, default=64, help="T of the scheme comparison (0: skip)")
    p.add_argument("--compare-repeats", type=int, default=10, help="seeds per scheme in the comparison")
    p.add_argument("--compare-schemes", default=",".join(COMPARE_SCHEMES), help="schemes compared")
    p.add_argument("--lengths", default="1024,4096,16384,65536", help="lengths of the error-vs-n sweep ('none': skip)")
    p.add_argument("--length-samples", type=int, default=100, help="s of the error-vs-n sweep")
    p.add_argument("--unbiasedness-replicates", type=int, default=2000, help="replicates of the test (0: skip)")
    p.add_argument("--synthetic-layers", type=int, default=2)
    p.add_argument("--synthetic-heads", type=int, default=8)
    p.add_argument("--synthetic-head-dim", type=int, default=64)
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=1, help="torch threads during the run")
    p.set_defaults(func=_run_cli)
