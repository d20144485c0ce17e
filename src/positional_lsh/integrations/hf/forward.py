"""What the replacement attention forwards share: finding the swap, the attention call and its weights, the
refusals, installing.

Used by every family's replacement (:mod:`~positional_lsh.integrations.hf.bloom`, ``mpt``, ``falcon``, and the
registered attention function of :mod:`~positional_lsh.integrations.hf.rope`) and by the installer
(:mod:`~positional_lsh.integrations.hf.swap`). It imports only :mod:`~positional_lsh.integrations.hf.attention_swap`
and :mod:`~positional_lsh.integrations.hf.masks`, so no replacement imports the installer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.attention_swap import SWAP_ATTR, AttentionSwap
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION, MASK_SUPPORT, key_validity
from positional_lsh.ops.padding import valid_runs


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
) -> torch.Tensor:
    """A native ALiBi forward's attention, heads merged.

    Args:
        module: the attention module (its ``layer_idx`` and ``training`` choose the partitions).
        swap: the module's swap (:func:`swap_of`).
        q: ``(B, Hq, Lq, d)`` queries.
        k, v: ``(B, Hkv, Lk, d)`` keys and values after the KV cache update (queries aligned to the last keys).
        attention_mask: the mask handed to the module (the ``(B, Lk)`` padding mask or ``None``).
        scale: the module's score scale.

    Returns:
        ``(B, Lq, Hq * d)``.
    """
    b, lq = q.shape[0], q.shape[-2]
    valid = key_validity(attention_mask, b, k.shape[-2])
    layer: Any = module  # a transformers attention module: its layer_idx is read by name, untyped
    ctx = swap.attend(layer.layer_idx, module.training, q, k, v, valid, scale)
    return ctx.transpose(1, 2).reshape(b, lq, -1)


def check_dropout(module: nn.Module, p: float) -> None:
    """``ValueError`` if ``module`` is in training mode with attention dropout ``p > 0`` (not supported)."""
    if module.training and p > 0:
        raise ValueError(
            f"attention dropout (p={p}) is not supported by positional_lsh attention; set the model's attention "
            "dropout to 0 for training, or call model.eval()"
        )


def native_weights(
    module: nn.Module,
    swap: AttentionSwap,
    q: torch.Tensor,
    k: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    asked: object = False,
) -> torch.Tensor | None:
    """The ``(B, Hq, Lq, Lk)`` attention weights of :func:`attend_native`'s call on the same arguments
    (:meth:`AttentionSwap.attention_weights`) when ``asked`` or the model call asked for them
    (``swap.output_attentions``), else ``None``."""
    if not (asked or swap.output_attentions):
        return None
    layer: Any = module  # a transformers attention module: its layer_idx is read by name, untyped
    valid = key_validity(attention_mask, q.shape[0], k.shape[-2])
    return swap.attention_weights(layer.layer_idx, module.training, q, k, valid, scale)


def asks_for_attentions(config: Any, kwargs: dict[str, object]) -> bool:
    """Whether a model call asks for attention weights: its ``output_attentions`` argument, else the config's."""
    asked = kwargs.get("output_attentions")
    return bool(getattr(config, "output_attentions", False) if asked is None else asked)


def check_model_inputs(args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """``ValueError`` unless the ``attention_mask`` of a swapped model's call is ``None`` or a 2-D padding mask.

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
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if not torch.compiler.is_compiling():
                check_no_holes(mask)
            continue
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"unsupported attention mask {shape}: {MASK_SUPPORT}")


def check_no_holes(mask: torch.Tensor) -> None:
    """``ValueError`` (naming ``attention_mask`` and the rows) if a row of the ``(B, n)`` padding ``mask`` has padding
    between valid positions: refused before any layer runs, so that a refused call leaves a KV cache as it was (one
    host read of one number; two when some row has padding)."""
    valid = mask if mask.dtype == torch.bool else mask != 0
    if bool(valid.all()):
        return
    starts = valid[:, :1].sum(-1) + (valid[:, 1:] & ~valid[:, :-1]).sum(-1)  # valid runs per row
    if bool((starts > 1).any()):
        valid_runs(valid, "attention_mask")  # raises, naming the rows
