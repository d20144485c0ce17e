"""What the replacement attention forwards share: finding the swap, the attention call and its weights, the
refusals, installing.

Used by every family's replacement (:mod:`~positional_lsh.integrations.hf.bloom`, ``mpt``, ``falcon``, and the
registered attention function of :mod:`~positional_lsh.integrations.hf.rope`) and by the installer
(:mod:`~positional_lsh.integrations.hf.swap`). It imports only :mod:`~positional_lsh.integrations.hf.attention_swap`
and :mod:`~positional_lsh.integrations.hf.masks`, so no replacement imports the installer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.attention_swap import SWAP_ATTR, AttentionSwap
from positional_lsh.integrations.hf.masks import (
    ATTN_IMPLEMENTATION,
    MASK_SUPPORT,
    check_custom_mask,
    is_slot_mask,
    key_validity,
)


def swap_of(module: nn.Module) -> AttentionSwap:
    """The active :class:`AttentionSwap` attached to an attention ``module``; ``RuntimeError`` if there is none.

    (A model whose ``attn_implementation`` was set to ``"positional_lsh"`` by hand, without a swap.)
    """
    swap = getattr(module, SWAP_ATTR, None)
    if not isinstance(swap, AttentionSwap) or not swap.active:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is set but this model was not prepared with "
            "positional_lsh.integrations.hf.use_positional_lsh or use_alibi: install a swap with one of them, or load "
            "a checkpoint saved by a swapped model (from_pretrained(folder, attn_implementation="
            f"{ATTN_IMPLEMENTATION!r}) installs its swap at the first call; hf.load_local_model(folder) and "
            "hf.apply_saved_swap(model, folder) at once)"
        )
    return swap


def attend_native(
    module: nn.Module,
    swap: AttentionSwap,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    asked: object = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A native ALiBi forward's attention, heads merged, and its weights when asked.

    Args:
        module: the attention module (its ``layer_idx`` and ``training`` choose the partitions).
        swap: the module's swap (:func:`swap_of`).
        q: ``(B, Hq, Lq, d)`` queries.
        k, v: ``(B, Hkv, Lk, d)`` keys and values after the KV cache update (queries aligned to the last keys).
        attention_mask: the mask handed to the module (the ``(B, Lk)`` padding mask or ``None``).
        scale: the module's score scale.
        asked: the module's ``output_attentions`` argument; the weights are also returned when the model call
            asked for them (``swap.output_attentions``).

    Returns:
        ``(B, Lq, Hq * d)`` and ``None``, or with the weights the ``(B, Hq, Lq, Lk)`` weights and the output
        computed from them (:meth:`AttentionSwap.attend_with_weights`: the weights are on the output's path).
    """
    b, lq = q.shape[0], q.shape[-2]
    valid = key_validity(attention_mask, b, k.shape[-2])
    layer: Any = module  # a transformers attention module: its layer_idx is read by name, untyped
    weights = None
    if asked or swap.output_attentions:
        ctx, weights = swap.attend_with_weights(layer.layer_idx, module.training, q, k, v, valid, scale)
    else:
        ctx = swap.attend(layer.layer_idx, module.training, q, k, v, valid, scale)
    return ctx.transpose(1, 2).reshape(b, lq, -1), weights


def check_dropout(module: nn.Module, p: float) -> None:
    """``ValueError`` if ``module`` is in training mode with attention dropout ``p > 0`` (not supported)."""
    if module.training and p > 0:
        raise ValueError(
            f"attention dropout (p={p}) is not supported by positional_lsh attention; set the model's attention "
            "dropout to 0 for training, or call model.eval()"
        )


def asks_for_attentions(config: Any, kwargs: dict[str, object]) -> bool:
    """Whether a model call asks for attention weights: its ``output_attentions`` argument, else the config's."""
    asked = kwargs.get("output_attentions")
    return bool(getattr(config, "output_attentions", False) if asked is None else asked)


def check_model_inputs(args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """``ValueError`` unless the ``attention_mask`` of a swapped model's call is ``None`` or a 2-D padding mask (any
    pattern, holes included).

    Run by the swap's forward pre-hook on the base model, before the stock model reads the mask (BLOOM and Falcon
    build their ALiBi tensor from it, and a 4-D mask would fail there with an unrelated unpacking error), so that
    every family refuses a 4-D or custom mask with the same message. Positional arguments are checked for 4-D
    tensors (only a mask has four dimensions among a causal LM's inputs). A dict of masks per layer type (what
    ``generate`` hands a model with a static cache) has each of its masks checked.
    """
    masks = [kwargs.get("attention_mask")] + [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if isinstance(masks[0], dict):  # one mask per layer type: generate builds them up front for a static cache
        masks = [*masks[0].values(), *masks[1:]]
    for mask in masks:
        if mask is None:
            continue
        if (isinstance(mask, torch.Tensor) and mask.dim() == 2) or is_slot_mask(mask):
            continue  # any pattern of valid keys, holes included (ops/padding.py); a static cache's slots
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"unsupported attention mask {shape}: {MASK_SUPPORT}")


def custom_mask_inputs(
    swap: AttentionSwap, rope: bool, args: tuple[object, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The keyword arguments of a swapped base model's call with a custom 4-D ``attention_mask`` on the RoPE family
    (``rope``): without a cache (``use_cache=False``: such a call is computed whole, and a cache written under a
    custom mask could not be continued), its position ids recorded on the swap
    (:attr:`AttentionSwap.mask_positions`, read by :meth:`AttentionSwap.attend_custom_mask`). ``None`` for any other
    call, whose masks :func:`check_model_inputs` checks (other families refuse 4-D masks: BLOOM, Falcon and MPT
    build their own mask or ALiBi tensor from it). ``ValueError`` for a custom mask continuing a KV cache, or one
    whose shape, dtype or position ids do not fit the call; nothing is changed then."""
    mask = kwargs.get("attention_mask")
    swap.mask_positions = None
    if not (rope and isinstance(mask, torch.Tensor) and mask.dim() == 4) or is_slot_mask(mask):
        check_model_inputs(args, kwargs)
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
        raise ValueError(
            "a custom 4-D attention_mask cannot continue a KV cache with positional_lsh attention: pass the whole "
            "sequence with its mask (or a 2-D padding mask to continue the cache)"
        )
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    tokens = ids if isinstance(ids, torch.Tensor) else embeds
    if isinstance(tokens, torch.Tensor):
        check_custom_mask(mask, kwargs.get("position_ids"), tokens.shape[0], tokens.shape[1])
    swap.mask_positions = kwargs.get("position_ids")
    out = {**kwargs, "use_cache": False}
    for name in ("cache", "past_key_values"):
        if name in out:
            out[name] = None
    return out


def packed_inputs(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments of a swapped base model's call with packed sequences (position ids that restart
    within a row, no attention mask: ``DataCollatorWithFlattening``), made so that transformers hands the attention
    the documents (:func:`~positional_lsh.integrations.hf.masks.packed_segments`): ``use_cache=False`` (transformers
    looks for packing only without a cache); ``None`` when the call is not packed (or under ``torch.compile``, where
    the mask interface refuses packing). ``ValueError`` for packed sequences continuing a KV cache, or on a model
    whose forward takes no position ids (BLOOM, MPT: their mask never sees the documents).

    Under ``torch.compile`` packed sequences are refused when the graph runs (``RuntimeError``): the position ids
    cannot be read while tracing, and with a cache (``use_cache`` left on) transformers would not look for the
    documents, so that they would silently attend to each other."""
    pos = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is not None or not isinstance(pos, torch.Tensor):
        return None
    if pos.dim() == 0 or pos.shape[-1] < 2:
        return None
    if torch.compiler.is_compiling():
        torch._assert_async(
            (pos[..., 1:] - pos[..., :-1] == 1).all(),
            "positional_lsh attention under torch.compile: these position ids restart (packed sequences), which "
            "are supported in eager mode only; call the uncompiled model, or one sequence per row",
        )
        return None
    if not bool((pos[..., 1:] - pos[..., :-1] != 1).any()):
        return None
    if "position_ids" not in inspect.signature(module.forward).parameters:
        raise ValueError(
            f"packed sequences (position_ids that restart) are not supported on {type(module).__name__}: its "
            "attention mask never sees the position ids (use a RoPE-family model or Falcon, or one sequence per row)"
        )
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
        raise ValueError("packed sequences (position_ids that restart) cannot continue a KV cache")
    if kwargs.get("use_cache") is False and cache is None:
        return None
    return {**kwargs, "use_cache": False, "past_key_values": None}
