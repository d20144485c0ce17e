"""The one table of model families: where each architecture's attention is, its heads, slopes and Q/K/V.

Both the transformers swap (:mod:`positional_lsh.integrations.hf`) and Q/K/V capture
(:mod:`positional_lsh.theory.capture`) read this table, so they find the same attention modules and the same
ALiBi slopes. One :class:`Family` per architecture:

==================  ===================================  ==========================================================
family              models (``config.model_type``)       swap
==================  ===================================  ==========================================================
``bloom``           BLOOM                                native: the attention's ``forward`` is replaced
``mpt``             MPT                                  native
``falcon``          Falcon (ALiBi only with ``alibi``)   native (only ``alibi=True``)
``rope``            Llama, Mistral, Qwen2, Qwen3         transformers' attention registry, rotary embedding neutral
``gpt_neox``        GPT-NeoX                             capture only
``gpt2``            GPT-2                                capture only
``transformer_lm``  the project's ``TransformerLM``      capture only (it has its own positional-LSH modes)
==================  ===================================  ==========================================================

Models of other types are matched by the shape of their attention modules (``q_proj``/``k_proj``/``v_proj``,
a fused ``qkv`` with ``n_head`` and ``head_dim``, ``query_key_value``, ``Wqkv``, ``c_attn``), for capture only.

**Slopes: what the stock model computes.** :func:`native_slopes` reads each model's own ALiBi builder, called
as the stock forward calls it, and converts to this library's convention (bias ``-slope |i - j|`` added to the
*scaled* score):

* BLOOM: ``build_alibi_tensor`` — float32 slopes ``m`` times the key position, after scaling.
* MPT: ``build_mpt_alibi_tensor(num_heads, length)`` — transformers' ``MptModel`` passes no
  ``alibi_bias_max``, so the default 8 is what the stock model uses whatever ``attn_config.alibi_bias_max``
  (or ``attn_config.alibi``) says (transformers 5.24); the config value is therefore ignored here too.
* Falcon (``alibi=True``): ``build_alibi_tensor`` rounds the slopes to bfloat16 and the model divides the bias
  by ``sqrt(hidden_size / num_heads)`` *after* adding it to the unscaled score: slope ``bf16(m) / sqrt(d)``.

The builders compute ``slope * position`` at their own precision (float32 for BLOOM and MPT, bfloat16 for
Falcon) whatever the model's dtype; their last step casts each bias value to the activations' dtype, which
rounds ``m * j`` position by position and is not a change of slope, so the slope is read before that cast
(returned as float64). The project's ``TransformerLM`` gives ``cfg.slopes()`` in its ALiBi modes.

This module imports neither transformers nor the swap at import time: the transformers builders are taken
from the model's own modeling module, and a family's replacement forward is named by its import path.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from positional_lsh.ops.errors import UserError
from positional_lsh.theory.qkv import (
    CapturePoint,
    split_falcon_grouped,
    split_falcon_multiquery,
    split_fused_blocks,
    split_fused_interleaved,
    split_heads,
    split_neox,
)


@dataclass(frozen=True)
class Family:
    """One architecture: how to find its attention, its heads, slopes and Q/K/V, and how the swap replaces it.

    Attributes:
        name: the family's name (``AttentionSwap.family`` for the swappable ones).
        model_types: ``config.model_type`` values of transformers models of this family.
        is_attention: recognizes an attention module by its structure (used when ``attention_class`` is not
            found, and to match models of unknown type).
        num_heads: model -> number of query heads.
        capture: ``(attention module, layer index, model) -> [CapturePoint]``: where its Q/K/V are.
        slopes: model -> ``(H,)`` float64 slopes in this library's convention, ``None`` without ALiBi.
        attention_class: name of the attention class in the model's modeling module (transformers models).
        forward: ``"module:function"`` of the replacement attention forward (native ALiBi families).
        registry: swapped through transformers' attention registry (the RoPE family).
    """

    name: str
    model_types: tuple[str, ...]
    is_attention: Callable[[nn.Module], bool]
    num_heads: Callable[[nn.Module], int]
    capture: Callable[[nn.Module, int, nn.Module], list[CapturePoint]]
    slopes: Callable[[nn.Module], torch.Tensor | None]
    attention_class: str | None = None
    forward: str | None = None
    registry: bool = False

    @property
    def swappable(self) -> bool:
        """Whether :mod:`positional_lsh.integrations.hf` can swap this family's attention."""
        return self.forward is not None or self.registry

    def load_forward(self) -> Callable[..., Any]:
        """The replacement attention forward (imports its module, which needs transformers)."""
        if self.forward is None:
            raise ValueError(f"the {self.name} family has no replacement forward")
        module, name = self.forward.split(":")
        return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _attr(obj: nn.Module, name: str) -> Any:
    """``obj.name`` (``AttributeError`` when missing), typed ``Any``: the attributes of a transformers model or
    attention module are read by name (``nn.Module.__getattr__`` is typed ``Tensor | Module``)."""
    return getattr(obj, name)


def _cfg(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _modeling_module(model: nn.Module) -> types.ModuleType | None:
    """The transformers modeling module the model's classes come from (``None`` for other models)."""
    base = getattr(model, "base_model", model)
    return sys.modules.get(type(base).__module__)


def _builder(model: nn.Module, name: str) -> Callable[..., torch.Tensor]:
    fn = getattr(_modeling_module(model), name, None)
    if not callable(fn):
        raise ValueError(f"cannot find {name} in the modeling code of {type(model).__name__}")
    return fn


def _has(mod: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(mod, n, None), nn.Module) for n in names)


def _out_features(mod: nn.Module) -> int:
    out = getattr(mod, "out_features", None)
    if out is None:
        weight = getattr(mod, "weight", None)
        if weight is None:
            raise ValueError(f"cannot tell the output size of {type(mod).__name__}")
        out = weight.shape[0]
    return int(out)


def _heads(model: nn.Module) -> int:
    return int(_cfg(_config(model), "num_attention_heads", "n_head", "n_heads"))


def _hidden(model: nn.Module) -> int:
    return int(_cfg(_config(model), "hidden_size", "d_model", "n_embd"))


def _no_slopes(model: nn.Module) -> None:
    return None


# --------------------------------------------------------------------------------------------------
# Slopes: the stock model's own builders
# --------------------------------------------------------------------------------------------------


def _bloom_slopes(model: nn.Module) -> torch.Tensor:
    """BLOOM: ``build_alibi_tensor`` gives ``m * j`` per key (float32 products), added after scaling."""
    build = _builder(model, "build_alibi_tensor")
    alibi = build(torch.ones(1, 2, dtype=torch.long), int(_attr(model, "config").n_head), torch.float64)  # (H, 1, 2)
    return alibi[:, 0, 1].to(torch.float64)


def _mpt_slopes(model: nn.Module) -> torch.Tensor:
    """MPT: ``build_mpt_alibi_tensor(H, n)`` gives ``m * (j - (n - 1))``, called as ``MptModel`` calls it."""
    build = _builder(model, "build_mpt_alibi_tensor")
    alibi = build(int(_attr(model, "config").n_heads), 2)  # (H, 1, 2); no alibi_bias_max, as in MptModel.forward
    return (-alibi[:, 0, 0]).to(torch.float64)


def _falcon_slopes(model: nn.Module) -> torch.Tensor | None:
    """Falcon ``alibi=True``: bfloat16 slopes times ``j``, added before dividing by ``sqrt(d)``."""
    cfg = _attr(model, "config")
    if not getattr(cfg, "alibi", False):
        return None
    h = int(cfg.num_attention_heads)
    build = _builder(model, "build_alibi_tensor")
    alibi = build(torch.ones(1, 2, dtype=torch.long), h, torch.float64)  # (H, 1, 2), bfloat16 values
    return alibi[:, 0, 1].to(torch.float64) / math.sqrt(cfg.hidden_size // h)


def _transformer_lm_slopes(model: nn.Module) -> torch.Tensor | None:
    """The project's ``TransformerLM``: ``cfg.slopes()`` in its ALiBi modes (``alibi``, ``plsh``, ``window-alibi``).

    With learned slopes (``cfg.learn_slopes``) the slopes every layer uses now (``model.slopes()``), when all layers
    share them; learned slopes that differ between layers have no one ``(H,)`` answer: ``UserError``.
    """
    cfg = getattr(model, "cfg", None)
    slopes = getattr(cfg, "slopes", None)
    if getattr(cfg, "position", None) not in ("alibi", "plsh", "window-alibi") or not callable(slopes):
        return None
    if getattr(cfg, "learn_slopes", False):
        per_layer = model.slopes()  # type: ignore[operator]  # TransformerLM.slopes(): (n_layer, n_head)
        if not bool((per_layer == per_layer[:1]).all()):
            raise UserError(
                "this TransformerLM learned different slopes in each layer, so it has no one set of ALiBi slopes; "
                "read them per layer with model.slopes(), or pass the slopes explicitly"
            )
        return per_layer[0].to(torch.float64)
    return slopes().detach().to("cpu", torch.float64).reshape(-1)


# --------------------------------------------------------------------------------------------------
# Capture points
# --------------------------------------------------------------------------------------------------


def _rope_points(mod: nn.Module, layer: int, model: nn.Module) -> list[CapturePoint]:
    d = getattr(mod, "head_dim", None) or _cfg(_config(model), "head_dim") or (_hidden(model) // _heads(model))
    q_proj, k_proj, v_proj = _attr(mod, "q_proj"), _attr(mod, "k_proj"), _attr(mod, "v_proj")
    hq, hkv = _out_features(q_proj) // d, _out_features(k_proj) // d
    return [
        CapturePoint(layer, q_proj, "q", split_heads(hq, d)),
        CapturePoint(layer, k_proj, "k", split_heads(hkv, d)),
        CapturePoint(layer, v_proj, "v", split_heads(hkv, d)),
    ]


def _nanogpt_points(mod: nn.Module, layer: int, model: nn.Module) -> list[CapturePoint]:
    # Fused [q | k | v] as the project's TransformerLM (``qkv(x).view(b, l, 3, n_head, head_dim)``); RoPE,
    # when configured, comes after it.
    h, d = _attr(mod, "n_head"), _attr(mod, "head_dim")
    return [CapturePoint(layer, _attr(mod, "qkv"), "qkv", split_fused_blocks(h, h, d))]


def _falcon_points(mod: nn.Module, layer: int, model: nn.Module) -> list[CapturePoint]:
    d, h = _attr(mod, "head_dim"), _attr(mod, "num_heads")
    if getattr(mod, "new_decoder_architecture", False):
        split = split_falcon_grouped(h, _attr(mod, "num_kv_heads"), d)
    elif getattr(mod, "multi_query", False):
        split = split_falcon_multiquery(h, d)
    else:
        split = split_fused_interleaved(h, d)
    return [CapturePoint(layer, _attr(mod, "query_key_value"), "qkv", split)]


def _neox_points(mod: nn.Module, layer: int, model: nn.Module) -> list[CapturePoint]:
    heads = _heads(model)
    d = getattr(mod, "head_size", None) or getattr(mod, "head_dim", None) or _hidden(model) // heads
    return [CapturePoint(layer, _attr(mod, "query_key_value"), "qkv", split_neox(heads, d))]


def _bloom_points(mod: nn.Module, layer: int, model: nn.Module) -> list[CapturePoint]:
    h = getattr(mod, "num_heads", None) or _heads(model)
    d = getattr(mod, "head_dim", None) or _hidden(model) // h
    return [CapturePoint(layer, _attr(mod, "query_key_value"), "qkv", split_fused_interleaved(h, d))]


def _fused_blocks_points(attr: str) -> Callable[[nn.Module, int, nn.Module], list[CapturePoint]]:
    def points(mod: nn.Module, layer: int, model: nn.Module) -> list[CapturePoint]:
        h = getattr(mod, "n_heads", None) or getattr(mod, "num_heads", None) or _heads(model)
        d = getattr(mod, "head_dim", None) or _hidden(model) // h
        return [CapturePoint(layer, getattr(mod, attr), "qkv", split_fused_blocks(h, h, d))]

    return points


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------


def _is_nanogpt(mod: nn.Module) -> bool:
    return (
        isinstance(getattr(mod, "qkv", None), nn.Linear)
        and isinstance(getattr(mod, "n_head", None), int)
        and isinstance(getattr(mod, "head_dim", None), int)
    )


def _is_fused_qkv(mod: nn.Module, name_part: str | None) -> bool:
    if not _has(mod, "query_key_value"):
        return False
    cls = type(mod).__name__
    if name_part is None:  # BLOOM: any other fused query_key_value
        return "Falcon" not in cls and "NeoX" not in cls
    return name_part in cls


#: Every family, in the order used to match models of unknown type by their attention modules.
FAMILIES: tuple[Family, ...] = (
    Family(
        name="rope",
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        is_attention=lambda m: _has(m, "q_proj", "k_proj", "v_proj"),
        num_heads=lambda model: int(_attr(model, "config").num_attention_heads),
        capture=_rope_points,
        slopes=_no_slopes,
        registry=True,
    ),
    Family(
        name="transformer_lm",
        model_types=(),
        is_attention=_is_nanogpt,
        num_heads=lambda model: int(_attr(model, "cfg").n_head),
        capture=_nanogpt_points,
        slopes=_transformer_lm_slopes,
    ),
    Family(
        name="falcon",
        model_types=("falcon",),
        is_attention=lambda m: _is_fused_qkv(m, "Falcon"),
        num_heads=lambda model: int(_attr(model, "config").num_attention_heads),
        capture=_falcon_points,
        slopes=_falcon_slopes,
        attention_class="FalconAttention",
        forward="positional_lsh.integrations.hf.falcon:falcon_forward",
    ),
    Family(
        name="gpt_neox",
        model_types=("gpt_neox",),
        is_attention=lambda m: _is_fused_qkv(m, "NeoX"),
        num_heads=lambda model: int(_attr(model, "config").num_attention_heads),
        capture=_neox_points,
        slopes=_no_slopes,
    ),
    Family(
        name="bloom",
        model_types=("bloom",),
        is_attention=lambda m: _is_fused_qkv(m, None),
        num_heads=lambda model: int(_attr(model, "config").n_head),
        capture=_bloom_points,
        slopes=_bloom_slopes,
        attention_class="BloomAttention",
        forward="positional_lsh.integrations.hf.bloom:bloom_forward",
    ),
    Family(
        name="mpt",
        model_types=("mpt",),
        is_attention=lambda m: _has(m, "Wqkv"),
        num_heads=lambda model: int(_attr(model, "config").n_heads),
        capture=_fused_blocks_points("Wqkv"),
        slopes=_mpt_slopes,
        attention_class="MptAttention",
        forward="positional_lsh.integrations.hf.mpt:mpt_forward",
    ),
    Family(
        name="gpt2",
        model_types=("gpt2",),
        is_attention=lambda m: _has(m, "c_attn") and hasattr(m, "split_size"),
        num_heads=lambda model: int(_attr(model, "config").n_head),
        capture=_fused_blocks_points("c_attn"),
        slopes=_no_slopes,
    ),
)


def family_of(model: nn.Module) -> Family | None:
    """The model's :class:`Family`: by ``config.model_type``, else by the first attention module it recognizes."""
    mtype = getattr(_config(model), "model_type", None)
    for fam in FAMILIES:
        if mtype in fam.model_types:
            return fam
    for mod in model.modules():
        for fam in FAMILIES:
            if fam.is_attention(mod):
                return fam
    return None


def attention_modules(model: nn.Module, family: Family) -> list[nn.Module]:
    """The model's attention modules of ``family``, in module order: instances of the family's transformers class
    when its modeling module defines it, else the modules the family's ``is_attention`` recognizes."""
    cls = getattr(_modeling_module(model), family.attention_class or "", None)
    if isinstance(cls, type):
        return [m for m in model.modules() if isinstance(m, cls)]
    return [m for m in model.modules() if family.is_attention(m)]


def family_capture_points(model: nn.Module) -> list[CapturePoint]:
    """Q/K/V capture points of every attention layer of ``model`` (``[]`` if no family matches).

    The layer index is the module's ``layer_idx`` when it has one, else its position among the attention modules.
    """
    fam = family_of(model)
    if fam is None:
        return []
    points: list[CapturePoint] = []
    for i, mod in enumerate(attention_modules(model, fam)):
        li = getattr(mod, "layer_idx", None)
        points += fam.capture(mod, i if li is None else int(li), model)
    return points


def native_slopes(model: nn.Module) -> torch.Tensor | None:
    """The ALiBi slopes the stock model computes, ``(H,)`` float64 in this library's convention, or ``None``.

    See the module docstring for what each family's builder gives; ``None`` for models without ALiBi (RoPE
    families, GPT-NeoX, GPT-2, Falcon with ``alibi=False``, ``TransformerLM`` in its RoPE/NoPE modes).
    """
    fam = family_of(model)
    return None if fam is None else fam.slopes(model)
