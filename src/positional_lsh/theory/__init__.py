"""The paper's theory: bounds on ``||Mbar - A||`` and the empirical error metrics, at any scale.

Notation (docs/design.md; docs/theory.md §2): ``n`` positions, slope ``m > 0`` and ``sigma = 1/m`` for one
head, the ALiBi matrix ``A[i, j] = exp(-m |i - j|)``, ``T`` (a.k.a. ``s``) sampled block masks ``M_1..M_T``
and their mean ``Mbar``. One idea per module:

* :mod:`positional_lsh.theory.bounds` — the paper's bounds (``Psi``, expectation and tail bounds, suggested
  sample counts) and the exact ``||A||_2``;
* :mod:`positional_lsh.theory.operators` — ``A x`` and ``Mbar x`` without an ``n x n`` matrix, and the block
  starts of one sample;
* :mod:`positional_lsh.theory.metrics` — ``||Mbar - A||_2`` (Lanczos), ``max |Mbar - A|`` (exact, matrix-free or
  from a dense ``Mbar``), the §5.2 output metrics for given Q/K/V, and power-law fits of errors against ``T``;
* :mod:`positional_lsh.theory.unbiased` — a statistical test that each mask is an exact sample;
* :mod:`positional_lsh.theory.blocks` — block sizes, their work and high-probability bound, pitch caps;
* :mod:`positional_lsh.theory.adversarial` — the uniform theorem's bound for all inputs, and adversaries;
* :mod:`positional_lsh.theory.capture` (with :mod:`positional_lsh.theory.qkv`) — Q/K/V of real models;
* :mod:`positional_lsh.theory.slope_grad` — learning the slopes: the bias and variance of positional LSH's
  surrogate and score-function slope gradients against the exact gradient.

Everything listed in ``__all__`` is importable from here.
"""

from __future__ import annotations

from positional_lsh.theory.adversarial import AdversarialResult, UniformBound, adversarial_search, uniform_error_bound
from positional_lsh.theory.blocks import (
    BlockStats,
    block_size_bound,
    block_size_tail,
    block_stats,
    capped_bias,
    capped_bias_norms,
    largest_blocks,
    pitch_tail,
)
from positional_lsh.theory.bounds import (
    alibi_norm_bound,
    alibi_spectral_norm,
    expected_error_bound,
    psi,
    psi_without_one,
    suggested_samples,
    tail_bound,
    tail_bound_epsilon,
)
from positional_lsh.theory.metrics import (
    MaskErrors,
    OutputErrors,
    SpectralEstimate,
    dense_mask_errors,
    dense_max_error,
    fit_power_law,
    mask_errors,
    max_error,
    output_errors,
    samples_for_error,
    spectral_error,
)
from positional_lsh.theory.operators import MeanMaskOperator, alibi_matvec, block_starts
from positional_lsh.theory.slope_grad import (
    SlopeGradRow,
    SlopeGradStudy,
    exact_slope_gradient,
    log_prob,
    loss_weight,
    plsh_slope_gradients,
    score,
    shipped_qkv,
    slope_gradient_study,
)
from positional_lsh.theory.unbiased import UnbiasednessResult, unbiasedness_test

__all__ = [
    "AdversarialResult",
    "BlockStats",
    "MaskErrors",
    "MeanMaskOperator",
    "OutputErrors",
    "SlopeGradRow",
    "SlopeGradStudy",
    "SpectralEstimate",
    "UnbiasednessResult",
    "UniformBound",
    "adversarial_search",
    "alibi_matvec",
    "alibi_norm_bound",
    "alibi_spectral_norm",
    "block_size_bound",
    "block_size_tail",
    "block_starts",
    "block_stats",
    "capped_bias",
    "capped_bias_norms",
    "dense_mask_errors",
    "dense_max_error",
    "exact_slope_gradient",
    "expected_error_bound",
    "fit_power_law",
    "largest_blocks",
    "log_prob",
    "loss_weight",
    "mask_errors",
    "max_error",
    "output_errors",
    "pitch_tail",
    "plsh_slope_gradients",
    "psi",
    "psi_without_one",
    "samples_for_error",
    "score",
    "shipped_qkv",
    "slope_gradient_study",
    "spectral_error",
    "suggested_samples",
    "tail_bound",
    "tail_bound_epsilon",
    "unbiasedness_test",
    "uniform_error_bound",
]
