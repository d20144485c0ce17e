"""Context-parallel positional-LSH attention: each rank holds a contiguous shard of the sequence.

Only the keys/values of blocks that cross shard boundaries travel (see :mod:`positional_lsh.distributed.halo`);
each rank then runs :func:`positional_lsh.plsh_attention` on its key window with the whole-sequence partitions
cropped to that window. The result is this rank's rows of what ``plsh_attention`` gives on the whole sequence.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from positional_lsh import Partitions, alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.distributed.chunked import (
    ChunkedWindowAttention,
    LocalOptions,
    RankWindow,
    local_window_attention,
)
from positional_lsh.distributed.exchange import halo_exchange
from positional_lsh.distributed.halo import crop_partitions, halo_plan
from positional_lsh.ops.checks import as_scale, check_bool, check_qkv, nonnegative_int, positive_int
from positional_lsh.ops.options import DEFAULT_BACKEND, DEFAULT_METHOD, check_backend, check_method
from positional_lsh.ops.partitions.partition import check_partitions, check_slopes_match

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

    :func:`~positional_lsh.ops.checks.check_qkv`'s checks (an empty shard, which holds no positions, is checked as
    one position of the same batch, heads, head_dim, dtype and device), plus what sharding needs: ``q`` and ``k``
    hold the same positions, and a dtype that the metadata carries.
    """
    shard: tuple[torch.Tensor, ...] = (q, k, v)
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
            checksum). Every argument is checked on every rank before that exchange; when any check fails on any
            rank, or the ranks disagree, every rank raises the same ``ValueError`` (naming the failed ranks and
            each one's error), so that none of them hangs.
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
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        _check_options(causal, partitions, head_chunk)
        check_backend(backend)
        check_method(method)
        n_local = check_qkv(q, k, v)[3]
        if shard_lengths is not None and _check_lengths(shard_lengths, 1) != [n_local]:
            raise ValueError(f"shard_lengths={shard_lengths!r} for one rank holding {n_local} positions")
        return plsh_attention(
            q, k, v, slopes, num_samples=num_samples, scheme=scheme, generator=generator, partitions=partitions,
            causal=causal, scale=scale, backend=backend, method=method,
        )  # fmt: skip
    # Every check on every rank, then one all_gather (a failed check included: every rank raises alike, none
    # hangs), then planning, the exchange and the local compute.
    world = dist.get_world_size(group)
    try:
        call = _check_call(q, k, v, slopes, num_samples, partitions, scheme, generator, causal, scale, shard_lengths,
                           head_chunk, backend, method, world)  # fmt: skip
        err: Exception | None = None
    except Exception as exc:  # any failure: the other ranks must learn of it before anyone raises
        call, err = None, exc
    table = _gather_meta(q, k, v, err, causal, scale, None if call is None else call.lengths,
                         0 if call is None else call.parts_key, world, group)  # fmt: skip
    _raise_if_invalid(table, err, group)
    assert call is not None
    lengths = _agreed_lengths(table, call.lengths)
    n = sum(lengths)
    if call.partitions.seq_len != n and partitions is not None:
        raise ValueError(
            f"partitions must be those of the whole sequence: seq_len={partitions.seq_len}, but the shards "
            f"hold {n} positions"
        )
    whole = call.partitions if partitions is not None else call.partitions.with_seq_len(n)
    plan = halo_plan(whole, lengths, causal=causal)
    return _local_attention(q, k, v, RankWindow(plan, dist.get_rank(group), group, whole, call.local, call.head_chunk))


class _Call(NamedTuple):
    """A context-parallel call whose arguments passed this rank's checks."""

    local: LocalOptions
    head_chunk: int | None
    lengths: list[int] | None
    parts_key: int
    partitions: Partitions  # given, or drawn for one position (extended to the whole sequence after the gather)


def _check_call(
    q: Any, k: Any, v: Any, slopes: Any, num_samples: Any, partitions: Any, scheme: Any, generator: Any,
    causal: Any, scale: Any, shard_lengths: Any, head_chunk: Any, backend: Any, method: Any, world: int,
) -> _Call:  # fmt: skip
    """Every check of a call that needs no other rank, raising the first problem: options, this rank's shard, the
    shard lengths, the scale, and the partitions (given: heads and slopes; else drawn here, which checks the slopes,
    ``num_samples``, ``scheme`` and the int seed). What needs the whole group (equal options and partitions, the
    total length) is compared after the gather."""
    chunk = _check_options(causal, partitions, head_chunk)
    if isinstance(slopes, torch.Tensor) and slopes.requires_grad:  # never a silent missing slope gradient
        raise ValueError(
            "slopes requires grad, but context-parallel attention over more than one rank computes no slope "
            "gradient (slope_grad); pass slopes.detach(), or learn the slopes without context parallelism"
        )
    local = LocalOptions(causal, scale, check_backend(backend), check_method(method))
    err = _local_error(q, k, v)
    if err is not None:
        raise err
    as_scale(scale, q.shape[-1])
    lengths = None if shard_lengths is None else _check_lengths(shard_lengths, world)
    hq = q.shape[1]
    key = _sampling_key(partitions, slopes, num_samples, scheme, generator)
    if partitions is None:
        slopes = alibi_slopes(hq) if slopes is None else slopes
        partitions = sample_partitions(1, slopes, num_samples, scheme=scheme, generator=generator, num_heads=hq)
    else:
        check_partitions(partitions, hq, partitions.seq_len)
        check_slopes_match(slopes, partitions, hq)
    return _Call(local, chunk, lengths, key, partitions)


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
    meta[_CAUSAL] = int(causal) if isinstance(causal, bool) else -1
    meta[_SCALE] = _digest(scale)
    meta[_LENGTHS] = _digest(lengths)
    meta[_PARTS] = parts_key
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    return torch.stack(gathered)


# Longest message of a rank's error that the other ranks receive (bytes of UTF-8).
_MESSAGE_BYTES = 480


def _raise_if_invalid(table: torch.Tensor, err: Exception | None, group: Any) -> None:
    """If any rank's checks failed, every rank raises the same ``ValueError``: which ranks, and each one's error
    (a second small all_gather, only on this path, carries the messages)."""
    bad = table[:, _ERR].nonzero().flatten().tolist()
    if not bad:
        return
    text = "" if err is None else f"{type(err).__name__}: {' '.join(str(err).split())}"
    data = text.encode("utf-8")[:_MESSAGE_BYTES]
    mine = torch.zeros(_MESSAGE_BYTES + 2, dtype=torch.uint8)
    mine[0], mine[1] = len(data) // 256, len(data) % 256
    mine[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[2:2]
    gathered = [torch.empty_like(mine) for _ in range(table.shape[0])]
    dist.all_gather(gathered, mine, group=group)
    messages: dict[str, list[int]] = {}
    for r in bad:
        size = int(gathered[r][0]) * 256 + int(gathered[r][1])
        msg = bytes(gathered[r][2 : 2 + size].tolist()).decode("utf-8", errors="replace")
        messages.setdefault(msg, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in messages.items()]
    raise ValueError(f"invalid input on rank(s) {bad} of the context-parallel group ({'; '.join(parts)})")


def _agreed_lengths(table: torch.Tensor, lengths: list[int] | None) -> list[int]:
    """Raise (alike on every rank) unless all ranks agree on the shapes, options and partitions; return the shard
    lengths."""
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


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: RankWindow) -> torch.Tensor:
    """Exchange the halo and run ``plsh_attention`` on this rank's key window (whole or in head chunks)."""
    n_local = q.shape[2]
    plan, rank, group, partitions, local, head_chunk = window
    left, end, right = plan.left[rank], plan.ends[rank], plan.right[rank]
    if head_chunk is not None and n_local > 0:
        chunked = window._replace(
            group=dist.group.WORLD if group is None else group, partitions=crop_partitions(partitions, left, right)
        )
        out: torch.Tensor = ChunkedWindowAttention.apply(q, k, v, chunked)
        return out
    k_win, v_win = halo_exchange(k, v, plan, rank, group)
    if n_local == 0:
        # Nothing to compute; keep k and v in the graph so that their (empty) gradients are zeros, not None.
        return q * 0.0 + (k_win.sum() + v_win.sum()) * 0.0
    return local_window_attention(q, k_win, v_win, crop_partitions(partitions, left, right), local, right - end)
