"""The mask side of the swap: a ``(B, n)`` key-validity mask instead of transformers' ``(B, 1, n, n)`` mask.

:func:`padding_mask_interface` is registered in transformers' ``AttentionMaskInterface`` under
:data:`ATTN_IMPLEMENTATION` (by the package ``__init__``); the attention then receives only the padding (causality
is applied by the attention itself), checks it with :func:`key_validity` and splits each batch row into its valid
run with :func:`valid_runs`. This module imports nothing else from the integration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function

__all__ = ["ATTN_IMPLEMENTATION", "key_validity", "padding_mask_interface", "valid_runs"]

#: Name under which the attention and mask functions are registered in transformers.
ATTN_IMPLEMENTATION = "positional_lsh"


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
) -> torch.Tensor:
    """Mask function registered as ``"positional_lsh"``: a ``(B, kv_length)`` bool key-validity mask.

    Causality is applied by the attention itself; only the padding is passed on, so no ``n x n`` mask is
    built. Anything other than a plain causal mask with padding raises ``ValueError``.
    """
    if mask_function is not causal_mask_function:
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
        return torch.ones((), dtype=torch.bool, device=device).expand(batch_size, kv_length)
    if attention_mask.dim() != 2 or attention_mask.shape[-1] < kv_length:
        raise ValueError(
            f"attention_mask must be a 2-D (batch, {kv_length}) padding mask, got shape {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, -kv_length:].to(torch.bool)


def key_validity(attention_mask: object, batch: int, k_len: int) -> torch.Tensor | None:
    """The attention's ``attention_mask`` argument as a ``(batch, k_len)`` bool key-validity mask.

    ``None`` stays ``None`` (every key valid). Anything but the 2-D mask :func:`padding_mask_interface` hands down
    (a 4-D or custom mask) raises ``ValueError``.
    """
    if attention_mask is None:
        return None
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and tuple(attention_mask.shape) == (batch, k_len)
    ):
        return attention_mask.to(torch.bool)
    shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
    raise ValueError(
        f"unsupported attention mask {shape} for {batch} sequences of {k_len} keys: positional_lsh attention takes "
        "only a 2-D (batch, seq_len) padding mask (4-D and custom masks are not supported)"
    )


def valid_runs(key_valid: torch.Tensor) -> list[tuple[int, int]]:
    """``(first, end)`` of the contiguous run of valid keys of every row of ``key_valid (B, Lk)`` (bool).

    A row without valid keys gives ``(0, 0)``; padding between valid keys raises ``ValueError``.
    """
    n = key_valid.shape[-1]
    pos = torch.arange(n, device=key_valid.device)
    first = torch.where(key_valid, pos, n).amin(-1)
    end = torch.where(key_valid, pos, -1).amax(-1) + 1
    count = key_valid.sum(-1)
    holes = (count > 0) & (end - first != count)
    if bool(holes.any()):
        rows = torch.nonzero(holes).flatten().tolist()
        raise ValueError(
            f"attention_mask has padding between valid tokens in batch row(s) {rows}; positional_lsh attention "
            "supports left and/or right padding only (each row's valid tokens must be one contiguous run)"
        )
    rows = zip(first.tolist(), end.tolist(), count.tolist(), strict=True)
    return [(int(f), int(e)) if c > 0 else (0, 0) for f, e, c in rows]
