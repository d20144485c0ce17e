"""Sampling positional-LSH partitions: random contiguous block partitions of token positions.

A partition of positions ``0..n-1`` is described by two numbers, a *pitch* ``b > 0`` and a *shift*
``xi`` in ``[0, b)``: position ``i`` goes to block ``floor((i - xi) / b)``. Blocks are contiguous runs
of about ``b`` positions. Averaged over the law of ``(b, xi)``, the probability that positions ``i``
and ``j`` share a block is the ALiBi factor ``exp(-m |i - j|)`` for the head's slope ``m``
(DESIGN.md §2), so the mean of many sampled block masks estimates the ALiBi matrix ``A``.

Schemes:

* ``"discrete"`` (default): integer pitch ``B = 1 + G1 + G2`` with ``G1, G2`` geometric on
  ``{0, 1, ...}`` with success probability ``1 - e^{-m}``, integer shift uniform on ``{0..B-1}``.
  ``P[i, j same block] = e^{-m|i-j|}`` exactly. Every block but the first and last holds exactly ``B``
  positions, so a sample is a *reshape* of the sequence — this is what makes the fast path fast.
* ``"gamma"``: the paper's scheme. Real pitch ``b ~ Gamma(shape 2, scale 1/m)``, shift
  ``~ Uniform[0, b)``. Also exactly unbiased (random binning for the Laplace kernel); blocks hold
  ``floor(b)`` or ``ceil(b)`` positions.
* ``"fixed"``: the paper's ``--fixed_block_size`` ablation, pitch ``2/m`` and shift ``0``. **Biased**:
  the mean mask does not converge to ``A``. Kept only for ablations.

A slope of ``0`` means no positional bias: one block holding the whole sequence (pitch ``inf``).

Randomness: partitions are always drawn on the CPU in float64 from a CPU ``torch.Generator`` (or an
``int`` seed, or ``None`` for torch's global generator), so one seed gives the same partitions on every
run and every device. Draws are laid out sample-major, so the first ``T`` samples of a draw with
``num_samples > T`` equal a draw with ``num_samples = T`` from the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from positional_lsh.ops._checks import GeneratorLike, SlopesLike, as_generator, as_slopes, positive_int

__all__ = ["SCHEMES", "UNBIASED_SCHEMES", "Partitions", "Segment", "sample_partitions"]

# Dense validation helpers refuse to build more than this many mask entries.
MAX_DENSE_ELEMENTS = 2**28

Sampler = Callable[[torch.Tensor, int, "torch.Generator | None"], tuple[torch.Tensor, torch.Tensor]]


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """Uniform draws in ``(0, 1]`` (never 0, so ``log`` is finite)."""
    return 1.0 - torch.rand(shape, generator=generator, dtype=torch.float64)


def _sample_discrete(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    u = _uniform((t, m.numel(), 3), g)
    # G = floor(log(u) / log(x)) with x = e^{-m} is geometric: P[G >= k] = x^k.
    geo = torch.floor(-torch.log(u[..., :2]) / m[:, None])
    pitch = 1.0 + geo.sum(-1)
    shift = torch.floor((1.0 - u[..., 2]) * pitch).clamp_max(pitch - 1.0)
    return pitch, shift


def _sample_gamma(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    u = _uniform((t, m.numel(), 3), g)
    # Gamma(2, sigma) as the sum of two exponentials with mean sigma = 1/m.
    pitch = -torch.log(u[..., :2]).sum(-1) / m
    shift = (1.0 - u[..., 2]) * pitch
    return pitch, shift


def _sample_fixed(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    pitch = (2.0 / m).expand(t, m.numel()).clone()
    return pitch, torch.zeros_like(pitch)


_SAMPLERS: dict[str, Sampler] = {
    "discrete": _sample_discrete,
    "gamma": _sample_gamma,
    "fixed": _sample_fixed,
}
# Schemes whose mean mask is exactly the ALiBi matrix in expectation.
_UNBIASED = {"discrete", "gamma"}
# Schemes whose pitches and shifts are integers (blocks are exact reshapes).
_INTEGER = {"discrete"}


def register_scheme(name: str, sampler: Sampler, *, unbiased: bool, integer: bool) -> None:
    """Register a partition sampler ``sampler(slopes (H,) float64 > 0, T, generator) -> (pitch, shift)``.

    ``pitch`` and ``shift`` are ``(T, H)`` float64 with ``0 <= shift < pitch``. Heads with slope 0 are
    handled by the caller (one block). ``unbiased`` declares that each sample's mask has mean ``A``;
    ``integer`` that pitches and shifts are integers.
    """
    _SAMPLERS[name] = sampler
    if unbiased:
        _UNBIASED.add(name)
    if integer:
        _INTEGER.add(name)


def _schemes() -> tuple[str, ...]:
    return tuple(_SAMPLERS)


SCHEMES = _schemes()
UNBIASED_SCHEMES = tuple(sorted(_UNBIASED))


@dataclass(frozen=True)
class Segment:
    """``count`` equal-shape blocks of one (sample, head), processed by one kernel call.

    Block ``c`` (``0 <= c < count``) pairs the query rows ``q_start + c*step + [0, q_len)`` with the key rows
    ``k_start + c*step + [0, k_len)``, where ``step = stride or k_len`` (adjacent blocks by default). Query row
    ``r`` sits at key position ``r + Lk - Lq``: queries are aligned to the last keys. ``q_len < k_len`` only
    for the one block that the first query cuts (decoding, chunked prefill); its queries are the block's
    *last* ``q_len`` positions. If ``index`` is given, it is a ``(count, k_len)`` tensor of the key positions
    of non-adjacent blocks, and the rows are ``index + q_start`` for queries and ``index + k_start`` for keys.
    ``masked`` says whether the causal mask applies inside the segment (``False`` for pieces whose keys all
    precede their queries).
    """

    q_start: int
    k_start: int
    q_len: int
    k_len: int
    count: int
    index: torch.Tensor | None = None
    stride: int = 0
    masked: bool = True

    @property
    def step(self) -> int:
        return self.stride or self.k_len


def _label_runs(pitch: float, shift: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block starts and sizes (int64) for positions ``0..n-1``."""
    if math.isinf(pitch):
        return torch.zeros(1, dtype=torch.long), torch.full((1,), n, dtype=torch.long)
    if pitch <= 1.0:
        # Boundaries are less than one position apart: every position is its own block.
        return torch.arange(n, dtype=torch.long), torch.ones(n, dtype=torch.long)
    labels = torch.floor((torch.arange(n, dtype=torch.float64) - shift) / pitch)
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = labels[1:] != labels[:-1]
    starts = torch.nonzero(change).flatten()
    sizes = torch.diff(starts, append=torch.tensor([n]))
    return starts, sizes


@dataclass(frozen=True, eq=False)
class Partitions:
    """``T`` positional-LSH partitions for each of ``H`` heads of a length-``n`` sequence.

    The ``T`` partitions of a head are independent draws for the ``"discrete"``, ``"gamma"`` and ``"fixed"``
    schemes, and coupled (each one still marginally an exact draw) for the variance-reduced schemes.

    Stores ``O(T*H)`` numbers (a pitch and a shift per sample and head), never ``O(n)`` labels. The same
    partitions are used for every element of a batch.

    Attributes:
        seq_len: number of positions ``n`` (the key length).
        slopes: ``(H,)`` float64 CPU tensor, the ALiBi slopes the partitions were drawn for.
        pitch: ``(T, H)`` float64 CPU tensor, block pitch (``inf`` for slope 0).
        shift: ``(T, H)`` float64 CPU tensor in ``[0, pitch)``.
        scheme: name of the sampling scheme.
        device: default device for :meth:`labels`, :meth:`dense_masks` and :meth:`mean_mask`.
    """

    seq_len: int
    slopes: torch.Tensor
    pitch: torch.Tensor
    shift: torch.Tensor
    scheme: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def num_samples(self) -> int:
        return int(self.pitch.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.pitch.shape[1])

    @property
    def unbiased(self) -> bool:
        """Whether each sampled mask has expectation exactly equal to the ALiBi matrix."""
        return self.scheme in _UNBIASED

    def __repr__(self) -> str:
        return (
            f"Partitions(seq_len={self.seq_len}, num_samples={self.num_samples}, "
            f"num_heads={self.num_heads}, scheme={self.scheme!r})"
        )

    def with_seq_len(self, seq_len: int) -> Partitions:
        """The same partitions of the positions ``0..seq_len-1``.

        The law of a partition does not depend on the length, so restricting (or extending) a sampled
        partition to another length is again an exact sample. Used by decoding with a KV cache.
        """
        seq_len = positive_int("seq_len", seq_len)
        return Partitions(seq_len, self.slopes, self.pitch, self.shift, self.scheme, self.device)

    def select(self, samples: slice | list[int] | torch.Tensor) -> Partitions:
        """A sub-collection of the samples (e.g. ``partitions.select(slice(0, 4))``)."""
        return Partitions(self.seq_len, self.slopes, self.pitch[samples], self.shift[samples], self.scheme, self.device)

    def labels(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Block label of every position: ``(T, H, n)`` int64, non-decreasing along positions."""
        n = self.seq_len
        pos = torch.arange(n, dtype=torch.float64)
        pitch = self.pitch[..., None]
        lab = torch.floor((pos - self.shift[..., None]) / pitch)
        lab = torch.where(torch.isinf(pitch), torch.zeros_like(lab), lab)
        # For pitch <= 1 several boundaries fall between two positions; floor() still separates them.
        return lab.to(torch.long).to(device or self.device)

    def blocks(self, sample: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block boundaries of one (sample, head): ``(starts, sizes)``, int64 tensors covering ``0..n-1``."""
        return _label_runs(float(self.pitch[sample, head]), float(self.shift[sample, head]), self.seq_len)

    def _check_dense(self, what: str, elements: int) -> None:
        if elements > MAX_DENSE_ELEMENTS:
            raise ValueError(
                f"{what} would hold {elements:,} entries (more than {MAX_DENSE_ELEMENTS:,}); it is meant for "
                f"validation at small seq_len. Use labels() or blocks(), or positional_lsh.theory for "
                f"matrix-free error metrics at this size"
            )

    def dense_masks(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Binary block masks ``M[t, h, i, j] = [i, j in one block]``: ``(T, H, n, n)`` bool (small n only)."""
        n = self.seq_len
        self._check_dense("dense_masks()", self.num_samples * self.num_heads * n * n)
        lab = self.labels(device)
        return lab[..., :, None] == lab[..., None, :]

    def mean_mask(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``Mbar = (1/T) sum_t M_t``: ``(H, n, n)`` (float64 by default; small n only)."""
        n = self.seq_len
        self._check_dense("mean_mask()", self.num_heads * n * n)
        lab = self.labels(device)
        out = torch.zeros(self.num_heads, n, n, dtype=dtype, device=lab.device)
        for t in range(self.num_samples):
            out += (lab[t, :, :, None] == lab[t, :, None, :]).to(dtype)
        return out / self.num_samples

    def segments(self, sample: int, head: int, q_len: int | None = None) -> list[Segment]:
        """Kernel work list for one (sample, head), for ``q_len`` queries aligned to the last keys."""
        n = self.seq_len
        q_len = n if q_len is None else q_len
        q0 = n - q_len
        pitch = float(self.pitch[sample, head])
        shift = float(self.shift[sample, head])
        if self.scheme in _INTEGER and math.isfinite(pitch):
            return _integer_segments(int(pitch), int(shift), n, q0)
        starts, sizes = _label_runs(pitch, shift, n)
        return _generic_segments(starts, sizes, n, q0)

    def iter_segments(self, q_len: int | None = None) -> Iterator[tuple[int, int, list[Segment]]]:
        """``(head, sample, segments)`` for every head and sample, head-major."""
        for h in range(self.num_heads):
            for t in range(self.num_samples):
                yield h, t, self.segments(t, h, q_len)


def _cut_block(start: int, size: int, q0: int) -> Segment:
    """A block that the first query position ``q0`` may cut: queries ``max(start, q0)..start+size``."""
    qs = max(start, q0)
    return Segment(q_start=qs - q0, k_start=start, q_len=start + size - qs, k_len=size, count=1)


def _integer_segments(b: int, s: int, n: int, q0: int) -> list[Segment]:
    """Blocks ``[0, s)`` (when ``s > 0``), then ``[s + k b, s + (k+1) b)`` clipped to ``n``."""
    segs: list[Segment] = []
    if s > 0 and min(s, n) > q0:
        segs.append(_cut_block(0, min(s, n), q0))
    if s >= n:
        return segs
    start = s + ((q0 - s) // b) * b if q0 > s else s  # the block holding q0, or the first after it
    if start < q0:
        end = min(start + b, n)
        segs.append(_cut_block(start, end - start, q0))
        start = end
    full = max(0, (n - start) // b)
    if full > 0:
        segs.append(Segment(q_start=start - q0, k_start=start, q_len=b, k_len=b, count=full))
    tail = start + full * b
    if tail < n:
        segs.append(_cut_block(tail, n - tail, q0))
    return segs


def _generic_segments(starts: torch.Tensor, sizes: torch.Tensor, n: int, q0: int) -> list[Segment]:
    ends = starts + sizes
    keep = ends > q0
    starts, sizes = starts[keep], sizes[keep]
    segs: list[Segment] = []
    if starts.numel() and int(starts[0]) < q0:
        segs.append(_cut_block(int(starts[0]), int(sizes[0]), q0))
        starts, sizes = starts[1:], sizes[1:]
    if starts.numel() == 0:
        return segs
    # Group the remaining (whole) blocks by size; one kernel call per size, gathering rows.
    for size in torch.unique(sizes).tolist():
        sel = starts[sizes == size]
        count = sel.numel()
        first = int(sel[0])
        if count == 1 or bool((torch.diff(sel) == size).all()):
            segs.append(Segment(q_start=first - q0, k_start=first, q_len=size, k_len=size, count=count))
        else:
            index = sel[:, None] + torch.arange(size)
            segs.append(Segment(q_start=-q0, k_start=0, q_len=size, k_len=size, count=count, index=index))
    return segs


def sample_partitions(
    seq_len: int,
    slopes: SlopesLike,
    num_samples: int,
    *,
    scheme: str = "discrete",
    generator: GeneratorLike = None,
    device: torch.device | str | None = None,
    num_heads: int | None = None,
) -> Partitions:
    """Draw ``num_samples`` positional-LSH partitions per head.

    Args:
        seq_len: number of positions ``n >= 1``.
        slopes: ``(H,)`` ALiBi slopes (``>= 0``, finite), a sequence, or one float for every head
            (then ``num_heads`` is required). ``None`` means ``alibi_slopes(num_heads)``.
        num_samples: ``T >= 1`` partitions per head.
        scheme: ``"discrete"`` (exactly unbiased, integer blocks: fastest), ``"gamma"`` (the paper's
            scheme, exactly unbiased), ``"fixed"`` (biased ablation), the variance-reduced
            ``"discrete-strat"``, ``"gamma-strat"``, ``"discrete-antithetic"`` (coupled samples, each
            marginally exact; see ``docs/theory.md``), or a scheme added with :func:`register_scheme`.
        generator: a CPU ``torch.Generator``, an ``int`` seed, or ``None`` (torch's global generator).
        device: default device of :meth:`Partitions.labels` and the dense masks.
        num_heads: number of heads when ``slopes`` is ``None`` or a single float.

    Returns:
        :class:`Partitions` with ``pitch`` and ``shift`` of shape ``(T, H)``.
    """
    seq_len = positive_int("seq_len", seq_len)
    num_samples = positive_int("num_samples", num_samples)
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
    if scheme not in _SAMPLERS:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {sorted(_SAMPLERS)}")
    if isinstance(slopes, torch.Tensor) and slopes.dim() == 1:
        h = slopes.numel()
    elif slopes is not None and not isinstance(slopes, (int, float, torch.Tensor)):
        h = len(slopes)
    else:
        if num_heads is None:
            raise ValueError("num_heads is required when slopes is None or a single number")
        h = positive_int("num_heads", num_heads)
    if num_heads is not None and positive_int("num_heads", num_heads) != h:
        raise ValueError(f"num_heads={num_heads} but slopes has {h} entries")
    m = as_slopes(slopes, h)
    gen = as_generator(generator)
    positive = m > 0
    safe = torch.where(positive, m, torch.ones_like(m))
    pitch, shift = _SAMPLERS[scheme](safe, num_samples, gen)
    pitch = torch.where(positive, pitch, torch.full_like(pitch, math.inf))
    shift = torch.where(positive, shift, torch.zeros_like(shift))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return Partitions(seq_len, m, pitch.contiguous(), shift.contiguous(), scheme, dev)


# ======================================================================================================
# Variance-reduced positional LSH (theory-validation issue; this section is owned by that issue).
#
# The T masks of one head are *coupled* so that their errors cancel, while every mask stays marginally
# an exact sample of its base scheme (so E[M_t] = A for every index t and E[Mbar] = A):
#
# * ``"discrete-strat"`` / ``"gamma-strat"``: the T slots form P = ceil(T / K) groups of K consecutive
#   slots (K = round(sqrt(T) / 2), at least 1; the last group may be smaller). Group p owns the
#   probability stratum [start_p / T, end_p / T) of the pitch law (mass = its share of the slots) and
#   draws ONE pitch from it by inverse CDF (jittered stratification); its K masks share that pitch. The
#   c slots holding one pitch (for integer pitches, groups that drew equal pitches are merged first) take
#   systematic shifts frac(V + j/c) * pitch, j = 0..c-1 (evenly spread over [0, pitch), V uniform). The
#   slots are then randomly permuted, so each index is a uniformly random slot of the design: its pitch
#   law is the mixture of the strata (= the exact law) and, given the pitch, its shift is uniform.
#   Stratifying the pitch removes most of the error of the mean block size (the low-frequency part of
#   Mbar - A); sharing a pitch among K evenly shifted masks makes their average close to the triangle
#   max(0, 1 - |i-j|/pitch) it estimates. K ~ sqrt(T)/2 balances the two (measured, docs/theory.md).
# * ``"discrete-antithetic"``: independent pitches, each used by an antithetic pair of masks whose
#   shifts are half a pitch apart. An ablation: coupling shifts alone gains little; see docs/theory.md.
#
# These draws are not prefix-consistent (the first t masks of a T-mask draw are not a t-mask draw).
# ======================================================================================================


def _strat_group_size(t: int) -> int:
    """Masks per shared pitch for the stratified schemes: ``round(sqrt(T) / 2)``, at least 1."""
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


def _discrete_pitch_quantile(surv: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
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


def _stratified_draw(
    m: torch.Tensor,
    t: int,
    g: torch.Generator | None,
    quantile: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    integer: bool,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stratified pitches x systematic shifts (see the section comment); ``(T, H)`` pitch and shift."""
    h = m.numel()
    k = _strat_group_size(t) if group_size is None else group_size
    groups = -(-t // k)
    slot = torch.arange(t)
    group = slot // k
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
    # uniform (the phase of the first group holding that pitch). Groups share a pitch by construction;
    # with integer pitches, groups that drew equal pitches are merged into one class.
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
    slot_cls = cls[group]  # (T, H): the class of every slot
    counts = torch.zeros((groups, h), dtype=torch.float64).scatter_add_(
        0, slot_cls, torch.ones((t, h), dtype=torch.float64)
    )
    # rank of every slot inside its class, in slot order
    by_cls = torch.argsort(slot_cls * t + slot[:, None], dim=0)
    sorted_cls = torch.gather(slot_cls, 0, by_cls)
    run_start = torch.zeros((t, h), dtype=torch.long)
    run_start[1:] = torch.where(sorted_cls[1:] != sorted_cls[:-1], slot[1:, None], 0)
    rank_sorted = slot[:, None] - torch.cummax(run_start, dim=0).values
    rank = torch.empty_like(rank_sorted).scatter_(0, by_cls, rank_sorted)
    v = torch.gather(phase, 0, torch.gather(first_group, 0, slot_cls))  # (T, H): phase of the slot's class
    frac = torch.frac(v + rank.to(torch.float64) / torch.gather(counts, 0, slot_cls))
    if integer:
        shift = torch.minimum(torch.floor(frac * pitch), pitch - 1.0)
    else:
        shift = torch.minimum(frac * pitch, torch.nextafter(pitch, torch.zeros_like(pitch)))
    perm = torch.argsort(order, dim=0)  # a uniformly random permutation of the slots, per head
    return torch.gather(pitch, 0, perm).contiguous(), torch.gather(shift, 0, perm).contiguous()


def _sample_discrete_strat(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _stratified_draw(m, t, g, _discrete_pitch_quantile, True)


def _sample_gamma_strat(m: torch.Tensor, t: int, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _stratified_draw(m, t, g, _gamma_pitch_quantile, False)


def _sample_discrete_antithetic(
    m: torch.Tensor, t: int, g: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    h = m.numel()
    pairs = -(-t // 2)
    surv = 1.0 - torch.rand((pairs, h), generator=g, dtype=torch.float64)  # (0, 1]
    phase = torch.rand((pairs, h), generator=g, dtype=torch.float64)
    pitch_p = _discrete_pitch_quantile(surv, m[None, :])
    pitch = pitch_p.repeat_interleave(2, dim=0)[:t]
    frac = torch.stack([phase, torch.frac(phase + 0.5)], dim=1).reshape(2 * pairs, h)[:t]
    shift = torch.minimum(torch.floor(frac * pitch), pitch - 1)
    return pitch.contiguous(), shift.contiguous()


register_scheme("discrete-strat", _sample_discrete_strat, unbiased=True, integer=True)
register_scheme("gamma-strat", _sample_gamma_strat, unbiased=True, integer=False)
register_scheme("discrete-antithetic", _sample_discrete_antithetic, unbiased=True, integer=True)

# Recomputed so that they include the schemes registered above.
SCHEMES = _schemes()
UNBIASED_SCHEMES = tuple(sorted(_UNBIASED))
# Schemes whose T masks are coupled (not independent); their draws are not prefix-consistent.
VARIANCE_REDUCED_SCHEMES = ("discrete-strat", "gamma-strat", "discrete-antithetic")
