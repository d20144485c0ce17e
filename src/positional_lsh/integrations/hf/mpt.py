"""MPT: the replacement ``MptAttention.forward`` (the model's projections, ``clip_qkv`` and KV cache, then the swap's
attention). MPT's bias ``m * (j - (n - 1))`` is added after scaling; without an ``n x n`` bias, its ``max_seq_len``
limit disappears.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.forward import attend_native, check_dropout, swap_of


def mpt_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_bias: torch.Tensor | None = None,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of a swapped ``MptAttention`` (installed on the instance): the layer's own projections, then
    this library's attention (positional LSH or exact ALiBi, as the swap says) and the output projection; the same
    arguments and return value as transformers' forward (the ``(B, H, Lq, Lk)`` attention weights when the model
    call asked for them: :func:`~positional_lsh.integrations.hf.forward.attend_native`)."""
    layer: Any = self  # a transformers MptAttention: its attributes are read by name, untyped
    swap = swap_of(self)
    check_dropout(self, layer.attn_dropout_p)
    b, lq = hidden_states.shape[:2]
    mixed = layer.Wqkv(hidden_states)
    if layer.clip_qkv:
        mixed = mixed.clamp(min=-layer.clip_qkv, max=layer.clip_qkv)
    q, k, v = (x.reshape(b, lq, layer.n_heads, layer.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(k, v, layer.layer_idx, kwargs=kwargs)
    ctx, weights = attend_native(self, swap, q, k, v, attention_mask, layer.softmax_scale)
    return layer.out_proj(ctx), weights
