""":class:`LiveKeyCache`: a transformers KV cache that keeps only the keys a later query can reach.

Block starts only grow with the position, so once a query at position ``i`` runs, every key before
``i - reach`` is dead for it and for every later query, where ``reach`` is the layer's
:meth:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap.key_reach` (positional LSH: the longest block of
the layer's partitions minus one, :func:`positional_lsh.ops.decode.key_reach`; windowed ALiBi: the window; exact ALiBi
or a slope of 0: every key stays). Each layer of the cache drops them, so decoding holds about ``reach`` keys per
layer whatever the length of the prompt, and each new token copies only those.

Positions stay absolute: ``get_seq_length()`` counts every token seen, and the mask the swap's mask function hands
down covers the whole sequence, so the attention reads the position of its first cached key from the difference
(:func:`positional_lsh.integrations.hf.attention_swap.split_rows`). A query that needs a dropped key raises
``ValueError`` (:func:`positional_lsh.ops.decode.plsh_decode`), e.g. a model switched to training mode mid-generation.

Use it through the swap: ``model.generate(ids, use_cache=True, cache=swap.new_cache(), ...)``. Eager mode only
(not under ``torch.compile``); cropping (assisted generation) is refused once keys were dropped. A swap stacked on
top later does not change which swap a cache asks: build the cache from the swap in effect.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

__all__ = ["LiveKeyCache"]


class LiveKeyLayer(DynamicLayer):
    """One layer of a :class:`LiveKeyCache`: a ``DynamicLayer`` that drops the keys no later query can reach.

    Args:
        swap: the model's :class:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap`.
        layer_idx: the layer's index (its partitions).

    Attributes:
        offset: position of the first cached key (the keys before it were dropped).
        cumulative_length: tokens seen so far (the next query's position).
    """

    is_croppable = False

    def __init__(self, swap: Any, layer_idx: int) -> None:
        super().__init__()
        self.swap = swap
        self.layer_idx = layer_idx
        self.offset = 0
        self.cumulative_length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys and values, drop those before ``first query - reach``; returns the cached ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first_query = self.cumulative_length  # position of this call's first query
        self.cumulative_length += key_states.shape[-2]
        reach = self.swap.key_reach(self.layer_idx, training=bool(self.swap.model.training))
        old_keys, old_values = self.keys, self.values  # set (possibly empty) once initialized
        stored = old_keys.shape[-2] if old_keys is not None and old_keys.dim() == 4 else 0
        drop = 0 if reach is None else min(stored, max(0, first_query - reach - self.offset))
        if stored == 0 or old_keys is None or old_values is None:  # (a copy: the new states may be views)
            keys = key_states.clone(memory_format=torch.contiguous_format)
            values = value_states.clone(memory_format=torch.contiguous_format)
        else:
            keys = torch.cat([old_keys[..., drop:, :], key_states], dim=-2)
            values = torch.cat([old_values[..., drop:, :], value_states], dim=-2)
        self.keys, self.values = keys, values
        self.offset += drop
        return keys, values

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

    def reset(self) -> None:
        super().reset()
        self.offset = 0
        self.cumulative_length = 0

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
        """Bytes of the cached keys and values, all layers."""
        total = 0
        for layer in self._live_layers():
            keys, values = layer.keys, layer.values
            if layer.cached_length() and keys is not None and values is not None:
                total += keys.numel() * keys.element_size()
                total += values.numel() * values.element_size()
        return total
