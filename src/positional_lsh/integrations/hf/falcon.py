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

from positional_lsh.integrations.hf.forward import attend_native, check_dropout, check_no_attentions, swap_of

__all__ = ["falcon_forward"]


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
) -> tuple[torch.Tensor, None]:
    check_no_attentions(output_attentions)
    swap = swap_of(self)
    check_dropout(self, self.attention_dropout.p)
    num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    q, k, v = self._split_heads(self.query_key_value(hidden_states))  # (B, L, heads, d)
    b, lq = q.shape[:2]
    q = q.transpose(1, 2).reshape(b, self.num_heads, lq, self.head_dim)
    k = k.transpose(1, 2).reshape(b, num_kv_heads, lq, self.head_dim)
    v = v.transpose(1, 2).reshape(b, num_kv_heads, lq, self.head_dim)
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    return self.dense(attend_native(self, swap, q, k, v, attention_mask, self.inv_norm_factor)), None
