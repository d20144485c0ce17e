"""Context-parallel positional-LSH attention: each rank holds a contiguous shard of the sequence.

Only the keys/values of blocks that cross shard boundaries travel (see :mod:`positional_lsh.distributed.halo`);
each rank then runs :func:`positional_lsh.plsh_attention` on its key window with the whole-sequence partitions
cropped to that window. The result is this rank's rows of what ``plsh_attention`` gives on the whole sequence.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from positional_lsh import Partitions, alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.distributed.chunked import ChunkedWindowAttention
from positional_lsh.distributed.exchange import halo_exchange
from positional_lsh.distributed.halo import HaloPlan, crop_partitions, halo_plan

__all__ = ["context_parallel_plsh_attention"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# Layout of the metadata vector that every rank all-gathers once per call.
_ERR, _B, _HQ, _HKV, _LEN, _D, _DTYPE, _CAUSAL, _SCALE, _LENGTHS, _PARTS = range(11)


def _digest(*parts: object) -> int:
    """A 56-bit hash of the parts (tensors hashed by their bytes): equal on every rank for equal inputs."""
    h = hashlib.blake2b(digest_size=7)
    for part in parts:
        if isinstance(part, torch.Tensor):
            h.update(part.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little")


def _partitions_digest(p: Partitions) -> int:
    decays = None if p.decays is None else [repr(x) for x in p.decays]
    return _digest("partitions", p.seq_len, p.scheme, p.slopes, p.pitch, p.shift, decays, p.decay_len, p.max_block)


def _local_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Problems with this rank's own shard (reported to every rank, so that none of them hangs)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            return f"{name} must have rank 4 (batch, heads, n_local, head_dim), got shape {tuple(t.shape)}"
        if t.dtype not in _DTYPES:
            return f"{name} must be float64, float32, bfloat16 or float16, got {t.dtype}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if k.shape != v.shape:
        return f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch size and head_dim"
    if q.shape[2] != k.shape[2]:
        return f"q and k must hold the same positions of the shard, got {q.shape[2]} and {k.shape[2]}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        return f"the number of query heads ({q.shape[1]}) must be a multiple of the key/value heads ({k.shape[1]})"
    return None


def _check_lengths(shard_lengths: Sequence[int], world: int) -> list[int]:
    if isinstance(shard_lengths, (str, bytes)) or not isinstance(shard_lengths, Sequence):
        raise TypeError(f"shard_lengths must be a sequence of ints, got {type(shard_lengths).__name__}")
    out = []
    for x in shard_lengths:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"shard_lengths must hold ints, got {shard_lengths!r}")
        out.append(int(x))
    if len(out) != world:
        raise ValueError(f"shard_lengths has {len(out)} entries for a group of {world} ranks")
    if any(x < 0 for x in out):
        raise ValueError(f"shard_lengths must be >= 0, got {out}")
    return out


# Long only for its signature and docstring (the public reference); the body is a few step calls.
def context_parallel_plsh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | Sequence[float] | float | None = None,
    *,
    num_samples: int = 8,
    partitions: Partitions | None = None,
    scheme: str = "discrete",
    generator: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    group: Any = None,
    shard_lengths: Sequence[int] | None = None,
    head_chunk: int | None = None,
) -> torch.Tensor:
    """Positional-LSH attention over a sequence split across the ranks of a process group.

    Rank ``r`` holds positions ``[sum(lengths[:r]), sum(lengths[:r+1]))`` of the whole sequence (contiguous
    shards in rank order). The result is rank ``r``'s rows of ``plsh_attention(q_all, k_all, v_all, ...)``
    on the whole sequence with the same partitions: the estimator ``softmax(s + log Mbar) v`` with
    ``s[i, j] = scale * q_i . k_j``, approximating the ALiBi bias ``-slopes[h] * |i - j|`` added to the
    scaled score. Only the keys/values of blocks that cross shard boundaries are exchanged, by point-to-point
    sends; gradients of those halo keys/values are sent back to their owners in the backward.

    Args:
        q: ``(B, Hq, n_local, d)`` this rank's queries; float64, float32, bfloat16 or float16.
        k: ``(B, Hkv, n_local, d)`` this rank's keys (``Hq % Hkv == 0``: grouped-query attention).
        v: ``(B, Hkv, n_local, d)`` this rank's values.
        slopes: ALiBi slopes ``(Hq,)`` or one float; default ``alibi_slopes(Hq)``. Must equal
            ``partitions.slopes`` when both are given.
        num_samples: ``T`` partitions per head when sampling.
        partitions: partitions of the WHOLE sequence (``seq_len == sum of the shard lengths``), identical on
            every rank (checked by a checksum).
        scheme: sampling scheme when ``partitions`` is not given.
        generator: an ``int`` seed, required when ``partitions`` is not given, so that every rank draws the
            same partitions (a ``torch.Generator`` or the global RNG may differ across ranks and is refused).
        causal: causal (left halos) or bidirectional (left and right halos) attention.
        scale: score scale, default ``1/sqrt(d)``.
        group: the context-parallel process group (default: the world). Without an initialized process
            group, or with a group of one rank, this is :func:`positional_lsh.plsh_attention`.
        shard_lengths: ``(P,)`` positions per rank; default: each rank's ``n_local``, exchanged in the one small
            ``all_gather`` that every call makes (it also checks shapes, dtypes, options and the partitions'
            checksum, raising ``ValueError`` on every rank when they disagree).
        head_chunk: ``None`` (default): one ``plsh_attention`` call on the joined key/value window, which it keeps
            for the backward. An int: compute ``head_chunk`` key/value heads at a time and recompute them in the
            backward (:class:`~positional_lsh.distributed.chunked.ChunkedWindowAttention`): only ``q, k, v`` and
            the small halo are kept, no joined window or output — lower peak memory for one more forward's time.

    Returns:
        ``(B, Hq, n_local, d)`` in ``q``'s dtype, differentiable w.r.t. ``q``, ``k``, ``v``. Every rank of
        the group must call it (and run the backward) in the same order.
    """
    head_chunk = _check_args(q, k, v, causal, partitions, head_chunk)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if shard_lengths is not None and (
            isinstance(shard_lengths, (str, bytes))
            or not isinstance(shard_lengths, Sequence)
            or [int(x) for x in shard_lengths] != [q.shape[-2]]
        ):
            raise ValueError(f"shard_lengths={shard_lengths!r} for one rank holding {q.shape[-2]} positions")
        opts = {"num_samples": num_samples, "scheme": scheme, "generator": generator}
        return plsh_attention(q, k, v, slopes, causal=causal, partitions=partitions, scale=scale, **opts)
    # Validation, one all_gather (every rank raises alike), planning, then the exchange and the local compute.
    world = dist.get_world_size(group)
    lengths = None if shard_lengths is None else _check_lengths(shard_lengths, world)
    parts_key = _sampling_key(partitions, slopes, num_samples, scheme, generator)
    table = _gather_meta(q, k, v, causal, scale, lengths, parts_key, world, group)
    lengths = _agreed_lengths(table, _local_error(q, k, v), lengths)
    hq = q.shape[1]
    if partitions is None:
        slopes = alibi_slopes(hq) if slopes is None else slopes
        partitions = sample_partitions(
            sum(lengths), slopes, num_samples, scheme=scheme, generator=generator, num_heads=hq
        )
    else:
        _check_whole_partitions(partitions, slopes, sum(lengths), hq)
    plan = halo_plan(partitions, lengths, causal=causal)
    return _local_attention(q, k, v, plan, dist.get_rank(group), group, partitions, causal, scale, head_chunk)


def _sampling_key(partitions: Partitions | None, slopes: Any, num_samples: int, scheme: str, generator: Any) -> int:
    """Checksum of the partitions (or of how they are drawn), compared across ranks; the seed must be an int."""
    if partitions is not None:
        return _partitions_digest(partitions)
    if isinstance(generator, bool) or not isinstance(generator, numbers.Integral):
        raise ValueError(
            "context parallelism needs the same partitions on every rank: pass an int seed as generator, or "
            f"partitions (got generator={type(generator).__name__}, whose state may differ across ranks)"
        )
    slopes_key = slopes if not isinstance(slopes, torch.Tensor) else slopes.detach().double().cpu()
    return _digest("sample", num_samples, scheme, int(generator), slopes_key)


def _check_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, partitions: Partitions | None, head_chunk: Any
) -> int | None:
    """Type checks of the arguments (before any communication); returns ``head_chunk`` as an int or ``None``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if partitions is not None and not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    if head_chunk is None:
        return None
    if isinstance(head_chunk, bool) or not isinstance(head_chunk, numbers.Integral) or head_chunk < 1:
        raise ValueError(f"head_chunk must be an int >= 1 or None, got {head_chunk!r}")
    return int(head_chunk)


def _gather_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    lengths: list[int] | None,
    parts_key: int,
    world: int,
    group: Any,
) -> torch.Tensor:
    """One small all_gather: every rank's shapes, options and checksums, ``(world, 11)`` int64."""
    meta = torch.zeros(11, dtype=torch.int64)
    if _local_error(q, k, v) is not None:
        meta[_ERR] = 1
    else:
        b, hq, n_local, d = q.shape
        meta[_B], meta[_HQ], meta[_HKV], meta[_LEN], meta[_D] = b, hq, k.shape[1], n_local, d
        meta[_DTYPE] = _DTYPES.index(q.dtype)
    meta[_CAUSAL] = int(causal)
    meta[_SCALE] = _digest(scale)
    meta[_LENGTHS] = _digest(lengths)
    meta[_PARTS] = parts_key
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    return torch.stack(gathered)


def _agreed_lengths(table: torch.Tensor, err: str | None, lengths: list[int] | None) -> list[int]:
    """Raise ``ValueError`` (on every rank alike) unless all ranks agree; return the shard lengths."""
    bad = table[:, _ERR].nonzero().flatten().tolist()
    if bad:
        raise ValueError(err if err is not None else f"invalid input on rank(s) {bad} of the context-parallel group")
    for col, what in (
        (_B, "batch size"),
        (_HQ, "number of query heads"),
        (_HKV, "number of key/value heads"),
        (_D, "head_dim"),
        (_DTYPE, "dtype"),
        (_CAUSAL, "causal flag"),
        (_SCALE, "scale"),
        (_LENGTHS, "shard_lengths"),
    ):
        if bool((table[:, col] != table[0, col]).any()):
            values = table[:, col].tolist() if col not in (_SCALE, _LENGTHS) else "differ"
            raise ValueError(f"ranks of the context-parallel group disagree on the {what}: {values}")
    if bool((table[:, _PARTS] != table[0, _PARTS]).any()):
        raise ValueError(
            "ranks of the context-parallel group have different partitions (or sampling options/seeds); every "
            "rank must use the partitions of the whole sequence drawn from one seed"
        )
    local = table[:, _LEN].tolist()
    if lengths is not None and lengths != local:
        raise ValueError(f"shard_lengths={lengths} but the ranks hold {local} positions")
    return local


def _check_whole_partitions(partitions: Partitions, slopes: Any, n: int, hq: int) -> None:
    """Given partitions must be those of the whole sequence, for ``hq`` heads, with the given slopes."""
    if partitions.seq_len != n:
        raise ValueError(
            f"partitions must be those of the whole sequence: seq_len={partitions.seq_len}, but the shards "
            f"hold {n} positions"
        )
    if partitions.num_heads != hq:
        raise ValueError(f"partitions were drawn for {partitions.num_heads} heads, but q has {hq} heads")
    if slopes is not None:
        given = torch.as_tensor(slopes, dtype=torch.float64).expand(hq)
        if not torch.allclose(given, partitions.slopes):
            raise ValueError("slopes differ from partitions.slopes; pass one or the other")


def _local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: HaloPlan,
    rank: int,
    group: Any,
    partitions: Partitions,
    causal: bool,
    scale: float | None,
    head_chunk: int | None,
) -> torch.Tensor:
    """Exchange the halo and run ``plsh_attention`` on this rank's key window (whole or in head chunks)."""
    b, hq, n_local, d = q.shape
    left, end, right = plan.left[rank], plan.ends[rank], plan.right[rank]
    if head_chunk is not None and n_local > 0:
        local_parts = crop_partitions(partitions, left, right)
        exchange_group = dist.group.WORLD if group is None else group
        out: torch.Tensor = ChunkedWindowAttention.apply(
            q, k, v, plan, rank, exchange_group, local_parts, causal, scale, head_chunk
        )
        return out
    k_win, v_win = halo_exchange(k, v, plan, rank, group)
    if n_local == 0:
        # Nothing to compute; keep k and v in the graph so that their (empty) gradients are zeros, not None.
        return q * 0.0 + (k_win.sum() + v_win.sum()) * 0.0
    local_parts = crop_partitions(partitions, left, right)
    if causal or right == end:
        return plsh_attention(q, k_win, v_win, partitions=local_parts, causal=causal, scale=scale)
    # Bidirectional with a right halo: queries are aligned to the LAST keys, so pad the queries with the
    # right halo's positions (zeros; their rows are discarded and get no gradient) and keep the shard's rows.
    pad = q.new_zeros((b, hq, right - end, d))
    out = plsh_attention(torch.cat([q, pad], dim=2), k_win, v_win, partitions=local_parts, causal=False, scale=scale)
    return out[:, :, :n_local]
