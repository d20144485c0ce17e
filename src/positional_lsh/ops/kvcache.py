"""KV-cache attention: :func:`plsh_attention_with_kvcache`, the op layer's one entry point for decoding.

A decoder that keeps the keys and values of the positions it has seen (a KV cache) calls
:func:`plsh_attention_with_kvcache` with the queries of the new positions: positional LSH with ``partitions``, or
exact / windowed ALiBi with ``slopes`` (and ``window``). It decides how the call runs, in this one place:

* **a few queries** (at most :data:`DECODE_QUERIES`, or any number on a cache that dropped keys) take the decoding
  kernels below, which read only the keys the queries' blocks cover (ALiBi: the keys of the window);
* **more queries** (a long chunk of a prompt continuing a cache) go to :func:`~positional_lsh.plsh_attention` (or
  :func:`~positional_lsh.alibi_attention`) on every cached key, which then runs its own engine;
* **a static cache's buffer** (``key_positions``: the position of each slot's key, empty or masked slots negative)
  takes one dense masked softmax over the buffer (:mod:`positional_lsh.ops._slots`), with no host read and the same
  shapes at every step: one compiled graph for a whole generation;
* ``backend`` / ``method`` are honoured: the decoding kernels are the multiplicity form in torch's matmuls (backend
  ``"math"``, method ``"multiplicity"``), so ``"auto"``, ``"math"`` and ``"multiplicity"`` take them; any other choice
  goes to the full op with that choice, and is refused (``ValueError`` naming the argument) when the cache dropped
  keys the full op would need.

The decoding kernels (:mod:`positional_lsh.ops._decode`) read only the keys of the queries' blocks: the counts
``c[i, j]`` of a span of keys (:func:`~positional_lsh.ops.partitions.counts.block_counts`) and one dense masked
softmax; a one-token call with a :class:`DecodeState` (the caller keeps one per layer and sequence) reuses the
``log c`` row of its blocks until the next block boundary (exact and windowed ALiBi: a view of a per-head ramp),
three kernel calls and no host synchronisation per token. A cache may drop the keys no later query can reach
(:func:`key_reach`).

Torch ops only (any device and dtype, autograd for ``q, k, v`` included). Used by the transformers swap and the
language model's ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from positional_lsh.ops._decode import RampPlan, RowPlan, decode_rows
from positional_lsh.ops._engine.routing import decode_forced
from positional_lsh.ops._slots import SlotBias, alibi_bias, plsh_bias, slot_attention, slot_weights
from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.checks import SlopesLike, as_scale, as_slopes, as_window, check_bool, check_int, check_qkv
from positional_lsh.ops.exact.alibi import alibi_attention
from positional_lsh.ops.options import ALIBI_BACKENDS, BACKENDS, check_backend, check_method
from positional_lsh.ops.padding import check_key_padding_mask, row_groups, strip, with_holes
from positional_lsh.ops.partitions.partition import Partitions

__all__ = ["DecodeState", "key_reach", "plsh_attention_with_kvcache", "slot_attention_weights"]

#: Calls with at most this many queries take the decoding kernels (more: the full op on every cached key, unless the
#: cache dropped keys).
DECODE_QUERIES = 16


def key_reach(partitions: Partitions, *, backend: str = "auto", method: str = "auto") -> int | None:
    """The farthest a query of :func:`plsh_attention_with_kvcache` reaches back: ``max_{t,h} ceil(pitch) - 1``
    (``None`` when a pitch is ``inf``, or when ``backend`` / ``method`` run the full op, which needs every key).

    A block of pitch ``b`` holds at most ``ceil(b)`` positions, so a query at ``i`` shares no block with a key
    ``j < i - key_reach``, in any sample and head; neither does any later query. Capped partitions
    (``max_block``) reach at most ``max_block - 1``. A cache may drop the keys before that.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    if decode_forced(check_backend(backend), check_method(method)):
        return None
    pitch = partitions.pitch
    if not bool(torch.isfinite(pitch).all()):
        return None
    return int(torch.ceil(pitch.clamp_min(1.0)).max().item()) - 1


class DecodeState:
    """What :func:`plsh_attention_with_kvcache` keeps from one call to the next of one decoder layer: the bias row of
    the current token's blocks (positional LSH) or the ALiBi ramp, reused across tokens. Create one per layer and
    sequence (``DecodeState()``) and pass it as ``state=`` with every call of that layer; the entry point fills it.
    It holds no keys, and is rebuilt by the entry point when the partitions or the slopes change."""

    # Filled by the entry point (instance attributes then shadow these empty defaults).
    _plsh: RowPlan | None = None
    _alibi: RampPlan | None = None


def plsh_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    partitions: Partitions | None = None,
    *,
    slopes: SlopesLike = None,
    window: SlopesLike = None,
    key_offset: int = 0,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    method: str = "auto",
    key_padding_mask: torch.Tensor | None = None,
    state: DecodeState | None = None,
    keys_finite: bool = False,
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the last queries of a sequence on its KV cache: positional LSH, or exact / windowed ALiBi.

    Args:
        q: ``(B, Hq, Lq, d)``: the last ``Lq`` positions of the sequence.
        k_cache, v_cache: ``(B, Hkv, Lk, d)``: the keys and values of positions ``key_offset .. key_offset + Lk - 1``
            (``Hq % Hkv == 0``, ``Lq <= Lk``); the sequence ends there. Any strides (e.g. views of a cache buffer).
        partitions: positional LSH: the partitions, for ``Hq`` heads and at least ``key_offset + Lk`` positions
            (their law does not depend on the length: a decoder may pass the same partitions at every step).
        slopes: exact ALiBi instead (give ``partitions`` or ``slopes``, not both): ``(Hq,)`` slopes or one float.
        window: with ``slopes``: ``None`` (exact) or the largest kept distance ``|i - j|``, one number or per head.
        key_offset: position of the first cached key (``>= 0``): keys before it were dropped. ``ValueError`` if a
            query needs one of them (see :func:`key_reach`; ALiBi: the window).
        causal: restrict query ``i`` to keys ``j <= i``.
        scale: score scale, default ``1/sqrt(d)``.
        backend: one of ``positional_lsh.ops.options.BACKENDS`` (``ALIBI_BACKENDS`` with ``slopes``). ``"auto"`` and
            ``"math"`` run the decoding kernels for a few queries; another backend runs the full op with it, on
            every cached key (``ValueError`` naming ``backend`` when the cache dropped keys).
        method: positional LSH's ``method`` (``METHODS``): ``"auto"`` and ``"multiplicity"`` run the decoding
            kernels; ``"samples"`` the full op with it (``ValueError`` naming ``method`` when the cache dropped keys).
            ALiBi has no method: ``"auto"`` only.
        key_padding_mask: ``None`` or the ``(B, key_offset + Lk)`` bool validity of every position of the sequence
            (dropped ones included), ``True`` for a valid key, any pattern (holes too), as the ops'
            ``key_padding_mask``: a masked key leaves the softmax, positions are counted from the row's first valid
            key (masked keys after it included), query rows at masked positions get zeros.
        state: a :class:`DecodeState` the caller keeps per layer: a one-token call (``Lq = 1``, causal, no padding)
            then reuses the bias row of earlier tokens. Without one, the call builds what it needs.
        keys_finite: the caller knows every cached key and value is finite (a cache that checked them when they came
            in): skips the scan for NaN/inf. Otherwise a non-finite key makes the rows that keep it NaN, as in the
            full ops.
        key_positions: a cache of fixed size instead (a static KV cache's buffer, e.g. under ``torch.compile``):
            ``(B, Lk)`` integer, the position of each slot's key in its row's sequence (counted as
            ``key_padding_mask`` counts them: from the row's first valid key), negative for an empty or masked slot;
            the queries are the last ``Lq`` slots (at their positions; a query slot that is masked gets zeros). The
            call is one dense masked softmax over the buffer with the bias computed from the positions (no host
            read, the same shapes at every step: one compiled graph for a whole generation); ``key_offset`` must be
            0 and ``key_padding_mask`` ``None`` (the positions say both), ``state`` is not used, and ``backend`` /
            ``method`` must be ``"auto"``, ``"math"`` / ``"multiplicity"``. Work ``O(B Hq Lq Lk (d + T))``: meant for
            a few queries on a buffer of the live window.

    Returns:
        ``(B, Hq, Lq, d)`` in ``q``'s dtype (accumulated in float32 for half types), equal to
        ``plsh_attention(q, k_all, v_all, partitions=...)`` (``alibi_attention(q, k_all, v_all, slopes, window=...)``)
        on the whole sequence, float rounding aside. Differentiable in ``q, k, v``.
    """
    shape = check_qkv(q, k_cache, v_cache)
    key_offset = check_int("key_offset", key_offset, minimum=0)
    causal = check_bool("causal", causal)
    keys_finite = check_bool("keys_finite", keys_finite)
    sc = as_scale(scale, shape.head_dim)
    if state is not None and not isinstance(state, DecodeState):
        raise TypeError(f"state must be a DecodeState or None, got {type(state).__name__}")
    n = key_offset + shape.k_len
    mask = check_key_padding_mask(key_padding_mask, q, n)
    if (partitions is None) == (slopes is None):
        raise ValueError("give partitions (positional LSH) or slopes (exact ALiBi), exactly one of them")
    if key_positions is not None:
        if key_offset != 0 or key_padding_mask is not None:
            raise ValueError("key_positions gives every slot's position and validity: pass key_offset=0 and no "
                             "key_padding_mask with it")  # fmt: skip
        bias = _slot_bias(q, k_cache, key_positions, partitions, slopes, window, backend, method)
        return slot_attention(q, k_cache, v_cache, key_positions, bias, causal, sc)
    if partitions is not None:
        if window is not None:
            raise ValueError("window is exact ALiBi's (with slopes=); positional LSH takes partitions, got a window")
        return _plsh(q, k_cache, v_cache, partitions, key_offset, causal, sc, backend, method, mask, state, keys_finite)
    return _alibi(q, k_cache, v_cache, slopes, window, key_offset, causal, sc, backend, method, mask, state,
                  keys_finite)  # fmt: skip


def slot_attention_weights(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    key_positions: torch.Tensor,
    partitions: Partitions | None = None,
    *,
    slopes: SlopesLike = None,
    window: SlopesLike = None,
    causal: bool = True,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``(B, Hq, Lq, Lk)`` attention weights of :func:`plsh_attention_with_kvcache` with ``key_positions`` (the
    same arguments): ``softmax(scale q k^T + bias)`` over the buffer's slots, positional LSH's ``log c`` or exact /
    windowed ALiBi's ``-m |i - j|``; empty or masked slots, keys after the query and keys no block (window) keeps
    weigh 0; masked query rows are zeros. In the accumulation dtype of ``q`` (float32 for half types);
    ``weights @ v`` is the call's output.

    ``attn_mask``: ``None`` or an additive float mask broadcastable to ``(B, Hq, Lq, Lk)``, added after the bias
    (``-inf``: not kept; a custom attention mask, with ``causal=False`` and the positions of a whole call as
    ``key_positions``, queries and keys alike)."""
    check_qkv(q, k_cache, k_cache)
    causal = check_bool("causal", causal)
    sc = as_scale(scale, q.shape[-1])
    if (partitions is None) == (slopes is None):
        raise ValueError("give partitions (positional LSH) or slopes (exact ALiBi), exactly one of them")
    shape = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[2])
    if attn_mask is not None and (
        not isinstance(attn_mask, torch.Tensor)
        or not attn_mask.is_floating_point()
        or attn_mask.dim() != 4
        or any(m not in (1, n) for m, n in zip(attn_mask.shape, shape, strict=True))
    ):
        shown = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise ValueError(f"attn_mask must be a float tensor broadcastable to {shape}, got {shown}")
    bias = _slot_bias(q, k_cache, key_positions, partitions, slopes, window, "auto", "auto")
    return slot_weights(q, k_cache, key_positions, bias, causal, sc, attn_mask)


def _slot_bias(
    q: torch.Tensor, k: torch.Tensor, key_positions: object, partitions: Partitions | None, slopes: SlopesLike,
    window: SlopesLike, backend: str, method: str,
) -> SlotBias:  # fmt: skip
    """Checks a call with ``key_positions`` and returns its bias (:mod:`positional_lsh.ops._slots`)."""
    b, hq, lk = q.shape[0], q.shape[1], k.shape[2]
    if (
        not isinstance(key_positions, torch.Tensor)
        or key_positions.dtype not in (torch.int32, torch.int64)
        or tuple(key_positions.shape) != (b, lk)
    ):
        shown = (f"{tuple(key_positions.shape)} {key_positions.dtype}" if isinstance(key_positions, torch.Tensor)
                 else type(key_positions).__name__)  # fmt: skip
        raise ValueError(f"key_positions must be a ({b}, {lk}) int32 or int64 tensor (one position per cached key), "
                         f"got {shown}")  # fmt: skip
    if key_positions.device != q.device:
        raise ValueError(f"key_positions is on {key_positions.device}, q on {q.device}: put them on one device")
    backend = check_backend(backend, BACKENDS if partitions is not None else ALIBI_BACKENDS)
    forced = decode_forced(backend, check_method(method))
    if forced:
        name, value = forced[0]
        raise ValueError(f"{name}={value!r} cannot run with key_positions (a dense call over the buffer's slots): use "
                         f"{name}='auto'")  # fmt: skip
    if partitions is not None:
        if not isinstance(partitions, Partitions):
            raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
        if window is not None:
            raise ValueError("window is exact ALiBi's (with slopes=); positional LSH takes partitions, got a window")
        if partitions.num_heads != hq:
            raise ValueError(f"partitions are for {partitions.num_heads} heads; q has {hq} heads")
        return plsh_bias(partitions)
    if torch.compiler.is_compiling():  # values cannot be read while tracing: the structural checks only
        return alibi_bias(as_slopes(slopes, hq, read=False),
                          None if window is None else as_slopes(window, hq, "window", read=False))  # fmt: skip
    return alibi_bias(as_slopes(slopes, hq), as_window(window, hq))


def _by_row_groups(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, key_offset: int, scale: float,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """A masked call: ``attend(q, k, v, key_offset, seq_len)`` (at the explicit ``scale``) on each row group's
    queries and its cached keys from the span's first valid key (positions counted from there; a span with holes
    through :func:`~positional_lsh.ops.padding.with_holes`); query rows at masked positions stay zeros."""
    out = q.new_zeros(q.shape)
    for g in row_groups(mask, q.shape[2]) or ():
        first = max(g.keys.start, key_offset)  # the group's first cached key
        cached = slice(first - key_offset, g.keys.stop - key_offset)
        qg, kg, vg = q[g.rows][:, :, g.queries], k[g.rows][:, :, cached], v[g.rows][:, :, cached]
        span = (first - g.keys.start, g.keys.stop - g.keys.start)
        if g.valid is None:
            sub = attend(qg, kg, vg, *span)
        else:
            valid = g.valid[:, first - g.keys.start :]
            sub = strip(attend(*with_holes(qg, kg, vg, valid, scale), *span))
            sub = torch.where(valid[:, None, valid.shape[1] - qg.shape[2] :, None], sub, sub.new_zeros(()))
        out[g.rows, :, g.queries] = sub
    return out


def _plsh(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Partitions, key_offset: int, causal: bool,
    scale: float, backend: str, method: str, mask: torch.Tensor | None, state: DecodeState | None, keys_finite: bool,
) -> torch.Tensor:  # fmt: skip
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    backend, method = check_backend(backend), check_method(method)
    hq, lq = q.shape[1], q.shape[2]
    n = key_offset + k.shape[2]
    if partitions.num_heads != hq or partitions.seq_len < n:
        raise ValueError(
            f"partitions are for {partitions.num_heads} heads and seq_len={partitions.seq_len}; q has {hq} heads "
            f"and the keys cover positions {key_offset}..{n - 1} (at least seq_len={n})"
        )
    forced = decode_forced(backend, method)
    if forced or (key_offset == 0 and lq > min(n - 1, DECODE_QUERIES)):
        # The full op on every cached key: a forced backend or method, or a long chunk of queries.
        if key_offset > 0:
            name, value = forced[0]
            raise ValueError(
                f"{name}={value!r} runs plsh_attention on the whole sequence, but the KV cache dropped the keys "
                f"before position {key_offset}; use {name}='auto' (the decoding kernels) or keep every key"
            )
        return plsh_attention(q, k, v, partitions=partitions.with_seq_len(n), causal=causal, scale=scale,
                              backend=backend, method=method, key_padding_mask=mask)  # fmt: skip
    if mask is not None and not bool(mask.all()):

        def group(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, offset: int, _: int) -> torch.Tensor:
            return decode_rows(qg, kg, vg, partitions, offset, causal, scale)

        return _by_row_groups(q, k, v, mask, key_offset, scale, group)
    if lq == 1 and causal and state is not None:
        plan = state._plsh
        if plan is None or not plan.serves(partitions):
            plan = state._plsh = RowPlan(partitions)
        return plan.step(q, k, v, key_offset, scale, keys_finite)
    return decode_rows(q, k, v, partitions, key_offset, causal, scale)


def _alibi(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: SlopesLike, window: SlopesLike, key_offset: int,
    causal: bool, scale: float, backend: str, method: str, mask: torch.Tensor | None, state: DecodeState | None,
    keys_finite: bool,
) -> torch.Tensor:  # fmt: skip
    backend = check_backend(backend, ALIBI_BACKENDS)
    if method != "auto":
        raise ValueError(f"method is positional LSH's; exact ALiBi (slopes=) takes method='auto' only, got {method!r}")
    hq, lq, lk = q.shape[1], q.shape[2], k.shape[2]
    plan = None if state is None else state._alibi
    if plan is None or not plan.serves(slopes, window):
        plan = RampPlan(slopes, window, hq)
        if state is not None:
            state._alibi = plan
    elif plan.slopes.numel() != hq:
        raise ValueError(f"slopes has {plan.slopes.numel()} entries; q has {hq} heads")
    if mask is not None and key_offset > 0 and not bool(mask.all()):

        def group(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, offset: int, _: int) -> torch.Tensor:
            plan.check_reach(offset, qg.shape[2], kg.shape[2])
            return alibi_attention(qg, kg, vg, plan.slopes, causal=causal, window=plan.window, scale=scale,
                                   backend=backend)  # fmt: skip

        return _by_row_groups(q, k, v, mask, key_offset, scale, group)
    plan.check_reach(key_offset, lq, lk)
    if lq == 1 and causal and not decode_forced(backend, "auto") and (mask is None or bool(mask.all())):
        return plan.step(q, k, v, scale, keys_finite)
    return alibi_attention(q, k, v, plan.slopes, causal=causal, window=plan.window, scale=scale, backend=backend,
                           key_padding_mask=mask)  # fmt: skip
