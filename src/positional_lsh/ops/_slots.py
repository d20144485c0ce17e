"""Attention over a fixed buffer of cached keys whose positions are given: the kernel of
:func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache` with ``key_positions`` (private: call the entry point
or :func:`~positional_lsh.ops.kvcache.slot_attention_weights`).

A static KV cache keeps its keys in slots of a buffer of fixed size; some slots are still empty, some hold padded
tokens, and once the cache dropped keys the first slot is no longer position 0. ``key_positions (B, Lk)`` says for
each slot the position of its key in its row's sequence (``-1``: empty or masked), and the queries are the last
``Lq`` slots. The call is then one dense masked softmax over the buffer, its bias computed from the positions by
torch ops (positional LSH: ``log c(i, j)``, ``c`` the number of samples in which ``i`` and ``j`` share a block,
from the partitions' labels at the positions; exact / windowed ALiBi: ``-m |i - j|``, ``-inf`` beyond the window):
no host read and the same shapes at every step, so a compiled decoding step is one graph for the whole generation.
The work is ``O(B H Lq Lk (d + T))``: meant for a few queries on a buffer of the live window (or the whole length,
for exact ALiBi).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from positional_lsh.ops._engine.torch_attention import acc_dtype
from positional_lsh.ops.partitions.partition import Partitions

#: The bias of a call: ``(qpos (B, Lq), kpos (B, Lk), dtype) -> (B, H, Lq, Lk)`` (``-inf``: never kept).
SlotBias = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]

#: Samples whose labels are compared at once (bounds the transient ``(chunk, H, B, Lq, Lk)`` comparison).
_SAMPLE_CHUNK = 8


def plsh_bias(partitions: Partitions) -> SlotBias:
    """Positional LSH: ``log c(i, j)``, ``c`` the number of samples in which positions ``i`` and ``j`` share a block
    (``-inf`` where none; ``log(c / T)`` differs by a constant per row, which the softmax ignores)."""

    def bias(qpos: torch.Tensor, kpos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        lab_q = partitions.labels_at(qpos)[..., :, None]  # (T, H, B, Lq, 1)
        lab_k = partitions.labels_at(kpos)[..., None, :]  # (T, H, B, 1, Lk)
        count = None
        for a in range(0, partitions.num_samples, _SAMPLE_CHUNK):
            part = (lab_q[a : a + _SAMPLE_CHUNK] == lab_k[a : a + _SAMPLE_CHUNK]).sum(0, dtype=torch.int32)
            count = part if count is None else count + part
        assert count is not None
        return torch.log(count.to(dtype)).transpose(0, 1)  # (B, H, Lq, Lk)

    return bias


def alibi_bias(slopes: torch.Tensor, window: torch.Tensor | None) -> SlotBias:
    """Exact ALiBi ``-m_h |i - j|`` (``slopes (H,)``), ``-inf`` beyond ``window (H,)`` when given."""

    def bias(qpos: torch.Tensor, kpos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dist = (qpos[:, None, :, None] - kpos[:, None, None, :]).abs().to(dtype)  # (B, 1, Lq, Lk)
        out = -slopes.to(device=dist.device, dtype=dtype)[None, :, None, None] * dist
        if window is not None:
            far = dist > window.to(device=dist.device, dtype=dtype)[None, :, None, None]
            out = out.masked_fill(far, float("-inf"))
        return out

    return bias


def slot_weights(
    q: torch.Tensor, k: torch.Tensor, key_positions: torch.Tensor, bias: SlotBias, causal: bool, scale: float,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The ``(B, Hq, Lq, Lk)`` attention weights, in the accumulation dtype of ``q`` (float32 for half types):
    ``softmax(scale q k^T + bias + attn_mask)`` with empty or masked slots (``key_positions < 0``), keys after the
    query (``causal``) and keys the bias or ``attn_mask`` (an additive float mask, ``-inf``: not kept) never keeps at
    weight 0; rows of masked queries (or without a key) zeros. ``k`` is ``(B, Hkv, Lk, d)`` (grouped heads:
    ``Hq % Hkv == 0``)."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    kpos = key_positions.to(torch.long)
    qpos = kpos[:, lk - lq :]
    keep = (kpos >= 0)[:, None, None, :] & (qpos >= 0)[:, None, :, None]  # (B, 1, Lq, Lk)
    if causal:
        keep = keep & (kpos[:, None, None, :] <= qpos[:, None, :, None])
    z = bias(qpos.clamp_min(0), kpos.clamp_min(0), acc)
    if attn_mask is not None:
        z = z + attn_mask.to(acc)
    keep = keep & (z > float("-inf"))  # (B, Hq, Lq, Lk)
    kk = k.to(acc).masked_fill(~(kpos >= 0)[:, None, :, None], 0)  # a NaN in an empty or masked slot reaches nothing
    s = torch.matmul(q.to(acc).reshape(b, hkv, (hq // hkv) * lq, d), kk.transpose(-1, -2)).view(b, hq, lq, lk)
    s = torch.where(keep, s * scale + z, float("-inf"))
    some = keep.any(-1, keepdim=True)
    w = torch.softmax(torch.where(some, s, 0.0), dim=-1)  # a row without a key: finite, then zeros
    return torch.where(some, w, 0.0)


def slot_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_positions: torch.Tensor, bias: SlotBias, causal: bool,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """``slot_weights(...) @ v``: ``(B, Hq, Lq, d)`` in ``q``'s dtype; values of empty or masked slots are not read
    (a NaN there reaches nothing)."""
    b, hq, lq, _ = q.shape
    hkv, lk, dv = v.shape[1], v.shape[2], v.shape[3]
    w = slot_weights(q, k, key_positions, bias, causal, scale)
    vv = v.to(w.dtype).masked_fill(~(key_positions >= 0)[:, None, :, None], 0)
    out = torch.matmul(w.reshape(b, hkv, (hq // hkv) * lq, lk), vv).view(b, hq, lq, dv)
    return out if out.dtype == q.dtype else out.to(q.dtype)
