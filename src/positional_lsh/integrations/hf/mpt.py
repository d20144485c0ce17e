"""MPT: the replacement ``MptAttention.forward`` (the model's projections, ``clip_qkv`` and KV cache, then the swap's
attention). MPT's bias ``m * (j - (n - 1))`` is added after scaling; without an ``n x n`` bias, its ``max_seq_len``
limit disappears.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.forward import attend_native, check_dropout, swap_of

__all__ = ["mpt_forward"]


def mpt_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_bias: torch.Tensor | None = None,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    swap = swap_of(self)
    check_dropout(self, self.attn_dropout_p)
    b, lq = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (x.reshape(b, lq, self.n_heads, self.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    return self.out_proj(attend_native(self, swap, q, k, v, attention_mask, self.softmax_scale)), None
