""":class:`LiveKeyCache`: a transformers KV cache that keeps only the keys a later query can reach.

Block starts only grow with the position, so once a query at position ``i`` runs, every key before
``i - reach`` is dead for it and for every later query, where ``reach`` is the layer's
:meth:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap.key_reach` (positional LSH: the longest block of
the layer's partitions minus one, :func:`positional_lsh.ops.kvcache.key_reach`; windowed ALiBi: the window; exact ALiBi
or a slope of 0: every key stays). Each layer of the cache drops them, so decoding holds about ``reach`` keys per
layer whatever the length of the prompt. The keys and values sit in buffers with room to grow: a new token writes
its key and value there (no copy of the cache per token; a full buffer moves to a fresh one a quarter larger), and
each one is checked for NaN and inf once, when it comes in, so that the attention's decoding
(:func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache`, with the layer's
:class:`~positional_lsh.ops.kvcache.DecodeState`) need not scan the keys it reads.

Positions stay absolute: ``get_seq_length()`` counts every token seen, and the mask the swap's mask function hands
down covers the whole sequence, so the attention reads the position of its first cached key from the difference
(its ``key_offset``). A query that needs a dropped key raises ``ValueError``
(:func:`positional_lsh.ops.kvcache.plsh_attention_with_kvcache`), e.g. a model switched to training mode mid-generation.

Use it through the swap: ``model.generate(ids, use_cache=True, cache=swap.new_cache(), ...)``. Eager mode only
(not under ``torch.compile``); cropping (assisted generation) works while the cache holds every key it was given
(``is_croppable``: always with exact ALiBi, which drops none) and is refused once keys were dropped. A swap stacked on
top later does not change which swap a cache asks: build the cache from the swap in effect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

__all__ = ["LiveKeyCache"]


@dataclass(eq=False)
class _Store:
    """The buffers of a :class:`LiveKeyLayer`: ``(B, H, capacity, d)`` keys and values, of which positions
    ``lo .. hi - 1`` are cached, and the views of them the layer handed out last."""

    keys: torch.Tensor
    values: torch.Tensor
    lo: int
    hi: int
    keys_view: torch.Tensor | None = None
    values_view: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.keys_view is None or self.values_view is None:
            self.keys_view, self.values_view = self.keys, self.values


class LiveKeyLayer(DynamicLayer):
    """One layer of a :class:`LiveKeyCache`: a ``DynamicLayer`` that drops the keys no later query can reach.

    Args:
        swap: the model's :class:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap`.
        layer_idx: the layer's index (its partitions).

    The cached keys and values are views of buffers with room to grow (:class:`_Store`): a decoded token writes its
    key and value there instead of copying the cache (``torch.cat``), as long as autograd is off.

    Attributes:
        offset: position of the first cached key (the keys before it were dropped).
        cumulative_length: tokens seen so far (the next query's position).
        nonfinite_end: one past the last position whose key or value had a NaN or inf when it came in (0: none).
        decode_state: the attention's decoding state for this layer (set and read by the swap's attention: the
            :class:`~positional_lsh.ops.kvcache.DecodeState` that consecutive tokens reuse), or ``None``.
    """

    def __init__(self, swap: Any, layer_idx: int) -> None:
        super().__init__()
        self.swap = swap
        self.layer_idx = layer_idx
        self.offset = 0
        self.cumulative_length = 0
        self.nonfinite_end = 0
        self.decode_state: Any = None
        self._store: _Store | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys and values, drop those before ``first query - reach``; returns the cached ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first_query = self.cumulative_length  # position of this call's first query
        self.cumulative_length += key_states.shape[-2]
        reach = self.swap.key_reach(self.layer_idx, training=bool(self.swap.model.training))
        stored = self.cached_length()
        drop = 0 if reach is None else min(stored, max(0, first_query - reach - self.offset))
        if not math.isfinite(key_states.sum().item() + value_states.sum().item()):  # (an overflow: only slower)
            self.nonfinite_end = self.cumulative_length
        if stored == 0 or self.keys is None or self.values is None:  # (a copy: the new states may be views)
            keys = key_states.clone(memory_format=torch.contiguous_format)
            values = value_states.clone(memory_format=torch.contiguous_format)
            self._store = _Store(keys, values, 0, keys.shape[-2])
        elif self._appendable(self.keys, self.values, key_states, value_states):
            store = self._store
            if store is None or self.keys is not store.keys_view or self.values is not store.values_view:
                # Something replaced the cached tensors (a beam reorder, a crop, ...): they become the buffers, full.
                self._store = _Store(self.keys, self.values, 0, stored)
            keys, values = self._append(drop, key_states, value_states)
        else:
            keys = torch.cat([self.keys[..., drop:, :], key_states], dim=-2)
            values = torch.cat([self.values[..., drop:, :], value_states], dim=-2)
            self._store = None
        self.keys, self.values = keys, values
        self.offset += drop
        self.swap.attach_cache_layer(self.layer_idx, self)
        return keys, values

    @staticmethod
    def _appendable(
        keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> bool:
        """Whether the new states may be written into buffers (:class:`_Store`) after the cached ``keys, values``:
        autograd is off (an in-place write would invalidate the views it saved) and the new states match the
        cached ones in batch, heads, head size, dtype and device (otherwise ``torch.cat`` gives its error)."""
        if torch.is_grad_enabled() or keys.dim() != 4 or key_states.dim() != 4 or value_states.dim() != 4:
            return False
        kb, kh, _, kd = keys.shape
        vb, vh, _, vd = values.shape
        ks, vs = key_states.shape, value_states.shape
        return (
            ks[0] == kb and ks[1] == kh and ks[3] == kd and vs[0] == vb and vs[1] == vh and vs[3] == vd
            and key_states.dtype == keys.dtype and value_states.dtype == values.dtype
            and key_states.device == keys.device and value_states.device == values.device
        )  # fmt: skip

    def _append(
        self, drop: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop ``drop`` keys and append the new ones in the buffers. Full buffers (or inference-mode ones outside
        inference mode) move to fresh ones a quarter larger than what they then hold, so earlier views stay valid and
        a token copies ``O(1)`` keys on average (about four)."""
        store = self._store
        assert store is not None
        lo, hi, new = store.lo + drop, store.hi, key_states.shape[-2]
        frozen = store.keys.is_inference() and not torch.is_inference_mode_enabled()
        if hi + new > store.keys.shape[-2] or frozen:
            live = hi - lo
            width = live + new + max(64, (live + new) // 4)  # geometric growth: O(1) copies per token
            b, h, _, d = store.keys.shape
            keys = store.keys.new_empty((b, h, width, d))
            values = store.values.new_empty((b, h, width, store.values.shape[3]))
            keys[..., :live, :].copy_(store.keys[..., lo:hi, :])
            values[..., :live, :].copy_(store.values[..., lo:hi, :])
            store.keys, store.values, lo, hi = keys, values, 0, live
        store.keys[..., hi : hi + new, :].copy_(key_states)
        store.values[..., hi : hi + new, :].copy_(value_states)
        store.lo, store.hi = lo, hi + new
        store.keys_view = store.keys[..., lo : hi + new, :]
        store.values_view = store.values[..., lo : hi + new, :]
        return store.keys_view, store.values_view

    def keys_finite(self) -> bool:
        """Whether every cached key and value is finite (checked when they came in): the attention may then skip
        its scan for non-finite keys."""
        return self.nonfinite_end <= self.offset

    def get_seq_length(self) -> int:
        """Tokens seen so far (including the dropped ones): positions stay absolute."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask covers the whole sequence (the swap's attention reads its first cached key from the difference)."""
        return self.cumulative_length + query_length, 0

    def cached_length(self) -> int:
        """Keys held now."""
        keys = self.keys
        return keys.shape[-2] if self.is_initialized and keys is not None and keys.dim() == 4 else 0

    def held_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The tensors that hold the cached keys and values: the buffers of which they are views, or themselves."""
        store = self._store
        if store is not None and self.keys is store.keys_view and self.values is store.values_view:
            return store.keys, store.values
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self.offset = 0
        self.cumulative_length = 0
        self.nonfinite_end = 0
        self.decode_state = None
        self._store = None

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Whether :meth:`crop` can roll the layer back (transformers' assisted decoding asks): while it holds every
        key it was given (always for exact ALiBi, which drops none)."""
        return self.offset == 0

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last tokens (``tokens_to_remove < 0``); refused once keys were dropped (they may be needed
        again by the queries that replace the removed ones)."""
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if self.offset > 0:
            raise ValueError(
                "LiveKeyCache cannot be cropped after it dropped dead keys (assisted generation rolls the cache back); "
                "use the default DynamicCache"
            )
        super().crop(tokens_to_remove)
        self.cumulative_length = self.cached_length()


class LiveKeyCache(DynamicCache):
    """A KV cache for a swapped model that keeps only the keys a later query can reach (module docstring).

    Args:
        swap: the swap installed on the model (:meth:`AttentionSwap.new_cache` builds one).
        num_layers: number of attention layers (default: ``swap.model.config.num_hidden_layers``).
    """

    def __init__(self, swap: Any, num_layers: int | None = None) -> None:
        if num_layers is None:
            config = swap.model.config
            num_layers = int(config.get_text_config(decoder=True).num_hidden_layers)
        Cache.__init__(self, layers=[LiveKeyLayer(swap, i) for i in range(num_layers)])

    def _live_layers(self) -> list[LiveKeyLayer]:
        """The cache's layers (the :class:`LiveKeyLayer` of each attention layer, built in ``__init__``)."""
        return cast("list[LiveKeyLayer]", self.layers)

    def check_continues(self, kwargs: dict[str, Any]) -> None:
        """``ValueError`` unless the model call with these keyword arguments continues the cached sequence.

        A cache reused by a second ``generate()`` (or model call) holds the tokens of the first: transformers then
        feeds only the tokens after them, so the new prompt must *continue* the cached sequence (the previous output
        plus new tokens), as with its ``DynamicCache``. A call whose positions or mask do not line up with the cached
        length (e.g. the same prompt again) would read another sequence's keys: refused. The call's tokens cannot be
        compared with the cached ones (the cache holds keys, not tokens), so a new prompt at least as long as the
        cached sequence is assumed to continue it (as ``DynamicCache`` assumes).
        """
        seen = self.get_seq_length()
        if seen == 0:
            return
        tokens = kwargs.get("input_ids")
        if not isinstance(tokens, torch.Tensor):
            tokens = kwargs.get("inputs_embeds")
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            return
        new = tokens.shape[1]
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            found = f"an attention mask of {mask.shape[-1]} positions for {new} new tokens"
            ok = mask.shape[-1] == seen + new
        elif isinstance(positions, torch.Tensor) and positions.numel() > 0:
            first = int(positions.reshape(-1, positions.shape[-1])[:, 0].min())
            found = f"new tokens from position {first}"
            ok = first == seen
        elif isinstance(positions, torch.Tensor) and new > 0:  # (a chunked prefill slices past the positions given)
            found = f"no position ids for {new} new tokens"
            ok = False
        else:
            return
        if not ok:
            raise ValueError(
                f"this LiveKeyCache holds a sequence of {seen} tokens, but the call gives {found}: it does not "
                f"continue the cached sequence. A cache may be reused only to continue its sequence (the previous "
                "output plus new tokens as the prompt); for a new prompt build a fresh one with swap.new_cache()"
            )

    def cached_tokens(self) -> list[int]:
        """Keys held now, per layer."""
        return [layer.cached_length() for layer in self._live_layers()]

    def memory_bytes(self) -> int:
        """Bytes held for the cached keys and values, all layers: their buffers, with the room to grow."""
        total = 0
        for layer in self._live_layers():
            keys, values = layer.held_tensors()
            if layer.cached_length() and keys is not None and values is not None:
                total += keys.numel() * keys.element_size()
                total += values.numel() * values.element_size()
        return total
