""":class:`LiveKeyStaticCache`: the fixed-capacity KV cache ``generate(..., cache_implementation="static")`` gets on a
swapped model (a compiled ``generate`` needs a cache whose buffers never move).

Each layer holds one ``(B, Hkv, capacity, d)`` buffer of keys and one of values, allocated at the first call and then
only written in place (their addresses stay fixed, as transformers' ``StaticLayer``). The capacity is chosen from
what the layer's queries can reach (:meth:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap.key_reach`):

* **exact ALiBi** (or a slope of 0): every key stays, so the capacity is the whole length, ``max_cache_len`` (what
  ``generate`` asks for: the prompt plus ``max_new_tokens``). A call that would go beyond it raises ``ValueError``
  naming ``max_cache_len`` and ``max_new_tokens``, before anything is written;
* **positional LSH and windowed ALiBi**: keys older than the reach are dead, so the capacity is ``reach + CHUNK``
  (the live window plus a chunk of :data:`CHUNK` new tokens), at most ``max_cache_len``: decoding holds about
  ``reach`` keys per layer whatever the length. A call with more new tokens than the chunk (a long prompt) gets
  every key it needs for that call (a concatenation) and the buffer keeps the last ``capacity``.

The buffer is right-aligned: the newest key sits in the last slot, and a call shifts the older ones left (one copy
of the buffer per call, in place). The layer returns the filled part (the last ``min(seen, capacity)`` slots, a view
of the buffer), so the swap's attention sees the same keys as with
:class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`: positions stay absolute (``get_seq_length()`` counts
every token seen), the mask covers the whole sequence and the attention reads the position of its first cached key
from the difference, and decoding goes through
:func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache` with the layer's
:class:`~positional_lsh.ops.kvcache.DecodeState` (the swap's).

The swap installs :class:`StaticCacheFactory` as the model's ``_prepare_static_cache`` (what ``generate`` calls for
``cache_implementation="static"``), so ``model.generate(ids, cache_implementation="static", max_new_tokens=...)``
builds one; ``LiveKeyStaticCache(swap, max_cache_len=...)`` builds one by hand (``generate(..., cache=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, StaticCache, StaticLayer

from positional_lsh.ops.checks import check_int

__all__ = ["CHUNK", "LiveKeyStaticCache", "LiveKeyStaticLayer", "StaticCacheFactory"]

#: New tokens a call may bring while the layer still returns its fixed buffer (positional LSH, windowed ALiBi): the
#: capacity is ``reach + CHUNK``. One for greedy decoding; a few more for prompt lookup and assisted decoding.
CHUNK = 16


class LiveKeyStaticLayer(StaticLayer):
    """One layer of a :class:`LiveKeyStaticCache`: a right-aligned buffer of ``capacity`` keys and values.

    Args:
        capacity: slots of the buffer.
        reach: how far back a query reaches (``None``: every key, exact ALiBi); with ``None`` a call beyond
            ``capacity`` raises ``ValueError``.

    Attributes:
        seen: tokens seen so far (the next query's position), a Python int.
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, capacity: int, reach: int | None) -> None:
        super().__init__(max_cache_len=capacity)
        self.reach = reach
        self.seen = 0

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Whether :meth:`crop` can roll the layer back: while the buffer holds every key it was given."""
        return self.seen <= self.max_cache_len

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values into the buffer; returns every cached key the call's queries may need."""
        cap, new = self.max_cache_len, key_states.shape[-2]
        start = self.seen
        end = start + new
        if self.reach is None and end > cap:
            raise ValueError(
                f"this static KV cache holds max_cache_len={cap} tokens and exact ALiBi keeps every key, but the call "
                f"would bring it to {end} tokens: give generate() a larger max_cache_len (or fewer max_new_tokens / a "
                "shorter prompt), or use the default dynamic cache"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._buffers()
        held = min(start, cap)
        fits = end <= cap or (self.reach is not None and cap >= new + self.reach)
        full: tuple[torch.Tensor, torch.Tensor] | None = None
        if not fits or new > cap:  # the call needs more keys than the buffer keeps
            full = (
                torch.cat([keys[..., cap - held :, :], key_states], dim=-2),
                torch.cat([values[..., cap - held :, :], value_states], dim=-2),
            )
        if new >= cap:
            src_k, src_v = (key_states, value_states) if full is None else full
            keys.copy_(src_k[..., -cap:, :])
            values.copy_(src_v[..., -cap:, :])
        else:  # shift left by `new`, the new states in the last slots
            keys.copy_(torch.cat([keys[..., new:, :], key_states], dim=-2))
            values.copy_(torch.cat([values[..., new:, :], value_states], dim=-2))
        self.seen = end
        if full is not None:
            return full
        filled = min(end, cap)
        return keys[..., cap - filled :, :], values[..., cap - filled :, :]

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen so far (including those the buffer no longer holds): positions stay absolute."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask covers the whole sequence (the swap's attention reads its first cached key from the difference)."""
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        """``-1``: the masks cover the sequence, not the buffer (BLOOM would otherwise pad its 2-D mask to the
        buffer's length)."""
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (transformers' convention); refused once keys were dropped."""
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        if tokens_to_remove > 0 or not self.is_croppable:
            raise ValueError(
                "this static KV cache can be cropped only by a negative count, while it holds every key it was given"
            )
        r = min(-tokens_to_remove, self.seen)
        cap = self.max_cache_len
        for buf in self._buffers():  # shift right by r: the last r tokens leave, zeros come in on the left
            buf.copy_(torch.cat([buf.new_zeros(buf[..., :r, :].shape), buf[..., : cap - r, :]], dim=-2))
        self.seen -= r

    def reset(self) -> None:
        super().reset()
        self.seen = 0


class LiveKeyStaticCache(StaticCache):
    """A fixed-capacity KV cache for a swapped model (module docstring): ``generate(cache_implementation="static")``.

    Args:
        swap: the swap installed on the model.
        max_cache_len: the longest sequence the cache serves (prompt plus new tokens); the capacity of a layer whose
            queries reach every key (exact ALiBi), the upper bound of the others' (``reach + CHUNK``).
        chunk: new tokens a call may bring while a layer returns its fixed buffer (default :data:`CHUNK`).
    """

    def __init__(self, swap: Any, max_cache_len: int, *, chunk: int = CHUNK) -> None:
        max_cache_len = check_int("max_cache_len", max_cache_len, minimum=1)
        chunk = check_int("chunk", chunk, minimum=1)
        config = swap.model.config
        num_layers = int(config.get_text_config(decoder=True).num_hidden_layers)
        layers = []
        for i in range(num_layers):
            reach = swap.key_reach(i, training=False)
            capacity = max_cache_len if reach is None else min(max_cache_len, reach + chunk)
            layers.append(LiveKeyStaticLayer(capacity, reach))
        self.max_cache_len = max_cache_len
        Cache.__init__(self, layers=cast("list[Any]", layers))

    def capacities(self) -> list[int]:
        """Slots per layer."""
        return [layer.max_cache_len for layer in cast("list[LiveKeyStaticLayer]", self.layers)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return cast("list[LiveKeyStaticLayer]", self.layers)[layer_idx].seen


@dataclass(eq=False)
class StaticCacheFactory:
    """The swapped model's ``_prepare_static_cache`` (installed by the swap on the model instance): what
    ``generate(cache_implementation="static")`` calls to build its cache. Builds a :class:`LiveKeyStaticCache` of
    ``max_cache_len`` (the generation length, or ``generation_config.max_cache_len`` when larger)."""

    swap: Any

    def __call__(
        self, cache_implementation: str, batch_size: int, max_cache_len: int, *args: Any, **kwargs: Any
    ) -> LiveKeyStaticCache:
        if cache_implementation != "static":
            raise ValueError(
                f"cache_implementation={cache_implementation!r} is not supported by positional_lsh attention: use "
                "'static' (a fixed-capacity LiveKeyStaticCache) or the default dynamic cache"
            )
        return LiveKeyStaticCache(self.swap, max_cache_len)
