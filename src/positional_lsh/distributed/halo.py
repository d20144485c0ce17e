"""Halo planning for context parallelism: which keys each rank needs, computed exactly from the partitions.

A sequence of ``n`` positions is split into contiguous shards in rank order: rank ``r`` owns positions
``[starts[r], ends[r])``. Positional-LSH attention only lets a query see keys of its own block (in each of
the ``T`` sampled partitions of its head), so a rank needs, besides its own keys, only the keys of the blocks
that cross its shard boundaries:

* causal: ``[L_r, starts[r])`` with ``L_r`` the smallest start, over all samples ``t`` and heads ``h``, of
  the block that contains the shard's first position;
* bidirectional: also ``[ends[r], R_r)`` with ``R_r`` the largest end of the block containing its last
  position.

These windows are exact (they are read off the same ``floor((i - shift) / pitch)`` labels that
:meth:`positional_lsh.Partitions.labels` uses), not estimates. A block longer than a shard gives a halo that
spans several ranks; every owner of a piece of it sends that piece.

Everything here is pure Python/torch on the CPU: no process group is needed, so the byte accounting of
:func:`bytes_per_rank` can be computed for any ``n`` and ``P`` on one machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from positional_lsh import Partitions


@dataclass(frozen=True)
class Transfer:
    """Keys/values ``[start, end)`` (global positions) sent by rank ``src`` (their owner) to rank ``dst``."""

    src: int
    dst: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class HaloPlan:
    """Per-rank key windows and the point-to-point transfers that fill them.

    Attributes:
        seq_len: the whole sequence length ``n``.
        causal: whether the plan is for causal attention (no right halos).
        starts, ends: ``(P,)`` tuples, rank ``r`` owns positions ``[starts[r], ends[r])``.
        left, right: ``(P,)`` tuples, rank ``r``'s key window is ``[left[r], right[r])``, a superset of its shard.
        transfers: every ``(src, dst, start, end)`` piece, in a fixed order (identical on every rank).
    """

    seq_len: int
    causal: bool
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    transfers: tuple[Transfer, ...]

    @property
    def world_size(self) -> int:
        return len(self.starts)

    def halo_positions(self, rank: int) -> int:
        """Number of key positions rank ``rank`` receives (left plus right halo)."""
        return (self.starts[rank] - self.left[rank]) + (self.right[rank] - self.ends[rank])

    def incoming(self, rank: int) -> list[Transfer]:
        return [tr for tr in self.transfers if tr.dst == rank]

    def outgoing(self, rank: int) -> list[Transfer]:
        return [tr for tr in self.transfers if tr.src == rank]


def shard_bounds(shard_lengths: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(starts, ends)`` of contiguous shards of the given lengths, in rank order."""
    starts, ends, pos = [], [], 0
    for length in shard_lengths:
        length = int(length)
        if length < 0:
            raise ValueError(f"shard lengths must be >= 0, got {list(shard_lengths)}")
        starts.append(pos)
        pos += length
        ends.append(pos)
    return tuple(starts), tuple(ends)


def _label(pos: torch.Tensor, shift: torch.Tensor, pitch: torch.Tensor) -> torch.Tensor:
    # Exactly the arithmetic of Partitions.labels(): floor((pos - shift) / pitch) in float64.
    return torch.floor((pos - shift) / pitch)


def block_extents(partitions: Partitions, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and end (exclusive) of the block holding each position, for every sample and head.

    Args:
        partitions: partitions of ``n = partitions.seq_len`` positions.
        positions: ``(K,)`` int64 positions in ``[0, n)``.

    Returns:
        ``(start, end)``: ``(T, H, K)`` int64 tensors, the block of sample ``t``, head ``h`` that holds
        ``positions[k]`` is ``[start, end)``. Exact: consistent with ``partitions.labels()``.
    """
    n = partitions.seq_len
    pitch = partitions.pitch.to(torch.float64)[..., None]
    shift = partitions.shift.to(torch.float64)[..., None]
    pos = positions.to(torch.float64).reshape(1, 1, -1)
    finite = torch.isfinite(pitch)
    safe_pitch = torch.where(finite, pitch, torch.ones_like(pitch))
    lab = _label(pos, shift, safe_pitch)
    # First guesses from the real-valued boundary s + lab * b, then exact integer corrections.
    start = torch.clamp(torch.ceil(shift + lab * safe_pitch), min=0.0)
    start = torch.minimum(start, pos)
    end = torch.clamp(torch.ceil(shift + (lab + 1.0) * safe_pitch), max=float(n))
    end = torch.maximum(end, pos + 1.0)
    for _ in range(64):
        # start: smallest c <= pos with label(c) == lab.
        down = (start > 0) & (_label(start - 1.0, shift, safe_pitch) == lab)
        up = _label(start, shift, safe_pitch) < lab
        # end: smallest c > pos with label(c) > lab (or n).
        e_down = (end - 1.0 > pos) & (_label(end - 1.0, shift, safe_pitch) > lab)
        e_up = (end < n) & (_label(end, shift, safe_pitch) == lab)
        if not bool(down.any() | up.any() | e_down.any() | e_up.any()):
            break
        start = start - down.to(start.dtype) + up.to(start.dtype)
        end = end - e_down.to(end.dtype) + e_up.to(end.dtype)
    else:  # pragma: no cover - the first guesses are within a few positions
        raise RuntimeError("block_extents did not converge")
    start = torch.where(finite, start, torch.zeros_like(start))
    end = torch.where(finite, end, torch.full_like(end, float(n)))
    shape = (partitions.num_samples, partitions.num_heads, positions.numel())
    return start.to(torch.long).expand(shape).contiguous(), end.to(torch.long).expand(shape).contiguous()


def halo_plan(partitions: Partitions, shard_lengths: Sequence[int], causal: bool = True) -> HaloPlan:
    """Exact halos of every rank for the whole-sequence ``partitions`` and contiguous shards.

    Args:
        partitions: partitions of the whole sequence (``seq_len == sum(shard_lengths)``).
        shard_lengths: ``(P,)`` number of positions of each rank, in rank order (zeros allowed).
        causal: causal attention (left halos only) or bidirectional (left and right halos).

    Returns:
        A :class:`HaloPlan`. Rank ``r``'s window ``[left[r], right[r])`` holds every key that any query of its
        shard can attend to in any sample of any head.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    starts, ends = shard_bounds(shard_lengths)
    n = partitions.seq_len
    if ends[-1] != n:
        raise ValueError(f"shard lengths {list(shard_lengths)} sum to {ends[-1]}, but the partitions have seq_len={n}")
    world = len(starts)
    nonempty = [r for r in range(world) if ends[r] > starts[r]]
    left = list(starts)
    right = list(ends)
    if nonempty:
        firsts = torch.tensor([starts[r] for r in nonempty], dtype=torch.long)
        lo, _ = block_extents(partitions, firsts)
        for r, value in zip(nonempty, lo.flatten(0, 1).amin(0).tolist(), strict=True):
            left[r] = int(value)
        if not causal:
            lasts = torch.tensor([ends[r] - 1 for r in nonempty], dtype=torch.long)
            _, hi = block_extents(partitions, lasts)
            for r, value in zip(nonempty, hi.flatten(0, 1).amax(0).tolist(), strict=True):
                right[r] = int(value)
    transfers = []
    for dst in range(world):
        for src in range(world):
            if src == dst or ends[src] == starts[src]:
                continue
            if src < dst:
                a, b = max(left[dst], starts[src]), min(starts[dst], ends[src])
            else:
                a, b = max(ends[dst], starts[src]), min(right[dst], ends[src])
            if b > a:
                transfers.append(Transfer(src, dst, a, b))
    return HaloPlan(n, causal, starts, ends, tuple(left), tuple(right), tuple(transfers))


def crop_partitions(partitions: Partitions, start: int, end: int, *, verify: bool | None = None) -> Partitions:
    """The partitions restricted to the window ``[start, end)``, re-indexed so that ``start`` becomes 0.

    The block boundaries of the result are exactly those of ``partitions`` inside the window (same pitch,
    shift moved by ``-start`` modulo the pitch). Every other field is kept: the slopes, the scheme, and for decay
    or capped partitions ``decays``, ``decay_len`` (the law's length, ``>= n``: a window of an exact draw is
    exact up to it too) and ``max_block`` (the same blocks, so the same cap and bias). For integer pitches and
    shifts this is exact arithmetic; for real-valued ones (``"gamma"``) the result is checked against
    ``partitions.labels()`` and the shift is nudged by a few ulps if rounding moved a boundary across an integer.

    Args:
        partitions: partitions of the whole sequence.
        start, end: ``0 <= start < end <= partitions.seq_len``.
        verify: compare the block boundaries with ``labels()``; default: only for non-integer partitions.

    Returns:
        :class:`~positional_lsh.Partitions` of ``end - start`` positions.
    """
    n = partitions.seq_len
    if not 0 <= start < end <= n:
        raise ValueError(f"window [{start}, {end}) is not inside [0, {n})")
    pitch = partitions.pitch.to(torch.float64)
    shift = partitions.shift.to(torch.float64)
    finite = torch.isfinite(pitch)
    safe = torch.where(finite, pitch, torch.ones_like(pitch))
    new_shift = torch.remainder(shift - float(start), safe)
    new_shift = torch.where(new_shift >= safe, torch.zeros_like(new_shift), new_shift)
    new_shift = torch.where(finite, new_shift, torch.zeros_like(new_shift))
    integer = bool(((torch.frac(pitch) == 0) | ~finite).all()) and bool((torch.frac(shift) == 0).all())
    cropped = replace(partitions, seq_len=end - start, shift=new_shift)
    if verify is None:
        verify = not integer
    if not verify:
        return cropped
    want = _boundaries(partitions, start, end)
    got = _boundaries(cropped, 0, end - start)
    bad = (want != got).any(-1)
    if bool(bad.any()):
        new_shift = new_shift.clone()
        for t, h in bad.nonzero().tolist():
            new_shift[t, h] = _fix_shift(partitions, t, h, start, end, float(new_shift[t, h]), want[t, h])
        cropped = replace(partitions, seq_len=end - start, shift=new_shift)
    return cropped


def _boundaries(partitions: Partitions, start: int, end: int) -> torch.Tensor:
    """``(T, H, end-start-1)`` bool: whether a new block starts at each position after the window's first."""
    pos = torch.arange(start, end, dtype=torch.float64)
    pitch = partitions.pitch.to(torch.float64)[..., None]
    lab = torch.floor((pos - partitions.shift.to(torch.float64)[..., None]) / pitch)
    lab = torch.where(torch.isinf(pitch), torch.zeros_like(lab), lab)
    return lab[..., 1:] != lab[..., :-1]


def _fix_shift(partitions: Partitions, t: int, h: int, start: int, end: int, shift: float, want: torch.Tensor) -> float:
    pitch = float(partitions.pitch[t, h])
    pos = torch.arange(end - start, dtype=torch.float64)
    for direction in (math.inf, -math.inf):
        s = shift
        for _ in range(64):
            s = math.nextafter(s, direction)
            if not 0.0 <= s < pitch:
                break
            lab = torch.floor((pos - s) / pitch)
            if bool(((lab[1:] != lab[:-1]) == want).all()):
                return s
    raise RuntimeError(  # pragma: no cover - needs a boundary within ulps of an integer twice over
        f"cannot crop sample {t}, head {h} to [{start}, {end}) exactly in float64"
    )


def _element_size(dtype: torch.dtype | int) -> int:
    if isinstance(dtype, int):
        return dtype
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_rank(
    plan: HaloPlan,
    *,
    batch: int = 1,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | int = torch.float32,
    backward: bool = False,
) -> dict[str, list[int]]:
    """Exact bytes that each rank sends and receives in the halo exchange of one forward (and backward).

    Keys and values travel together: a halo position costs ``2 * batch * kv_heads * head_dim`` elements.
    The backward sends the same pieces' key/value gradients back to their owners (the same byte count, the
    other direction).

    Args:
        plan: from :func:`halo_plan`.
        batch, kv_heads, head_dim: shape of the key/value shards ``(batch, kv_heads, n_local, head_dim)``.
        dtype: element dtype (or its size in bytes).
        backward: include the backward exchange.

    Returns:
        ``{"sent": [...], "received": [...]}``, one entry per rank.
    """
    per_pos = 2 * batch * kv_heads * head_dim * _element_size(dtype)
    sent = [0] * plan.world_size
    recv = [0] * plan.world_size
    for tr in plan.transfers:
        sent[tr.src] += tr.length * per_pos
        recv[tr.dst] += tr.length * per_pos
    if backward:
        sent, recv = [s + r for s, r in zip(sent, recv, strict=True)], [r + s for s, r in zip(sent, recv, strict=True)]
    return {"sent": sent, "received": recv}


EXCHANGES = {"ring": 3, "allgather": 2}
"""The exchanges of exact attention that :func:`exchange_bytes` counts, each with its backward's bytes in units of its
forward's: ring attention's ``K, V`` go round the ring again and ``dK, dV`` once (as in ring-flash-attn: 3); the
all-gather's ``dK, dV`` are reduce-scattered back (2)."""


def exchange_bytes(
    seq_len: int,
    world_size: int,
    *,
    exchange: str = "ring",
    batch: int = 1,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | int = torch.float32,
    backward: bool = False,
) -> int:
    """Bytes each rank receives when exact attention (equal shards) exchanges whole ``K, V`` shards, the baselines of
    the halo exchange: ``exchange="ring"`` (ring attention) or ``"allgather"`` (:data:`EXCHANGES`).

    Forward: the keys and values of the other ``P - 1`` shards, ``(P-1)/P * n`` positions per rank, either way;
    ``backward`` adds the backward's bytes.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {sorted(EXCHANGES)}, got {exchange!r}")
    per_pos = 2 * batch * kv_heads * head_dim * _element_size(dtype)
    forward = (world_size - 1) * (seq_len // world_size) * per_pos
    return forward * (EXCHANGES[exchange] if backward else 1)
