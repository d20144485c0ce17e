"""Empirical errors of ``Mbar`` against ``A``: spectral and max norm (matrix-free) and the output metrics.

* ``||Mbar - A||_2`` by the Lanczos recurrence on ``x -> Mbar x - A x`` (:func:`spectral_error`), stopped
  at a relative tolerance ``tol``: when the residual estimate ``beta_k |s_k|`` of the top Ritz pair is below
  ``tol * theta`` (then ``theta`` is within ``tol * theta`` of an eigenvalue), or when ``theta`` has stopped
  moving (by less than ``tol * theta`` over 30 steps; this happens in a dense band of top eigenvalues).
  Ritz values never exceed the largest ``|eigenvalue|``, so the estimate errs low, if at all.
* ``max |Mbar - A|`` exactly (:func:`max_error`), diagonal by diagonal: on the ``d``-th diagonal the count
  of samples in which ``i`` and ``i + d`` share a block is a difference of two counting functions of block
  starts and (ends - d), so each diagonal costs ``O(n + #blocks longer than d)``; diagonals whose error
  cannot beat the running maximum (by a bound from the longest block of each sample) are skipped.
  From an already dense ``Mbar``: :func:`dense_max_error`.
* For given ``Q, K, V`` (:func:`output_errors`): the exp-weighted form ``(E∘A)V`` vs ``(E∘Mbar)V`` with
  ``E = exp(s)``, the softmax form ``softmax(s + log A) V`` vs ``softmax(s + log Mbar) V``, row-wise relative
  errors (median, p90, p99) and cosine similarities: the paper's §5.2 metrics. These need ``O(n^2)`` time
  (dense rows of ``Mbar`` are built chunk by chunk in ``O(T n + n^2)``) but only ``O(chunk * n)`` memory.
* Scaling: :func:`fit_power_law` and :func:`samples_for_error` (the ``T`` at which a fitted error reaches ``eps``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy.linalg import eigh_tridiagonal

from positional_lsh.ops.checks import as_scale, check_bool
from positional_lsh.ops.exact.reference import alibi_matrix
from positional_lsh.ops.partitions.partition import Partitions
from positional_lsh.theory.bounds import alibi_spectral_norm
from positional_lsh.theory.operators import MeanMaskOperator, alibi_matvec, block_starts


@dataclass(frozen=True)
class SpectralEstimate:
    """``||Mbar - A||_2`` for one head.

    Attributes:
        value: the estimate, the largest ``|Ritz value|`` (it does not exceed the true norm).
        residual: the Lanczos residual estimate ``beta_k |s_k|`` of that Ritz pair (in exact arithmetic an
            eigenvalue lies within it); 0 for the dense method.
        matvecs: number of operator applications.
        method: ``"lanczos"``, ``"dense"`` (tiny ``n``) or ``"exact"`` (slope 0: the error is 0).
    """

    value: float
    residual: float
    matvecs: int
    method: str


def _top_abs_eigenvalue(
    matvec: Callable[[np.ndarray], np.ndarray], n: int, tol: float, seed: int = 0, max_iter: int = 3000
) -> SpectralEstimate:
    """Largest-magnitude eigenvalue of a symmetric operator by the Lanczos recurrence (dense for tiny n).

    Plain three-term Lanczos (``O(n)`` memory, no re-orthogonalization: lost orthogonality only creates
    duplicate copies of converged Ritz values, the extreme ones stay inside the spectrum). The extreme
    Ritz values of the tridiagonal ``T_k`` are checked every few steps; it stops when the standard residual
    estimate ``beta_k |s_k|`` of the top Ritz pair is below ``tol |theta|``, or when ``theta`` has changed by
    less than ``tol |theta|`` over the last 30 steps (a dense band of eigenvalues at the top, as for the
    periodic errors of stratified schemes, where eigenvectors are never resolved but ``theta`` is).
    Vector operations are numpy ufuncs, not BLAS, so they stay single-threaded.
    """
    if n <= 64:
        dense = np.stack([matvec(e) for e in np.eye(n)], axis=1)
        w = np.linalg.eigvalsh((dense + dense.T) / 2)
        return SpectralEstimate(float(np.abs(w).max()), 0.0, n, "dense")
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(n)
    v /= math.sqrt(float((v * v).sum()))
    v_prev = np.zeros(n)
    alphas: list[float] = []
    betas: list[float] = []
    beta = 0.0
    history: list[tuple[int, float]] = []
    theta, resid = 0.0, math.inf
    for j in range(min(max_iter, n)):
        w = matvec(v)
        if beta:
            w -= beta * v_prev
        alpha = float((w * v).sum())
        w -= alpha * v
        beta = math.sqrt(float((w * w).sum()))
        alphas.append(alpha)
        betas.append(beta)
        k = j + 1
        done = beta <= 1e-14 * max(abs(alpha), 1e-300)
        if k >= 8 and (k % 4 == 0 or done or k == min(max_iter, n)):
            vals, vecs = eigh_tridiagonal(np.array(alphas), np.array(betas[:-1]))
            top = int(np.argmax(np.abs(vals)))
            theta = abs(float(vals[top]))
            resid = abs(beta * float(vecs[-1, top]))
            history.append((k, theta))
            old = [t for kk, t in history if kk <= k - 30]
            stalled = bool(old) and abs(theta - old[-1]) <= tol * theta
            if resid <= tol * theta or stalled or done:
                break
        if done:
            break
        v_prev, v = v, w / beta
    return SpectralEstimate(theta, resid, len(alphas), "lanczos")


def spectral_error(
    partitions: Partitions,
    head: int = 0,
    *,
    tol: float = 1e-8,
    operator: MeanMaskOperator | None = None,
    dense_mbar: np.ndarray | None = None,
) -> SpectralEstimate:
    """``||Mbar - A||_2`` for one head, matrix-free (Lanczos on ``x -> Mbar x - A x``).

    Args:
        partitions: sampled partitions (any scheme).
        head: which head.
        tol: relative tolerance of the Lanczos iteration (see the module docstring).
        operator: a prebuilt :class:`MeanMaskOperator` for this head (built if ``None``).
        dense_mbar: optionally the dense ``(n, n)`` ``Mbar`` (then its matvec is used, cheaper when
            the partitions hold very many samples).

    Returns:
        :class:`SpectralEstimate`.
    """
    if not (isinstance(tol, float) and 0 < tol < 1):
        raise ValueError(f"tol must be a float in (0, 1), got {tol!r}")
    op = operator if operator is not None else MeanMaskOperator(partitions, head)
    m = op.slope
    if m == 0:
        return SpectralEstimate(0.0, 0.0, 0, "exact")
    if dense_mbar is not None:
        mb = np.asarray(dense_mbar, dtype=np.float64)

        def mv(x: np.ndarray) -> np.ndarray:
            return mb @ x - alibi_matvec(x, m)

    else:

        def mv(x: np.ndarray) -> np.ndarray:
            return op.matvec(x) - alibi_matvec(x, m)

    return _top_abs_eigenvalue(mv, op.n, tol)


def max_error(partitions: Partitions, head: int = 0, *, operator: MeanMaskOperator | None = None) -> float:
    """``max_{i,j} |Mbar[i, j] - A[i, j]|`` for one head, exactly, without an ``n x n`` matrix.

    On diagonal ``d`` the number of samples in which ``i`` and ``i + d`` share a block is
    ``#{blocks longer than d with start <= i} - #{such blocks with end - d <= i}``; both counting
    functions are a ``bincount`` and a ``cumsum``. Diagonals whose error cannot exceed the running maximum
    are skipped: the count is at most the number of samples having a block longer than ``d`` and at least
    the number of samples that are a single block. Pairs farther apart than every block never collide,
    so their error is ``A`` itself, largest at the smallest such distance.
    """
    op = operator if operator is not None else MeanMaskOperator(partitions, head)
    n, t_total, m = op.n, op.num_samples, op.slope
    if m == 0 or n == 1:
        return 0.0
    uniq, counts = op.distinct_samples
    starts_l, sizes_l, weights_l = [], [], []
    longest = np.zeros(len(uniq), dtype=np.int64)
    for u, (p, s) in enumerate(uniq.tolist()):
        if p <= 1.0:
            longest[u] = 1
            continue
        starts = block_starts(p, s, n)
        sizes = np.diff(np.append(starts, n))
        longest[u] = sizes.max()
        keep = sizes >= 2
        starts_l.append(starts[keep])
        sizes_l.append(sizes[keep])
        weights_l.append(np.full(int(keep.sum()), float(counts[u])))
    if not starts_l:
        return math.exp(-m)  # no pair ever collides: the largest error is A at distance 1
    starts = np.concatenate(starts_l)
    sizes = np.concatenate(sizes_l)
    weights = np.concatenate(weights_l)
    order = np.argsort(-sizes, kind="stable")
    starts, sizes, weights = starts[order], sizes[order], weights[order]
    ends = starts + sizes
    w_longest = counts.astype(np.float64)
    full = float(w_longest[longest >= n].sum())  # single-block samples: every pair collides
    dmax = int(longest.max())  # pairs at distance >= dmax never collide
    best = math.exp(-m * dmax) if dmax <= n - 1 else 0.0
    # number of samples (with multiplicity) whose longest block exceeds d, for every d
    srt = np.argsort(longest)
    lon_sorted, w_sorted = longest[srt], w_longest[srt]
    cum_w = np.concatenate([[0.0], np.cumsum(w_sorted)])
    last = min(dmax - 1, n - 1)
    num_longer = np.searchsorted(-sizes, -np.arange(1, last + 1), side="left")  # blocks longer than d
    for d in range(1, last + 1):
        a = math.exp(-m * d)
        upper = (t_total - cum_w[np.searchsorted(lon_sorted, d, side="right")]) / t_total
        if max(upper - a, a - full / t_total) <= best:
            continue
        k = int(num_longer[d - 1])
        st, en, w = starts[:k], ends[:k] - d, weights[:k]
        cnt = np.cumsum(np.bincount(st, weights=w, minlength=n + 1) - np.bincount(en, weights=w, minlength=n + 1))
        cnt = cnt[: n - d]
        best = max(best, float(cnt.max()) / t_total - a, a - float(cnt.min()) / t_total)
    return best


@dataclass(frozen=True)
class MaskErrors:
    """Mask-level errors of one head: the paper's ``||Mbar - A||_2``, relative error and ``max|Mbar - A|``.

    Attributes:
        head, slope, seq_len, num_samples, scheme: what was measured.
        spectral: ``||Mbar - A||_2`` (Lanczos estimate, see :class:`SpectralEstimate`).
        spectral_residual: Lanczos residual of ``spectral``.
        alibi_norm: exact ``||A||_2``.
        relative_spectral: ``spectral / alibi_norm``.
        max_abs: exact ``max |Mbar - A|``.
    """

    head: int
    slope: float
    seq_len: int
    num_samples: int
    scheme: str
    spectral: float
    spectral_residual: float
    alibi_norm: float
    relative_spectral: float
    max_abs: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def mask_errors(
    partitions: Partitions,
    heads: Sequence[int] | None = None,
    *,
    tol: float = 1e-8,
    dense_mbar: dict[int, np.ndarray] | None = None,
) -> list[MaskErrors]:
    """Spectral, relative spectral and max-norm error of ``Mbar`` against ``A``, per head, matrix-free.

    Args:
        partitions: sampled partitions.
        heads: heads to measure (default all).
        tol: Lanczos tolerance (see :func:`spectral_error`).
        dense_mbar: optional ``{head: dense Mbar}`` to use instead of the matrix-free operator (its
            matvec and its max error are then computed from the dense matrix).

    Returns:
        one :class:`MaskErrors` per requested head.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    heads = list(range(partitions.num_heads)) if heads is None else list(heads)
    out = []
    for h in heads:
        op = MeanMaskOperator(partitions, h)
        dense = None if dense_mbar is None else dense_mbar.get(h)
        spec = spectral_error(partitions, h, tol=tol, operator=op, dense_mbar=dense)
        norm_a = alibi_spectral_norm(partitions.seq_len, op.slope)
        if dense is not None:
            mx = dense_max_error(dense, op.slope)
        else:
            mx = max_error(partitions, h, operator=op)
        out.append(
            MaskErrors(
                head=h,
                slope=op.slope,
                seq_len=partitions.seq_len,
                num_samples=partitions.num_samples,
                scheme=partitions.scheme,
                spectral=spec.value,
                spectral_residual=spec.residual,
                alibi_norm=norm_a,
                relative_spectral=spec.value / norm_a,
                max_abs=mx,
            )
        )
    return out


def dense_max_error(mbar: np.ndarray, slope: float) -> float:
    """``max_{i,j} |Mbar[i, j] - A[i, j]|`` for a given dense ``(n, n)`` ``Mbar`` and ``A = exp(-slope |i - j|)``.

    The max-norm error when ``Mbar`` is already materialized (e.g. :meth:`Partitions.mean_mask` of one head);
    :func:`max_error` gives the same number from the partitions without an ``n x n`` matrix. ``A`` is built
    1024 rows at a time, so the extra memory is ``O(1024 n)``.
    """
    n = mbar.shape[0]
    best = 0.0
    for a in range(0, n, 1024):
        b = min(n, a + 1024)
        dist = np.abs(np.arange(a, b)[:, None] - np.arange(n)[None, :])
        best = max(best, float(np.abs(mbar[a:b] - np.exp(-slope * dist)).max()))
    return best


def dense_mask_errors(partitions: Partitions, head: int = 0) -> tuple[float, float]:
    """``(||Mbar - A||_2, max|Mbar - A|)`` for one head from dense float64 matrices (a cross-check).

    Uses :meth:`Partitions.mean_mask` and :func:`~positional_lsh.alibi_matrix` and a full symmetric
    eigendecomposition: ``O(n^3)`` time and ``O(n^2)`` memory, small ``n`` only.
    """
    mb = partitions.mean_mask()[head]
    a = alibi_matrix(partitions.seq_len, partitions.slopes[head : head + 1])[0]
    diff = mb - a
    spec = float(torch.linalg.eigvalsh(diff).abs().max())
    return spec, float(diff.abs().max())


# ----------------------------------------------------------------------------------------------------
# Output errors for given Q, K, V
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputErrors:
    """The paper's output metrics for one head (all relative, dimensionless).

    ``exp`` refers to the exp-weighted form ``N = (E∘W) V`` with ``E = exp(s)``; ``softmax`` to the
    normalized form ``O = softmax(s + log W) V``; ``W`` is ``A`` (reference) or ``Mbar`` (estimate).

    Attributes:
        exp_rel: ``||N_Mbar - N_A||_F / ||N_A||_F``.
        softmax_rel: ``||O_Mbar - O_A||_F / ||O_A||_F``.
        exp_row_median, exp_row_p90, exp_row_p99: quantiles over rows of ``||N_Mbar,i - N_A,i|| / ||N_A,i||``.
        row_median, row_p90, row_p99: quantiles over rows of ``||O_Mbar,i - O_A,i|| / ||O_A,i||``.
        cosine_mean, cosine_min: cosine similarity of ``O_Mbar,i`` and ``O_A,i`` over rows.
    """

    exp_rel: float
    softmax_rel: float
    exp_row_median: float
    exp_row_p90: float
    exp_row_p99: float
    row_median: float
    row_p90: float
    row_p99: float
    cosine_mean: float
    cosine_min: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _as_head_matrix(name: str, x: object, n: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating (seq_len, head_dim) tensor, got {tuple(x.shape)} {x.dtype}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} must have {n} rows (the partitions' seq_len), got {x.shape[0]}")
    return x.detach().to("cpu", torch.float64)


def output_errors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    partitions: Partitions,
    head: int = 0,
    *,
    causal: bool = True,
    scale: float | None = None,
    chunk_rows: int = 512,
    operator: MeanMaskOperator | None = None,
    dense_mbar: np.ndarray | None = None,
) -> OutputErrors:
    """The paper's §5.2 output metrics for one head, in float64, chunked over query rows.

    Args:
        q, k, v: ``(n, d)`` tensors of this head (any float dtype; computed in float64 on the CPU).
        partitions: partitions with ``seq_len == n``; ``head`` selects the head's masks and slope.
        causal: restrict query ``i`` to keys ``j <= i`` (both in ``A`` and ``Mbar``).
        scale: score scale ``s = scale * q.k``, default ``1/sqrt(d)``.
        chunk_rows: query rows per chunk (memory ``O(chunk_rows * n)``).
        operator: a prebuilt :class:`MeanMaskOperator` for this head.
        dense_mbar: optionally this head's dense ``(n, n)`` ``Mbar`` (reused instead of rebuilding rows).

    Returns:
        :class:`OutputErrors`. Rows are stabilized by their own maximum score; the Frobenius norms of the
        exp-weighted form use one global stabilizer (a common factor, so the ratio is exact).
    """
    n = partitions.seq_len
    qq = _as_head_matrix("q", q, n)
    kk = _as_head_matrix("k", k, n)
    vv = _as_head_matrix("v", v, n)
    if qq.shape[1] != kk.shape[1]:
        raise ValueError(f"q and k must have the same head_dim, got {qq.shape[1]} and {kk.shape[1]}")
    check_bool("causal", causal)
    sc = as_scale(scale, qq.shape[1])
    op = operator if operator is not None else MeanMaskOperator(partitions, head)
    row_max, num_a_sq, num_diff_sq, out_a_sq, out_diff_sq, cos = _row_sums(
        qq, kk, vv, op, sc, causal, chunk_rows, dense_mbar
    )
    g = np.exp(2.0 * (row_max - row_max.max()))  # squared global stabilizer per row
    exp_rel = math.sqrt(float((g * num_diff_sq).sum()) / float((g * num_a_sq).sum()))
    with np.errstate(divide="ignore", invalid="ignore"):
        exp_rows = np.sqrt(num_diff_sq / num_a_sq)
        out_rows = np.sqrt(out_diff_sq / out_a_sq)
    exp_rows = exp_rows[np.isfinite(exp_rows)]
    out_rows = out_rows[np.isfinite(out_rows)]
    return OutputErrors(
        exp_rel=exp_rel,
        softmax_rel=math.sqrt(float(out_diff_sq.sum()) / float(out_a_sq.sum())),
        exp_row_median=float(np.median(exp_rows)),
        exp_row_p90=float(np.quantile(exp_rows, 0.9)),
        exp_row_p99=float(np.quantile(exp_rows, 0.99)),
        row_median=float(np.median(out_rows)),
        row_p90=float(np.quantile(out_rows, 0.9)),
        row_p99=float(np.quantile(out_rows, 0.99)),
        cosine_mean=float(np.mean(cos)),
        cosine_min=float(np.min(cos)),
    )


def _row_sums(
    qq: torch.Tensor,
    kk: torch.Tensor,
    vv: torch.Tensor,
    op: MeanMaskOperator,
    sc: float,
    causal: bool,
    chunk_rows: int,
    dense_mbar: np.ndarray | None,
) -> tuple[np.ndarray, ...]:
    """Per-row sums for :func:`output_errors`, chunk by chunk over query rows (float64 ``(n, d)`` inputs).

    Returns ``(n,)`` float64 arrays: the row's maximum score, ``||N_A,i||^2``, ``||N_Mbar,i - N_A,i||^2``
    (both with the row's own stabilizer), ``||O_A,i||^2``, ``||O_Mbar,i - O_A,i||^2`` and the cosine.
    """
    n, m = qq.shape[0], op.slope
    row_max, num_a_sq, num_diff_sq, out_a_sq, out_diff_sq, cos = (np.empty(n) for _ in range(6))
    pos = torch.arange(n, dtype=torch.float64)
    for a in range(0, n, chunk_rows):
        b = min(n, a + chunk_rows)
        s = (qq[a:b] @ kk.T) * sc
        dist = pos[a:b, None] - pos[None, :]
        if causal:
            s = s.masked_fill(dist < 0, float("-inf"))
        rmax = s.max(dim=1, keepdim=True).values
        e = torch.exp(s - rmax)
        wa = e * torch.exp(-m * dist.abs())
        rows = dense_mbar[a:b] if dense_mbar is not None else op.rows(a, b)
        wm = e * torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float64))
        na, nm = wa @ vv, wm @ vv
        oa, om = na / wa.sum(1, keepdim=True), nm / wm.sum(1, keepdim=True)
        row_max[a:b] = rmax[:, 0].numpy()
        num_a_sq[a:b] = (na**2).sum(1).numpy()
        num_diff_sq[a:b] = ((nm - na) ** 2).sum(1).numpy()
        out_a_sq[a:b] = (oa**2).sum(1).numpy()
        out_diff_sq[a:b] = ((om - oa) ** 2).sum(1).numpy()
        cos[a:b] = torch.nn.functional.cosine_similarity(om, oa, dim=1, eps=1e-300).numpy()
    return row_max, num_a_sq, num_diff_sq, out_a_sq, out_diff_sq, cos


# ----------------------------------------------------------------------------------------------------
# Scaling
# ----------------------------------------------------------------------------------------------------


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``log y = slope * log x + intercept``; returns ``(slope, intercept)``."""
    lx = np.log(np.asarray(x, dtype=np.float64))
    ly = np.log(np.asarray(y, dtype=np.float64))
    if lx.size < 2 or np.ptp(lx) == 0:
        raise ValueError("fit_power_law needs at least two distinct x values")
    slope, intercept = np.polyfit(lx, ly, 1)
    return float(slope), float(intercept)


def samples_for_error(x: Sequence[float], y: Sequence[float], eps: float) -> float:
    """The sample count at which the fitted power law ``y = e^c x^slope`` reaches ``eps`` (``inf`` if never)."""
    slope, intercept = fit_power_law(x, y)
    if slope >= 0:
        return math.inf
    return float(math.exp((math.log(eps) - intercept) / slope))
