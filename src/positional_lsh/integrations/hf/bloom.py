"""BLOOM: the replacement ``BloomAttention.forward`` (the model's projections and KV cache, then the swap's attention).

BLOOM adds ``m * j`` per key after scaling by ``1/sqrt(d)`` (equal to ``-m |i - j|`` up to a per-row constant), so
its slopes are used as they are (:func:`positional_lsh.integrations.families.native_slopes`).

The stock ``BloomModel`` builds a ``(B H, 1, n)`` ALiBi tensor for every call (``n`` the whole sequence, also for one
decoded token), which the replacement forward does not read: the swap installs :class:`NoAlibi` as the model's
``build_alibi_tensor`` (a zero-strided view: no ``O(n)`` buffer, no ``O(n)`` work per token) and hands the model an
all-valid mask view when it gets none (:func:`all_valid_mask`), so that it calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_masks_for_generate

from positional_lsh.integrations.hf.forward import attend_native, check_dropout, swap_of
from positional_lsh.integrations.hf.masks import all_valid
from positional_lsh.integrations.hf.static_cache import LiveKeyStaticCache


@dataclass(eq=False)
class NoAlibi:
    """A swapped ``BloomModel``'s ``build_alibi_tensor``: the ``(B H, 1, n)`` shape the model passes on, as a view of
    one zero (the replacement attention computes its own positions)."""

    def __call__(self, attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        batch, n = attention_mask.shape[0], attention_mask.shape[-1]  # (B, n), or a static cache's (B, 1, 1, n) slots
        return torch.zeros((), dtype=dtype, device=attention_mask.device).expand(batch * num_heads, 1, n)


@dataclass(eq=False)
class SlotMasks:
    """A swapped BLOOM's ``create_masks_for_generate`` (what ``generate`` calls before each step on a static cache):
    for the swap's :class:`~positional_lsh.integrations.hf.static_cache.LiveKeyStaticCache`, transformers' generic
    mask creation (the swap's mask function: the slots' positions, of a fixed shape at every step); otherwise
    BLOOM's own (its 2-D mask padded to the cache's length)."""

    model: Any

    def __call__(self, config: Any, inputs_embeds: torch.Tensor, attention_mask: Any, cache: Any, **kwargs: Any) -> Any:
        if isinstance(cache, LiveKeyStaticCache):
            return create_masks_for_generate(config, inputs_embeds, attention_mask, cache, **kwargs)
        own = type(self.model).create_masks_for_generate
        return own(self.model, config, inputs_embeds, attention_mask, cache, **kwargs)


def install(model: nn.Module) -> None:
    """On a BLOOM causal LM being swapped: :class:`NoAlibi` as its base model's ``build_alibi_tensor`` and
    :class:`SlotMasks` as its ``create_masks_for_generate`` (instance attributes: the swap's restore removes them)."""
    base: Any = model.base_model
    base.__dict__["build_alibi_tensor"] = NoAlibi()
    if hasattr(type(model), "create_masks_for_generate"):
        model.__dict__["create_masks_for_generate"] = SlotMasks(model)


def all_valid_mask(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Give a ``BloomModel`` call (``args``, ``kwargs``: its arguments) without an ``attention_mask`` the all-valid
    ``(B, past + L)`` mask as a view of one ``True`` (the stock model then calls :class:`NoAlibi` instead of building
    its ALiBi tensor for every position); eager calls with ``input_ids`` (by name or first) or ``inputs_embeds``."""
    if len(args) > 1 or kwargs.get("attention_mask") is not None or torch.compiler.is_compiling():
        return
    tokens = args[0] if args else kwargs.get("input_ids")
    if not isinstance(tokens, torch.Tensor):
        tokens = kwargs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
    kwargs["attention_mask"] = all_valid(tokens.device).expand(tokens.shape[0], past + tokens.shape[1])


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
    weights when asked: :func:`~positional_lsh.integrations.hf.forward.attend_native`)."""
    layer: Any = self  # a transformers BloomAttention: its attributes are read by name, untyped
    swap = swap_of(self)
    check_dropout(self, layer.attention_dropout.p)
    q, k, v = layer._reshape(layer.query_key_value(hidden_states))  # (B, H, L, d) each
    if layer_past is not None:
        k, v = layer_past.update(k, v, layer.layer_idx)
    ctx, weights = attend_native(self, swap, q, k, v, attention_mask, layer.inv_norm_factor, output_attentions)
    if layer.pretraining_tp > 1 and layer.slow_but_exact:
        slices = layer.hidden_size / layer.pretraining_tp
        out = torch.zeros_like(ctx)
        for i in range(layer.pretraining_tp):
            a, z = int(i * slices), int((i + 1) * slices)
            out = out + F.linear(ctx[:, :, a:z], layer.dense.weight[:, a:z])
    else:
        out = layer.dense(ctx)
    out = residual + F.dropout(out, p=layer.hidden_dropout, training=layer.training)
    return out, weights
