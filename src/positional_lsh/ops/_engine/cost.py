"""The cost model of the estimator: time estimates of its two methods, ``method="auto"``'s rule, the size bounds.

Estimates are in nanoseconds per batch element; only their ratios decide anything. The constants were fitted on
the measured 2-core CPU (AMD EPYC, d = 64, fp32, causal, standard slopes 1/2 ... 1/256, torch's CPU flash op, one
thread): the per-sample terms by least squares to single-head timings at n = 32768 (docs/implementation.md,
"Choosing the method"), its per-call term and the multiplicity terms by least squares (relative error) to the time
of every kernel call of the multiplicity form at n = 32768, T = 8, 64, 256 and every tile height (median error 5 %,
90th percentile 18 %), then :data:`AUTO_MARGIN` against both methods timed at n = 40 ... 16384. Per head, with
``T`` samples and ``Lq`` query rows:

    per-sample   = ENTRY_COST * (score entries) + BLOCK_COST * (blocks)
                   + (CALL_ROW_COST * Lq + SAMPLES_CALL_COST) * (kernel calls)
    multiplicity = min over tile of  pairs * (PAIR_COST + PAIR_COST_TILE / tile) + TILE_COST * tiles
                                     + CALL_COST * (distinct window lengths) + BOUND_COST * Lq * T

The per-call term scales with ``Lq``: what grows with the number of per-sample calls is planning and merging. (A
first fit as a constant, 2.1e6 ns per call at the fitted n = 32768, overrated the per-sample path at small n and
sent heads at T = 1-4, n = 2048 to the multiplicity form at 2-9x the time.)

``method="auto"`` (:func:`auto_method`) takes the multiplicity form, for all heads of a call, when the sum of its
per-head estimates is at most :data:`AUTO_MARGIN` times the per-sample path's, and never for one sample. The same
rule routes CUDA calls (the Triton kernels or torch's CUDA flash op), where it is unfitted: no GPU has timed either
side (``benchmarks/gpu_check.py`` does).

The up-front size check of ``plsh_attention`` (``ops.attention.check_call_size``) uses :func:`call_estimate` and
:func:`exact_seconds`; they add :data:`PLAN_COST` and :data:`PLAN_BYTES` (the per-sample plan, measured at
n = 256 and 4096 on the same machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from positional_lsh.ops._engine.kinds import Method
from positional_lsh.ops._engine.per_sample import SamplesPlan

__all__ = [
    "AUTO_MARGIN", "AUTO_PLAN_SECONDS", "BLOCK_COST", "BOUND_COST", "CALL_COST", "CALL_ROW_COST", "ENTRY_COST",
    "MOVE_EVENT_NS", "PAIR_COST", "PAIR_COST_TILE", "PLAN_BYTES", "PLAN_COST", "ROW_START_NS", "ROW_SUM_ENTRY_NS",
    "ROW_SUM_NS", "SAMPLES_CALL_COST", "TILE_COST", "TILE_HEIGHTS", "AutoEstimate", "auto_method", "call_estimate",
    "exact_seconds", "kernel_auto_method", "samples_estimate", "samples_floor", "tiling_estimate",
]  # fmt: skip

TILE_HEIGHTS = (16, 32, 64, 128, 256)
"""Candidate query-tile heights of the multiplicity form; its plan takes the cheapest per head
(:func:`tiling_estimate`)."""

PAIR_COST = 4.7
"""Multiplicity form: one masked-tile score entry (the flash kernel, about 3.5-4 ns, and its mask, about 1 ns) ..."""
PAIR_COST_TILE = 50.0
"""... plus this / tile per entry: per (tile, key), the gathered key and value rows and the kernel's per-key work."""
TILE_COST = 6500.0
"""Multiplicity form: per tile (its rows' gathers and writes, the kernel's per-query-block setup)."""
CALL_COST = 40000.0
"""Multiplicity form: per kernel call (a dozen torch ops of mask and index work; the indices are planned once)."""
BOUND_COST = 5.5
"""Multiplicity form: per (query row, sample): block bounds and the start events of the kernel calls (2.5 ns) and
planning them (3 ns at T = 256); an upper bound where draws repeat (counted once) and for causal calls of integer
pitches (which take the blocks' moves instead)."""
ENTRY_COST = 0.82
"""Per-sample path: one score entry of a block ..."""
BLOCK_COST = 420.0
"""... per block."""
CALL_ROW_COST = 64.0
"""... per (kernel call, query row): the planning and merging that grow with calls and Lq ..."""
SAMPLES_CALL_COST = 35000.0
"""... and per kernel call (its index and merge ops: 22-53 us measured at n = 64-1024, where it dominates)."""
PLAN_COST = 28000.0
"""Planning the per-sample path, per (sample, head): its segment lists, 28-42 us (:func:`call_estimate` only)."""
PLAN_BYTES = 500.0
"""... and about this many bytes each (:func:`call_estimate` only)."""
# A causal call's counts come from its block moves (``ops._engine.multiplicity.mask.move_events``) where that is
# estimated cheaper than the T start events of every row: ns per (row, sample) start (its bounds and scatter), per
# move event, per row of the running sum down the rows (one torch op) and per entry it adds (measured on one core at
# n = 32768).
ROW_START_NS = 8.0
MOVE_EVENT_NS = 10.0
ROW_SUM_NS = 3000.0
ROW_SUM_ENTRY_NS = 0.35
AUTO_MARGIN = 0.6
"""``method="auto"`` takes the multiplicity form when its summed estimate is at most this times the per-sample one.

Measured on the 2-core CPU, one thread, after the multiplicity form's mask got 3-5x cheaper (int32 counts, a table
lookup for ``log c``, repeated draws counted once): over n = 40 ... 16384 and T = 2 ... 16 the calls where the
multiplicity form is faster have estimate ratios of 0.06-0.57, those where the per-sample path is faster (T = 2 at
n >= 512) 0.68-0.97; 0.6 separates them (the multiplicity estimate is low by up to 1.7x at T = 2). The figures are in
docs/benchmarks.md, "Choosing the method"."""


def tiling_estimate(
    pairs: np.ndarray, tile: int, num_tiles: int, q_len: int, num_samples: int, calls: np.ndarray | float = 1.0
) -> np.ndarray:
    """The multiplicity form's estimate of one tiling of each head: ``pairs`` (float64, per head) score entries of
    ``num_tiles`` tiles of ``tile`` rows, over ``q_len`` rows and ``num_samples`` samples, in ``calls`` kernel calls
    (per head: its distinct window lengths)."""
    fixed = TILE_COST * num_tiles + BOUND_COST * q_len * num_samples + CALL_COST * calls
    return pairs * (PAIR_COST + PAIR_COST_TILE / tile) + fixed


def samples_estimate(plan: SamplesPlan) -> float:
    """The per-sample path's estimate of ``plan``, summed over its heads."""
    total = 0.0
    for work in plan.heads:
        blocks = sum(s.count for segments, _ in work.samples for s in segments)
        per_call = CALL_ROW_COST * plan.q_len + SAMPLES_CALL_COST
        total += ENTRY_COST * work.cost + BLOCK_COST * blocks + per_call * work.calls
    return total


def samples_floor(pitch: torch.Tensor, shift: torch.Tensor, q_len: int) -> float:
    """A lower bound on :func:`samples_estimate` of the per-sample plan of partitions ``pitch``, ``shift`` (float64
    ``(T, H)`` on the CPU) over ``q_len`` query rows, without building it. Each distinct partition of a head (pitches
    ``<= 1`` all one, as the plan counts them) is at least one kernel call, and its blocks, none longer than
    ``ceil(pitch)``, cover the ``q_len`` rows (at least one score entry each): at least ``ceil(q_len /
    ceil(pitch))`` blocks. ``method="auto"`` takes the multiplicity form without planning the per-sample path where
    even this bound loses (:func:`auto_method`'s rule then holds for the plan's estimate too: the same choice)."""
    single = pitch.numpy() <= 1.0
    p, s = np.where(single, 1.0, pitch.numpy()), np.where(single, 0.0, shift.numpy())
    order = np.lexsort((s, p), axis=0)  # each head's (column's) partitions in order: a new one where a value changes
    ps, ss = np.take_along_axis(p, order, 0), np.take_along_axis(s, order, 0)
    new = np.ones(p.shape, dtype=bool)
    new[1:] = (ps[1:] != ps[:-1]) | (ss[1:] != ss[:-1])
    longest = np.minimum(np.ceil(ps[new]), float(q_len))  # inf: one block
    blocks = float(np.ceil(q_len / longest).sum())
    per_call = ENTRY_COST * q_len + CALL_ROW_COST * q_len + SAMPLES_CALL_COST
    return int(new.sum()) * per_call + BLOCK_COST * blocks


def auto_method(num_samples: int, multiplicity_ns: float, samples_ns: float) -> Method:
    """``method="auto"``'s choice for one call: ``"multiplicity"`` when its estimate (summed over the heads) is at
    most :data:`AUTO_MARGIN` times the per-sample path's, ``"samples"`` otherwise and for one sample (the
    multiplicity form would compute the same pairs plus a mask)."""
    if num_samples > 1 and multiplicity_ns <= AUTO_MARGIN * samples_ns:
        return Method.MULTIPLICITY
    return Method.SAMPLES


def kernel_auto_method(num_samples: int) -> Method:
    """``method="auto"``'s choice where the multiplicity form runs on the CPU kernel (``ops._engine.cpu``): the
    multiplicity form for two samples or more. The kernel computes each kept (query, key) pair once with its bias
    inside the loop, and the pairs a tile keeps are the union of the samples' blocks, never more than the per-sample
    path's sum over samples; its cost per pair is that of a fused kernel (no mask tensor, no gathers). One sample:
    the per-sample path (the same pairs, without a bias)."""
    return Method.MULTIPLICITY if num_samples > 1 else Method.SAMPLES


AUTO_PLAN_SECONDS = 60.0
"""``method="auto"`` does not build the per-sample plan when planning alone is estimated above this many seconds
and the multiplicity form's up-front estimate is lower (:attr:`AutoEstimate.up_front`)."""


@dataclass(frozen=True)
class AutoEstimate:
    """The cost model's up-front estimate of one call, before anything is drawn (:meth:`of`), computed once per
    call: the size check (:func:`call_estimate`) and ``method="auto"``'s choice (:attr:`up_front`) read it.

    Attributes:
        samples_bytes, samples_s: lower bounds on the per-sample path's host memory and time (planning each
            (sample, head), ``PLAN_COST`` and ``PLAN_BYTES``, and at least one kernel call per (sample, head),
            ``CALL_ROW_COST`` per query row);
        kernel_s: that kernel term alone;
        multiplicity_bytes, multiplicity_s: the multiplicity form's (the block bounds of every (query row, sample,
            head), ``BOUND_COST``; in memory, the tile plan's pitches and shifts, 16 bytes per (tile of the largest
            height, sample, head), and one chunk's bounds, ``8 * 4`` bytes per (row of the smallest tile, sample));
        up_front: ``method="auto"``'s choice before any plan is built: the multiplicity form when more than one
            sample's per-sample plan alone would take over :data:`AUTO_PLAN_SECONDS` and the multiplicity form's
            estimate is below the per-sample path's (e.g. ``T = 3,000,000`` at ``n = 16``, which would spend minutes
            planning a path the rule then rejects); ``False``: the cost model decides from the plans
            (:func:`auto_method`).
    """

    num_samples: int
    samples_bytes: float
    samples_s: float
    kernel_s: float
    multiplicity_bytes: float
    multiplicity_s: float
    up_front: bool

    @classmethod
    def of(cls, num_samples: int, num_heads: int, q_len: int) -> AutoEstimate:
        """The estimate of a call of ``num_samples`` samples, ``num_heads`` query heads and ``q_len`` query rows."""
        th = float(num_samples) * num_heads
        plan_s = th * PLAN_COST * 1e-9
        kernel_s = th * CALL_ROW_COST * q_len * 1e-9
        mult_s = th * q_len * BOUND_COST * 1e-9
        mult_b = 16.0 * th * math.ceil(q_len / TILE_HEIGHTS[-1]) + 32.0 * TILE_HEIGHTS[0] * num_samples
        up_front = num_samples > 1 and plan_s > AUTO_PLAN_SECONDS and mult_s < plan_s + kernel_s
        return cls(num_samples, th * PLAN_BYTES, plan_s + kernel_s, kernel_s, mult_b, mult_s, up_front)


def call_estimate(estimate: AutoEstimate, method: Method) -> tuple[float, float]:
    """Lower bounds on the host memory (bytes) and time (seconds) of one estimator call of ``method``, from its
    :class:`AutoEstimate` (the cost model, measured on a 2-core CPU; unmeasured elsewhere: only the terms that grow
    with ``T``, so a refusal on these numbers is never a close call). ``"auto"``: the multiplicity form's where
    ``estimate.up_front`` takes it without planning the per-sample path; otherwise the per-sample plan (then always
    built) and the cheaper of the two kernels' terms. One sample: always the per-sample path's."""
    e = estimate
    if method is Method.SAMPLES or e.num_samples == 1:
        return e.samples_bytes, e.samples_s
    if method is Method.MULTIPLICITY or e.up_front:
        return e.multiplicity_bytes, e.multiplicity_s
    plan_s = e.samples_s - e.kernel_s
    return e.samples_bytes, plan_s + min(e.kernel_s, e.multiplicity_s)


def exact_seconds(num_heads: int, q_len: int, k_len: int, head_dim: int, causal: bool) -> float:
    """The cost model's time for exact attention over the same call (every query-key pair once, ``ENTRY_COST`` per
    score entry at ``d = 64``, scaled by ``head_dim / 64``): the yardstick of the up-front size check."""
    pairs = float(q_len) * k_len
    if causal:
        pairs -= q_len * (q_len - 1) / 2.0
    return num_heads * pairs * ENTRY_COST * max(1.0, head_dim / 64.0) * 1e-9
