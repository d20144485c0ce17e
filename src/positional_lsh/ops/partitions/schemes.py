"""The scheme registry: how positional-LSH partitions are drawn, one entry per scheme.

A partition of positions ``0..n-1`` is described by two numbers, a *pitch* ``b > 0`` and a *shift*
``xi`` in ``[0, b)``: position ``i`` goes to block ``floor((i - xi) / b)``. Blocks are contiguous runs
of about ``b`` positions. Averaged over the law of ``(b, xi)``, the probability that positions ``i``
and ``j`` share a block is the ALiBi factor ``exp(-m |i - j|)`` for the head's slope ``m``
(see docs/design.md), so the mean of many sampled block masks estimates the ALiBi matrix ``A``.

A *scheme* is a sampler of ``T`` such ``(pitch, shift)`` pairs per head plus what it promises
(:class:`Scheme`). Built-in schemes:

* ``"discrete"`` (default): integer pitch ``B = 1 + G1 + G2`` with ``G1, G2`` geometric on
  ``{0, 1, ...}`` with success probability ``1 - e^{-m}``, integer shift uniform on ``{0..B-1}``.
  ``P[i, j same block] = e^{-m|i-j|}`` exactly. Every block but the first and last holds exactly ``B``
  positions, so a sample is a *reshape* of the sequence — this is what makes the fast path fast.
* ``"gamma"``: the paper's scheme. Real pitch ``b ~ Gamma(shape 2, scale 1/m)``, shift
  ``~ Uniform[0, b)``. Also exactly unbiased (random binning for the Laplace kernel); blocks hold
  ``floor(b)`` or ``ceil(b)`` positions.
* ``"fixed"``: the paper's ``--fixed_block_size`` ablation, pitch ``2/m`` and shift ``0``. **Biased**:
  the mean mask does not converge to ``A``. Kept only for ablations.
* ``"discrete-strat"``, ``"gamma-strat"``, ``"discrete-antithetic"``: variance-reduced (coupled) versions
  of ``"discrete"`` and ``"gamma"``, see :mod:`positional_lsh.ops.partitions.variance_reduced`.

The registry is read when it is used (:func:`scheme_names`, :func:`get_scheme`), so a scheme added with
:func:`register_scheme` is accepted everywhere a scheme name is (``sample_partitions``, ``plsh_attention``,
``PositionalLSHAttention``, ``ModelConfig``, the CLIs); :func:`unregister_scheme` removes an added one again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from positional_lsh.ops.partitions.variance_reduced import (
    sample_discrete_antithetic,
    sample_discrete_strat,
    sample_gamma_strat,
)

__all__ = ["Sampler", "Scheme", "get_scheme", "register_scheme", "scheme_names", "unregister_scheme"]

Sampler = Callable[[torch.Tensor, int, "torch.Generator | None"], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Scheme:
    """One partition-sampling scheme.

    Attributes:
        name: the name passed as ``scheme=`` everywhere.
        sampler: ``sampler(slopes, T, generator) -> (pitch, shift)``; ``slopes`` is ``(H,)`` float64 CPU, all
            ``> 0`` (heads with slope 0 are handled by the caller: one block); ``generator`` is a CPU
            ``torch.Generator`` or ``None`` (torch's global RNG). ``pitch`` and ``shift`` are ``(T, H)``
            float64 with ``0 <= shift < pitch``.
        unbiased: each sampled mask has expectation exactly the ALiBi matrix ``A``.
        integer: pitches and shifts are integers (blocks are exact reshapes of the sequence).
        coupled: the ``T`` masks of a head are not independent (variance-reduced schemes); such draws are
            not prefix-consistent.
        base: the independent scheme this one derives from (its own name for an independent scheme), e.g.
            ``"discrete"`` for ``"discrete-strat"``.
    """

    name: str
    sampler: Sampler
    unbiased: bool
    integer: bool
    coupled: bool
    base: str


_REGISTRY: dict[str, Scheme] = {}
_BUILT_IN: frozenset[str] = frozenset()  # the names registered by this module (set at its end)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def register_scheme(
    name: str,
    sampler: Sampler,
    *,
    unbiased: bool,
    integer: bool,
    coupled: bool = False,
    base: str | None = None,
    replace: bool = False,
) -> Scheme:
    """Register a partition sampler under ``name`` and return its :class:`Scheme`.

    Args:
        name: a new, non-empty scheme name.
        sampler: ``sampler(slopes (H,) float64 > 0, T, generator) -> (pitch, shift)``, both ``(T, H)`` float64
            with ``0 <= shift < pitch`` (see :class:`Scheme`).
        unbiased: each sample's mask has mean ``A`` (the ALiBi matrix ``exp(-m|i-j|)``).
        integer: pitches and shifts are integers; the fast path then uses reshapes instead of gathers.
            Declaring ``integer=True`` for non-integer draws gives wrong blocks.
        coupled: the ``T`` samples of a head are not independent.
        base: for a coupled scheme, the registered independent scheme it derives from (required); for an
            independent scheme, ``None`` or ``name``.
        replace: allow replacing an existing scheme of that name.

    Raises:
        ValueError: naming the bad argument (empty or taken name, a non-callable sampler, a non-bool flag,
            a missing or unknown base).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name in _REGISTRY and not _flag("replace", replace):
        raise ValueError(f"name {name!r} is already registered; pass replace=True to replace it")
    if not callable(sampler):
        raise ValueError(f"sampler must be callable, got {type(sampler).__name__}")
    unbiased, integer, coupled = _flag("unbiased", unbiased), _flag("integer", integer), _flag("coupled", coupled)
    if coupled:
        if base is None or base == name:
            raise ValueError("base must name the independent scheme a coupled scheme derives from")
        if base not in _REGISTRY or _REGISTRY[base].coupled:
            raise ValueError(f"base must be a registered independent scheme, got {base!r}; known: {scheme_names()}")
    elif base is not None and base != name:
        raise ValueError(f"base of an independent scheme must be None or its own name, got {base!r}")
    scheme = Scheme(name, sampler, unbiased, integer, coupled, name if base is None else base)
    _REGISTRY[name] = scheme
    return scheme


def unregister_scheme(name: str) -> None:
    """Remove the scheme ``name`` that :func:`register_scheme` added.

    Raises:
        ValueError: naming the scheme if it is not registered, is one of the built-in schemes, or is the ``base``
            of another registered scheme (unregister that one first).
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"scheme {name!r} is not registered; known: {scheme_names()}")
    if name in _BUILT_IN:
        raise ValueError(f"scheme {name!r} is built in and cannot be unregistered")
    derived = [s.name for s in _REGISTRY.values() if s.base == name and s.name != name]
    if derived:
        raise ValueError(f"scheme {name!r} is the base of {derived}; unregister those first")
    del _REGISTRY[name]


def get_scheme(name: str) -> Scheme:
    """The registered :class:`Scheme` called ``name``; ``ValueError`` listing the known names otherwise."""
    scheme = _REGISTRY.get(name) if isinstance(name, str) else None
    if scheme is None:
        raise ValueError(f"unknown scheme {name!r}; expected one of {list(_REGISTRY)}")
    return scheme


def scheme_names(
    *, unbiased: bool | None = None, integer: bool | None = None, coupled: bool | None = None
) -> tuple[str, ...]:
    """Names of the registered schemes (in registration order), optionally filtered by their properties.

    Read at call time, so it includes schemes registered after import. ``None`` means "either".
    """
    return tuple(
        s.name
        for s in _REGISTRY.values()
        if (unbiased is None or s.unbiased == unbiased)
        and (integer is None or s.integer == integer)
        and (coupled is None or s.coupled == coupled)
    )


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """Uniform draws in ``(0, 1]`` (never 0, so ``log`` is finite)."""
    return 1.0 - torch.rand(shape, generator=generator, dtype=torch.float64)


def sample_discrete(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``"discrete"``: pitch ``1 + G1 + G2`` (geometric, ``P[G >= k] = e^{-mk}``), shift uniform on ``0..B-1``."""
    u = _uniform((t, m.numel(), 3), g)
    # G = floor(log(u) / log(x)) with x = e^{-m} is geometric: P[G >= k] = x^k.
    geo = torch.floor(-torch.log(u[..., :2]) / m[:, None])
    pitch = 1.0 + geo.sum(-1)
    shift = torch.floor((1.0 - u[..., 2]) * pitch).clamp_max(pitch - 1.0)
    return pitch, shift


def sample_gamma(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``"gamma"``: pitch ``~ Gamma(2, 1/m)``, shift ``~ Uniform[0, pitch)``."""
    u = _uniform((t, m.numel(), 3), g)
    # Gamma(2, sigma) as the sum of two exponentials with mean sigma = 1/m.
    pitch = -torch.log(u[..., :2]).sum(-1) / m
    shift = (1.0 - u[..., 2]) * pitch
    return pitch, shift


def sample_fixed(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``"fixed"`` (biased ablation): pitch ``2/m``, shift 0."""
    pitch = (2.0 / m).expand(t, m.numel()).clone()
    return pitch, torch.zeros_like(pitch)


register_scheme("discrete", sample_discrete, unbiased=True, integer=True)
register_scheme("gamma", sample_gamma, unbiased=True, integer=False)
register_scheme("fixed", sample_fixed, unbiased=False, integer=False)
register_scheme("discrete-strat", sample_discrete_strat, unbiased=True, integer=True, coupled=True, base="discrete")
register_scheme("gamma-strat", sample_gamma_strat, unbiased=True, integer=False, coupled=True, base="gamma")
register_scheme(
    "discrete-antithetic", sample_discrete_antithetic, unbiased=True, integer=True, coupled=True, base="discrete"
)
_BUILT_IN = frozenset(_REGISTRY)
