"""Falcon (``alibi=True``): the replacement ``FalconAttention.forward``.

Falcon adds ``m * j`` *before* dividing by ``sqrt(d)``: an effective slope of ``m / sqrt(d)`` in this library's
convention (:func:`positional_lsh.integrations.families.native_slopes`). transformers 5.24's *eager* Falcon path
adds the bias a second time (``2 m / sqrt(d)``); we match its ``sdpa`` path and the original Falcon code.
Multi-query and grouped (``new_decoder_architecture``) key/value heads are passed on as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.forward import attend_native, check_dropout, swap_of


def falcon_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    alibi: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of a swapped ``FalconAttention`` (``alibi=True`` models; installed on the instance): the
    layer's own projections, then this library's attention (positional LSH or exact ALiBi, as the swap says) and
    the output projection; the same arguments and return value as transformers' forward (the ``(B, H, Lq, Lk)``
    attention weights, per query head, when asked: :func:`~positional_lsh.integrations.hf.forward.attend_native`)."""
    layer: Any = self  # a transformers FalconAttention: its attributes are read by name, untyped
    swap = swap_of(self)
    check_dropout(self, layer.attention_dropout.p)
    num_kv_heads = layer.num_heads if layer.new_decoder_architecture else layer.num_kv_heads
    q, k, v = layer._split_heads(layer.query_key_value(hidden_states))  # (B, L, heads, d)
    b, lq = q.shape[:2]
    q = q.transpose(1, 2).reshape(b, layer.num_heads, lq, layer.head_dim)
    k = k.transpose(1, 2).reshape(b, num_kv_heads, lq, layer.head_dim)
    v = v.transpose(1, 2).reshape(b, num_kv_heads, lq, layer.head_dim)
    if layer_past is not None:
        k, v = layer_past.update(k, v, layer.layer_idx)
    ctx, weights = attend_native(self, swap, q, k, v, attention_mask, layer.inv_norm_factor, output_attentions)
    return layer.dense(ctx), weights
