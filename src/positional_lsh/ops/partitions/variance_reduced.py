"""Variance-reduced positional LSH: coupled samplers whose masks are each marginally exact.

The T masks of one head are *coupled* so that their errors cancel, while every mask stays marginally
an exact sample of its base scheme (so ``E[M_t] = A`` for every index t and ``E[Mbar] = A``). The samplers
are registered in :mod:`positional_lsh.ops.partitions.schemes` (``coupled=True``, with their base scheme):

* ``"discrete-strat"`` / ``"gamma-strat"``: the T slots form P = ceil(T / K) groups of K consecutive
  slots (K = round(sqrt(T) / 2), at least 1; the last group may be smaller). Group p owns the
  probability stratum [start_p / T, end_p / T) of the pitch law (mass = its share of the slots) and
  draws ONE pitch from it by inverse CDF (jittered stratification); its K masks share that pitch. The
  c slots holding one pitch (for integer pitches, groups that drew equal pitches are merged first) take
  systematic shifts frac(V + j/c) * pitch, j = 0..c-1 (evenly spread over [0, pitch), V uniform). The
  slots are then randomly permuted, so each index is a uniformly random slot of the design: its pitch
  law is the mixture of the strata (= the exact law) and, given the pitch, its shift is uniform.
  Stratifying the pitch removes most of the error of the mean block size (the low-frequency part of
  Mbar - A); sharing a pitch among K evenly shifted masks makes their average close to the triangle
  ``max(0, 1 - |i-j|/pitch)`` it estimates. K ~ sqrt(T)/2 balances the two (measured, docs/theory.md).
* ``"discrete-antithetic"``: independent pitches, each used by an antithetic pair of masks whose
  shifts are half a pitch apart. An ablation: coupling shifts alone gains little; see docs/theory.md.

These draws are not prefix-consistent (the first t masks of a T-mask draw are not a t-mask draw).
Every sampler has the :data:`~positional_lsh.ops.partitions.schemes.Sampler` signature
``(slopes (H,) float64 > 0, T, generator) -> (pitch, shift)``, both ``(T, H)`` float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def stratified_group_size(t: int) -> int:
    """Masks per shared pitch (K) of the stratified schemes for ``t`` masks: ``round(sqrt(t) / 2)``, at least 1."""
    return max(1, math.floor(math.sqrt(t) / 2.0 + 0.5))


def _bisect_decreasing(
    f: Callable[[torch.Tensor], torch.Tensor], target: torch.Tensor, iters: int = 100
) -> torch.Tensor:
    """Solve ``f(k) = target`` for a decreasing ``f`` on ``[0, inf)`` with ``f(0) >= target`` (elementwise)."""
    lo = torch.zeros_like(target)
    hi = torch.ones_like(target)
    for _ in range(2100):  # doubling: f(hi) <= target within 2^2100 (far beyond float64 quantiles)
        above = f(hi) > target
        if not bool(above.any()):
            break
        hi = torch.where(above, hi * 2.0, hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        above = f(mid) > target
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return hi


def discrete_pitch_quantile(surv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Smallest integer ``B >= 1`` with ``P[pitch > B] <= surv`` for the ``discrete`` law (``surv`` in (0, 1]).

    ``P[pitch > k] = P[G1 + G2 >= k] = x^k (1 + k (1 - x))`` with ``x = e^{-m}``; with ``surv`` uniform on
    (0, 1] the result has exactly that law. ``m`` broadcasts against ``surv``.
    """
    one_minus_x = -torch.expm1(-m)

    def log_sf(k: torch.Tensor) -> torch.Tensor:
        return -m * k + torch.log1p(k * one_minus_x)

    target = torch.log(surv)
    k = torch.ceil(_bisect_decreasing(log_sf, target)).clamp_min(1.0)
    for _ in range(4):  # exact integer corrections against the closed form
        k = torch.where(log_sf(k) > target, k + 1.0, k)
        k = torch.where((k > 1.0) & (log_sf(k - 1.0) <= target), k - 1.0, k)
    return k


def _gamma_pitch_quantile(surv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``b`` with ``P[pitch > b] = surv`` for ``pitch ~ Gamma(2, 1/m)``: ``e^{-t} (1 + t) = surv``, ``b = t / m``."""

    def log_sf(t: torch.Tensor) -> torch.Tensor:
        return -t + torch.log1p(t)

    return _bisect_decreasing(log_sf, torch.log(surv)) / m


def _pitch_classes(pitch_g: torch.Tensor, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Class of every group (groups holding one pitch share a class) and each class's first group.

    Groups share a pitch by construction; with integer pitches, groups that drew equal pitches are merged
    into one class. Both outputs are ``(groups, H)`` int64.
    """
    groups, h = pitch_g.shape
    ar_g = torch.arange(groups)[:, None].expand(groups, h)
    if integer:
        order_g = torch.argsort(pitch_g, dim=0, stable=True)
        sorted_p = torch.gather(pitch_g, 0, order_g)
        new_cls = torch.ones_like(sorted_p, dtype=torch.bool)
        new_cls[1:] = sorted_p[1:] != sorted_p[:-1]
        cls = torch.empty_like(order_g).scatter_(0, order_g, torch.cumsum(new_cls.long(), 0) - 1)
    else:
        cls = ar_g.clone()
    first_group = torch.full((groups, h), groups, dtype=torch.long).scatter_reduce(0, cls, ar_g, reduce="amin")
    return cls, first_group


def _rank_in_class(slot_cls: torch.Tensor) -> torch.Tensor:
    """Rank of every slot inside its class, in slot order: ``(T, H)`` int64 from the ``(T, H)`` slot classes."""
    t = slot_cls.shape[0]
    slot = torch.arange(t)
    by_cls = torch.argsort(slot_cls * t + slot[:, None], dim=0)
    sorted_cls = torch.gather(slot_cls, 0, by_cls)
    run_start = torch.zeros_like(slot_cls)
    run_start[1:] = torch.where(sorted_cls[1:] != sorted_cls[:-1], slot[1:, None], 0)
    rank_sorted = slot[:, None] - torch.cummax(run_start, dim=0).values
    return torch.empty_like(rank_sorted).scatter_(0, by_cls, rank_sorted)


def _stratified_draw(
    m: torch.Tensor,
    t: int,
    g: torch.Generator | None,
    quantile: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    integer: bool,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stratified pitches x systematic shifts (see the module docstring); ``(T, H)`` pitch and shift."""
    h = m.numel()
    k = stratified_group_size(t) if group_size is None else group_size
    groups = -(-t // k)
    group = torch.arange(t) // k
    first = torch.arange(groups) * k
    start = first.to(torch.float64)
    size = (torch.clamp(first + k, max=t) - first).to(torch.float64)
    jitter = torch.rand((groups, h), generator=g, dtype=torch.float64)
    phase = torch.rand((groups, h), generator=g, dtype=torch.float64)
    order = torch.rand((t, h), generator=g, dtype=torch.float64)
    # Group p draws its pitch from the stratum [start_p, start_p + size_p) / T of u = 1 - survival.
    surv = 1.0 - (start[:, None] + size[:, None] * jitter) / t
    pitch_g = quantile(surv.clamp_min(torch.finfo(torch.float64).tiny), m[None, :])  # (groups, H)
    pitch = pitch_g[group]  # (T, H)
    # Systematic shifts: the c slots that share one pitch get phases frac(V + j / c), j = 0..c-1, with V
    # uniform (the phase of the first group holding that pitch).
    cls, first_group = _pitch_classes(pitch_g, integer)
    slot_cls = cls[group]  # (T, H): the class of every slot
    counts = torch.zeros((groups, h), dtype=torch.float64).scatter_add_(
        0, slot_cls, torch.ones((t, h), dtype=torch.float64)
    )
    rank = _rank_in_class(slot_cls)
    v = torch.gather(phase, 0, torch.gather(first_group, 0, slot_cls))  # (T, H): phase of the slot's class
    frac = torch.frac(v + rank.to(torch.float64) / torch.gather(counts, 0, slot_cls))
    if integer:
        shift = torch.minimum(torch.floor(frac * pitch), pitch - 1.0)
    else:
        shift = torch.minimum(frac * pitch, torch.nextafter(pitch, torch.zeros_like(pitch)))
    perm = torch.argsort(order, dim=0)  # a uniformly random permutation of the slots, per head
    return torch.gather(pitch, 0, perm).contiguous(), torch.gather(shift, 0, perm).contiguous()


def sample_discrete_strat(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``"discrete-strat"``: stratified ``discrete`` pitches, systematic integer shifts."""
    return _stratified_draw(m, t, g, discrete_pitch_quantile, True)


def sample_gamma_strat(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``"gamma-strat"``: stratified ``gamma`` pitches, systematic real shifts."""
    return _stratified_draw(m, t, g, _gamma_pitch_quantile, False)


def sample_discrete_antithetic(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``"discrete-antithetic"``: independent ``discrete`` pitches, each shared by two masks half a pitch apart."""
    h = m.numel()
    pairs = -(-t // 2)
    surv = 1.0 - torch.rand((pairs, h), generator=g, dtype=torch.float64)  # (0, 1]
    phase = torch.rand((pairs, h), generator=g, dtype=torch.float64)
    pitch_p = discrete_pitch_quantile(surv, m[None, :])
    pitch = pitch_p.repeat_interleave(2, dim=0)[:t]
    frac = torch.stack([phase, torch.frac(phase + 0.5)], dim=1).reshape(2 * pairs, h)[:t]
    shift = torch.minimum(torch.floor(frac * pitch), pitch - 1)
    return pitch.contiguous(), shift.contiguous()
