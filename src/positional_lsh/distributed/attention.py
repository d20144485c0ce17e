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
from positional_lsh.distributed.exchange import halo_exchange
from positional_lsh.distributed.halo import crop_partitions, halo_plan

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
    return _digest("partitions", p.seq_len, p.scheme, p.slopes, p.pitch, p.shift)


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

    Returns:
        ``(B, Hq, n_local, d)`` in ``q``'s dtype, differentiable w.r.t. ``q``, ``k``, ``v``. Every rank of
        the group must call it (and run the backward) in the same order.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if partitions is not None and not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if shard_lengths is not None and (
            isinstance(shard_lengths, (str, bytes))
            or not isinstance(shard_lengths, Sequence)
            or [int(x) for x in shard_lengths] != [q.shape[-2]]
        ):
            raise ValueError(f"shard_lengths={shard_lengths!r} for one rank holding {q.shape[-2]} positions")
        return plsh_attention(
            q,
            k,
            v,
            slopes,
            num_samples=num_samples,
            causal=causal,
            partitions=partitions,
            scheme=scheme,
            generator=generator,
            scale=scale,
        )
    if partitions is None and (isinstance(generator, bool) or not isinstance(generator, numbers.Integral)):
        raise ValueError(
            "context parallelism needs the same partitions on every rank: pass an int seed as generator, or "
            f"partitions (got generator={type(generator).__name__}, whose state may differ across ranks)"
        )
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    lengths = None if shard_lengths is None else _check_lengths(shard_lengths, world)

    # One small all_gather: shapes, options and checksums of every rank.
    err = _local_error(q, k, v)
    meta = torch.zeros(11, dtype=torch.int64)
    if err is not None:
        meta[_ERR] = 1
    else:
        b, hq, n_local, d = q.shape
        meta[_B], meta[_HQ], meta[_HKV], meta[_LEN], meta[_D] = b, hq, k.shape[1], n_local, d
        meta[_DTYPE] = _DTYPES.index(q.dtype)
    meta[_CAUSAL] = int(causal)
    meta[_SCALE] = _digest(scale)
    meta[_LENGTHS] = _digest(lengths)
    if partitions is not None:
        meta[_PARTS] = _partitions_digest(partitions)
    else:
        slopes_key = slopes if not isinstance(slopes, torch.Tensor) else slopes.detach().double().cpu()
        meta[_PARTS] = _digest("sample", num_samples, scheme, int(generator), slopes_key)  # type: ignore[arg-type]
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    table = torch.stack(gathered)

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
    if lengths is None:
        lengths = local
    elif lengths != local:
        raise ValueError(f"shard_lengths={lengths} but the ranks hold {local} positions")

    b, hq, n_local, d = q.shape
    n = sum(lengths)
    if partitions is None:
        if slopes is None:
            slopes = alibi_slopes(hq)
        partitions = sample_partitions(n, slopes, num_samples, scheme=scheme, generator=generator, num_heads=hq)
    else:
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

    plan = halo_plan(partitions, lengths, causal=causal)
    k_win, v_win = halo_exchange(k, v, plan, rank, group)
    if n_local == 0:
        # Nothing to compute; keep k and v in the graph so that their (empty) gradients are zeros, not None.
        return q * 0.0 + (k_win.sum() + v_win.sum()) * 0.0
    left, end, right = plan.left[rank], plan.ends[rank], plan.right[rank]
    local_parts = crop_partitions(partitions, left, right)
    if causal or right == end:
        return plsh_attention(q, k_win, v_win, partitions=local_parts, causal=causal, scale=scale)
    # Bidirectional with a right halo: queries are aligned to the LAST keys, so pad the queries with the
    # right halo's positions (zeros; their rows are discarded and get no gradient) and keep the shard's rows.
    pad = q.new_zeros((b, hq, right - end, d))
    out = plsh_attention(torch.cat([q, pad], dim=2), k_win, v_win, partitions=local_parts, causal=False, scale=scale)
    return out[:, :, :n_local]
