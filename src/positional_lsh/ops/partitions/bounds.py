"""The one definition of a block: :func:`block_bounds`, the block ``[start, end)`` holding a position.

Position ``i`` is in block ``floor((i - shift) / pitch)`` of a partition, computed in float64 exactly as
:meth:`~positional_lsh.ops.partitions.partition.Partitions.labels` computes it (``pitch = inf``: one block holding
the whole sequence). Everything that needs the block of a position (``Partitions.block_span``, the multiplicity
form's plan and masks, decoding, the Triton plan) asks :func:`block_bounds`, and takes its integer fast path under
one rule, :func:`integer_pitch_shift`.

Why the integer path is exact. Let ``b >= 1`` and ``0 <= s < b`` be integers and ``0 <= i < n <= 2**51``
(:data:`MAX_SEQ_LEN`). If ``i < s``, the float64 quotient ``(i - s) / b`` of :meth:`Partitions.labels` is in
``(-1, 0)`` up to rounding, which cannot reach 0: its floor is ``-1``, the exact one. If ``a = i - s >= 0`` (exact)
and ``b`` does not divide ``a``, the quotient is ``1/b`` or more below the next integer ``k``, and rounding moves it
by at most ``k * 2**-53``, less than ``1/b`` when ``k b < 2**53``: so it is for ``b < n`` (``k b < a + b < 2 n``)
and for ``n <= b < 2**53`` (``k = 1``); for ``b >= 2**53`` the quotient is below ``1/4``. So the labels are the
exact integer ones for *every* integer pitch ``>= 1`` and integer shift, however large (subnormal slopes draw
pitches far beyond ``2**53``): the rule needs no bound on the pitch. The int64 arithmetic ``i - ((i - s) mod b)``
takes ``min(b, 2**53)`` and ``min(s, 2**53 - 1)`` (the same blocks below ``2**51``: ``[0, s)`` and ``[s, n)``, or
one), so it cannot overflow; a pitch of ``inf`` (one block) is pitch ``2**53`` with shift ``0``.

For ``n <= 2**23`` (:data:`FLOAT32_SEQ_LEN`) the same integer blocks come out of float32 arithmetic, about 6x faster
than the int64 ``remainder`` (x86 has no vector integer division): ``start = s + floor((i - s) / b) * b``. It is
exact by the argument above with float32's ``2**-24``: for ``b`` not dividing ``a = i - s >= 0`` the quotient is
``1/b`` or more below ``k``, rounding moves it by at most ``k * 2**-24 < 1/b`` since ``k b < 2 n <= 2**24``; for
``i < s`` it is in ``[-1 + 1/b, -1/b]`` and cannot round to ``0`` (nor below ``-1``: a rounded ``s`` stays below
the rounded ``b``); the start ``s + lab b`` and end ``s + (lab + 1) b`` are integers below ``2**24``, so exact,
except where they clip: a label of ``-1`` with ``b >= 2**24`` gives a start ``s - b < 0`` (clipped to 0) and an
end ``s`` (exact, or above ``n`` when rounded); a label of ``0`` with ``b >= 2**24`` an end above ``n`` (clipped).

Otherwise (real pitches) the floor formula's bounds are computed in float64 and then moved, one position at a time,
until the labels on both sides of each bound agree with the floor formula; a pass that moves nothing proves them
exact (labels are non-decreasing in the position). One or two passes in practice.
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT32_SEQ_LEN", "MAX_SEQ_LEN", "block_bounds", "integer_pitch_shift"]

#: The longest sequence :func:`block_bounds` takes: its float64 label quotients stay below ``2**51``, where
#: ``exact_floor`` is exact, and its integer path equals the float64 labels (module docstring).
MAX_SEQ_LEN = 2**51

#: Sequences up to this length take :func:`block_bounds`'s integer path in float32 arithmetic (module docstring).
FLOAT32_SEQ_LEN = 2**23

_ROUND = 6755399441055744.0  # 1.5 * 2**52: (x + _ROUND) - _ROUND rounds a float64 |x| < 2**51 to an integer
_INTEGRAL = 4503599627370496.0  # 2**52: float64 numbers from here on are integers; (x + 2**52) - 2**52 rounds below
_BIG = 2.0**53  # integer pitches above this (and inf) become this pitch: the same blocks below MAX_SEQ_LEN


def exact_floor(x: torch.Tensor) -> torch.Tensor:
    """``torch.floor`` for float64 ``|x| < 2**51`` (and +-inf), exact, with vectorized adds only.

    torch's CPU ``floor``/``ceil`` on float64 runs at about 60 ns per element on the measured machine (against
    0.5 ns for float32); this is the bottleneck of block bounds otherwise.
    """
    r = (x + _ROUND) - _ROUND  # round to nearest integer
    return r - (r > x).to(x.dtype)


def _exact_ceil(x: torch.Tensor) -> torch.Tensor:
    """``torch.ceil`` for float64 ``|x| < 2**51`` (and +-inf), exact: ``-exact_floor(-x)``."""
    return -exact_floor(-x)


def _integral(x: torch.Tensor) -> torch.Tensor:
    """Whether each float64 ``x >= 0`` is an integer (``inf`` counts as one), with vectorized adds only."""
    return (x >= _INTEGRAL) | ((x + _INTEGRAL) - _INTEGRAL == x)


def integer_pitch_shift(pitch: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The one integer-path rule: int64 ``(pitch, shift)`` for :func:`block_bounds`'s integer arithmetic, or ``None``.

    The rule: every pitch is ``inf`` or an integer ``>= 1`` whose shift is an integer (``pitch``, ``shift``:
    broadcastable float64 tensors of valid partition values, ``0 <= shift < pitch``). Then the block of position
    ``i < MAX_SEQ_LEN`` is ``[i - ((i - s) mod b), that + b)`` clipped to ``[0, n]``, exactly the blocks of
    :meth:`~positional_lsh.ops.partitions.partition.Partitions.labels` (module docstring), with ``b = min(pitch,
    2**53)``, ``s = min(shift, 2**53 - 1)`` and ``(b, s) = (2**53, 0)`` for ``inf`` (``b`` of ``pitch``'s shape,
    ``s`` of the broadcast one). Every draw of an integer scheme (``discrete`` and its variance-reduced versions,
    the decays; capped or not, with slope-0 heads and subnormal slopes) passes; ``None`` when one value is real
    (``gamma``, most ``fixed`` draws) or a pitch is below 1. One reduction (a host sync on a device).
    """
    ok = (pitch >= 1.0) & _integral(pitch) & (torch.isinf(pitch) | _integral(shift))
    if not bool(ok.all()):
        return None
    b = torch.where(pitch > _BIG, _BIG, pitch)
    s = torch.where(torch.isinf(pitch), 0.0, shift.clamp_max(_BIG - 1.0))
    return b.long(), s.long()


def block_bounds(
    pitch: torch.Tensor, shift: torch.Tensor, seq_len: int, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block holding ``pos`` in each partition: int64 ``(start, end)``, its first position and one past its last.

    Args:
        pitch, shift: float64 tensors, broadcastable with ``pos``, of valid partition values (``pitch > 0`` or
            ``inf``, ``0 <= shift < pitch``), e.g. ``partitions.pitch[..., None]`` for ``(T, H, P)`` bounds.
        seq_len: the sequence length ``n`` (``1 <= n <= MAX_SEQ_LEN``); blocks are clipped to ``[0, n)``.
        pos: an integer tensor of positions in ``[0, n)`` (not checked: this runs in the estimator's hot path).

    Returns:
        ``(start, end)``, int64 of the broadcast shape, on ``pos``'s device. Exactly the blocks of
        :meth:`~positional_lsh.ops.partitions.partition.Partitions.labels` (position ``i`` in block
        ``floor((i - shift) / pitch)``): integer pitches and shifts (:func:`integer_pitch_shift`) by integer
        arithmetic, real ones by the floor formula moved until it is proven exact; ``pitch = inf`` is one block
        ``[0, n)``, ``pitch <= 1`` single positions.
    """
    if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        raise TypeError(f"pos must be an integer tensor, got {pos.dtype if isinstance(pos, torch.Tensor) else pos!r}")
    for name, x in (("pitch", pitch), ("shift", shift)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float64:
            what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name} must be a float64 tensor (the arithmetic of the labels), got {what}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    if not 1 <= seq_len <= MAX_SEQ_LEN:
        raise ValueError(f"seq_len must be in [1, 2**51], got {seq_len}")
    whole = integer_pitch_shift(pitch, shift)
    if whole is not None:
        return integer_block_bounds(*whole, seq_len, pos)
    return _real_bounds(pitch, shift, seq_len, pos.to(torch.float64))


def integer_block_bounds(
    b: torch.Tensor, s: torch.Tensor, seq_len: int, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_bounds` of integer partitions, from :func:`integer_pitch_shift`'s int64 ``(b, s)`` (computed once
    by a caller that bounds many positions of the same partitions; nothing is checked here)."""
    if seq_len <= FLOAT32_SEQ_LEN:
        bf, sf, i32 = b.to(pos.device, torch.float32), s.to(pos.device, torch.float32), pos.to(torch.float32)
        lab = torch.floor(torch.sub(i32, sf).div_(bf))
        end32 = torch.add(lab, 1.0).mul_(bf).add_(sf).clamp_(max=float(seq_len))  # s + (lab + 1) b
        first = lab.mul_(bf).add_(sf).clamp_(min=0.0)  # s + lab b
        return first.long(), end32.long()
    i = pos.long()
    start = torch.sub(i, s)  # of the broadcast shape (s is that of pitch and shift): then in place
    start = torch.sub(i, torch.remainder(start, b, out=start), out=start)  # unclipped: the end is start + b
    end = (start + b).clamp_(max=seq_len)
    return start.clamp_(min=0), end


def _real_bounds(
    pitch: torch.Tensor, shift: torch.Tensor, seq_len: int, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_bounds` for real pitches; ``p`` float64 positions."""
    n = float(seq_len)
    one_block = torch.isinf(pitch)
    single = pitch <= 1.0  # boundaries less than one position apart: every position its own block
    # Those two are set at the end; a pitch of 2 and shift 0 meanwhile keep their labels' quotients small.
    regular = ~(one_block | single)
    b = torch.where(regular, pitch, 2.0)
    s = torch.where(regular, shift, 0.0)

    def label(i: torch.Tensor) -> torch.Tensor:  # the block label of position(s) i, as labels() computes it
        return exact_floor((i - s) / b)

    lab = label(p)
    # First position of the block and one past its last, up to rounding.
    lo = _exact_ceil(s + lab * b).clamp_min(0.0).minimum(p)
    hi = _exact_ceil(s + (lab + 1.0) * b).maximum(p + 1.0).clamp_max(n)
    while True:  # move each bound one position towards the labels' boundary; a pass that moves none proves them
        down = (lo > 0) & (label(lo - 1.0) >= lab)
        lo = torch.where(down, lo - 1.0, lo)
        up = label(lo) < lab
        lo = torch.where(up, lo + 1.0, lo)
        right = (hi < n) & (label(hi) <= lab)
        hi = torch.where(right, hi + 1.0, hi)
        left = label(hi - 1.0) > lab
        hi = torch.where(left, hi - 1.0, hi)
        if not bool((down | up | right | left).any()):
            break
    lo = torch.where(one_block, 0.0, torch.where(single, p, lo))
    hi = torch.where(one_block, n, torch.where(single, p + 1.0, hi))
    return lo.long(), hi.long()
