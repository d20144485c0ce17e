"""Positional LSH beyond ALiBi: any convex, decreasing positional decay ``k(|i - j|)``.

ALiBi re-weights attention by ``A[i, j] = exp(-m |i - j|)``. The same construction estimates any
multiplicative positional decay ``K[i, j] = k(|i - j|)`` (additive bias ``log k(|i - j|)``) with
``k(0) = 1``, ``k`` non-increasing and discretely convex (``k(d-1) - 2 k(d) + k(d+1) >= 0``), ``k >= 0``
(docs/theory.md §10):

* given an integer pitch ``B = b`` and a shift uniform on ``{0..b-1}``, two positions at distance ``d`` share
  a block with probability ``(1 - d/b)_+``;
* the triangle ``(1 - d/b)_+`` has second difference ``1/b`` at ``d = b`` and 0 elsewhere, so the pitch law
  ``P(B = b) = b (k(b-1) - 2 k(b) + k(b+1))`` reproduces ``k`` exactly. For ``k(d) = e^{-m d}`` this is
  ``b x^{b-1} (1 - x)^2`` with ``x = e^{-m}``: the ``"discrete"`` scheme.

**Truncation at ``n`` (exact).** Only distances ``0..n-1`` occur in a length-``n`` sequence. The law that is
drawn is ``P(B = b) = b (k(b-1) - 2k(b) + k(b+1))`` for ``1 <= b <= n-2``, ``P(B = n-1) = (n-1)(k(n-2) -
k(n-1))``, and, with the remaining probability ``k(n-1)``, one block holding the whole sequence (pitch
``inf``). This reproduces ``k(d)`` exactly for every ``d <= n - 1`` (not approximately: all pitches ``>= n-1``
act on ``[0, n)`` like a linear function of ``d``, matched by the atom at ``n - 1`` plus the whole block).
Such partitions are exact for lengths up to the one they were drawn for, and **not** beyond (far pairs
would see ``k(n-1)`` instead of ``k(d)``): :meth:`~positional_lsh.Partitions.with_seq_len` refuses to
extend them.

**Per-head parameters.** A :class:`Decay` is one head's decay; ``sample_partitions(n, None, T, decay=...)``
takes one :class:`Decay` for every head (with ``num_heads``) or a sequence of them, one per head — so each
head has its own family and parameters (e.g. ``[power_decay(r1, r2) for r1, r2 in params]``). A plain
callable on int64 distances or a tabulated array ``k(0..L-1)`` is accepted too (:func:`as_decay`).

**Trainable parameters.** The built-in families are also registered as :class:`DecayFamily` objects
(:data:`DECAY_FAMILIES`, :func:`decay_family`): ``log k_theta(d)`` as a differentiable function of the
parameters ``theta`` (exponential: ``slope``, ``log k = -slope d``; power: ``r1, r2``, ``log k = -r1 log(1 + r2 d)``;
truncated-linear: ``width``, ``log k = log(1 - d/width)_+``, ``-inf`` from ``d >= width`` on), its closed-form
derivatives ``d log k / d theta_p``, and the parameter checks.
:func:`~positional_lsh.ops.partitions.decays.decay_bias` of a family's name is the dense bias, differentiable in
``params``;
the exact ``O(n)``-memory op with ``params.grad`` is :func:`positional_lsh.ops.exact.alibi.decay_attention`.

**Cost.** The mean block length is the mean pitch ``sum_b b P(B = b)`` (:func:`mean_pitch`); the work of one
sample is ``sum_blocks len^2`` (about ``n E[B^2]/E[B]``). Heavy-tailed decays have long blocks: for the power
decay ``(1 + r2 d)^{-r1}`` with ``r1 <= 1``, ``E[B]`` grows like ``n^{1 - r1}`` with the length.

This module holds the decays, their families and pitch law, and the draw of decay pitches; the dense exact
references (:func:`decay_attention_reference`, :func:`decay_bias`) are
:mod:`positional_lsh.ops.partitions.decays`, which is also where the public names are imported from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from positional_lsh.ops.checks import GeneratorLike, as_generator, check_choice, positive_int

# Rounding allowance for the monotonicity and convexity checks (values are probabilities in [0, 1]).
_TOL = 1e-12


@dataclass(frozen=True, eq=False)
class Decay:
    """One head's positional decay ``k(d)`` on integer distances ``d >= 0``.

    Attributes:
        name: family name (``"exponential"``, ``"power"``, ``"truncated-linear"``, ``"tabulated"``,
            ``"callable"``).
        params: the family's parameters, e.g. ``(("r1", 0.5), ("r2", 1.0))``.
        fn: ``fn(d)`` for an int64 tensor of distances returns float64 values ``k(d)``; or ``None``.
        table: ``(L,)`` float64 tensor ``k(0..L-1)`` (usable for ``n <= L``); or ``None``.
    """

    name: str
    params: tuple[tuple[str, float], ...] = ()
    fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    table: torch.Tensor | None = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v:g}" for k, v in self.params)
        return f"Decay({self.name}{', ' if args else ''}{args})"

    def values(self, n: int) -> torch.Tensor:
        """``k(0), ..., k(n-1)``: ``(n,)`` float64 CPU (not yet checked; see :meth:`checked_values`)."""
        n = positive_int("n", n)
        if self.table is not None:
            if self.table.numel() < n:
                raise ValueError(f"the tabulated decay has {self.table.numel()} values; {n} distances needed")
            return self.table[:n].to(torch.float64)
        assert self.fn is not None
        out = self.fn(torch.arange(n, dtype=torch.long))
        try:
            out = torch.as_tensor(out, dtype=torch.float64).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"the decay callable must return numbers k(d) (a tensor or a sequence of floats) for an int64 tensor "
                f"of distances, got {type(out).__name__} {str(out)[:40]!r}"
            ) from None
        if out.numel() != n:
            raise ValueError(f"the decay callable returned {out.numel()} values for {n} distances")
        return out

    def checked_values(self, n: int) -> torch.Tensor:
        """:meth:`values`, refused (``ValueError`` naming the first offending distance) unless ``k(0) = 1``,
        ``k >= 0``, finite, non-increasing and discretely convex on ``0..n-1``."""
        return _check(self.values(n), repr(self))


DecayLike = Decay | Callable[[torch.Tensor], torch.Tensor] | Sequence[float] | torch.Tensor


def _check(k: torch.Tensor, what: str) -> torch.Tensor:
    n = k.numel()
    if not bool(torch.isfinite(k).all()):
        d = int(torch.nonzero(~torch.isfinite(k))[0])
        raise ValueError(f"{what} is not finite at distance {d}: k({d}) = {float(k[d])}")
    if abs(float(k[0]) - 1.0) > _TOL:
        raise ValueError(f"{what} must have k(0) = 1 (distance 0), got k(0) = {float(k[0])!r}")
    first: list[tuple[int, int, str]] = []  # (distance, rank, message): ties name the simplest failure
    neg = torch.nonzero(k < -_TOL).flatten()
    if neg.numel():
        d = int(neg[0])
        first.append((d, 0, f"is negative at distance {d}: k({d}) = {float(k[d]):.6g}"))
    if n >= 2:
        inc = torch.nonzero(k[1:] - k[:-1] > _TOL).flatten()
        if inc.numel():
            d = int(inc[0]) + 1
            first.append((d, 1, f"is not decreasing at distance {d}: k({d}) = {float(k[d]):.6g} > "
                             f"k({d - 1}) = {float(k[d - 1]):.6g}"))
    if n >= 3:
        second = k[:-2] - 2.0 * k[1:-1] + k[2:]
        bad = torch.nonzero(second < -_TOL).flatten()
        if bad.numel():
            d = int(bad[0]) + 1
            first.append((d, 2, f"is not convex at distance {d}: k({d - 1}) - 2 k({d}) + k({d + 1}) = "
                             f"{float(second[d - 1]):.3g} < 0"))
    if first:
        d, _, msg = min(first)
        raise ValueError(f"{what} {msg}; positional LSH needs k(0) = 1, k >= 0, non-increasing and convex")
    return k.clamp(0.0, 1.0)


def as_decay(decay: DecayLike) -> Decay:
    """A :class:`Decay` from a :class:`Decay`, a callable on int64 distances, or a tabulated ``k(0..L-1)``."""
    if isinstance(decay, Decay):
        return decay
    if callable(decay):
        return Decay("callable", (), fn=decay)
    if isinstance(decay, (str, bytes)):
        raise TypeError(f"decay must be a Decay, a callable or a sequence of values, got {decay!r}")
    return tabulated_decay(decay)


def exponential_decay(slope: float) -> Decay:
    """ALiBi's ``k(d) = exp(-slope d)`` (``slope >= 0``); its pitch law is the ``"discrete"`` scheme's."""
    (m,) = DECAY_FAMILIES["exponential"].check_values(slope)
    return Decay("exponential", (("slope", m),), fn=lambda d: torch.exp(-m * d.to(torch.float64)))


def power_decay(r1: float, r2: float) -> Decay:
    """KERPLE's power/log decay: bias ``-r1 log(1 + r2 d)``, ``k(d) = (1 + r2 d)^{-r1}`` (``r1, r2 > 0``).

    Heavy-tailed: ``P(B = b) ~ b^{-r1-1}``, so the mean pitch grows like ``n^{1 - r1}`` when ``r1 < 1``.
    """
    a, c = DECAY_FAMILIES["power"].check_values(r1, r2)
    return Decay("power", (("r1", a), ("r2", c)), fn=lambda d: torch.pow(1.0 + c * d.to(torch.float64), -a))


def truncated_linear_decay(width: float) -> Decay:
    """``k(d) = (1 - d/width)_+`` (``width >= 1``): for an integer width, every pitch equals ``width``."""
    (w,) = DECAY_FAMILIES["truncated-linear"].check_values(width)
    return Decay("truncated-linear", (("width", w),), fn=lambda d: (1.0 - d.to(torch.float64) / w).clamp_min(0.0))


@dataclass(frozen=True, eq=False)
class DecayFamily:
    """A built-in decay family with trainable parameters ``theta = (theta_0, ..., theta_{P-1})``.

    ``log k_theta(d)`` is written with torch ops, so it is differentiable in ``theta``; :meth:`grad_log_k` gives
    its derivatives in closed form (the weights of the exact op's parameter gradient, ``dL/dtheta_p = sum_ij dS_ij
    d log k_theta(|i - j|) / d theta_p``). Registered in :data:`DECAY_FAMILIES`; look one up with
    :func:`decay_family`.

    Attributes:
        name: the family (``"exponential"``, ``"power"``, ``"truncated-linear"``).
        param_names: the parameters in order (``("slope",)``, ``("r1", "r2")``, ``("width",)``).
        lower: per parameter ``(bound, inclusive)``: admissible values are finite and ``>= bound`` (inclusive)
            or ``> bound``; inside these bounds ``k`` is a valid positional-LSH decay (``k(0) = 1``, non-increasing,
            convex).
        log_k_fn: ``(d, theta) -> log k``; ``theta[..., p]`` broadcasts against the float distances ``d``.
        grad_fn: ``(d, theta) -> (P, *shape)``: ``d log k / d theta_p`` (0 where ``k = 0``).
        reach_fn: ``theta (P,) float64 -> the largest distance with k > 0`` (``inf`` for full support).
        make: ``(*values) -> Decay``: the :class:`Decay` of one head's parameters (to sample partitions from).
    """

    name: str
    param_names: tuple[str, ...]
    lower: tuple[tuple[float, bool], ...]
    log_k_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    reach_fn: Callable[[torch.Tensor], float]
    make: Callable[..., Decay]

    def __repr__(self) -> str:
        return f"DecayFamily({self.name}: {', '.join(self.param_names)})"

    @property
    def num_params(self) -> int:
        """``P``, the number of parameters."""
        return len(self.param_names)

    def log_k(self, d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """``log k_theta(d)`` for float distances ``d >= 0`` and ``theta (..., P)`` (``theta[..., p]`` broadcast
        against ``d``); ``-inf`` where ``k = 0``. Differentiable in ``theta`` (and finite gradients where finite)."""
        return self.log_k_fn(d, theta)

    def grad_log_k(self, d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """``(P, *broadcast shape)``: ``d log k_theta(d) / d theta_p`` in closed form (0 where ``k = 0``: the
        support's edge is a hard mask, with no gradient through it)."""
        return self.grad_fn(d, theta)

    def reach(self, theta: torch.Tensor) -> float:
        """The largest integer distance with ``k_theta(d) > 0`` for one head's ``theta (P,)`` (``inf``: none)."""
        return self.reach_fn(theta.detach().to("cpu", torch.float64).reshape(-1))

    def _bad(self, p: int, value: float) -> str | None:
        bound, inclusive = self.lower[p]
        ok = math.isfinite(value) and (value >= bound if inclusive else value > bound)
        return None if ok else f"finite and {'>=' if inclusive else '>'} {bound:g}"

    def check_values(self, *values: float) -> tuple[float, ...]:
        """One head's parameters as floats; ``ValueError`` naming the first parameter out of its bounds."""
        if len(values) != self.num_params:
            raise ValueError(f"the {self.name} decay has {self.num_params} parameters {self.param_names}, got "
                             f"{len(values)}")  # fmt: skip
        out = []
        for p, (name, value) in enumerate(zip(self.param_names, values, strict=True)):
            try:
                x = float(value)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None
            need = self._bad(p, x)
            if need is not None:
                raise ValueError(f"{name} must be {need} ({self.name} decay), got {value!r}")
            out.append(x)
        return tuple(out)

    def check_params(
        self, params: torch.Tensor | Sequence[float], num_heads: int, name: str = "params"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(params (H, P), values (H, P) float64 CPU)`` from ``params`` of shape ``(H, P)`` or ``(P,)`` (one set
        for every head).

        A tensor stays connected to autograd (a ``(P,)`` one is expanded, so its gradient is the sum over heads);
        ``values`` are its detached float64 copy. ``ValueError`` naming ``name`` for a wrong shape and naming the
        parameter (e.g. ``params[:, 1] (r2)``) for a value out of its bounds; ``TypeError`` for a non-real input.
        """
        t = self.check_param_shape(params, num_heads, name)
        if t.device.type == "meta":
            raise ValueError(
                f"{name} is a meta tensor, which holds no values; meta {name} are taken with meta q, k and v only "
                "(shape propagation)"
            )
        values = t.detach().to("cpu", torch.float64).clone()
        for col, pname in enumerate(self.param_names):
            bad = [x for x in values[:, col].tolist() if self._bad(col, x) is not None]
            if bad:
                need = self._bad(col, bad[0])
                raise ValueError(
                    f"{name}[:, {col}] ({pname} of the {self.name} decay) must be {need}, got "
                    f"{values[:, col].tolist()}"
                )
        return t, values

    def check_param_shape(
        self, params: torch.Tensor | Sequence[float], num_heads: int, name: str = "params"
    ) -> torch.Tensor:
        """The checks of :meth:`check_params` that read no values (type and shape; a meta tensor passes): ``params``
        as an ``(H, P)`` tensor (a ``(P,)`` one expanded), still connected to autograd."""
        h = positive_int("num_heads", num_heads)
        if isinstance(params, torch.Tensor):
            if params.is_complex() or not params.is_floating_point():
                raise TypeError(f"{name} must be a real floating-point tensor, got dtype {params.dtype}")
            t = params
        else:
            if isinstance(params, (str, bytes, bool)) or not isinstance(params, (Sequence, int, float)):
                raise TypeError(f"{name} must be a tensor or a sequence of numbers, got {type(params).__name__}")
            try:
                t = torch.as_tensor(params, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(f"{name} must contain numbers: {exc}") from None
        p = self.num_params
        if t.dim() == 1 and t.shape[0] == p:
            t = t[None].expand(h, p)
        elif not (t.dim() == 2 and tuple(t.shape) == (h, p)):
            raise ValueError(
                f"{name} of the {self.name} decay ({', '.join(self.param_names)}) must have shape ({h}, {p}) "
                f"(one row per query head) or ({p},) (every head), got {tuple(t.shape)}"
            )
        return t


def _broadcast(d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.broadcast_tensors(d, x)[0]


def _exp_log_k(d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    return -theta[..., 0] * d


def _exp_grad(d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    return (-_broadcast(d, theta[..., 0]))[None]


def _power_log_k(d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    return -theta[..., 0] * torch.log1p(theta[..., 1] * d)


def _power_grad(d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    r1, r2 = theta[..., 0], theta[..., 1]
    return torch.stack([_broadcast(-torch.log1p(r2 * d), r1), -r1 * d / (1.0 + r2 * d)])


def _linear_log_k(d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    w = theta[..., 0]
    inside = d < w
    safe = torch.where(inside, d, 0.0)  # no log(0) or division by w - d = 0 on the masked side, even in autograd
    return torch.where(inside, torch.log1p(-safe / w), -math.inf)


def _linear_grad(d: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    w = theta[..., 0]
    inside = d < w
    safe = torch.where(inside, d, 0.0)
    return torch.where(inside, safe / (w * (w - safe)), 0.0)[None]  # d/dw log(1 - d/w) = d / (w (w - d))


def _linear_reach(theta: torch.Tensor) -> float:
    return float(math.ceil(float(theta[0])) - 1)  # the largest integer d < width


DECAY_FAMILIES: dict[str, DecayFamily] = {
    f.name: f
    for f in (
        DecayFamily("exponential", ("slope",), ((0.0, True),), _exp_log_k, _exp_grad, lambda _: math.inf,
                    exponential_decay),
        DecayFamily("power", ("r1", "r2"), ((0.0, False), (0.0, False)), _power_log_k, _power_grad,
                    lambda _: math.inf, power_decay),
        DecayFamily("truncated-linear", ("width",), ((1.0, True),), _linear_log_k, _linear_grad, _linear_reach,
                    truncated_linear_decay),
    )
}  # fmt: skip
"""The built-in decay families with trainable parameters, by name (one registry: :func:`decay_family`)."""


def decay_family(family: object) -> DecayFamily:
    """The :class:`DecayFamily` named ``family`` (a :data:`DECAY_FAMILIES` key); ``ValueError`` naming ``family``."""
    if isinstance(family, DecayFamily):
        return family
    if not isinstance(family, str):
        raise ValueError(f"family must be one of {tuple(DECAY_FAMILIES)}, got {family!r}")
    check_choice("family", family, tuple(DECAY_FAMILIES))
    return DECAY_FAMILIES[family]


def tabulated_decay(values: Sequence[float] | torch.Tensor) -> Decay:
    """A decay given by its values ``k(0), ..., k(L-1)`` (usable for sequences of length ``<= L``)."""
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone()
    if t.numel() == 0:
        raise ValueError("a tabulated decay needs at least k(0)")
    return Decay("tabulated", (("length", float(t.numel())),), table=t)


def pitch_law(decay: DecayLike, n: int) -> tuple[torch.Tensor, float]:
    """The exact pitch law for ``n`` positions: ``(probs, whole)``.

    ``probs`` is ``(n-1,)`` float64 with ``probs[b-1] = P(B = b)`` for ``b = 1..n-1`` and ``whole`` the
    probability of one block holding the whole sequence (module docstring). ``ValueError`` naming the first
    offending distance if the decay is not admissible on ``0..n-1``.
    """
    n = positive_int("n", n)
    k = as_decay(decay).checked_values(n)
    if n == 1:
        return torch.zeros(0, dtype=torch.float64), 1.0
    b = torch.arange(1, n - 1, dtype=torch.float64)
    inner = (b * (k[:-2] - 2.0 * k[1:-1] + k[2:])).clamp_min(0.0)  # b = 1..n-2
    last = torch.tensor([(n - 1) * max(float(k[n - 2] - k[n - 1]), 0.0)], dtype=torch.float64)
    probs = torch.cat([inner, last])
    whole = max(0.0, 1.0 - float(probs.sum()))
    return probs, whole


def mean_pitch(decay: DecayLike, n: int) -> float:
    """``E[min(B, n)]``: the mean block length (pitch) at length ``n``, the whole-sequence block counting ``n``."""
    probs, whole = pitch_law(decay, n)
    return float((torch.arange(1, n, dtype=torch.float64) * probs).sum()) + whole * n


def decay_list(decays: DecayLike | Sequence[DecayLike], num_heads: int | None) -> list[Decay]:
    """One :class:`Decay` per head from ``decays`` (one for every head, ``num_heads`` times, or one per head);
    ``TypeError``/``ValueError`` naming ``decay`` or ``num_heads`` otherwise."""
    if isinstance(decays, (str, bytes)):
        raise TypeError(
            f"decay must be a Decay (e.g. exponential_decay(0.1)), a callable k(distance), tabulated values, or one of "
            f"those per head, got the string {decays!r}"
        )
    if not isinstance(decays, Sequence) and not (isinstance(decays, Decay) or callable(decays)
                                                 or isinstance(decays, torch.Tensor)):  # fmt: skip
        raise TypeError(f"decay must be a Decay, a callable, tabulated values or a sequence of them, got "
                        f"{type(decays).__name__}")  # fmt: skip
    if isinstance(decays, Decay) or callable(decays) or isinstance(decays, torch.Tensor):
        one = as_decay(decays)
        return [one] * (1 if num_heads is None else positive_int("num_heads", num_heads))
    items = list(decays)
    if items and all(isinstance(x, (int, float)) for x in items):  # one tabulated decay for every head
        one = tabulated_decay(cast("list[float]", items))
        return [one] * (1 if num_heads is None else positive_int("num_heads", num_heads))
    # A number among per-head decays reaches tabulated_decay as a one-entry table, as before typing.
    out = [as_decay(cast(DecayLike, x)) for x in items]
    if not out:
        raise ValueError("decay must name at least one head's decay")
    if num_heads is not None and positive_int("num_heads", num_heads) != len(out):
        raise ValueError(f"num_heads={num_heads} but decay has {len(out)} entries")
    return out


def sample_decay_pitches(
    decays: DecayLike | Sequence[DecayLike],
    seq_len: int,
    num_samples: int,
    generator: GeneratorLike = None,
    *,
    num_heads: int | None = None,
) -> tuple[list[Decay], torch.Tensor, torch.Tensor]:
    """Draw ``(pitch, shift)`` for each head's decay: ``(decays, pitch (T, H), shift (T, H))`` float64 CPU.

    Integer pitches from :func:`pitch_law` by inverse CDF (``inf`` for the whole-sequence block), integer
    shifts uniform on ``{0..pitch-1}`` (0 for ``inf``). Uniforms are drawn sample-major, two per (sample,
    head), so the first ``T`` samples of a larger draw equal a ``T``-sample draw from the same seed.
    """
    n = positive_int("seq_len", seq_len)
    t = positive_int("num_samples", num_samples)
    heads = decay_list(decays, num_heads)
    gen = as_generator(generator)
    u = torch.rand((t, len(heads), 2), generator=gen, dtype=torch.float64)
    pitch = torch.empty(t, len(heads), dtype=torch.float64)
    for h, dec in enumerate(heads):
        probs, _ = pitch_law(dec, n)
        cdf = torch.cumsum(probs, 0)
        idx = torch.searchsorted(cdf, u[:, h, 0].contiguous(), right=True)  # number of pitches whose cdf <= u
        pitch[:, h] = torch.where(idx < probs.numel(), (idx + 1).to(torch.float64), math.inf)
    finite = torch.isfinite(pitch)
    safe = torch.where(finite, pitch, torch.ones_like(pitch))
    shift = torch.where(finite, torch.floor(u[..., 1] * safe).clamp_max(safe - 1.0), torch.zeros_like(pitch))
    return heads, pitch, shift
