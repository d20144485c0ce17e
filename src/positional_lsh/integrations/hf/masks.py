"""The mask side of the swap: a ``(B, n)`` key-validity mask instead of transformers' ``(B, 1, n, n)`` mask.

:func:`padding_mask_interface` is registered in transformers' ``AttentionMaskInterface`` under
:data:`ATTN_IMPLEMENTATION` (by the package ``__init__``); the attention then receives only the padding (causality
is applied by the attention itself), checks it with :func:`key_validity` and hands it to the ops as their
``key_padding_mask`` (:mod:`positional_lsh.ops.padding`: any pattern of valid keys, holes included). Packed
sequences (position ids that restart, no attention mask: transformers hands down ``causal AND same-sequence``)
become ``(B, n)`` int64 segment ids instead (:func:`packed_segments`), which the attention hands to the ops as
``cu_seqlens``. A static cache's slot layout gets the ``(B, 1, 1, capacity)`` int32 positions of its slots instead
(:func:`slot_positions`), which the attention hands to the ops as ``key_positions``. Otherwise the mask covers the
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
    "positional_lsh attention takes only a 2-D (batch, seq_len) padding mask, or packed sequences (position ids "
    "that restart); custom 4-D masks only on the RoPE family (Llama, Mistral, Qwen2, Qwen3), without a KV cache"
)


def padding_mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int | torch.Tensor = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function registered as ``"positional_lsh"``: a ``(B, kv_length)`` bool key-validity mask, or the
    ``(B, kv_length)`` int64 segment ids of packed sequences (:func:`packed_segments`).

    Causality is applied by the attention itself; only the padding (any pattern, holes included) or the packing is
    passed on, so no ``n x n`` mask is built. Anything else (a sliding window, a custom overlay) raises
    ``ValueError``. Under ``torch.compile`` without an ``attention_mask``, the same-sequence mask transformers hands
    down for possibly packed sequences gives ``None`` (no padding) once the graph checks that it is the plain
    causal one: packed sequences are taken eagerly only.
    """
    if isinstance(kv_offset, torch.Tensor):  # a static cache's slot layout (static_cache.LiveKeyStaticLayer)
        if mask_function is not causal_mask_function:
            raise ValueError(
                "positional_lsh attention on a static KV cache supports only the plain causal mask (with padding); "
                "this forward asked for another pattern (sliding window, packed sequences or a custom mask overlay)"
            )
        return slot_positions(batch_size, kv_length, kv_offset, attention_mask, device)
    if mask_function is not causal_mask_function:
        if attention_mask is None and torch.compiler.is_compiling():
            return _traced_causal(batch_size, kv_length, mask_function, device)
        if attention_mask is None and kv_offset == 0 and int(q_offset) == 0 and q_length == kv_length:
            return packed_segments(batch_size, kv_length, mask_function, device)
        raise ValueError(
            "positional_lsh attention supports only the plain causal mask (with padding) and packed sequences; this "
            "forward asked for another pattern (sliding window, bidirectional or a custom mask overlay)"
        )
    q_offset = int(q_offset)
    if kv_offset != 0 or q_offset + q_length != kv_length:
        raise ValueError(
            "positional_lsh attention needs the queries to be the last positions of the keys "
            f"(got q_offset={q_offset}, q_length={q_length}, kv_offset={kv_offset}, kv_length={kv_length}); "
            "static, sliding-window and other fixed-size caches are not supported: use the default DynamicCache"
        )
    if attention_mask is None:
        return all_valid(device).expand(batch_size, kv_length)
    if attention_mask.dim() != 2 or attention_mask.shape[-1] < kv_length:
        raise ValueError(
            f"attention_mask must be a 2-D (batch, {kv_length}) padding mask, got shape {tuple(attention_mask.shape)}"
        )
    return attention_mask[:, -kv_length:].to(torch.bool)


def slot_positions(
    batch_size: int, kv_length: int, kv_offset: torch.Tensor, attention_mask: torch.Tensor | None,
    device: torch.device | str,
) -> torch.Tensor:  # fmt: skip
    """The mask of a static cache's slot layout: ``(B, 1, 1, kv_length)`` int32, each slot's key position in its
    row's sequence (counted from the row's first valid token, as the ops' ``key_padding_mask`` counts), ``-1`` for an
    empty slot or a padded token. The slots hold positions ``kv_offset .. kv_offset + kv_length - 1`` of the
    sequence (``kv_offset`` a 0-dim tensor, negative while slots are empty); ``attention_mask`` is ``None`` or the
    ``(B, kv_offset + kv_length)`` padding mask of the whole sequence. Four dimensions, so that transformers passes
    it on as it is (a prepared mask), and torch ops only: ``generate`` builds it before each compiled step, and a
    compiled forward traces it."""
    dev = torch.device(device)
    slots = kv_offset.to(dev) + torch.arange(kv_length, device=dev)  # absolute positions, (L,)
    if attention_mask is None:
        pos = slots.expand(batch_size, kv_length)
        valid = pos >= 0
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
            raise ValueError(f"attention_mask must be a 2-D (batch, seq_len) padding mask, got shape "
                             f"{tuple(attention_mask.shape)}")  # fmt: skip
        if not torch.compiler.is_compiling() and attention_mask.shape[-1] != int(kv_offset) + kv_length:
            raise ValueError(
                f"attention_mask must cover the whole sequence, ({batch_size}, {int(kv_offset) + kv_length}), "
                f"continuing a static KV cache; got shape {tuple(attention_mask.shape)}"
            )
        mask = attention_mask.to(device=dev, dtype=torch.bool)
        first = mask.to(torch.int8).argmax(-1, keepdim=True)  # the row's first valid token (0 for a row of none)
        index = slots.clamp_min(0).expand(batch_size, kv_length)
        valid = (slots >= 0) & mask.gather(1, index)
        pos = slots - first
    return torch.where(valid, pos, -1).to(torch.int32)[:, None, None, :]


def is_slot_mask(mask: object) -> bool:
    """Whether ``mask`` is the slot layout's mask (:func:`slot_positions`): ``(B, 1, 1, L)`` int32."""
    return (
        isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
    )


def packed_segments(
    batch_size: int, kv_length: int, mask_function: Callable, device: torch.device | str
) -> torch.Tensor | None:
    """The ``(B, n)`` int64 segment ids (``1, 2, ...`` along each row) of the packed sequences that ``mask_function``
    describes, ``None`` when every row is one sequence (then the mask is the plain causal one).

    transformers hands a call with position ids that restart (and no attention mask) ``causal AND same-sequence``
    (``DataCollatorWithFlattening``'s padding-free batches). The documents are read from the mask at the ``n - 1``
    pairs of neighbours ``(i, i - 1)``, and the mask is checked to be causal within them at every query's ends: its
    own key and its document's first key kept, the key before its document and the key after it dropped
    (``ValueError`` naming the mask pattern otherwise: a sliding window, a custom overlay). ``O(n)`` evaluations of
    the mask function, vectorized."""
    dev = torch.device(device)
    b_idx = torch.arange(batch_size, device=dev)[:, None]
    pos = torch.arange(kv_length, device=dev)[None, :].expand(batch_size, kv_length)

    def keeps(q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(mask_function(b_idx, 0, q_idx, kv_idx), device=dev).expand(batch_size, -1)

    joined = keeps(pos[:, 1:], pos[:, :-1])  # (B, n - 1): i - 1 and i in one document
    starts = torch.cat([torch.ones(batch_size, 1, dtype=torch.bool, device=dev), ~joined], dim=-1)
    ids = starts.long().cumsum(-1)
    first = torch.where(starts, pos, torch.zeros_like(pos)).cummax(-1).values  # each query's document start
    ok = keeps(pos, pos).all() & keeps(pos, first).all()
    before = first > 0
    ok &= ~(keeps(pos, (first - 1).clamp_min(0)) & before).any()
    ok &= ~keeps(pos[:, :-1], pos[:, 1:]).any()
    if not bool(ok):
        raise ValueError(
            "positional_lsh attention supports only the plain causal mask (with padding) and packed sequences "
            "(causal within each document); this forward asked for another pattern (sliding window, bidirectional "
            "or a custom mask overlay)"
        )
    return ids if bool(starts[:, 1:].any()) else None


def segments_of_cu_seqlens(cu_seqlens: object, batch: int, n: int) -> torch.Tensor:
    """The ``(1, n)`` int64 segment ids of flash-attention's ``cu_seq_lens_k`` (what ``DataCollatorWithFlattening``
    with ``return_flash_attn_kwargs=True`` hands the attention): ``ValueError`` naming ``cu_seq_lens_k`` unless it
    is a 1-D integer tensor ``[0, ..., n]``, strictly increasing, over one flattened row (``batch == 1``)."""
    ok = (
        isinstance(cu_seqlens, torch.Tensor)
        and cu_seqlens.dim() == 1
        and cu_seqlens.dtype in (torch.int32, torch.int64)
        and batch == 1
    )
    bounds = cu_seqlens.tolist() if ok and isinstance(cu_seqlens, torch.Tensor) else None
    if bounds is None or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n or bounds != sorted(set(bounds)):
        shown = bounds if bounds is not None else type(cu_seqlens).__name__
        raise ValueError(
            f"cu_seq_lens_k must be a 1-D integer tensor [0, ..., {n}], strictly increasing, over one flattened row "
            f"(batch size 1); got {shown} for batch size {batch}"
        )
    assert isinstance(cu_seqlens, torch.Tensor)
    pos = torch.arange(n, device=cu_seqlens.device)
    return ((cu_seqlens[None, 1:-1].long() <= pos[:, None]).sum(-1) + 1)[None, :]


_TRUE: dict[torch.device, torch.Tensor] = {}


def all_valid(device: torch.device | str) -> torch.Tensor:
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


def uniform(mask: torch.Tensor) -> bool:
    """Whether every element of ``mask`` is one element (a view of one value, e.g. :func:`all_valid` expanded): its
    first element then says whether all are valid, without reading the ``n`` positions."""
    return mask.numel() > 0 and all(st == 0 or sz == 1 for st, sz in zip(mask.stride(), mask.shape, strict=True))


def key_validity(attention_mask: object, batch: int, k_len: int) -> torch.Tensor | None:
    """The attention's ``attention_mask`` argument as a ``(batch, m)`` bool key-validity mask, ``m >= k_len``, the
    ``(batch, k_len)`` int64 segment ids of packed sequences (:func:`packed_segments`), as they came, or the
    ``(batch, k_len)`` int32 slot positions of a static cache (:func:`slot_positions`).

    The mask covers the ``m`` positions of the sequence and the keys are its last ``k_len`` (``m > k_len`` when the
    cache dropped dead keys). ``None`` stays ``None`` (every key valid). Anything but the 2-D mask
    :func:`padding_mask_interface` hands down (a 4-D or custom mask) raises ``ValueError``.
    """
    if attention_mask is None:
        return None
    if (
        isinstance(attention_mask, torch.Tensor)
        and is_slot_mask(attention_mask)
        and attention_mask.shape[0] == batch
        and attention_mask.shape[-1] == k_len
    ):
        return attention_mask[:, 0, 0]
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.int64
        and tuple(attention_mask.shape) == (batch, k_len)
    ):
        return attention_mask
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.shape[0] == batch
        and attention_mask.shape[1] >= k_len
    ):
        return attention_mask.to(torch.bool)
    shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
    raise ValueError(f"unsupported attention mask {shape} for {batch} sequences of {k_len} keys: {MASK_SUPPORT}")


def custom_mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A custom 4-D attention mask as the bias it adds to the scores: bool ``True`` -> 0, ``False`` -> ``-inf``;
    float as it is (transformers' masked entries are ``finfo.min``), in ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def check_custom_mask(mask: torch.Tensor, positions: object, batch: int, length: int) -> None:
    """``ValueError`` unless ``mask`` is a bool or float ``(batch or 1, 1 or heads, length, length)`` custom mask and
    ``positions`` ``None`` or ``(batch or 1, length)`` integer position ids, none negative."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"a custom 4-D attention_mask must be bool (True: attend) or float (added), got {mask.dtype}")
    if mask.shape[0] not in (1, batch) or tuple(mask.shape[-2:]) != (length, length):
        raise ValueError(
            f"a custom 4-D attention_mask must be (batch or 1, 1 or heads, {length}, {length}) for {batch} "
            f"sequences of {length} tokens without a KV cache, got {tuple(mask.shape)}"
        )
    if positions is None:
        return
    if (
        not isinstance(positions, torch.Tensor)
        or positions.is_floating_point()
        or positions.dtype == torch.bool
        or positions.dim() != 2
        or positions.shape[1] != length
        or (positions.shape[0] not in (1, batch))
    ):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise ValueError(f"position_ids with a custom 4-D attention_mask must be integer ({batch} or 1, {length}), got "
                         f"{shape}")  # fmt: skip
    if not torch.compiler.is_compiling() and bool((positions < 0).any()):
        raise ValueError("position_ids must be non-negative")
