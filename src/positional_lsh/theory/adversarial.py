"""The uniform approximation theorem, tested: a computable bound for all inputs, and adversaries against it.

Setting (docs/theory.md §11): one head, slope ``m``, sampled masks with mean ``Mbar``, ALiBi matrix ``A``.
Inputs are constrained by ``|q_i| <= R``, ``|k_j| <= R`` (so ``|s_ij| <= c := scale R^2``) and ``|v_j| <= 1``
(Euclidean norms). For a query row ``i`` with keys ``J`` (``j <= i`` when causal), put ``a_j = A_ij e^{s_ij}``,
``b_j = Mbar_ij e^{s_ij}``, ``w = a / sum a`` (exact ALiBi weights) and ``w~ = b / sum b`` (positional LSH).
Then, for **every** input in the constraint set, ::

    |out_i - out~_i| = |sum_j (w_j - w~_j) v_j| <= sum_j |w_j - w~_j| <= 2 sum_j |a_j - b_j| / sum_j a_j
                     <= 2 sup_{u in [e^-c, e^c]^J} sum_j u_j |Mbar_ij - A_ij| / sum_j u_j A_ij      (tight form)
                     <= 2 e^{2c} sum_j |Mbar_ij - A_ij| / sum_j A_ij                               (simple form)

(the middle step: ``|a/Sa - b/Sb| <= |a - b|/Sa + b |Sb - Sa|/(Sa Sb)``, summed). The supremum of the
linear-fractional function over the box is attained at a vertex: ``u_j = e^c`` exactly on the ``k`` keys
with the largest ratios ``|Mbar_ij - A_ij| / A_ij`` — found by sorting (:func:`uniform_error_bound`).
Taking the maximum over rows gives a bound that holds simultaneously for all inputs, given the masks.

Adversaries (:func:`adversarial_search`) look for inputs that come close to it, on the rows with the largest
bound and those whose bound vertex is worst in fact: structured ones (all keys
equal; one key aligned with the query at a chosen distance; the bound's extremal vertex), projected gradient
ascent on one row's scores ``s in [-c, c]^J`` (any row pattern is realizable: ``q_i = R e_1``,
``k_j = s_j / (scale R) e_1``, and ``v_j = ±e_2`` is optimal given ``s``), and projected gradient ascent on the
full ``(q, k, v)`` with restarts (dense, float64, small ``n``). Every reported error is re-measured with the
library's ops (the dense oracle ``dense_plsh_attention`` against exact ``alibi_attention``) on the realized input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from positional_lsh.ops.exact.alibi import alibi_attention
from positional_lsh.ops.exact.reference import dense_plsh_attention
from positional_lsh.ops.partitions.partition import Partitions


@dataclass(frozen=True)
class UniformBound:
    """:func:`uniform_error_bound` of one head: the bound on ``max_i |out_i - out~_i|`` for all inputs.

    Attributes:
        tight: ``2 max_i sup_u sum u |Mbar - A| / sum u A`` (the box-vertex form).
        simple: ``2 e^{2c} max_i sum |Mbar - A| / sum A``.
        row_tight, row_simple: ``(n,)`` float64, the per-row values.
        vertex: ``(n,)`` int64: for each row, how many keys get ``u = e^c`` at the tight optimum.
        row_vertex_error: ``(n,)`` float64: the row's actual ``sum_j |w_j - w~_j|`` at that vertex (scores
            ``s_j = +c`` on those keys, ``-c`` elsewhere): an achievable error, ``<= min(2, row_tight)``.
    """

    tight: float
    simple: float
    row_tight: np.ndarray = field(repr=False)
    row_simple: np.ndarray = field(repr=False)
    vertex: np.ndarray = field(repr=False)
    row_vertex_error: np.ndarray = field(repr=False)


def head_mean_mask(partitions: Partitions, head: int) -> torch.Tensor:
    """``Mbar`` of one head, ``(n, n)`` float64, equal to ``partitions.mean_mask()[head]``.

    Built block by block (each sample adds 1 on its diagonal blocks): ``O(sum_t n b_t)`` writes for pitches
    ``b_t`` instead of the ``O(T n^2)`` of comparing labels, which dominates the study at ``n = 4096``.
    """
    n = partitions.seq_len
    out = np.zeros((n, n))
    for t in range(partitions.num_samples):
        starts, sizes = partitions.blocks(t, head)
        for a, size in zip(starts.tolist(), sizes.tolist(), strict=True):
            out[a : a + size, a : a + size] += 1.0
    out /= partitions.num_samples
    return torch.from_numpy(out)


def _alibi_rows(rows: np.ndarray, n: int, slope: float) -> np.ndarray:
    return np.exp(-slope * np.abs(rows[:, None] - np.arange(n)[None, :]))


def uniform_error_bound(
    partitions: Partitions, head: int, score_bound: float, *, causal: bool = True, chunk: int = 256,
    mbar: torch.Tensor | None = None,
) -> UniformBound:
    """The uniform bound for all inputs with ``|s_ij| <= score_bound`` and ``|v_j| <= 1`` (module docstring).

    Dense rows of ``Mbar`` (:func:`head_mean_mask`, or ``mbar`` if already computed; fine up to ``n`` of a few
    thousand), ``O(n^2 log n)``.
    """
    c = float(score_bound)
    if not c >= 0:
        raise ValueError(f"score_bound must be >= 0, got {score_bound!r}")
    n = partitions.seq_len
    slope = float(partitions.slopes[head])
    mbar_rows = (head_mean_mask(partitions, head) if mbar is None else mbar).numpy()
    lo, hi = math.exp(-c), math.exp(c)
    tight = np.empty(n)
    simple = np.empty(n)
    vertex = np.empty(n, dtype=np.int64)
    vertex_err = np.empty(n)
    for start in range(0, n, chunk):
        rows = np.arange(start, min(n, start + chunk))
        a = _alibi_rows(rows, n, slope)
        m = mbar_rows[rows]
        e = np.abs(m - a)
        if causal:
            keep = np.arange(n)[None, :] <= rows[:, None]
            a, e, m = a * keep, e * keep, m * keep
        simple[rows] = 2 * math.exp(2 * c) * e.sum(1) / a.sum(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(a > 0, e / np.where(a > 0, a, 1.0), -np.inf)
        order = np.argsort(-ratio, axis=1)
        es, as_ = np.take_along_axis(e, order, 1), np.take_along_axis(a, order, 1)
        ce, ca = np.cumsum(es, 1), np.cumsum(as_, 1)
        te, ta = ce[:, -1:], ca[:, -1:]
        zero = np.zeros((len(rows), 1))
        ce, ca = np.concatenate([zero, ce], 1), np.concatenate([zero, ca], 1)  # top-k sums, k = 0..n
        f = (hi * ce + lo * (te - ce)) / (hi * ca + lo * (ta - ca))
        best = np.argmax(f, 1)
        tight[rows] = 2 * f[np.arange(len(rows)), best]
        vertex[rows] = best
        u = np.where(np.arange(n)[None, :] < best[:, None], hi, lo)  # the vertex, in sorted order
        wa, wm = u * as_, u * np.take_along_axis(m, order, 1)
        vertex_err[rows] = np.abs(wa / wa.sum(1, keepdims=True) - wm / wm.sum(1, keepdims=True)).sum(1)
    return UniformBound(float(tight.max()), float(simple.max()), tight, simple, vertex, vertex_err)


def _row_weights(s: torch.Tensor, log_m: torch.Tensor, log_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.softmax(s + log_a, -1), torch.softmax(s + log_m, -1)


def worst_row_error(
    partitions: Partitions,
    head: int,
    row: int,
    score_bound: float,
    *,
    causal: bool = True,
    steps: int = 150,
    starts: list[torch.Tensor] | None = None,
    mbar: torch.Tensor | None = None,
) -> tuple[float, torch.Tensor]:
    """Projected gradient ascent of ``sum_j |w_j - w~_j|`` over row ``row``'s scores ``s in [-c, c]^J``.

    ``v_j = sign(w_j - w~_j) e`` makes this the row's output error, so the maximum is the worst error of the row
    over all inputs. Returns ``(error, s)`` with ``s`` ``(J,)`` float64 (``J = row + 1`` if causal, else ``n``).
    ``mbar``: the head's ``(n, n)`` mean mask, if already computed.
    """
    n = partitions.seq_len
    c = float(score_bound)
    keys = row + 1 if causal else n
    mrow = (head_mean_mask(partitions, head) if mbar is None else mbar)[row, :keys]
    slope = float(partitions.slopes[head])
    log_a = -slope * (row - torch.arange(keys, dtype=torch.float64)).abs()
    log_m = torch.log(mrow)
    best_err, best_s = -1.0, torch.zeros(keys, dtype=torch.float64)
    for s0 in starts or [torch.zeros(keys, dtype=torch.float64)]:
        s = s0.clone().clamp(-c, c).requires_grad_(True)
        step = c / 2 if c > 0 else 0.0
        for it in range(steps):
            w, wt = _row_weights(s, log_m, log_a)
            err = (w - wt).abs().sum()
            if float(err.detach()) > best_err:
                best_err, best_s = float(err.detach()), s.detach().clone()
            (g,) = torch.autograd.grad(err, s)
            with torch.no_grad():
                s += step * torch.sign(g) * (0.97**it)
                s.clamp_(-c, c)
        with torch.no_grad():
            w, wt = _row_weights(s, log_m, log_a)
            final = float((w - wt).abs().sum())
            if final > best_err:
                best_err, best_s = final, s.detach().clone()
    return best_err, best_s


def realize_row_input(
    s: torch.Tensor, row: int, n: int, head_dim: int, radius: float, scale: float, partitions: Partitions,
    head: int, *, causal: bool = True, mbar: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``(q, k, v)`` in the constraint set whose row ``row`` has scores ``s`` and optimal values.

    ``q_j = R e_1`` for all rows, ``k_j = s_j / (scale R) e_1`` (``0`` after the row's keys), ``v_j = sign(w_j - w~_j)
    e_2``. Shapes ``(1, 1, n, head_dim)`` float64.
    """
    keys = s.numel()
    q = torch.zeros(1, 1, n, head_dim, dtype=torch.float64)
    k = torch.zeros_like(q)
    v = torch.zeros_like(q)
    q[..., 0] = radius
    k[0, 0, :keys, 0] = s / (scale * radius)
    slope = float(partitions.slopes[head])
    log_a = -slope * (row - torch.arange(keys, dtype=torch.float64)).abs()
    log_m = torch.log((head_mean_mask(partitions, head) if mbar is None else mbar)[row, :keys])
    w, wt = _row_weights(s, log_m, log_a)
    v[0, 0, :keys, 1] = torch.sign(w - wt)
    return q, k, v


def _oracle_error(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Partitions, head: int, scale: float, causal: bool
) -> torch.Tensor:
    """Per-row ``|out - out~|``, float64: ``(B, n)`` for inputs ``(B, 1, n, d)``.

    ``out~`` by ``dense_plsh_attention``, ``out`` by exact ``alibi_attention``. Batch several inputs into one
    call: the oracle rebuilds ``Mbar`` (``O(T n^2)``) on every call.
    """
    one = partitions.select(slice(None))
    sub = Partitions(one.seq_len, one.slopes[head : head + 1], one.pitch[:, head : head + 1],
                     one.shift[:, head : head + 1], one.scheme, one.device)  # fmt: skip
    approx = dense_plsh_attention(q, k, v, sub, causal=causal, scale=scale)
    exact = alibi_attention(q, k, v, sub.slopes, causal=causal, scale=scale)
    return (approx - exact)[:, 0].norm(dim=-1)


def _oracle_max_errors(inputs: list[tuple[torch.Tensor, ...]], partitions: Partitions, head: int, scale: float,
                       causal: bool) -> list[float]:  # fmt: skip
    """``max_i |out_i - out~_i|`` of each ``(q, k, v)`` in ``inputs``, in one oracle call."""
    q, k, v = (torch.cat([x[i] for x in inputs]) for i in range(3))
    return _oracle_error(q, k, v, partitions, head, scale, causal).amax(-1).tolist()


def _gaussian_inputs(n: int, radius: float, head_dim: int, draws: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    inputs: list[tuple[torch.Tensor, ...]] = []
    for _ in range(draws):
        q, k, v = (torch.randn(1, 1, n, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
        q = q / q.norm(dim=-1, keepdim=True) * radius
        k = k / k.norm(dim=-1, keepdim=True) * radius
        v = v / v.norm(dim=-1, keepdim=True)
        inputs.append((q, k, v))
    return inputs


def gaussian_error(
    partitions: Partitions, head: int, radius: float, scale: float, head_dim: int, *,
    causal: bool = True, draws: int = 3, seed: int = 0,
) -> float:
    """Typical error: mean over ``draws`` of ``max_i |out_i - out~_i|`` for Gaussian ``q, k`` scaled to norm ``R``
    and Gaussian ``v`` scaled to norm 1."""
    inputs = _gaussian_inputs(partitions.seq_len, radius, head_dim, draws, seed)
    return float(np.mean(_oracle_max_errors(inputs, partitions, head, scale, causal)))


def _full_pgd(
    partitions: Partitions, head: int, radius: float, scale: float, head_dim: int, init: list[tuple], *,
    causal: bool, steps: int, mbar: torch.Tensor,
) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Projected gradient ascent on ``(q, k, v)`` of ``max_i |out_i - out~_i|`` (dense, float64)."""
    n = partitions.seq_len
    slope = float(partitions.slopes[head])
    pos = torch.arange(n, dtype=torch.float64)
    log_a = -slope * (pos[:, None] - pos[None, :]).abs()
    log_m = torch.log(mbar)
    if causal:
        mask = torch.triu(torch.full((n, n), -math.inf, dtype=torch.float64), 1)
        log_a, log_m = log_a + mask, log_m + mask

    def project(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        with torch.no_grad():
            q *= (radius / q.norm(dim=-1, keepdim=True).clamp_min(radius))
            k *= (radius / k.norm(dim=-1, keepdim=True).clamp_min(radius))
            v /= v.norm(dim=-1, keepdim=True).clamp_min(1.0)

    best, best_x = -1.0, init[0]
    for x0 in init:
        q, k, v = (t[0, 0].clone().requires_grad_(True) for t in x0)
        project(q, k, v)
        for it in range(steps):
            s = scale * q @ k.T
            err = (torch.softmax(s + log_a, -1) @ v - torch.softmax(s + log_m, -1) @ v).norm(dim=-1)
            top = err.max()
            if float(top.detach()) > best:
                best, best_x = float(top.detach()), tuple(t.detach().clone()[None, None] for t in (q, k, v))
            gq, gk, gv = torch.autograd.grad(torch.logsumexp(err * 200, 0) / 200, (q, k, v))
            with torch.no_grad():
                lr = 0.3 * 0.98**it
                for t, gt, r in ((q, gq, radius), (k, gk, radius), (v, gv, 1.0)):
                    t += lr * r * gt / gt.norm(dim=-1, keepdim=True).clamp_min(1e-30)
            project(q, k, v)
    return best, best_x


@dataclass(frozen=True)
class AdversarialResult:
    """One (n, T) cell of the adversarial study.

    Attributes:
        seq_len, num_samples, slope, score_bound (``c = scale R^2``), radius (``R``), head_dim.
        gaussian: typical error (:func:`gaussian_error`).
        worst: the largest ``max_i |out_i - out~_i|`` found (re-measured with the library's ops).
        worst_by: the adversary that found it; ``found``: every adversary's error.
        bound_tight, bound_simple: :class:`UniformBound`.
        violation: ``worst > bound_tight`` beyond rounding (``1e-9`` relative; the bound is attained exactly at
            ``T = 1``): must never happen; the caller saves the input.
        input: the worst ``(q, k, v)``, each ``(1, 1, n, head_dim)`` float64.
    """

    seq_len: int
    num_samples: int
    slope: float
    score_bound: float
    radius: float
    head_dim: int
    gaussian: float
    worst: float
    worst_by: str
    found: dict[str, float]
    bound_tight: float
    bound_simple: float
    violation: bool
    input: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = field(repr=False)


# An adversary's best row so far: (its row error by the cheap row formula, the row's scores ``s``, the row).
_Candidate = tuple[float, torch.Tensor, int]


def adversarial_search(
    partitions: Partitions,
    head: int = 0,
    *,
    score_bound: float = 1.0,
    head_dim: int = 16,
    causal: bool = True,
    rows: int = 4,
    row_steps: int = 150,
    pgd_max_len: int = 1024,
    pgd_steps: int = 60,
    pgd_restarts: int = 2,
    seed: int = 0,
) -> AdversarialResult:
    """Search inputs ``|q|, |k| <= R``, ``|v| <= 1`` (``scale = 1/sqrt(head_dim)``, ``R = sqrt(c/scale)``) that
    maximize ``max_i |out_i - out~_i|`` for the given masks, and compare with the bound and Gaussian inputs.

    Adversaries, on the ``rows`` rows with the largest tight bound and the ``rows`` rows whose bound vertex has the
    largest actual error (``UniformBound.row_vertex_error``; at most ``2 rows`` rows): all keys equal (``s = 0``);
    one key aligned with the query at the best distance (``s = +c`` there, ``-c`` elsewhere); the bound's extremal
    vertex (``s = +c`` on the keys with the largest ``|Mbar - A|/A``); projected gradient ascent on the row's scores
    from those starts and random ones. Then (``n <= pgd_max_len``) projected gradient ascent on the full
    ``(q, k, v)`` from the best row input and ``pgd_restarts - 1`` Gaussian starts.
    """
    n = partitions.seq_len
    scale = 1.0 / math.sqrt(head_dim)
    c = float(score_bound)
    radius = math.sqrt(c / scale)
    mbar = head_mean_mask(partitions, head)
    bound = uniform_error_bound(partitions, head, c, causal=causal, mbar=mbar)
    gen = torch.Generator().manual_seed(seed)
    cand: dict[str, _Candidate] = {}
    for row in _attacked_rows(bound, rows):
        _attack_row(cand, partitions, head, row, c, int(bound.vertex[row]), gen, causal=causal, steps=row_steps,
                    mbar=mbar)  # fmt: skip
    inputs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for name, (_, s, row) in cand.items():  # realize each adversary's best row
        inputs[name] = realize_row_input(s, row, n, head_dim, radius, scale, partitions, head, causal=causal,
                                         mbar=mbar)  # fmt: skip
    if n <= pgd_max_len and pgd_restarts > 0:
        best_row = max(("row PGD", "bound vertex", "aligned key"), key=lambda k: cand[k][0])
        init = [inputs[best_row], *_random_inputs(n, head_dim, pgd_restarts - 1, gen)]
        _, x = _full_pgd(partitions, head, radius, scale, head_dim, init, causal=causal, steps=pgd_steps, mbar=mbar)
        inputs["full PGD"] = x  # type: ignore[assignment]
    found, gauss = _remeasure(inputs, partitions, head, radius, scale, head_dim, causal=causal, seed=seed)
    worst_by = max(found, key=lambda k: found[k])
    return AdversarialResult(
        seq_len=n, num_samples=partitions.num_samples, slope=float(partitions.slopes[head]), score_bound=c,
        radius=radius, head_dim=head_dim, gaussian=gauss, worst=found[worst_by], worst_by=worst_by, found=found,
        bound_tight=bound.tight, bound_simple=bound.simple,
        violation=found[worst_by] > bound.tight * (1 + 1e-9) + 1e-12,  # rounding: the bound can be attained
        input=inputs[worst_by],
    )  # fmt: skip


def _attacked_rows(bound: UniformBound, rows: int) -> list[int]:
    """The ``rows`` rows with the largest bound, then the ``rows`` whose bound vertex is worst in fact (no repeats).

    Where the bound exceeds the trivial 2, the rows with the largest bound need not be the most vulnerable ones.
    """
    by_bound = np.argsort(-bound.row_tight, kind="stable")[:rows].tolist()
    by_vertex = np.argsort(-bound.row_vertex_error, kind="stable")[:rows].tolist()
    return list(dict.fromkeys(by_bound + by_vertex))


def _consider(cand: dict[str, _Candidate], name: str, s: torch.Tensor, row: int, mbar: torch.Tensor,
              slope: float) -> None:  # fmt: skip
    """Keep ``s`` as adversary ``name``'s best row if its row error (cheap formula; verified later) is the largest."""
    a_log = -slope * (row - torch.arange(s.numel(), dtype=torch.float64)).abs()
    w, wt = _row_weights(s, torch.log(mbar[row, : s.numel()]), a_log)
    err = float((w - wt).abs().sum())
    if err > cand.get(name, (-1.0,))[0]:
        cand[name] = (err, s, row)


def _vertex_scores(mrow: torch.Tensor, a: torch.Tensor, top: int, c: float) -> torch.Tensor:
    """The bound's extremal vertex: ``s = +c`` on the ``top`` keys with the largest ``|Mbar - A|/A``, else ``-c``."""
    ratio = (mrow - a).abs() / a
    vertex = torch.full((a.numel(),), -c, dtype=torch.float64)
    vertex[torch.argsort(ratio, descending=True)[:top]] = c
    return vertex


def _aligned_scores(mrow: torch.Tensor, a: torch.Tensor, row: int, n: int, c: float, causal: bool) -> torch.Tensor:
    """One key aligned with the query (``s = +c`` there, ``-c`` elsewhere), at the distance with the largest error.

    Distances ``0 .. keys - 1`` on a geometric grid of 24 points (behind the query if causal, ahead otherwise).
    """
    keys = a.numel()
    best_aligned, best_s = -1.0, None
    for dist in sorted({int(x) for x in np.unique(np.geomspace(1, keys, 24).astype(int)) - 1}):
        s = torch.full((keys,), -c, dtype=torch.float64)
        j = row - dist if causal else min(n - 1, row + dist)
        s[j] = c
        w, wt = _row_weights(s, torch.log(mrow), torch.log(a))
        e = float((w - wt).abs().sum())
        if e > best_aligned:
            best_aligned, best_s = e, s
    assert best_s is not None
    return best_s


def _attack_row(
    cand: dict[str, _Candidate], partitions: Partitions, head: int, row: int, c: float, vertex_keys: int,
    gen: torch.Generator, *, causal: bool, steps: int, mbar: torch.Tensor,
) -> None:
    """Run the row adversaries on ``row`` (equal keys, bound vertex, aligned key, row PGD), updating ``cand``.

    Row PGD starts from the vertex, the aligned key, all-zero scores and one uniform draw from ``gen``.
    """
    keys = row + 1 if causal else partitions.seq_len
    slope = float(partitions.slopes[head])
    _consider(cand, "equal keys", torch.zeros(keys, dtype=torch.float64), row, mbar, slope)
    a = torch.exp(-slope * (row - torch.arange(keys, dtype=torch.float64)).abs())
    vertex = _vertex_scores(mbar[row, :keys], a, vertex_keys, c)
    _consider(cand, "bound vertex", vertex, row, mbar, slope)
    aligned = _aligned_scores(mbar[row, :keys], a, row, partitions.seq_len, c, causal)
    _consider(cand, "aligned key", aligned, row, mbar, slope)
    starts = [vertex, aligned, torch.zeros(keys, dtype=torch.float64),
              (2 * torch.rand(keys, generator=gen, dtype=torch.float64) - 1) * c]  # fmt: skip
    _, s = worst_row_error(partitions, head, row, c, causal=causal, steps=steps, starts=starts, mbar=mbar)
    _consider(cand, "row PGD", s, row, mbar, slope)


def _random_inputs(n: int, head_dim: int, count: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """``count`` standard Gaussian ``(q, k, v)`` from ``gen``, each ``(1, 1, n, head_dim)`` float64 (unprojected)."""
    return [tuple(torch.randn(1, 1, n, head_dim, generator=gen, dtype=torch.float64) for _ in range(3))
            for _ in range(count)]  # fmt: skip


def _remeasure(
    inputs: Mapping[str, tuple[torch.Tensor, ...]], partitions: Partitions, head: int, radius: float, scale: float,
    head_dim: int, *, causal: bool, seed: int,
) -> tuple[dict[str, float], float]:
    """Each adversary's ``max_i |out_i - out~_i|``, and the Gaussian error (:func:`gaussian_error`): one oracle call."""
    gauss_inputs = _gaussian_inputs(partitions.seq_len, radius, head_dim, 3, seed)
    errs = _oracle_max_errors([*inputs.values(), *gauss_inputs], partitions, head, scale, causal)
    found = dict(zip(inputs, errs[: len(inputs)], strict=True))
    return found, float(np.mean(errs[len(inputs) :]))
