"""Learning the slopes: the bias and variance of positional LSH's slope gradients against the exact one.

The loss is a fixed random linear function of the attention output, ``L = sum(out * W)`` with ``W`` standard
normal, drawn from ``seed`` (:func:`loss_weight`). The bias is ``-m_h |i - j|`` added after the score scale. Three
numbers per head ``h`` are compared (docs/theory.md, "Learning the slopes"):

* the **exact** gradient ``g = dL/dm`` of exact ALiBi (:func:`exact_slope_gradient`, through
  :func:`~positional_lsh.ops.exact.alibi.alibi_attention` with a slopes tensor that requires grad);
* the **surrogate** of positional LSH: the exact formula ``-sum_ij dS_ij |i - j|`` evaluated with the estimator's
  own ``dS`` (:func:`plsh_slope_gradients`, through :func:`~positional_lsh.plsh_attention` with
  ``slope_grad="surrogate"``). It is biased at finite ``T`` and consistent as ``T -> inf``;
* the **score-function** (REINFORCE) estimator ``(L_h - baseline) * sum_t d/dm log p(pitch_t, shift_t | m)``. It is
  **unbiased for d E[L_plsh] / dm, not for dL_exact / dm**: the estimator's expectation ``E[L_plsh]`` is not the
  exact ``L`` at finite ``T`` (the softmax of ``s + log Mbar`` is not linear in ``Mbar``), so against the exact
  gradient it carries the bias of ``E[L_plsh]`` itself. ``L_h`` is head ``h``'s part of the loss (the other heads'
  outputs do not depend on head ``h``'s partitions, so leaving them out only removes noise); the baseline is the
  mean of ``L_h`` over the other replicates (leave-one-out), which keeps the estimator unbiased. The scores
  (:func:`score`) of the two schemes with a known law (:func:`log_prob`), ``x = e^{-m}``:

  - ``"discrete"``: ``P(B = b) = b x^{b-1} (1 - x)^2`` and the shift uniform on ``0..b-1`` given ``B``, so
    ``log p(b, xi) = 2 log(1 - e^{-m}) - (b - 1) m`` and ``d/dm log p = 2 / (e^m - 1) - (b - 1)``;
  - ``"gamma"``: pitch density ``m^2 b e^{-m b}`` (shape 2, rate ``m``) and the shift uniform on ``[0, b)``, so
    ``log p(b, xi) = 2 log m - m b`` and ``d/dm log p = 2 / m - b``.

  Both scores have mean 0 under their law (tested, with the finite differences of :func:`log_prob`).
* a **finite difference** of ``E[L_plsh]`` itself, ``(L_h(m (1 + eps)) - L_h(m (1 - eps))) / (2 eps m)`` with
  *common random numbers* (the partitions at ``m (1 +- eps)`` are drawn from the same seed, i.e. the same uniforms),
  an unbiased estimate of the central difference of ``E[L_plsh]``: the score function's target. Against the exact
  gradient it shows that the score function's bias is the estimator's own.

:func:`slope_gradient_study` measures all of them at several ``T`` with ``R`` replicates (independent partitions,
seeded) in one call per ``T``: the replicates are stacked as extra heads (``q``, ``k``, ``v`` repeated ``R`` times
along the head axis, each copy with its own partitions), which computes exactly what ``R`` separate calls would.
Per estimator and ``T`` it reports (:class:`SlopeGradRow`), per head and as a norm over heads, the relative bias
``|E[g_hat] - g| / |g|`` with its standard error, the relative variance ``E|g_hat - E g_hat|^2 / |g|^2`` and the
relative RMSE ``sqrt(E|g_hat - g|^2) / |g|``.

Real inputs: :func:`shipped_qkv` captures the shipped model's ``q, k, v`` (loading the model lazily, on call);
any model's through :func:`positional_lsh.theory.capture.capture_qkv`.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.checks import SlopesLike, as_scale, as_slopes, check_bool, check_qkv, positive_int
from positional_lsh.ops.exact.alibi import alibi_attention
from positional_lsh.ops.options import check_method
from positional_lsh.ops.partitions.partition import Partitions, sample_partitions
from positional_lsh.ops.partitions.schemes import get_scheme
from positional_lsh.theory.qkv import LayerQKV

DEFAULT_SLOPE_GRAD_SAMPLES = (1, 4, 16, 64, 256)
"""The sample counts ``T`` of the study (docs/theory.md)."""

SCORE_SCHEMES = ("discrete", "gamma")
"""The schemes whose partition law has a score here (:func:`score`); the coupled schemes have none."""

ESTIMATORS = ("surrogate", "score", "fd")
"""The estimators of :func:`slope_gradient_study`: the surrogate, the score function, and the finite difference
of ``E[L_plsh]`` with common random numbers (the score function's target)."""


def subseed(seed: int, *parts: object) -> int:
    """A reproducible 62-bit seed from ``seed`` and the coordinates of a draw (blake2b of their ``repr``)."""
    h = hashlib.blake2b(repr((int(seed), *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


def _score_scheme(scheme: str) -> str:
    """``scheme`` if its law has a score here, else ``ValueError`` naming the schemes that do."""
    get_scheme(scheme)  # ValueError naming the known schemes
    if scheme not in SCORE_SCHEMES:
        raise ValueError(f"scheme must be one of {SCORE_SCHEMES} for a score (its partition law), got {scheme!r}")
    return scheme


def log_prob(scheme: str, pitch: torch.Tensor, shift: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """``log p(pitch, shift | m)`` of one sampled partition, elementwise, float64.

    ``"discrete"``: ``log[(1 - e^{-m})^2 e^{-m (b - 1)}]`` (``P(B = b) = b x^{b-1} (1 - x)^2``, ``x = e^{-m}``, times
    ``1/b`` for the shift), a probability. ``"gamma"``: ``log[m^2 e^{-m b}]`` (the Gamma(2, rate ``m``) density
    ``m^2 b e^{-mb}`` times ``1/b``), a density. ``shift`` must lie in ``[0, pitch)`` (it does not enter otherwise).

    Args:
        scheme: ``"discrete"`` or ``"gamma"`` (:data:`SCORE_SCHEMES`).
        pitch, shift: ``(T, H)`` (any matching shapes) as in :class:`~positional_lsh.Partitions`.
        slopes: ``(H,)`` slopes ``> 0``, broadcast against ``pitch``; may require grad (the result is differentiable
            in it).
    """
    scheme = _score_scheme(scheme)
    b = pitch.to(torch.float64)
    if bool(((shift < 0) | (shift >= pitch)).any()):
        raise ValueError("shift must lie in [0, pitch) (a sampled partition)")
    m = slopes.to(torch.float64) if slopes.dtype != torch.float64 else slopes
    if scheme == "discrete":
        return 2.0 * torch.log(-torch.expm1(-m)) - (b - 1.0) * m
    return 2.0 * torch.log(m) - m * b


def score(scheme: str, pitch: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """``d/dm log p(pitch, shift | m)`` of one sampled partition, elementwise, float64 (the shift does not enter).

    ``"discrete"``: ``2 / (e^m - 1) - (b - 1)``; ``"gamma"``: ``2 / m - b``. Mean 0 under the scheme's law.

    Args:
        scheme: ``"discrete"`` or ``"gamma"`` (:data:`SCORE_SCHEMES`).
        pitch: ``(T, H)`` pitches.
        slopes: ``(H,)`` slopes ``> 0`` (broadcast against ``pitch``).
    """
    scheme = _score_scheme(scheme)
    b = pitch.to(torch.float64)
    m = slopes.detach().to(torch.float64)
    if scheme == "discrete":
        return 2.0 / torch.expm1(m) - (b - 1.0)
    return 2.0 / m - b


def loss_weight(shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The fixed weights ``W`` of the linear loss ``L = sum(out * W)``: standard normal of ``shape``, drawn from a
    generator seeded with ``subseed(seed, "loss")`` (so ``W`` does not depend on the partitions' seeds)."""
    g = torch.Generator().manual_seed(subseed(seed, "loss"))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def _weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out * weight`` in float64: the terms of the linear loss ``L = sum(out * W)``."""
    return out.to(torch.float64) * weight.to(torch.float64)


def exact_slope_gradient(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: SlopesLike,
    weight: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """``dL/dm`` of exact ALiBi for ``L = sum(alibi_attention(q, k, v, m) * weight)``: ``(Hq,)`` float64.

    Through :func:`~positional_lsh.ops.exact.alibi.alibi_attention` with a slopes tensor that requires grad (``q`` ``(B,
    Hq, Lq, d)``, ``k, v`` ``(B, Hkv, Lk, d)``, ``weight`` like the output; bias ``-m_h |i - j|``).
    """
    _, hq, _, _, _, _ = check_qkv(q, k, v)
    m = as_slopes(slopes, hq).requires_grad_(True)
    out = alibi_attention(q, k, v, m, causal=causal, scale=scale)
    (grad,) = torch.autograd.grad(_weighted(out, weight).sum(), m)
    return grad.detach().to(torch.float64)


def plsh_slope_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    weight: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    method: str = "auto",
    grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positional LSH's per-head loss and surrogate slope gradient for the given partitions.

    Calls :func:`~positional_lsh.plsh_attention` with ``slopes = partitions.slopes`` as a tensor that requires grad
    and ``slope_grad="surrogate"`` (``grad=False``: without a slopes tensor, forward only), and returns
    ``(L_h, g_h)``: ``L_h = sum over batch, rows and features of out[:, h] * weight[:, h]`` (``(Hq,)`` float64;
    ``L = L_h.sum()``) and the surrogate ``dL/dm_h`` (``(Hq,)`` float64, or ``None`` when ``grad=False``).
    """
    check_qkv(q, k, v)
    check_bool("grad", grad)
    if not grad:
        with torch.no_grad():
            out = plsh_attention(q, k, v, partitions=partitions, causal=causal, scale=scale, method=method)
        return _weighted(out, weight).sum((0, 2, 3)), None
    m = partitions.slopes.clone().requires_grad_(True)
    out = plsh_attention(
        q, k, v, slopes=m, partitions=partitions, causal=causal, scale=scale, method=method, slope_grad="surrogate"
    )
    per_head = _weighted(out, weight).sum((0, 2, 3))
    (g,) = torch.autograd.grad(per_head.sum(), m)
    return per_head.detach(), g.detach().to(torch.float64)


@dataclass(frozen=True)
class SlopeGradRow:
    """One estimator at one ``T``, for one head or as a norm over heads.

    All relative numbers are divided by ``|g_h|`` (one head) or ``||g||`` (the norm over heads), ``g`` the exact
    gradient. ``mean`` and ``exact`` are the head's values (``head >= 0``) or their norms (``head = -1``).

    Attributes:
        inputs: the inputs' label (e.g. ``"gaussian"``, ``"shipped"``).
        estimator: ``"surrogate"``, ``"score"`` (score function) or ``"fd"`` (finite difference of ``E[L_plsh]``).
        scheme: the partition scheme.
        T: samples per partition draw.
        replicates: independent draws ``R``.
        head: the head, or ``-1`` for the norm over heads.
        slope: the head's slope (NaN for the norm).
        exact: ``g_h`` or ``||g||``.
        mean: the mean estimate ``E[g_hat]_h`` (over replicates) or ``||E[g_hat]||``.
        rel_bias: ``|E[g_hat] - g| / |g|`` (norm: ``||E[g_hat] - g|| / ||g||``); includes the noise of the mean,
            ``rel_bias_se``: a bias well above it is resolved.
        rel_bias_se: the standard error of the mean estimate, relative (norm: ``sqrt(sum_h var_h / R) / ||g||``).
        rel_var: ``var(g_hat) / g^2`` (norm: ``sum_h var_h / ||g||^2``), the variance of one replicate.
        rel_rmse: ``sqrt(E|g_hat - g|^2) / |g|``, over the replicates.
        rel_bias_vs_fd: score function only: ``|E[g_score] - E[g_fd]| / |g|``, the distance to its target
            ``d E[L_plsh] / dm`` (NaN otherwise, or without finite differences).
        rel_bias_vs_fd_se: its standard error (from the paired differences over the replicates).
        seed: the seed of the partitions of this ``T`` (:func:`subseed`).
        seconds: wall time of this ``T`` (all estimators together).
    """

    inputs: str
    estimator: str
    scheme: str
    T: int
    replicates: int
    head: int
    slope: float
    exact: float
    mean: float
    rel_bias: float
    rel_bias_se: float
    rel_var: float
    rel_rmse: float
    rel_bias_vs_fd: float
    rel_bias_vs_fd_se: float
    seed: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict (for a CSV)."""
        return dict(self.__dict__)


@dataclass
class SlopeGradStudy:
    """What :func:`slope_gradient_study` measured.

    Attributes:
        inputs: the inputs' label.
        scheme: the partition scheme.
        seq_len: ``Lk``.
        slopes: ``(H,)`` float64.
        exact: ``(H,)`` float64, the exact gradient ``g``.
        rows: one :class:`SlopeGradRow` per (estimator, ``T``, head and norm), in ``T`` order.
        estimates: ``{(estimator, T): (R, H) float64}``, every replicate's estimate.
        losses: ``{T: (R, H) float64}``, every replicate's per-head loss ``L_h`` of positional LSH.
        seed: the base seed.
        seconds: total wall time.
    """

    inputs: str
    scheme: str
    seq_len: int
    slopes: torch.Tensor
    exact: torch.Tensor
    rows: list[SlopeGradRow] = field(repr=False)
    estimates: dict[tuple[str, int], torch.Tensor] = field(repr=False)
    losses: dict[int, torch.Tensor] = field(repr=False)
    seed: int = 0
    seconds: float = 0.0

    def row(self, estimator: str, t: int, head: int = -1) -> SlopeGradRow:
        """The row of ``estimator`` at ``T = t`` for ``head`` (``-1``: the norm over heads)."""
        for r in self.rows:
            if (r.estimator, r.T, r.head) == (estimator, t, head):
                return r
        raise KeyError(f"no row for estimator={estimator!r}, T={t}, head={head}")


def _replicate(x: torch.Tensor, r: int) -> torch.Tensor:
    """``x`` ``(B, H, n, d)`` repeated ``r`` times along the head axis: head ``i * H + h`` is head ``h``."""
    return x.repeat(1, r, 1, 1)


def estimator_rows(
    estimates: torch.Tensor,
    exact: torch.Tensor,
    *,
    reference: torch.Tensor | None = None,
    **fields: Any,
) -> list[SlopeGradRow]:
    """The :class:`SlopeGradRow` of one estimator at one ``T``: the norm over heads (``head = -1``), then each head.

    Args:
        estimates: ``(R, H)`` replicate estimates, ``R >= 2``.
        exact: ``(H,)`` the exact gradient.
        reference: ``(R, H)`` paired estimates of the estimator's own target (the score function's finite
            differences), for ``rel_bias_vs_fd``; ``None``: NaN.
        fields: the other fields of the rows (``inputs``, ``estimator``, ``scheme``, ``T``, ``seed``, ``seconds``,
            and ``slopes``, a ``(H,)`` tensor).
    """
    est = estimates.to(torch.float64)
    r, h = est.shape
    if r < 2:
        raise ValueError(f"estimates must have at least 2 replicates (rows), got {r}")
    g = exact.to(torch.float64)
    slopes = fields.pop("slopes")
    mean, var, mse = est.mean(0), est.var(0, unbiased=True), ((est - g) ** 2).mean(0)
    nan = torch.full_like(g, math.nan)
    dev, dev_var = nan, nan
    if reference is not None:
        diff = est - reference.to(torch.float64)
        dev, dev_var = diff.mean(0), diff.var(0, unbiased=True)

    def rel(x: float, d: float) -> float:
        return x / d if d > 0 else math.nan

    def row(head: int, slope: float, ex: float, mn: float, stats: tuple[float, ...], d: float) -> SlopeGradRow:
        bias, var_sum, mse_sum, dv, dv_var = stats
        return SlopeGradRow(
            head=head, slope=slope, exact=ex, mean=mn, rel_bias=rel(bias, d),
            rel_bias_se=rel(math.sqrt(var_sum / r), d), rel_var=rel(var_sum, d * d),
            rel_rmse=rel(math.sqrt(mse_sum), d), replicates=r, rel_bias_vs_fd=rel(dv, d),
            rel_bias_vs_fd_se=rel(math.sqrt(dv_var / r), d), **fields,
        )  # fmt: skip

    norm_stats = (float((mean - g).norm()), float(var.sum()), float(mse.sum()), float(dev.norm()),
                  float(dev_var.sum()))  # fmt: skip
    rows = [row(-1, math.nan, float(g.norm()), float(mean.norm()), norm_stats, float(g.norm()))]
    for i in range(h):
        head_stats = (abs(float(mean[i] - g[i])), float(var[i]), float(mse[i]), abs(float(dev[i])), float(dev_var[i]))
        rows.append(row(i, float(slopes[i]), float(g[i]), float(mean[i]), head_stats, abs(float(g[i]))))
    return rows


def _check_samples(samples: Sequence[int]) -> tuple[int, ...]:
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence) or not samples:
        raise ValueError(f"samples must be a non-empty sequence of positive ints (the T values), got {samples!r}")
    ts = tuple(positive_int("samples", t) for t in samples)
    if len(set(ts)) != len(ts):
        raise ValueError(f"samples must be distinct T values, got {list(ts)}")
    return ts


def _check_fd_step(fd_step: float) -> float:
    if isinstance(fd_step, bool) or not isinstance(fd_step, int | float) or not 0 <= fd_step < 1:
        raise ValueError(f"fd_step must be a number in [0, 1) (the relative step of the slopes; 0: none), got "
                         f"{fd_step!r}")  # fmt: skip
    return float(fd_step)


def slope_gradient_study(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: SlopesLike = None,
    *,
    samples: Sequence[int] = DEFAULT_SLOPE_GRAD_SAMPLES,
    replicates: int = 32,
    scheme: str = "discrete",
    causal: bool = True,
    scale: float | None = None,
    seed: int = 0,
    fd_step: float = 0.25,
    method: str = "multiplicity",
    label: str = "inputs",
    progress: bool = False,
) -> SlopeGradStudy:
    """Measure the surrogate and score-function slope gradients of positional LSH against the exact gradient.

    For the loss ``L = sum(out * W)`` (``W = loss_weight(out.shape, seed)``), the exact ``g = dL/dm`` of
    :func:`~positional_lsh.ops.exact.alibi.alibi_attention`, and for each ``T`` in ``samples``: ``replicates``
    independent
    draws of ``T`` partitions per head (seed ``subseed(seed, "partitions", T)``), each giving the surrogate gradient
    (:func:`plsh_slope_gradients`), the score-function estimate (``"discrete"`` and ``"gamma"`` only, leave-one-out
    baseline over the replicates, see the module docstring) and, with ``fd_step > 0``, the finite difference of
    ``E[L_plsh]`` with common random numbers (forward only, at ``m (1 +- fd_step)``, for every scheme). Each
    ``T`` is one op call (the replicates are stacked along the head axis) plus two forward calls.

    Args:
        q: ``(B, Hq, Lq, d)``; ``k, v``: ``(B, Hkv, Lk, d)`` (as :func:`~positional_lsh.plsh_attention`). The dtype
            is the ops' dtype (float64 for reference-grade numbers; gradients are returned in float64 either way).
        slopes: ``(Hq,)`` slopes ``> 0`` (default ``alibi_slopes(Hq)``). A slope of 0 has no score and no
            partitions to learn from: refused.
        samples: the ``T`` values.
        replicates: ``R >= 2`` independent draws per ``T`` (the baseline and the variance need two).
        scheme: partition scheme (any; the score function only for :data:`SCORE_SCHEMES`).
        causal, scale, method: as :func:`~positional_lsh.plsh_attention` (every method computes the same estimator;
            the default ``"multiplicity"`` is the fastest for the stacked call at large ``T``, where ``"auto"``'s
            planning costs more than the call).
        seed: base seed of ``W`` and of every draw.
        fd_step: relative step of the finite differences (0: none).
        label: the inputs' name in the rows.
        progress: a progress bar on stderr (one step per ``T``).

    Returns:
        :class:`SlopeGradStudy`.

    Raises:
        TypeError, ValueError: naming the bad argument.
    """
    _, hq, _, _, lk, d = check_qkv(q, k, v)
    m = as_slopes(slopes, hq)
    if bool((m <= 0).any()):
        raise ValueError(f"slopes must be > 0 (a slope of 0 has no partitions to learn from), got {m.tolist()}")
    ts = _check_samples(samples)
    r = positive_int("replicates", replicates)
    if r < 2:
        raise ValueError(f"replicates must be >= 2 (the leave-one-out baseline and the variance need two), got {r}")
    get_scheme(scheme)
    check_bool("causal", causal)
    check_bool("progress", progress)
    as_scale(scale, d)
    check_method(method)
    step = _check_fd_step(fd_step)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")
    t_start = time.perf_counter()
    weight = loss_weight((q.shape[0], hq, q.shape[2], v.shape[3]), seed)
    exact = exact_slope_gradient(q, k, v, m, weight, causal=causal, scale=scale)
    qr, kr, vr, wr = (_replicate(x, r) for x in (q, k, v, weight))
    mr = m.repeat(r)
    has_score = scheme in SCORE_SCHEMES
    rows: list[SlopeGradRow] = []
    estimates: dict[tuple[str, int], torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}
    opts: dict[str, Any] = dict(causal=causal, scale=scale, method=method)
    for t in tqdm(ts, desc=f"slope gradient ({label})", unit="T", disable=not progress, file=sys.stderr):
        t0 = time.perf_counter()
        t_seed = subseed(seed, "partitions", t)
        parts = sample_partitions(lk, mr, t, scheme=scheme, generator=t_seed)
        loss, surrogate = plsh_slope_gradients(qr, kr, vr, parts, wr, **opts)
        assert surrogate is not None
        losses[t] = loss.reshape(r, hq)
        estimates[("surrogate", t)] = surrogate.reshape(r, hq)
        if has_score:
            scores = score(scheme, parts.pitch, mr).sum(0).reshape(r, hq)
            lh = losses[t]
            baseline = (lh.sum(0, keepdim=True) - lh) / (r - 1)  # leave-one-out mean of the other replicates
            estimates[("score", t)] = (lh - baseline) * scores
        if step > 0:
            up = sample_partitions(lk, mr * (1 + step), t, scheme=scheme, generator=t_seed)  # same uniforms
            down = sample_partitions(lk, mr * (1 - step), t, scheme=scheme, generator=t_seed)
            l_up, _ = plsh_slope_gradients(qr, kr, vr, up, wr, grad=False, **opts)
            l_down, _ = plsh_slope_gradients(qr, kr, vr, down, wr, grad=False, **opts)
            estimates[("fd", t)] = ((l_up - l_down) / (2 * step * mr)).reshape(r, hq)
        seconds = time.perf_counter() - t0
        common = dict(inputs=label, scheme=scheme, T=t, seed=t_seed, seconds=seconds, slopes=m)
        for name in ESTIMATORS:
            if (name, t) not in estimates:
                continue
            ref = estimates.get(("fd", t)) if name == "score" else None
            rows += estimator_rows(estimates[(name, t)], exact, reference=ref, estimator=name, **common)
    return SlopeGradStudy(label, scheme, lk, m, exact, rows, estimates, losses, seed, time.perf_counter() - t_start)


def shipped_qkv(seq_len: int = 64, *, layer: int = -1) -> tuple[LayerQKV, torch.Tensor]:
    """The shipped model's ``q, k, v`` of one layer on the first ``seq_len`` tokens of the longest test-split
    document of the shipped corpus, and its ALiBi slopes (``(H,)`` float64).

    Loads ``positional_lsh.lm`` lazily (on call), as ``plsh validate --source shipped`` does
    (:func:`positional_lsh.theory.capture.capture_qkv` on its fused ``qkv`` projection): float32 CPU tensors
    ``(1, H, seq_len, d)``.

    Raises:
        FileNotFoundError: the shipped model is missing.
    """
    from positional_lsh.lm.checkpoint import load_shipped_model
    from positional_lsh.lm.data import corpus_splits
    from positional_lsh.theory.capture import capture_qkv, model_alibi_slopes, tokenize_contexts

    n = positive_int("seq_len", seq_len)
    ckpt = load_shipped_model()
    if ckpt.tokenizer is None:
        raise FileNotFoundError("the shipped model has no tokenizer")
    doc = max(corpus_splits()["test"], key=lambda x: len(x.text))
    ids = tokenize_contexts(ckpt.tokenizer.encode, doc.text, n, 1)
    (qkv,) = capture_qkv(ckpt.model, ids, layers=[layer])
    slopes = model_alibi_slopes(ckpt.model)
    if slopes is None:  # pragma: no cover - the shipped model is an ALiBi model
        raise RuntimeError("the shipped model has no ALiBi slopes")
    return qkv, slopes
