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
from positional_lsh.distributed.chunked import ChunkedWindowAttention, LocalOptions, local_window_attention
from positional_lsh.distributed.exchange import halo_exchange
from positional_lsh.distributed.halo import HaloPlan, crop_partitions, halo_plan
from positional_lsh.ops._checks import check_bool, check_qkv, nonnegative_int, positive_int
from positional_lsh.ops.options import DEFAULT_BACKEND, DEFAULT_METHOD, check_backend, check_method
from positional_lsh.ops.partitions import check_partitions, check_slopes_match

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


def _local_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Exception | None:
    """This rank's problem with its own shard, or ``None``; returned, not raised, so that every rank learns of it
    (in the one ``all_gather``) and none of them hangs.

    :func:`~positional_lsh.ops._checks.check_qkv`'s checks (an empty shard, which holds no positions, is checked as
    one position of the same batch, heads, head_dim, dtype and device), plus what sharding needs: ``q`` and ``k``
    hold the same positions, and a dtype that the metadata carries.
    """
    shard = (q, k, v)
    if all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in shard):
        if q.shape[2] != k.shape[2]:
            return ValueError(f"q and k must hold the same positions of the shard, got {q.shape[2]} and {k.shape[2]}")
        if q.shape[2] == 0:
            shard = tuple(t.new_empty((t.shape[0], t.shape[1], 1, t.shape[3])) for t in shard)
    try:
        check_qkv(*shard)
    except (TypeError, ValueError) as exc:
        return exc
    if q.dtype not in _DTYPES:
        return TypeError(f"q, k and v must be float64, float32, bfloat16 or float16, got {q.dtype}")
    return None


def _check_lengths(shard_lengths: Sequence[int], world: int) -> list[int]:
    """``shard_lengths`` as a list of ``world`` ints ``>= 0`` (``TypeError``/``ValueError`` naming it)."""
    if isinstance(shard_lengths, (str, bytes)) or not isinstance(shard_lengths, Sequence):
        raise TypeError(f"shard_lengths must be a sequence of ints, got {type(shard_lengths).__name__}")
    out = [nonnegative_int(f"shard_lengths[{r}]", x) for r, x in enumerate(shard_lengths)]
    if len(out) != world:
        raise ValueError(f"shard_lengths has {len(out)} entries for a group of {world} ranks")
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
    backend: str = DEFAULT_BACKEND,
    method: str = DEFAULT_METHOD,
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
            checksum: when they disagree, or a rank's shard is invalid, every rank raises, the invalid rank its own
            ``TypeError``/``ValueError`` and the others ``ValueError``).
        head_chunk: ``None`` (default): one ``plsh_attention`` call on the joined key/value window, which it keeps
            for the backward. An int: compute ``head_chunk`` key/value heads at a time and recompute them in the
            backward (:class:`~positional_lsh.distributed.chunked.ChunkedWindowAttention`): only ``q, k, v`` and
            the small halo are kept, no joined window or output — lower peak memory for one more forward's time.
        backend: kernel backend of the local ``plsh_attention`` calls (``ops.options.BACKENDS``).
        method: how the local ``plsh_attention`` calls compute the estimator (``ops.options.METHODS``). Neither
            changes the result beyond float rounding; see :func:`positional_lsh.plsh_attention`.

    Returns:
        ``(B, Hq, n_local, d)`` in ``q``'s dtype, differentiable w.r.t. ``q``, ``k``, ``v``. Every rank of
        the group must call it (and run the backward) in the same order.
    """
    head_chunk = _check_options(causal, partitions, head_chunk)
    local = LocalOptions(causal, scale, check_backend(backend), check_method(method))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        n_local = check_qkv(q, k, v)[3]
        if shard_lengths is not None and _check_lengths(shard_lengths, 1) != [n_local]:
            raise ValueError(f"shard_lengths={shard_lengths!r} for one rank holding {n_local} positions")
        opts = {"num_samples": num_samples, "scheme": scheme, "generator": generator, "partitions": partitions}
        return plsh_attention(q, k, v, slopes, causal=causal, scale=scale, backend=backend, method=method, **opts)
    # Validation, one all_gather (every rank raises alike), planning, then the exchange and the local compute.
    world = dist.get_world_size(group)
    lengths = None if shard_lengths is None else _check_lengths(shard_lengths, world)
    parts_key = _sampling_key(partitions, slopes, num_samples, scheme, generator)
    err = _local_error(q, k, v)
    table = _gather_meta(q, k, v, err, causal, scale, lengths, parts_key, world, group)
    lengths = _agreed_lengths(table, err, lengths)
    hq = q.shape[1]
    if partitions is None:
        slopes = alibi_slopes(hq) if slopes is None else slopes
        partitions = sample_partitions(
            sum(lengths), slopes, num_samples, scheme=scheme, generator=generator, num_heads=hq
        )
    else:
        _check_whole_partitions(partitions, slopes, sum(lengths), hq)
    plan = halo_plan(partitions, lengths, causal=causal)
    return _local_attention(q, k, v, plan, dist.get_rank(group), group, partitions, local, head_chunk)


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


def _check_options(causal: object, partitions: object, head_chunk: object) -> int | None:
    """Checks of the options (before any communication; ``q, k, v`` are checked by every rank's
    :func:`_local_error` or, on one rank, by ``check_qkv``); returns ``head_chunk`` as an int or ``None``."""
    check_bool("causal", causal)
    if partitions is not None and not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    return None if head_chunk is None else positive_int("head_chunk", head_chunk)


def _gather_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    err: Exception | None,
    causal: bool,
    scale: float | None,
    lengths: list[int] | None,
    parts_key: int,
    world: int,
    group: Any,
) -> torch.Tensor:
    """One small all_gather: every rank's shapes, options and checksums, ``(world, 11)`` int64."""
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
    meta[_PARTS] = parts_key
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    return torch.stack(gathered)


def _agreed_lengths(table: torch.Tensor, err: Exception | None, lengths: list[int] | None) -> list[int]:
    """Raise unless all ranks agree (a rank with bad input raises its own error, the others ``ValueError``);
    return the shard lengths."""
    bad = table[:, _ERR].nonzero().flatten().tolist()
    if err is not None:
        raise err
    if bad:
        raise ValueError(f"invalid input on rank(s) {bad} of the context-parallel group")
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
    check_partitions(partitions, hq, n)
    check_slopes_match(slopes, partitions, hq)


def _local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: HaloPlan,
    rank: int,
    group: Any,
    partitions: Partitions,
    local: LocalOptions,
    head_chunk: int | None,
) -> torch.Tensor:
    """Exchange the halo and run ``plsh_attention`` on this rank's key window (whole or in head chunks)."""
    n_local = q.shape[2]
    left, end, right = plan.left[rank], plan.ends[rank], plan.right[rank]
    if head_chunk is not None and n_local > 0:
        local_parts = crop_partitions(partitions, left, right)
        exchange_group = dist.group.WORLD if group is None else group
        out: torch.Tensor = ChunkedWindowAttention.apply(
            q, k, v, plan, rank, exchange_group, local_parts, local, head_chunk
        )
        return out
    k_win, v_win = halo_exchange(k, v, plan, rank, group)
    if n_local == 0:
        # Nothing to compute; keep k and v in the graph so that their (empty) gradients are zeros, not None.
        return q * 0.0 + (k_win.sum() + v_win.sum()) * 0.0
    return local_window_attention(q, k_win, v_win, crop_partitions(partitions, left, right), local, right - end)
