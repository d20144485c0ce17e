"""The RoPE family (Llama, Mistral, Qwen2, Qwen3) in the paper's setup, through transformers' attention registry.

The rotary embedding is neutralized (it returns ``cos = 1, sin = 0``, so ``apply_rotary_pos_emb`` is the
identity; a decoded token gets the previous token's ones and zeros, not a fresh ``cos``/``sin`` to discard) and
:func:`attention_function`, registered under ``"positional_lsh"`` in transformers' ``AttentionInterface``, runs
the swap's attention; :func:`install` selects it with ``model.set_attn_implementation`` after
:func:`check_installable` has found the rotary embeddings.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.forward import check_dropout, swap_of
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION, is_slot_mask, key_validity, segments_of_cu_seqlens


def attention_function(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function registered as ``"positional_lsh"`` in transformers' ``AttentionInterface``.

    ``query (B, Hq, Lq, d)``, ``key, value (B, Hkv, Lk, d)`` (after the model's — neutralized — rotary
    embedding and KV cache); returns ``((B, Lq, Hq, d), weights)``: the ``(B, Hq, Lq, Lk)`` attention weights
    when the model call asked for them (``output_attentions``; the output is then ``weights @ v``:
    :meth:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap.attend_with_weights`), else ``None``.
    Packed sequences: the segment ids the mask interface
    hands down for position ids that restart, or flash-attention's ``cu_seq_lens_k`` keyword
    (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), which wins when given. A custom 4-D mask (which
    the swap's forward hook let in: no KV cache) goes to
    :meth:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap.attend_custom_mask`.
    """
    swap = swap_of(module)
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError("positional_lsh attention is causal only; this module asked for non-causal attention")
    if sliding_window is not None:
        raise ValueError("sliding-window layers are not supported by positional_lsh attention")
    if softcap is not None:
        raise ValueError("attention logit soft-capping is not supported by positional_lsh attention")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks are not supported by positional_lsh attention")
    if dropout:
        check_dropout(module, float(dropout))
    b, lk = query.shape[0], key.shape[-2]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    layer: Any = module  # a transformers attention module: its layer_idx is read by name, untyped
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and not is_slot_mask(attention_mask):
        out, weights = swap.attend_custom_mask(layer.layer_idx, module.training, query, key, value, attention_mask,
                                               scale)  # fmt: skip
        asked = kwargs.get("output_attentions") or swap.output_attentions
        return out.transpose(1, 2).contiguous(), weights if asked else None
    valid = key_validity(attention_mask, b, lk)
    cu = kwargs.get("cu_seq_lens_k")
    if cu is not None:  # DataCollatorWithFlattening(return_flash_attn_kwargs=True): one flattened row of documents
        valid = segments_of_cu_seqlens(cu, b, lk)
    weights = None
    if kwargs.get("output_attentions") or swap.output_attentions:  # the output from the weights returned
        out, weights = swap.attend_with_weights(layer.layer_idx, module.training, query, key, value, valid, scale)
    else:
        out = swap.attend(layer.layer_idx, module.training, query, key, value, valid, scale)
    return out.transpose(1, 2).contiguous(), weights


def _neutral_rotary(original: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    # The last one-position call's key and (cos, sin): every decoded token asks for the same ones and zeros (eager
    # only; keyed by the position ids' shape, the dtype and device, and inference mode, whose tensors autograd
    # cannot save). Nothing modifies them: the model multiplies q and k by them.
    held: dict[str, tuple[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]]] = {}

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = args[0] if args else kwargs.get("x")
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        key = None
        if isinstance(x, torch.Tensor) and isinstance(pos, torch.Tensor) and pos.dim() > 0 and pos.shape[-1] == 1:
            if not torch.compiler.is_compiling():
                key = (tuple(pos.shape), x.dtype, x.device, torch.is_inference_mode_enabled())
                last = held.get("last")
                if last is not None and last[0] == key:
                    return last[1]
        cos, sin = original(*args, **kwargs)
        out = (torch.ones_like(cos), torch.zeros_like(sin))
        if key is not None:
            held["last"] = (key, out)
        return out

    return forward


def check_installable(model: nn.Module) -> list[nn.Module]:
    """The rotary embedding modules of a RoPE-family ``model``, checked before anything is changed.

    ``ValueError`` for models with sliding-window layers (``config.layer_types``) or without a rotary embedding.
    """
    cfg: Any = model.config  # a transformers PretrainedConfig: read by name
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise ValueError(
            "models with sliding-window layers (config.layer_types) are not supported; positional_lsh and "
            "ALiBi attention need every layer to see (and cache) all keys"
        )
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if not rotary:
        raise ValueError(f"found no rotary embedding module in this {cfg.model_type} model")
    return rotary


def install(model: nn.Module, rotary: list[nn.Module]) -> None:
    """Neutralize the rotary embeddings and select the registered attention (the swap's installer records the
    changes by comparing the instance attributes before and after)."""
    hf_model: Any = model  # a transformers PreTrainedModel: set_attn_implementation and config are untyped here
    cfg = hf_model.config
    if getattr(cfg, "sliding_window", None) is not None:
        # Mistral: a full-attention cache and the plain causal mask (ALiBi/positional LSH replace it).
        cfg.sliding_window = None
    for m in rotary:
        m.__dict__["forward"] = types.MethodType(_neutral_rotary(m.forward), m)
    hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if cfg._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} refused attn_implementation={ATTN_IMPLEMENTATION!r}")
