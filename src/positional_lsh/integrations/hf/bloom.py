"""BLOOM: the replacement ``BloomAttention.forward`` (the model's projections and KV cache, then the swap's attention).

BLOOM adds ``m * j`` per key after scaling by ``1/sqrt(d)`` (equal to ``-m |i - j|`` up to a per-row constant), so
its slopes are used as they are (:func:`positional_lsh.integrations.families.native_slopes`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from positional_lsh.integrations.hf.forward import attend_native, check_dropout, native_weights, swap_of


def bloom_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of a swapped ``BloomAttention`` (installed on the instance): the layer's own projections, then
    this library's attention (positional LSH or exact ALiBi, as the swap says), the output projection and the
    residual; the same arguments and return value as transformers' forward (the ``(B, H, Lq, Lk)`` attention
    weights when asked: :func:`~positional_lsh.integrations.hf.forward.native_weights`)."""
    layer: Any = self  # a transformers BloomAttention: its attributes are read by name, untyped
    swap = swap_of(self)
    check_dropout(self, layer.attention_dropout.p)
    q, k, v = layer._reshape(layer.query_key_value(hidden_states))  # (B, H, L, d) each
    if layer_past is not None:
        k, v = layer_past.update(k, v, layer.layer_idx)
    ctx = attend_native(self, swap, q, k, v, attention_mask, layer.inv_norm_factor)  # (B, L, H * d)
    if layer.pretraining_tp > 1 and layer.slow_but_exact:
        slices = layer.hidden_size / layer.pretraining_tp
        out = torch.zeros_like(ctx)
        for i in range(layer.pretraining_tp):
            a, z = int(i * slices), int((i + 1) * slices)
            out = out + F.linear(ctx[:, :, a:z], layer.dense.weight[:, a:z])
    else:
        out = layer.dense(ctx)
    out = residual + F.dropout(out, p=layer.hidden_dropout, training=layer.training)
    return out, native_weights(self, swap, q, k, attention_mask, layer.inv_norm_factor, output_attentions)
