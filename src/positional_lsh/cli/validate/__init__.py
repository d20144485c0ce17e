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
long lengths), and a statistical unbiasedness test of every scheme; and the slope-gradient section
(:mod:`positional_lsh.cli.validate.slope_grad`: the surrogate and score-function slope gradients against the
exact one, ``--slope-grad-only`` runs it alone). The output directory receives
``measurements.csv``, ``schemes.csv``, ``lengths.csv``, ``unbiasedness.csv``, ``slope_grad.csv``, ``config.json``
(every setting and seed), ``report.md`` (findings and the paper-shaped tables) and PNG plots.

Inputs: the project's shipped model and corpus (:func:`load_shipped`, the default), synthetic Gaussian Q/K/V,
or a local transformers checkpoint with a text file.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from positional_lsh.cli.parsers import add_arguments, description, run_command
from positional_lsh.cli.validate.adversarial import ADVERSARIAL_FIELDS, quick_adversarial
from positional_lsh.cli.validate.findings import findings as compute_findings
from positional_lsh.cli.validate.inputs import load_contexts, load_shipped, slope_sets
from positional_lsh.cli.validate.plots import plots as write_plots
from positional_lsh.cli.validate.report import ReportData, report, write_csv
from positional_lsh.cli.validate.settings import (
    UNBIASED_TEST_SLOPES,
    ValidateConfig,
    command_line,
    config_from_args,
    derive_seed,
)
from positional_lsh.cli.validate.slope_grad import (
    SLOPE_GRAD_FIELDS,
    slope_grad_finding_lines,
    slope_grad_findings,
    slope_grad_inputs,
    slope_grad_plot,
    slope_grad_section,
    slope_grad_sweep,
)
from positional_lsh.cli.validate.sweeps import (
    BLOCK_FIELDS,
    MEASUREMENT_FIELDS,
    SweepInputs,
    block_sweep,
    compare_sweep,
    length_sweep,
    main_sweep,
    unbiasedness,
)
from positional_lsh.lm.run_dir import check_output_dir

__all__ = [
    "MEASUREMENT_FIELDS",
    "ValidateConfig",
    "ValidationResult",
    "command_line",
    "config_from_args",
    "derive_seed",
    "load_shipped",
    "register_cli",
    "run_validation",
]


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
    blocks: list[dict[str, Any]] = field(default_factory=list, repr=False)
    adversarial: list[dict[str, Any]] = field(default_factory=list, repr=False)
    slope_grad: list[dict[str, Any]] = field(default_factory=list, repr=False)


def run_validation(cfg: ValidateConfig) -> ValidationResult:
    """Run the whole validation described by ``cfg`` and write its outputs; see the module docstring."""
    if not isinstance(cfg, ValidateConfig):
        raise TypeError(f"cfg must be a ValidateConfig, got {type(cfg).__name__}")
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(prev_threads)


def _run(cfg: ValidateConfig) -> ValidationResult:
    """Inputs, the four experiments, findings, then the files."""
    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    check_output_dir(out, "--out")  # before any work; created once the inputs are loaded
    if cfg.adversarial:
        from positional_lsh.cli.validate.adversarial import run_adversarial

        out.mkdir(parents=True, exist_ok=True)
        files, found = run_adversarial(cfg, out)
        meta = _meta(cfg, {"source": "adversarial inputs"}, found, time.perf_counter() - t_start)
        files["config"] = out / "config.json"
        files["config"].write_text(json.dumps(meta, indent=2, default=_json_default))
        return ValidationResult(out, files, found, [], [], [], [])
    if cfg.slope_grad_only:
        return _run_slope_grad_only(cfg, out, t_start)
    contexts, model_slopes, scale, desc = load_contexts(cfg)
    num_heads = contexts[0].layers[0].num_heads
    heads = list(range(num_heads)) if cfg.heads is None else list(cfg.heads)
    bad = [h for h in heads if not 0 <= h < num_heads]
    if bad:
        raise ValueError(f"heads {bad} out of range for {num_heads} heads")
    sets = slope_sets(cfg, num_heads, model_slopes)
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(total=_total(cfg, len(sets), len(heads)), desc="plsh validate", unit="head",
              disable=not cfg.progress, file=sys.stderr) as bar:  # fmt: skip
        run = SweepInputs(cfg, contexts, sets, heads, scale)
        rows, skipped = main_sweep(run, bar)
        cmp_rows = compare_sweep(run, bar)
        len_rows = length_sweep(run, bar)
        unb_rows = unbiasedness(cfg, bar)
        block_rows = block_sweep(run)
        adv_rows, adv_files = quick_adversarial(cfg, sets, heads, out, bar)
        sg_inputs = slope_grad_inputs(cfg, contexts, model_slopes, scale) if cfg.slope_grad_samples else []
        sg_rows = slope_grad_sweep(cfg, sg_inputs, bar)
    found = compute_findings(cfg, rows, cmp_rows, unb_rows)
    found.update(_block_and_adversarial_findings(cfg, block_rows, adv_rows))
    found.update(slope_grad_findings(sg_rows))
    names = ("measurements", "schemes", "lengths", "unbiasedness", "blocks", "adversarial", "slope_grad")
    files = {name: out / f"{name}.csv" for name in names}
    files.update(adv_files)
    files.update(config=out / "config.json", report=out / "report.md")
    write_csv(files["measurements"], rows, MEASUREMENT_FIELDS)
    write_csv(files["schemes"], cmp_rows)
    write_csv(files["lengths"], len_rows)
    write_csv(files["unbiasedness"], unb_rows)
    write_csv(files["blocks"], block_rows, BLOCK_FIELDS)
    write_csv(files["adversarial"], adv_rows, ["slope_set", "heads", "slope", *ADVERSARIAL_FIELDS])
    write_csv(files["slope_grad"], sg_rows, SLOPE_GRAD_FIELDS)
    plots = write_plots(out, rows, len_rows, cmp_rows, cfg) if cfg.plots else {}
    if cfg.plots and sg_rows:
        plots["slope_grad_png"] = slope_grad_plot(sg_rows, out / "slope_grad.png")
    files.update(plots)
    elapsed = time.perf_counter() - t_start
    files["config"].write_text(json.dumps(_meta(cfg, desc, found, elapsed), indent=2, default=_json_default))
    data = ReportData(cfg, desc, rows, cmp_rows, len_rows, unb_rows, found, skipped, plots, elapsed, block_rows,
                      adv_rows, sg_rows)  # fmt: skip
    files["report"].write_text(report(data))
    return ValidationResult(out, files, found, rows, cmp_rows, len_rows, unb_rows, block_rows, adv_rows, sg_rows)


def _run_slope_grad_only(cfg: ValidateConfig, out: Path, t_start: float) -> ValidationResult:
    """``--slope-grad-only``: the inputs at ``slope_grad_len`` (one context), the slope-gradient section, and its
    files: ``slope_grad.csv``, ``slope_grad.md``, ``slope_grad.png``, ``config.json``."""
    contexts: list[Any] = []
    model_slopes, scale = None, None
    desc: dict[str, Any] = {"source": "synthetic Gaussian Q/K/V"}
    if cfg.source != "synthetic":
        contexts, model_slopes, scale, desc = load_contexts(replace(cfg, seq_lens=(cfg.slope_grad_len,), num_inputs=1))
    out.mkdir(parents=True, exist_ok=True)
    inputs = slope_grad_inputs(cfg, contexts, model_slopes, scale)
    total = len(cfg.slope_grad_samples) * sum(x.q.shape[1] for x in inputs)
    with tqdm(total=total, desc="plsh validate (slope gradient)", unit="head", disable=not cfg.progress,
              file=sys.stderr) as bar:  # fmt: skip
        rows = slope_grad_sweep(cfg, inputs, bar)
    found = slope_grad_findings(rows)
    files = {"slope_grad": out / "slope_grad.csv", "slope_grad_md": out / "slope_grad.md",
             "config": out / "config.json"}  # fmt: skip
    write_csv(files["slope_grad"], rows, SLOPE_GRAD_FIELDS)
    lines = [f"Command: `{command_line(cfg)}`  ", f"Inputs: {', '.join(f'{k}={v}' for k, v in desc.items())}.", ""]
    files["slope_grad_md"].write_text("\n".join([*slope_grad_section(rows, cfg), *lines]) + "\n")
    if cfg.plots:
        files["slope_grad_png"] = slope_grad_plot(rows, out / "slope_grad.png")
    meta = _meta(cfg, desc, found, time.perf_counter() - t_start)
    files["config"].write_text(json.dumps(meta, indent=2, default=_json_default))
    return ValidationResult(out, files, found, [], [], [], [], slope_grad=rows)


def _block_and_adversarial_findings(
    cfg: ValidateConfig, block_rows: list[dict[str, Any]], adv_rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """Share of (head, draw) whose largest block is within the delta-bound; the small adversarial study's summary."""
    out: dict[str, Any] = {}
    judged = [r for r in block_rows if r["within_bound"] is not None]
    if judged:
        out["blocks_within_bound"] = sum(bool(r["within_bound"]) for r in judged) / len(judged)
        out["blocks_judged"] = len(judged)
        out["largest_block"] = max(r["largest"] for r in block_rows)
    if adv_rows:
        out["adversarial_violations"] = sum(bool(r["violation"]) for r in adv_rows)
        out["adversarial_max_worst_over_bound"] = max(r["worst_over_bound"] for r in adv_rows)
        out["adversarial_min_worst_over_gaussian"] = min(r["worst_over_gaussian"] for r in adv_rows)
    return out


def _total(cfg: ValidateConfig, n_sets: int, n_heads: int) -> int:
    """Head measurements of the whole run (the progress bar's length)."""
    unb_schemes = len(dict.fromkeys([*cfg.schemes, *cfg.compare_schemes, "fixed"]))
    return (
        len(cfg.seq_lens) * n_sets * len(cfg.schemes) * len(cfg.samples) * cfg.repeats * n_heads
        + (n_sets * len(cfg.compare_schemes) * cfg.compare_repeats * n_heads if cfg.compare_samples > 0 else 0)
        + len(cfg.lengths) * n_sets * len(cfg.schemes) * cfg.repeats * n_heads
        + (unb_schemes * len(UNBIASED_TEST_SLOPES) if cfg.unbiasedness_replicates > 0 else 0)
        + n_heads * len(cfg.report_adversarial_lengths) * len(cfg.report_adversarial_samples)
        + len(cfg.slope_grad_samples) * (cfg.synthetic_heads + (n_heads if cfg.source != "synthetic" else 0))
    )


def _meta(cfg: ValidateConfig, desc: dict[str, Any], found: dict[str, Any], elapsed: float) -> dict[str, Any]:
    """``config.json``: every setting, the command, inputs, seed rule, versions, run time and findings."""
    return {
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
        "findings": found,
    }


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


def _run_cli(args: argparse.Namespace) -> int:
    return run_command(args, ValidateConfig, _validate_and_summarize)


def _validate_and_summarize(cfg: ValidateConfig) -> None:
    """``plsh validate``: :func:`run_validation`, then the report's path and the main findings on stdout."""
    result = run_validation(cfg)
    files = result.files
    print(f"report: {files.get('report', files.get('adversarial_md', files.get('slope_grad_md')))}")
    f = result.findings
    if "adversarial_violations" in f:
        print(f"adversarial: {f['adversarial_violations']} input(s) above the uniform bound")
    for x in f.get("fits", []):
        if x["independent"]:
            print(f"fitted slope ({x['scheme']}, n={x['seq_len']}, {x['slope_set']}): {x['slope']:.3f}")
    for line in slope_grad_finding_lines(f, cfg):
        print(line.removeprefix("- "))
    if "under_expected_bound" in f:
        print(
            f"under the expectation bound: {100 * f['under_expected_bound']:.1f}% "
            f"(bound/error median {f['bound_over_error_median']:.1f})"
        )


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plsh validate`` to the ``plsh`` command line."""
    p = subparsers.add_parser(
        "validate",
        help="validate the theory (bounds, error metrics, variance reduction) on captured or synthetic Q/K/V",
        description=description(__doc__),
    )
    add_arguments(p, ValidateConfig)
    p.set_defaults(func=_run_cli)
