"""The mask side of the swap: a ``(B, n)`` key-validity mask instead of transformers' ``(B, 1, n, n)`` mask.

:func:`padding_mask_interface` is registered in transformers' ``AttentionMaskInterface`` under
:data:`ATTN_IMPLEMENTATION` (by the package ``__init__``); the attention then receives only the padding (causality
is applied by the attention itself), checks it with :func:`key_validity` and hands it to the ops as their
``key_padding_mask`` (:mod:`positional_lsh.ops.padding`: each batch row on its valid run). The mask covers the
whole sequence: a cache that dropped dead keys (:class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`) hands
the attention fewer keys than mask positions, and the attention reads the position of its first key from the
difference. This module imports nothing else from the
integration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function

#: Name under which the attention and mask functions are registered in transformers.
ATTN_IMPLEMENTATION = "positional_lsh"

#: What the swapped attention accepts as ``attention_mask`` (the end of every refusal of another mask).
MASK_SUPPORT = (
    "positional_lsh attention takes only a 2-D (batch, seq_len) padding mask (4-D and custom masks are not supported)"
)


def padding_mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function registered as ``"positional_lsh"``: a ``(B, kv_length)`` bool key-validity mask.

    Causality is applied by the attention itself; only the padding is passed on, so no ``n x n`` mask is
    built. Anything other than a plain causal mask with padding raises ``ValueError``. Under ``torch.compile``
    without an ``attention_mask``, the same-sequence mask transformers hands down for possibly packed sequences
    gives ``None`` (no padding) once the graph checks that it is the plain causal one.
    """
    if mask_function is not causal_mask_function:
        if attention_mask is None and torch.compiler.is_compiling():
            return _traced_causal(batch_size, kv_length, mask_function, device)
        raise ValueError(
            "positional_lsh attention supports only the plain causal mask (with left/right padding); this forward "
            "asked for another pattern (sliding window, packed sequences, bidirectional or a custom mask overlay)"
        )
    q_offset = int(q_offset)
    if kv_offset != 0 or q_offset + q_length != kv_length:
        raise ValueError(
            "positional_lsh attention needs the queries to be the last positions of the keys "
            f"(got q_offset={q_offset}, q_length={q_length}, kv_offset={kv_offset}, kv_length={kv_length}); "
            "static, sliding-window and other fixed-size caches are not supported: use the default DynamicCache"
        )
    if attention_mask is None:
        return _true(device).expand(batch_size, kv_length)
    if attention_mask.dim() != 2 or attention_mask.shape[-1] < kv_length:
        raise ValueError(
            f"attention_mask must be a 2-D (batch, {kv_length}) padding mask, got shape {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, -kv_length:].to(torch.bool)


_TRUE: dict[torch.device, torch.Tensor] = {}


def _true(device: torch.device | str) -> torch.Tensor:
    """A 0-dim ``True`` on ``device``, made once per device (the all-valid mask is an expanded view of it: decoding
    builds one per token), as a normal tensor even when first asked for in inference mode (an inference tensor could
    not be saved for a later backward). Under ``torch.compile`` a fresh one (no tensor held across graphs)."""
    if torch.compiler.is_compiling():
        return torch.ones((), dtype=torch.bool, device=device)
    dev = torch.device(device)
    true = _TRUE.get(dev)
    if true is None:
        with torch.inference_mode(False):
            true = _TRUE[dev] = torch.ones((), dtype=torch.bool, device=dev)
    return true


def _traced_causal(
    batch_size: int, kv_length: int, mask_function: Callable, device: torch.device | str
) -> torch.Tensor | None:
    """Under ``torch.compile`` without an attention mask, transformers cannot tell whether the position ids pack
    several sequences (it would read them) and hands down ``causal AND same-sequence``. Packed sequences are
    refused when the graph runs (``torch._assert_async``: the last query must see every key, as with one
    sequence per row); then the mask is the plain causal one: ``None``, no padding."""
    b_idx = torch.arange(batch_size, device=device)[:, None]
    kv_idx = torch.arange(kv_length, device=device)[None, :]
    q_idx = kv_idx[:, -1:]  # the last query (an index tensor, not torch.tensor(kv_length - 1): symbolic under dynamic)
    seen = mask_function(b_idx, torch.zeros_like(q_idx), q_idx, kv_idx)
    torch._assert_async(
        torch.as_tensor(seen, device=device).all(),
        "positional_lsh attention supports only the plain causal mask: these position ids pack several sequences "
        "in one row (or the model asked for another mask pattern)",
    )
    return None


def key_validity(attention_mask: object, batch: int, k_len: int) -> torch.Tensor | None:
    """The attention's ``attention_mask`` argument as a ``(batch, m)`` bool key-validity mask, ``m >= k_len``.

    The mask covers the ``m`` positions of the sequence and the keys are its last ``k_len`` (``m > k_len`` when the
    cache dropped dead keys). ``None`` stays ``None`` (every key valid). Anything but the 2-D mask
    :func:`padding_mask_interface` hands down (a 4-D or custom mask) raises ``ValueError``.
    """
    if attention_mask is None:
        return None
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.shape[0] == batch
        and attention_mask.shape[1] >= k_len
    ):
        return attention_mask.to(torch.bool)
    shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
    raise ValueError(f"unsupported attention mask {shape} for {batch} sequences of {k_len} keys: {MASK_SUPPORT}")
