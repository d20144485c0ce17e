"""Sampled positional-LSH partitions: :class:`Partitions` and :func:`sample_partitions`.

A partition of positions ``0..n-1`` is a pitch ``b > 0`` and a shift ``xi`` in ``[0, b)`` per (sample, head):
position ``i`` goes to block ``floor((i - xi) / b)`` (see :mod:`positional_lsh.ops.partitions.schemes` for the schemes
that draw them). A slope of ``0`` means no positional bias: one block holding the whole sequence (pitch ``inf``).

Randomness: partitions are always drawn on the CPU in float64 from a CPU ``torch.Generator`` (or an
``int`` seed, or ``None`` for torch's global generator), so one seed gives the same partitions on every
run and every device. Draws are laid out sample-major, so for an independent scheme the first ``T``
samples of a draw with ``num_samples > T`` equal a draw with ``num_samples = T`` from the same seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import FrozenInstanceError, dataclass, field, replace

import torch

from positional_lsh.ops.checks import GeneratorLike, SlopesLike, as_generator, as_slopes, numpy_slopes, positive_int
from positional_lsh.ops.errors import check_memory, check_seconds
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.decays import DecayLike
from positional_lsh.ops.partitions.schemes import get_scheme
from positional_lsh.ops.partitions.values import check_partition_values, value_problem

__all__ = ["MAX_DENSE_ELEMENTS", "Partitions", "check_draw_size", "sample_partitions"]

#: The most entries a dense helper builds (mean masks, oracles, attention weights); larger calls are refused.
MAX_DENSE_ELEMENTS = 2**28
# The largest cap (max_block): float64 holds every integer up to here.
MAX_PITCH = 2**53
DRAW_BYTES = 48.0
"""A draw's peak memory per (sample, head), a lower bound: pitch, shift and the sampler's temporaries (measured
48-85 bytes over the built-in schemes at T = 4e6, H = 4)."""
DRAW_COST = 20.0
"""A draw's time per (sample, head) in ns, a lower bound for any scheme (measured 60-5000 ns over the built-in
schemes on the 2-core CPU: ``"fixed"`` the cheapest, ``"discrete-antithetic"`` the dearest)."""
DRAW_COSTS = {
    "fixed": 20.0, "gamma": 70.0, "discrete": 130.0, "gamma-strat": 290.0, "discrete-strat": 310.0,
    "discrete-antithetic": 1700.0,
}  # fmt: skip
"""Per built-in scheme, a third of its measured time per (sample, head) in ns (T = 1e6, H = 4, 2-core CPU: 60,
210, 390, 880, 955, 5160); other schemes take :data:`DRAW_COST`."""
MAX_DRAW_SECONDS = 60.0
"""A draw estimated (from :data:`DRAW_COST`) to take longer than this is refused up front."""


def check_draw_size(num_samples: int, num_heads: int, what: str | None = None, scheme: str | None = None) -> None:
    """Refuse (:class:`~positional_lsh.ops.errors.UserError`, one line with the estimate) a draw of ``num_samples``
    partitions for each of ``num_heads`` heads whose memory (:data:`DRAW_BYTES` per (sample, head)) exceeds this
    machine's or whose time (:data:`DRAW_COSTS` of ``scheme``, else :data:`DRAW_COST`) exceeds
    :data:`MAX_DRAW_SECONDS`: lower bounds, so a refusal is never a close call. ``what`` names the values that set
    it (default: ``sample_partitions``'s arguments)."""
    entries = float(num_samples) * num_heads
    what = what or f"sample_partitions with num_samples={num_samples} and {num_heads} heads"
    check_memory(entries * DRAW_BYTES, what)
    per_entry = DRAW_COSTS.get(scheme, DRAW_COST) if isinstance(scheme, str) else DRAW_COST
    check_seconds(entries * per_entry * 1e-9, MAX_DRAW_SECONDS, what)


def block_runs(pitch: float, shift: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass(eq=False)
class Partitions:
    """``T`` positional-LSH partitions for each of ``H`` heads of a length-``n`` sequence.

    The ``T`` partitions of a head are independent draws for the ``"discrete"``, ``"gamma"`` and ``"fixed"``
    schemes, and coupled (each one still marginally an exact draw) for the variance-reduced schemes.

    Stores ``O(T*H)`` numbers (a pitch and a shift per sample and head), never ``O(n)`` labels. The same
    partitions are used for every element of a batch.

    Checked once, when made (by hand, ``dataclasses.replace``, :meth:`select`, :meth:`with_seq_len` or a sampler):
    :func:`~positional_lsh.ops.partitions.values.check_partition_values` refuses (``TypeError``/``ValueError`` naming
    the field) anything the estimator cannot compute with — a NaN, zero or negative pitch, a shift outside ``[0,
    pitch)`` or not finite, non-integer values under an integer scheme, mismatched shapes, no samples — and copies
    ``pitch``, ``shift`` and ``slopes`` to float64 CPU tensors of its own (so changing the tensors it was made from
    changes nothing); ``seq_len``, ``decay_len`` and ``max_block`` become Python ints (a numpy integer is taken, a
    bool refused). Immutable once made: assigning a field raises ``dataclasses.FrozenInstanceError``; pickling and
    ``torch.compile`` take it as a plain dataclass.

    Attributes:
        seq_len: number of positions ``n`` (the key length).
        slopes: ``(H,)`` float64 CPU tensor, the ALiBi slopes the partitions were drawn for.
        pitch: ``(T, H)`` float64 CPU tensor, block pitch ``> 0`` (``inf``: one block holding the whole sequence,
            for slope 0, or a slope so small that the pitch overflows float64).
        shift: ``(T, H)`` float64 CPU tensor, finite, in ``[0, pitch)`` (0 for an ``inf`` pitch when sampled).
        scheme: name of the sampling scheme.
        device: default device for :meth:`labels`, :meth:`dense_masks` and :meth:`mean_mask`.
        decays: for partitions drawn with ``sample_partitions(..., decay=...)``, one
            :class:`~positional_lsh.ops.partitions.decays.Decay` per head (then ``slopes`` is NaN: there is no ALiBi
            slope); ``None`` for ALiBi partitions.
        decay_len: the length whose exact (truncated) pitch law the decay partitions were drawn from; they
            are exact samples for every length up to it and are not extended beyond it.
        max_block: the pitch cap the partitions were drawn with (``sample_partitions(max_block=...)``), or
            ``None``. Capped partitions are biased (far entries shrink; ``positional_lsh.theory.blocks``).
    """

    seq_len: int
    slopes: torch.Tensor
    pitch: torch.Tensor
    shift: torch.Tensor
    scheme: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    decays: tuple | None = None
    decay_len: int | None = None
    max_block: int | None = None

    def __post_init__(self) -> None:
        for name, value in check_partition_values(self).items():
            setattr(self, name, value)  # the checked values (Python ints, float64 CPU copies), before sealing
        self._sealed: bool = True  # (not a field) no assignment from here on

    def __setattr__(self, name: str, value: object) -> None:
        # Read-only once made (dataclasses.replace, select and with_seq_len make new ones): set only while
        # __init__ / __post_init__ run.
        if getattr(self, "_sealed", False):
            raise FrozenInstanceError(f"cannot assign to field {name!r}: Partitions are immutable")
        super().__setattr__(name, value)

    @property
    def num_samples(self) -> int:
        return int(self.pitch.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.pitch.shape[1])

    @property
    def unbiased(self) -> bool:
        """Whether each sampled mask has expectation exactly the target: the ALiBi matrix, or for decay
        partitions ``K[i, j] = k(|i - j|)``. Never for capped partitions (``max_block``)."""
        return get_scheme(self.scheme).unbiased and self.max_block is None

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
        if self.decay_len is not None and seq_len > self.decay_len:
            raise ValueError(
                f"decay partitions drawn for seq_len={self.decay_len} are exact only up to that length; draw them "
                f"for the longest length needed (got seq_len={seq_len})"
            )
        return replace(self, seq_len=seq_len)

    def select(self, samples: slice | list[int] | torch.Tensor) -> Partitions:
        """A sub-collection of the samples (e.g. ``partitions.select(slice(0, 4))``); at least one sample
        (``ValueError`` for an empty selection)."""
        pitch = self.pitch[samples]
        if pitch.dim() != 2 or pitch.shape[0] == 0:
            raise ValueError(
                f"select() must keep at least one sample as a (T, H) selection (an int index: use [i]), got {samples!r}"
            )
        return replace(self, pitch=pitch, shift=self.shift[samples])

    def labels(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Block label of every position: ``(T, H, n)`` int64, non-decreasing along positions."""
        return self.labels_at(torch.arange(self.seq_len)).to(device or self.device)

    def labels_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Block labels of the given positions: ``(T, H, *positions.shape)`` int64 on ``positions``' device, as
        :meth:`labels` computes them (``labels()[..., i] == labels_at(i)``), for any non-negative integer positions
        (beyond ``seq_len`` too: a partition's blocks continue at its pitch). Torch ops only, no host read: a decoding
        step computes the labels of its query and cached keys in a compiled graph."""
        dims = positions.dim()
        pos = positions.to(torch.float64)
        pitch = self.pitch.to(pos.device).view(*self.pitch.shape, *(1,) * dims)
        shift = self.shift.to(pos.device).view(*self.shift.shape, *(1,) * dims)
        # pitch <= 1: boundaries less than one position apart, every position its own block (label = position, as
        # block_bounds says). Computed with a pitch of 2 there (and 1 block for inf), so that no quotient can
        # overflow int64: the others are below n in magnitude (|i - shift| < n + pitch, pitch > 1).
        single = pitch <= 1.0
        one_block = torch.isinf(pitch)
        safe = torch.where(single | one_block, 2.0, pitch)
        lab = torch.floor((pos - torch.where(single | one_block, 0.0, shift)) / safe)
        lab = torch.where(one_block, 0.0, torch.where(single, pos, lab))
        return lab.to(torch.long)

    def blocks(self, sample: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block boundaries of one (sample, head): ``(starts, sizes)``, int64 tensors covering ``0..n-1``."""
        return block_runs(float(self.pitch[sample, head]), float(self.shift[sample, head]), self.seq_len)

    def block_span(self, head: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each position ``j``, the union over samples of the blocks holding ``j``: ``[lo, hi)`` int64.

        ``positions`` is a 1-D int64 CPU tensor; ``lo``/``hi`` have its shape. Positions outside that span never
        share a block with ``j`` (``Mbar[i, j] = 0``), so they never see key ``j``. The blocks are those of
        :func:`~positional_lsh.ops.partitions.bounds.block_bounds`.
        """
        lo, hi = block_bounds(self.pitch[:, head, None], self.shift[:, head, None], self.seq_len, positions[None, :])
        return lo.amin(0), hi.amax(0)

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



def sample_partitions(
    seq_len: int,
    slopes: SlopesLike,
    num_samples: int,
    *,
    scheme: str = "discrete",
    generator: GeneratorLike = None,
    device: torch.device | str | None = None,
    num_heads: int | None = None,
    decay: DecayLike | Sequence[DecayLike] | None = None,
    max_block: int | None = None,
) -> Partitions:
    """Draw ``num_samples`` positional-LSH partitions per head.

    Args:
        seq_len: number of positions ``n >= 1``.
        slopes: ``(H,)`` ALiBi slopes (``>= 0``, finite): a tensor, a numpy array, a sequence, or one float for
            every head (then ``num_heads`` is required). ``None`` means ``alibi_slopes(num_heads)``.
        num_samples: ``T >= 1`` partitions per head.
        scheme: ``"discrete"`` (exactly unbiased, integer blocks: fastest), ``"gamma"`` (the paper's
            scheme, exactly unbiased), ``"fixed"`` (biased ablation), the variance-reduced
            ``"discrete-strat"``, ``"gamma-strat"``, ``"discrete-antithetic"`` (coupled samples, each
            marginally exact; see ``docs/theory.md``), or a scheme added with :func:`register_scheme`.
        generator: a CPU ``torch.Generator``, an ``int`` seed, or ``None`` (torch's global generator).
        device: default device of :meth:`Partitions.labels` and the dense masks.
        num_heads: number of heads when ``slopes`` is ``None`` or a single float.
        decay: instead of ALiBi, a positional decay ``k(|i - j|)`` (convex, decreasing, ``k(0) = 1``): one
            :class:`~positional_lsh.ops.partitions.decays.Decay` (a callable on int64 distances, or tabulated values)
            for every head (with ``num_heads``), or a sequence of them, one per head. Needs ``slopes=None`` and
            ``scheme="discrete"`` (its general form: ``P(B = b) = b (k(b-1) - 2 k(b) + k(b+1))``, truncated
            exactly at ``seq_len``; see :mod:`positional_lsh.ops.partitions.decays`).
        max_block: cap every pitch at this many positions (``inf`` pitches included): a capped pitch gets a
            fresh shift, uniform on ``[0, max_block)`` (integers for integer schemes). No block is then longer
            than ``max_block``, but the partitions are **biased**: pairs at distance ``d`` share a block with
            probability ``E[(1 - d/min(B, cap))_+] <= A``, so far entries shrink (the exact bias is
            ``positional_lsh.theory.blocks.capped_bias``). With a cap, the first ``T`` samples of a larger
            draw are no longer a ``T``-sample draw. Cost: the per-sample fast path of
            :func:`~positional_lsh.plsh_attention` scores ``sum_t sum_blocks len^2 <= n * max_block * T`` query-key
            pairs per head, so a cap bounds its **worst case** at ``O(n * max_block * T * d)`` per head (uncapped,
            a block may be as long as ``n``: ``O(n^2 T d)``; ``theory.blocks.block_stats`` gives the actual work).

    Returns:
        :class:`Partitions` with ``pitch`` and ``shift`` of shape ``(T, H)``.

    Example:
        >>> import torch
        >>> from positional_lsh import alibi_slopes, sample_partitions
        >>> parts = sample_partitions(256, alibi_slopes(8), num_samples=4, scheme="discrete", generator=0)
        >>> parts.pitch.shape, parts.shift.shape  # (T, H)
        (torch.Size([4, 8]), torch.Size([4, 8]))
        >>> starts, sizes = parts.blocks(0, 0)  # sample 0, head 0: contiguous blocks covering 0..n-1
        >>> int(starts[0]), int(sizes.sum()), bool((starts[1:] == starts[:-1] + sizes[:-1]).all())
        (0, 256, True)
        >>> parts.mean_mask().shape  # Mbar, dense (H, n, n): small n only
        torch.Size([8, 256, 256])
        >>> again = sample_partitions(256, alibi_slopes(8), num_samples=4, generator=0)  # same seed, same draw
        >>> torch.equal(parts.pitch, again.pitch) and torch.equal(parts.shift, again.shift)
        True
    """
    seq_len = positive_int("seq_len", seq_len)
    num_samples = positive_int("num_samples", num_samples)
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
    cap = None if max_block is None else positive_int("max_block", max_block)
    if cap is not None and cap > MAX_PITCH:
        raise ValueError(
            f"max_block must be <= 2**53 (beyond, float64 pitches are not exact integers), got {_short(cap)}"
        )
    draw = _Draw(seq_len, num_samples, scheme, generator, num_heads, cap,
                 torch.device(device) if device is not None else torch.device("cpu"))  # fmt: skip
    if decay is None:
        return _sample_alibi(slopes, draw)
    if slopes is not None:
        raise ValueError("pass slopes or decay, not both")
    return _sample_decay(decay, draw)


@dataclass(frozen=True)
class _Draw:
    """The arguments of one :func:`sample_partitions` call that both laws (ALiBi's and a general decay's) take:
    ``seq_len``, ``num_samples`` and ``cap`` (``max_block``) checked, the generator as given."""

    seq_len: int
    num_samples: int
    scheme: str
    generator: GeneratorLike
    num_heads: int | None
    cap: int | None
    device: torch.device


def _short(value: int) -> str:
    """An int for a message: itself, or its size when it is too long to print."""
    text = str(value)
    return text if len(text) <= 30 else f"an int of {len(text)} digits"


def _num_heads(slopes: SlopesLike, num_heads: int | None) -> int:
    """The number of heads: ``len(slopes)``, or ``num_heads`` for ``None`` or one float (they must agree)."""
    slopes = numpy_slopes(slopes)  # a numpy array: as a tensor
    if isinstance(slopes, torch.Tensor) and slopes.dim() > 1:
        raise ValueError(f"slopes must be a 1-D tensor (one slope per head) or one number, got shape "
                         f"{tuple(slopes.shape)}")  # fmt: skip
    if isinstance(slopes, torch.Tensor) and slopes.dim() == 1:
        h = slopes.numel()
    elif isinstance(slopes, (str, bytes)):
        raise TypeError(f"slopes must be a tensor, a sequence of floats or a float, got {type(slopes).__name__}")
    elif slopes is not None and not isinstance(slopes, (int, float, torch.Tensor)):
        if not isinstance(slopes, Sequence):
            raise TypeError(f"slopes must be a tensor, a sequence of floats or a float, got {type(slopes).__name__}")
        h = len(slopes)
    else:
        if num_heads is None:
            raise ValueError("num_heads is required when slopes is None or a single number")
        h = positive_int("num_heads", num_heads)
    if h == 0:
        raise ValueError("slopes must have at least one entry (one slope per head), got none")
    if num_heads is not None and positive_int("num_heads", num_heads) != h:
        raise ValueError(f"num_heads={num_heads} but slopes has {h} entries")
    return h


def _sample_alibi(slopes: SlopesLike, draw: _Draw) -> Partitions:
    """ALiBi partitions from the scheme's sampler (a slope of 0: one block, pitch ``inf``), then the cap."""
    scheme, num_samples, cap = draw.scheme, draw.num_samples, draw.cap
    spec = get_scheme(scheme)
    h = _num_heads(slopes, draw.num_heads)
    m = as_slopes(slopes, h)
    check_draw_size(num_samples, h, scheme=scheme)
    gen = as_generator(draw.generator)
    positive = m > 0
    safe = torch.where(positive, m, torch.ones_like(m))
    pitch, shift = _sampler_output(scheme, spec.sampler(safe, num_samples, gen), (num_samples, h))
    # One block holding the whole sequence (pitch inf): a slope of 0, or a slope so small (subnormal, <~ 2e-307)
    # that the drawn pitch ~ 1/slope overflows float64. Its shift is 0: every position is in the one block whatever
    # the shift, and the sampler's shift of an overflowed pitch (inf * u: inf or NaN) is no number to compute with.
    one_block = ~positive[None, :] | torch.isinf(pitch)
    pitch = torch.where(one_block, math.inf, pitch)
    shift = torch.where(one_block, 0.0, shift)
    problem = value_problem(pitch, shift, spec.integer)
    if problem is not None:
        raise ValueError(
            f"the sampler of scheme {scheme!r} returned {problem}; a sampler must return (pitch, shift) with "
            "pitch > 0 and 0 <= shift < pitch" + (", both integers" if spec.integer else "")
        )
    pitch, shift = _cap(pitch, shift, cap, spec.integer, gen)
    return Partitions(draw.seq_len, m, pitch.contiguous(), shift.contiguous(), scheme, draw.device, max_block=cap)


def _sampler_output(scheme: str, out: object, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A scheme sampler's ``(pitch, shift)`` as float64 CPU ``(T, H)`` tensors; ``ValueError``/``TypeError`` naming
    the scheme unless it returned two real tensors of that shape."""
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise TypeError(f"the sampler of scheme {scheme!r} must return (pitch, shift), got {type(out).__name__}")
    tensors = []
    for name, x in zip(("pitch", "shift"), out, strict=True):
        if not isinstance(x, torch.Tensor) or x.is_complex() or x.dtype == torch.bool:
            what = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"the sampler of scheme {scheme!r} must return real tensors, got {what} for {name}")
        if tuple(x.shape) != shape:
            raise ValueError(
                f"the sampler of scheme {scheme!r} returned {name} of shape {tuple(x.shape)}; expected "
                f"(num_samples, num_heads) = {shape}"
            )
        tensors.append(x.detach().to("cpu", torch.float64))
    return tensors[0], tensors[1]


def _sample_decay(decay: DecayLike | Sequence[DecayLike], draw: _Draw) -> Partitions:
    """Partitions for a general decay (the ``"discrete"`` scheme's general law; slopes NaN), then the cap."""
    from positional_lsh.ops.partitions.decays import sample_decay_pitches

    n, num_samples, num_heads, cap = draw.seq_len, draw.num_samples, draw.num_heads, draw.cap
    if draw.scheme != "discrete":
        raise ValueError(f"decay= samples the general 'discrete' scheme; got scheme={draw.scheme!r}")
    check_draw_size(num_samples, 1 if num_heads is None else positive_int("num_heads", num_heads))
    heads, pitch, shift = sample_decay_pitches(decay, n, num_samples, draw.generator, num_heads=num_heads)
    nan = torch.full((len(heads),), math.nan, dtype=torch.float64)
    pitch, shift = _cap(pitch, shift, cap, True, as_generator(draw.generator) if cap else None)
    return Partitions(n, nan, pitch.contiguous(), shift.contiguous(), draw.scheme, draw.device, tuple(heads), n, cap)


def _cap(
    pitch: torch.Tensor, shift: torch.Tensor, cap: int | None, integer: bool, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pitches above ``cap`` set to ``cap`` with a fresh uniform shift (drawn after the main draw)."""
    if cap is None:
        return pitch, shift
    over = pitch > cap
    u = torch.rand(pitch.shape, generator=gen, dtype=torch.float64)
    fresh = torch.floor(u * cap).clamp_max(cap - 1.0) if integer else u * cap
    return torch.where(over, float(cap), pitch), torch.where(over, fresh, shift)


def check_partitions(partitions: object, num_heads: int, seq_len: int) -> None:
    """Raise unless ``partitions`` is a :class:`Partitions` drawn for ``num_heads`` query heads and ``seq_len`` keys."""
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    if partitions.num_heads != num_heads:
        raise ValueError(f"partitions were drawn for {partitions.num_heads} heads, but q has {num_heads} heads")
    if partitions.seq_len != seq_len:
        raise ValueError(
            f"partitions were drawn for seq_len={partitions.seq_len}, but k has {seq_len} positions "
            "(use partitions.with_seq_len(n) to reuse them at another length)"
        )


def check_slopes_match(slopes: SlopesLike, partitions: Partitions, num_heads: int) -> torch.Tensor | None:
    """Raise ``ValueError`` when a call passes both ``slopes`` and ``partitions`` and they disagree.

    ``slopes`` (``None``, one float, or ``(num_heads,)``) is read as for sampling
    (:func:`~positional_lsh.ops.checks.as_slopes`) and compared with ``partitions.slopes`` by ``torch.allclose``;
    ``None`` always matches. Under ``torch.compile`` the comparison reads the data, so it cannot run at trace time:
    a ``slopes`` tensor is returned as ``(num_heads,)`` for the compiled op to compare when it runs
    (:func:`check_same_slopes`), any other ``slopes`` is refused. Returns ``None`` otherwise. Partitions that are not
    a :class:`Partitions` for ``num_heads`` heads are left to :func:`check_partitions`.
    """
    if slopes is None or not isinstance(partitions, Partitions) or partitions.num_heads != num_heads:
        return None
    if torch.compiler.is_compiling():
        if isinstance(slopes, torch.Tensor) and slopes.dim() <= 1 and slopes.numel() in (1, num_heads):
            return slopes.detach().reshape(-1).expand(num_heads)
        raise ValueError(
            "under torch.compile, slopes= with partitions= must be a tensor of one or num_heads slopes (the "
            f"comparison with partitions.slopes runs inside the compiled op), got {type(slopes).__name__}"
        )
    check_same_slopes(as_slopes(slopes, num_heads), partitions.slopes)
    return None


def check_same_slopes(slopes: torch.Tensor, drawn: torch.Tensor) -> None:
    """``ValueError`` unless ``slopes`` equal the slopes ``drawn`` that the partitions were drawn from
    (``torch.allclose`` in float64 on the CPU; both ``(H,)``)."""
    if not torch.allclose(slopes.detach().to("cpu", torch.float64), drawn.detach().to("cpu", torch.float64)):
        raise ValueError("slopes differ from partitions.slopes; pass one or the other")
