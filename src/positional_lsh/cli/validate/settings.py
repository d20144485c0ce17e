"""``plsh validate``'s settings: :class:`ValidateConfig` (its parser is generated from it), seeds, slope sets."""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass

from positional_lsh.cli import parsers
from positional_lsh.cli.parsers import option, to_argv
from positional_lsh.ops.checks import nonnegative_int, positive_int
from positional_lsh.ops.errors import check_memory, check_seconds
from positional_lsh.ops.partitions.schemes import get_scheme
from positional_lsh.theory.slope_grad import subseed

__all__ = [
    "COMPARE_SCHEMES",
    "DEFAULT_SAMPLES",
    "DEFAULT_SCHEMES",
    "SLOPE_RANGE",
    "UNBIASED_TEST_SLOPES",
    "ValidateConfig",
    "adversarial_cell_seconds",
    "command_line",
    "config_from_args",
    "derive_seed",
    "parse_slope_mode",
]

DEFAULT_SAMPLES = (1, 10, 100, 1000, 10000)
DEFAULT_SCHEMES = ("discrete", "discrete-strat")
COMPARE_SCHEMES = ("discrete", "discrete-strat", "gamma", "gamma-strat", "discrete-antithetic")
MAX_SCORE_BOUND = 350.0  # adversarial_score_bound: the uniform bound's exp(2 c) must stay finite in float64
SLOPE_RANGE = (-0.6, -0.4)  # expected fitted slope of relative spectral error vs s (independent sampling)
UNBIASED_TEST_SLOPES = (0.5, 0.05)
ADVERSARIAL_MAX_SECONDS = 600.0
"""The adversarial cells (``--adversarial`` or the report's) estimated above this many seconds are refused up front."""
# The time of one adversarial cell (``adversarial_cell_seconds``), term by term. Measured on the 2-core CPU with
# torch at 1 thread (``--threads``' default) and the other cores busy (load 2-3), by timing each stage of
# ``theory.adversarial.adversarial_search`` at n = 64 ... 4096, T = 1 ... 20000 (docs/theory.md, "The uniform
# approximation theorem against adversarial inputs", has the estimate against whole runs).
ADVERSARIAL_SECONDS_PER_SAMPLE = 2.5e-4
"""Seconds per sample ``T`` of one cell: its draw, the mean mask's loop over its blocks and the row adversaries'
per-sample work (2.3e-4 s measured at n = 64, T = 20000; 3.5e-4 s at n = 256, T = 2000)."""
ADVERSARIAL_SECONDS_PER_ENTRY = 4.5e-9
"""Seconds per sample and per entry of the ``n x n`` mean mask (built block by block; the oracles rebuild it):
4.5e-9 s measured at n = 4096 between T = 1 and T = 64."""
ADVERSARIAL_SECONDS_PER_ROW = 0.07
"""Seconds per attacked row (at most ``2 * adversarial_rows``): four starts of 150 gradient steps on the row's
scores (0.25-0.58 s for 8 rows at every n measured)."""
ADVERSARIAL_SECONDS_BOUND = 1e-7
"""Seconds per entry of ``n x n`` for the uniform bound (its rows sorted: 0.1 s at n = 1024, 1.2-1.9 s at 4096)."""
ADVERSARIAL_SECONDS_REMEASURE = 3.2e-7
"""Seconds per entry of ``n x n`` for re-measuring the adversaries' inputs and three Gaussian ones with the dense
float64 oracles (0.28-0.40 s at n = 1024, 5.5 s at 4096)."""
ADVERSARIAL_SECONDS_PGD = 5e-8
"""Seconds per entry of ``n x n`` and gradient step of the full ``(q, k, v)`` ascent, which runs only up to
``--adversarial-pgd-max-len``: 2 starts of 60 steps (6.3-7.2 s at n = 1024, 0.27-0.40 s at 256)."""
ADVERSARIAL_PGD_STEPS = 2 * 60
"""Gradient steps of the full ascent per cell (``adversarial_search``'s ``pgd_restarts * pgd_steps``)."""
ADVERSARIAL_SECONDS_STARTUP = 2.0
"""Seconds once per study: the first call of the dense oracles (1.5-2.6 s measured, 0.02 s afterwards at n = 256)."""


def adversarial_cell_seconds(n: int, t: int, rows: int, pgd_max_len: int) -> dict[str, float]:
    """The estimated seconds of one adversarial cell (``n``, ``T``), term by term: ``"samples"`` (per sample:
    ``T * (ADVERSARIAL_SECONDS_PER_SAMPLE + ADVERSARIAL_SECONDS_PER_ENTRY * n^2)``), and the fixed cost of the cell
    whatever its ``T``: ``"rows"`` (the row adversaries on at most ``2 * rows`` rows), ``"bound"`` (the uniform
    bound), ``"remeasure"`` (the oracles) and ``"pgd"`` (the full ascent, 0 above ``pgd_max_len``)."""
    entries = float(n) * n
    return {
        "samples": t * (ADVERSARIAL_SECONDS_PER_SAMPLE + ADVERSARIAL_SECONDS_PER_ENTRY * entries),
        "rows": ADVERSARIAL_SECONDS_PER_ROW * min(2 * rows, n),
        "bound": ADVERSARIAL_SECONDS_BOUND * entries,
        "remeasure": ADVERSARIAL_SECONDS_REMEASURE * entries,
        "pgd": ADVERSARIAL_SECONDS_PGD * ADVERSARIAL_PGD_STEPS * entries if n <= pgd_max_len else 0.0,
    }


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
        adversarial: run only the adversarial study of the uniform theorem (``cli/validate/adversarial.py``):
            for each ``n`` in ``adversarial_lengths`` and ``T`` in ``adversarial_samples``, one head with
            ``sigma = adversarial_sigma``, inputs with ``|scale q.k| <= adversarial_score_bound``, ``|v| <= 1``.
        adversarial_lengths, adversarial_samples, adversarial_sigma, adversarial_score_bound,
            adversarial_head_dim, adversarial_rows, adversarial_pgd_max_len: its settings.
        block_delta: failure probability of the report's high-probability bound on the largest block
            (``theory.blocks.block_size_bound``), compared with the largest block of every measured draw.
        report_adversarial_lengths, report_adversarial_samples: the report's small adversarial study (every
            distinct slope of the measured heads, the other ``adversarial_*`` settings); an empty list skips it.
        slope_grad_samples: the sample counts ``T`` of the slope-gradient section (``cli/validate/slope_grad.py``;
            empty: skip it): the surrogate and score-function slope gradients against the exact one.
        slope_grad_len: its sequence length ``n`` (the first ``n`` positions of the model's captured inputs).
        slope_grad_replicates: its independent partition draws per ``T`` (``>= 2``).
        slope_grad_scheme: its partition scheme (the score function needs ``"discrete"`` or ``"gamma"``).
        slope_grad_fd_step: the relative step of its finite differences of ``E[L_plsh]`` (0: none).
        slope_grad_only: run only the slope-gradient section (``slope_grad.*``, ``config.json``).
        plots: write PNG plots.
        progress: show progress bars.
        threads: torch intra-op threads during the run (restored afterwards). 1 is fastest for the many
            small operations here, and by far on a machine shared with other jobs.
    """

    out_dir: str = option(help="output directory", name="--out")
    source: str = option(
        "shipped",
        "Q/K/V source: the project's shipped model, Gaussian, or a local transformers checkpoint",
        choices=("shipped", "synthetic", "checkpoint"),
    )
    checkpoint: str | None = option(None, "local transformers checkpoint directory (--source checkpoint)")
    tokenizer: str | None = option(None, "tokenizer directory (default: the checkpoint's)")
    text: str | None = option(None, "text file to tokenize into contexts")
    seq_lens: tuple[int, ...] = option((1024,), "context lengths n, comma-separated")
    num_inputs: int = option(1, "contexts per length")
    layers: tuple[int, ...] | None = option(None, "layers to capture ('all' or e.g. '0,-1')", none="all")
    heads: tuple[int, ...] | None = option(None, "query heads to measure ('all' or e.g. '0,3')", none="all")
    slopes: tuple[str, ...] = option(
        ("standard",), "slope sets: 'standard' (ALiBi schedule), 'model' (the model's own), 'sigma=X' (constant)"
    )
    schemes: tuple[str, ...] = option(
        DEFAULT_SCHEMES, "schemes of the main sweep (see positional_lsh.ops.partitions.schemes)"
    )
    samples: tuple[int, ...] = option(DEFAULT_SAMPLES, "sample counts s")
    repeats: int = option(1, "independent draws per (n, slopes, scheme, s)")
    causal: bool = option(True, "no causal mask in the output metrics", name="--bidirectional")
    seed: int = option(0, "base seed")
    eps: float = option(0.1, "target relative spectral error (sample-count columns)")
    delta: float = option(0.05, "failure probability of the tail bound")
    tol: float = option(1e-6, "Lanczos tolerance (relative)")
    max_output_len: int = option(8192, "output metrics only up to this n")
    max_work: float = option(1e9, "skip (n, s) with n*s above this")
    compare_samples: int = option(64, "T of the scheme comparison (0: skip)")
    compare_repeats: int = option(10, "seeds per scheme in the comparison")
    compare_schemes: tuple[str, ...] = option(COMPARE_SCHEMES, "schemes compared")
    lengths: tuple[int, ...] = option((1024, 4096, 16384, 65536), "lengths of the error-vs-n sweep ('none': skip)")
    length_samples: int = option(100, "s of the error-vs-n sweep")
    unbiasedness_replicates: int = option(2000, "replicates of the test (0: skip)")
    synthetic_layers: int = option(2, "layers of the synthetic Q/K/V")
    synthetic_heads: int = option(8, "heads of the synthetic Q/K/V")
    synthetic_head_dim: int = option(64, "head dimension of the synthetic Q/K/V")
    plots: bool = option(True, "do not write PNG plots", name="--no-plots")
    progress: bool = option(True, "no progress bar", name="--quiet")
    threads: int = option(1, "torch threads during the run")
    adversarial: bool = option(False, "run only the adversarial study of the uniform theorem (adversarial.*)")
    adversarial_lengths: tuple[int, ...] = option((256, 1024, 4096), "lengths n of the adversarial study")
    adversarial_samples: tuple[int, ...] = option((1, 4, 16, 64), "sample counts T of the adversarial study")
    adversarial_sigma: float = option(16.0, "length scale sigma = 1/slope of the adversarial study's head")
    adversarial_score_bound: float = option(1.0, "c = scale R^2: the bound on |scale q.k| of the constraint set")
    adversarial_head_dim: int = option(16, "head dimension of the adversarial inputs")
    adversarial_rows: int = option(4, "query rows attacked (those with the largest bound)")
    adversarial_pgd_max_len: int = option(1024, "full (q, k, v) gradient ascent only up to this n")
    block_delta: float = option(0.01, "failure probability of the report's bound on the largest block")
    report_adversarial_lengths: tuple[int, ...] = option(
        (256,), "lengths n of the report's small adversarial study ('none': skip)"
    )
    report_adversarial_samples: tuple[int, ...] = option((4, 16), "sample counts T of the report's adversarial study")
    slope_grad_samples: tuple[int, ...] = option(
        (1, 4, 16, 64, 256), "sample counts T of the slope-gradient study ('none': skip)"
    )
    slope_grad_len: int = option(64, "sequence length n of the slope-gradient study")
    slope_grad_replicates: int = option(32, "independent partition draws per T in the slope-gradient study (>= 2)")
    slope_grad_scheme: str = option("discrete", "scheme of the slope-gradient study (score function: discrete, gamma)")
    slope_grad_fd_step: float = option(0.25, "relative step of the slope-gradient study's finite differences (0: none)")
    slope_grad_only: bool = option(False, "run only the slope-gradient study (slope_grad.*)")

    def __post_init__(self) -> None:
        if self.source not in ("synthetic", "checkpoint", "shipped"):
            raise ValueError(f"source must be 'synthetic', 'checkpoint' or 'shipped', got {self.source!r}")
        if self.source == "checkpoint" and not self.checkpoint:
            raise ValueError("source='checkpoint' needs checkpoint (a local transformers directory)")
        if self.source == "checkpoint" and not self.text:
            raise ValueError("source='checkpoint' needs text (a text file to tokenize)")
        for name in ("seq_lens", "samples"):
            vals = getattr(self, name)
            if not vals:
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {vals}")
            for v in vals:
                positive_int(name, v)
        if any(n < 2 for n in self.seq_lens) or any(n < 2 for n in self.lengths):
            raise ValueError("sequence lengths must be >= 2")
        for s in (*self.schemes, *self.compare_schemes):
            get_scheme(s)  # ValueError naming the known schemes
        for mode in self.slopes:
            parse_slope_mode(mode)
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {self.eps}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        for name in ("num_inputs", "repeats", "length_samples", "synthetic_layers", "synthetic_heads"):
            positive_int(name, getattr(self, name))
        for name in ("adversarial_lengths", "adversarial_samples", "report_adversarial_lengths",
                     "report_adversarial_samples"):  # fmt: skip
            for v in getattr(self, name):
                positive_int(name, v)
        for name in ("adversarial_lengths", "report_adversarial_lengths"):
            if any(n > 4096 for n in getattr(self, name)):
                raise ValueError(f"{name} must be <= 4096 (dense float64 references)")
            if any(n < 2 for n in getattr(self, name)):
                raise ValueError(f"{name} must be >= 2 (a query and a key to compare), got {getattr(self, name)}")
        if not 0 < self.block_delta < 1:
            raise ValueError(f"block_delta must be in (0, 1), got {self.block_delta}")
        for name in ("adversarial_sigma", "adversarial_score_bound", "tol", "max_work"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not math.isfinite(self.adversarial_sigma):
            raise ValueError(f"adversarial_sigma must be finite (sigma = 1/slope of one ALiBi head), got "
                             f"{self.adversarial_sigma}")  # fmt: skip
        if self.adversarial_score_bound > MAX_SCORE_BOUND:
            raise ValueError(
                f"adversarial_score_bound must be <= {MAX_SCORE_BOUND:g} (the uniform bound holds exp(2 c), which "
                f"overflows float64 above ~354), got {self.adversarial_score_bound}"
            )
        if not self.tol < 1:
            raise ValueError(f"tol must be in (0, 1) (a relative Lanczos tolerance), got {self.tol}")
        for name in ("threads", "adversarial_head_dim", "adversarial_rows", "compare_repeats", "synthetic_head_dim",
                     "max_output_len"):  # fmt: skip
            positive_int(name, getattr(self, name))
        for name in ("seed", "compare_samples", "unbiasedness_replicates", "adversarial_pgd_max_len"):
            nonnegative_int(name, getattr(self, name))
        self._check_slope_grad()
        if not isinstance(self.out_dir, str) or not self.out_dir.strip():
            raise ValueError(f"out_dir (--out) must be a directory path, got {self.out_dir!r}")
        check_memory(*self.memory_estimate())
        seconds, what = self.adversarial_seconds()
        check_seconds(seconds, ADVERSARIAL_MAX_SECONDS, what, "each cell loops over its T samples in Python")

    def _check_slope_grad(self) -> None:
        """The slope-gradient section's settings (``ValueError`` naming the setting)."""
        for v in self.slope_grad_samples:
            positive_int("slope_grad_samples", v)
        if len(set(self.slope_grad_samples)) != len(self.slope_grad_samples):
            raise ValueError(f"slope_grad_samples must be distinct T values, got {list(self.slope_grad_samples)}")
        if self.slope_grad_only and not self.slope_grad_samples:
            raise ValueError("slope_grad_only needs slope_grad_samples (at least one T)")
        if positive_int("slope_grad_len", self.slope_grad_len) < 2:
            raise ValueError(f"slope_grad_len must be >= 2 (a query and a key to compare), got {self.slope_grad_len}")
        if positive_int("slope_grad_replicates", self.slope_grad_replicates) < 2:
            raise ValueError(f"slope_grad_replicates must be >= 2 (the score function's leave-one-out baseline and "
                             f"the variance need two), got {self.slope_grad_replicates}")  # fmt: skip
        get_scheme(self.slope_grad_scheme)
        step = self.slope_grad_fd_step
        if isinstance(step, bool) or not isinstance(step, int | float) or not 0 <= step < 1:
            raise ValueError(f"slope_grad_fd_step must be a number in [0, 1) (relative to the slope; 0: none), got "
                             f"{step!r}")  # fmt: skip

    def adversarial_cells(self) -> list[tuple[int, int]]:
        """The ``(n, T)`` cells of the adversarial study this run makes: ``--adversarial-lengths`` x
        ``--adversarial-samples`` with ``--adversarial``, else the report's (once per distinct slope)."""
        if self.adversarial:
            return [(n, t) for n in self.adversarial_lengths for t in self.adversarial_samples]
        return [(n, t) for n in self.report_adversarial_lengths for t in self.report_adversarial_samples]

    def adversarial_seconds(self) -> tuple[float, str]:
        """The adversarial study's estimated time (seconds, one slope) and the flags that set it: every cell's
        :func:`adversarial_cell_seconds` (its samples and its fixed cost: the row adversaries, the bound, the
        oracles, the full ascent up to ``--adversarial-pgd-max-len``), plus ``ADVERSARIAL_SECONDS_STARTUP`` once.
        Measured on a 2-core CPU at 1 thread with the other core busy: within -10 % / +25 % of whole runs there
        (docs/theory.md); a busier or slower machine takes longer, a faster one less."""
        cells = self.adversarial_cells()
        if not cells:
            return 0.0, ""

        def cell(c: tuple[int, int]) -> float:
            return sum(adversarial_cell_seconds(*c, self.adversarial_rows, self.adversarial_pgd_max_len).values())

        seconds = ADVERSARIAL_SECONDS_STARTUP + sum(map(cell, cells))
        n, t = max(cells, key=cell)
        flags = "--adversarial-lengths/--adversarial-samples" if self.adversarial else "--report-adversarial-*"
        return seconds, f"{flags} ({len(cells)} cell{'s' if len(cells) > 1 else ''}, the largest n={n}, T={t})"

    def memory_estimate(self) -> tuple[float, str]:
        """A lower bound on the run's peak memory (bytes) and the flags that set it: the largest of what one step
        holds at once — one context's synthetic Q/K/V (float32), the block labels of one head's draw (int64,
        ``n * s`` for the main sweep's ``(n, s)`` within ``max_work``, ``n * length_samples`` for the length sweep,
        ``n * T`` for the adversarial cells), one dense ``n x n`` float64 matrix where the output metrics or the
        adversarial references are computed, the slope-gradient section's replicates stacked as heads (about ten
        float32 ``(replicates * heads, n, d)`` tensors)."""
        parts: list[tuple[float, str]] = []
        per_pos = (4.0 * 3 * self.synthetic_layers * self.synthetic_heads * self.synthetic_head_dim
                   if self.source == "synthetic" else 0.0)  # fmt: skip
        for n in self.seq_lens:
            parts.append((per_pos * n, f"--seq-lens {n}"))
            for t in self.samples:
                if n * t <= self.max_work:
                    parts.append((8.0 * n * t, f"--seq-lens {n} with --samples {t}"))
            if n <= self.max_output_len:
                parts.append((8.0 * n * n, f"--seq-lens {n} (dense output metrics up to --max-output-len)"))
        for n in self.lengths:
            parts.append((8.0 * n * self.length_samples, f"--lengths {n} with --length-samples {self.length_samples}"))
        for n, t in self.adversarial_cells():
            flags = "--adversarial-lengths/--adversarial-samples" if self.adversarial else "--report-adversarial-*"
            parts.append((8.0 * n * t + 16.0 * n * n, f"{flags} n={n}, T={t}"))
        if self.slope_grad_samples:  # the replicates stacked as heads: q, k, v, out, W and their gradients
            sg = 4.0 * 10 * self.slope_grad_replicates * self.synthetic_heads * self.slope_grad_len
            parts.append((sg * self.synthetic_head_dim, "--slope-grad-len with --slope-grad-replicates"))
        return max(parts, default=(0.0, ""))


def derive_seed(base: int, *parts: object) -> int:
    """A reproducible 62-bit seed from a base seed and the coordinates of a draw (the one rule,
    :func:`positional_lsh.theory.slope_grad.subseed`: blake2b of their ``repr``)."""
    return subseed(base, *parts)


def parse_slope_mode(mode: str) -> tuple[str, float | None]:
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


def command_line(cfg: ValidateConfig) -> str:
    """The ``plsh validate`` command that reproduces ``cfg`` (options at their defaults are omitted)."""
    return shlex.join(["plsh", "validate", *to_argv(cfg, skip=("progress",))])


def config_from_args(args: argparse.Namespace) -> ValidateConfig:
    """Build a :class:`ValidateConfig` from ``plsh validate`` arguments."""
    return parsers.config_from_args(args, ValidateConfig)
