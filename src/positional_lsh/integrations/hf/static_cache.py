""":class:`LiveKeyStaticCache`: the fixed-capacity KV cache ``generate(..., cache_implementation="static")`` gets on a
swapped model (a compiled ``generate`` needs a cache whose buffers never move and whose shapes never change).

Each layer holds one ``(B, Hkv, capacity, d)`` buffer of keys and one of values, allocated at the first call and then
only written in place (their addresses stay fixed, as transformers' ``StaticLayer``), and its count of tokens seen
as a 0-dim tensor, ``LiveKeyStaticLayer.length``, advanced in place. One capacity serves every layer (the layers
share one mask), chosen from what the queries can reach
(:meth:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap.key_reach`):

* **exact ALiBi** (or a slope of 0), or a reach beyond ``max_cache_len``: every key stays, so the capacity is the
  whole length, ``max_cache_len`` (what ``generate`` asks for: the prompt plus ``max_new_tokens``). A call that
  would go beyond it raises ``ValueError`` naming ``max_cache_len`` and ``max_new_tokens``, before anything is
  written;
* **positional LSH and windowed ALiBi**: keys older than the reach are dead, so the capacity is the longest reach
  plus a chunk, ``reach + CHUNK`` (:data:`CHUNK` new tokens per call), at most ``max_cache_len``: decoding holds about
  ``reach`` keys per layer whatever the length.

The buffer is right-aligned: the newest key sits in the last slot, and a call shifts the older ones left (one copy
of the buffer per call, in place). **The slot layout** (the RoPE family and BLOOM, :data:`SLOT_FAMILIES`): a call of
at most :data:`CHUNK` tokens (a decoding step) gets the whole buffer, and its mask is the slots' positions, ``(B, 1,
1, capacity)`` int32 (:func:`~positional_lsh.integrations.hf.masks.slot_positions`: each slot's position in its row,
``-1`` for an empty slot or a padded token), which the swap's attention hands to
:func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache` as ``key_positions``: one dense call over the
buffer. Every decoding step then has the same shapes and reads no host value, so ``generate`` compiles one graph for
the whole generation (``fullgraph=True``, no recompilation). A longer call (a long prompt) gets the keys it needs
(the filled part, or the held keys and the new ones when it brings more than the buffer keeps), with a mask of the
whole sequence, as with :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`: positions stay absolute
(``get_seq_length()`` counts every token seen). Falcon and MPT, whose stock forwards rebuild the mask (Falcon's ALiBi
tensor, MPT's cast to bool), always get that layout.

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

__all__ = ["CHUNK", "SLOT_FAMILIES", "LiveKeyStaticCache", "LiveKeyStaticLayer", "StaticCacheFactory"]

#: New tokens a call may bring while the layer still returns its fixed buffer (positional LSH, windowed ALiBi): the
#: capacity is ``reach + CHUNK``. One for greedy decoding; a few more for prompt lookup and assisted decoding.
CHUNK = 16

#: The families whose stock forwards pass the slot layout's mask through to the swap's attention (MPT casts its mask
#: to bool and Falcon builds its ALiBi tensor from it: their static caches return the filled part instead).
SLOT_FAMILIES = ("rope", "bloom")


class LiveKeyStaticLayer(StaticLayer):
    """One layer of a :class:`LiveKeyStaticCache`: a right-aligned buffer of ``capacity`` keys and values.

    Args:
        capacity: slots of the buffer.
        reach: how far back a query reaches (``None``: every key, exact ALiBi).
        chunk: new tokens a call may bring in the slot layout (default :data:`CHUNK`).
        slots: whether calls of at most ``chunk`` tokens return the whole buffer (the slot layout, module docstring);
            ``False``: every call returns the keys it needs (the filled part), as a dynamic cache does.

    The layer *holds every key* (``reach`` is ``None``, or ``capacity < reach + chunk``: the buffer is the whole
    generation) or *drops* the keys beyond the reach. A layer that holds every key refuses a call beyond its
    capacity (``ValueError`` naming ``max_cache_len``; under ``torch.compile`` when the graph runs).

    Attributes:
        length: tokens seen so far, a 0-dim int64 tensor updated in place (a compiled step reads and advances it).
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, capacity: int, reach: int | None, chunk: int = CHUNK, *, slots: bool = True) -> None:
        super().__init__(max_cache_len=capacity)
        self.reach = reach
        self.chunk = chunk
        self.slots = slots
        self.holds_all = reach is None or reach + chunk > capacity
        self.length = torch.zeros((), dtype=torch.long)
        self._seen: int | None = 0  # the host's copy of `length` (None after a compiled step: read it again)

    @property
    def seen(self) -> int:
        """Tokens seen so far (the next query's position), a Python int (read from ``length`` once after a
        compiled step)."""
        if self._seen is None:
            self._seen = int(self.length)
        return self._seen

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        """Whether :meth:`crop` can roll the layer back: while the buffer holds every key it was given."""
        return self.seen <= self.max_cache_len

    def slot_call(self, new: int) -> bool:
        """Whether a call of ``new`` tokens uses the slot layout: the whole buffer returned, its mask the slots'
        positions (:meth:`get_mask_sizes`)."""
        return self.slots and new <= min(self.chunk, self.max_cache_len)

    def _refuse_beyond(self, end: int) -> None:
        cap = self.max_cache_len
        if self.holds_all and end > cap:
            raise ValueError(
                f"this static KV cache holds max_cache_len={cap} tokens and its queries reach every key (exact ALiBi, "
                f"or a reach beyond the capacity), but the call would bring it to {end} tokens: give generate() a "
                "larger max_cache_len (or fewer max_new_tokens / a shorter prompt), or use the default dynamic cache"
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = self.length.to(key_states.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values into the buffer; returns every cached key the call's queries may need: the
        whole buffer in the slot layout (:meth:`slot_call`), else the filled part (or, for a long call that needs
        more keys than the buffer keeps, those keys)."""
        cap, new = self.max_cache_len, key_states.shape[-2]
        if torch.compiler.is_compiling() and self.slot_call(new):
            # A compiled step: the buffers and `length` only, in place (no host value read or guarded).
            if not self.is_initialized:  # (a first call inside a compiled region)
                self.lazy_initialization(key_states, value_states)
            keys, values = self._shift_in(key_states, value_states)
            self.length.add_(new)
            if self.holds_all:
                torch._assert_async(self.length <= cap, f"this static KV cache holds max_cache_len={cap} tokens and "
                                    "its queries reach every key: give generate() a larger max_cache_len")  # fmt: skip
            self._seen = None
            return keys, values
        start = self.seen
        end = start + new
        self._refuse_beyond(end)
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
        else:
            self._shift_in(key_states, value_states)
        self.length.fill_(end)
        self._seen = end
        if self.slot_call(new):
            return keys, values
        if full is not None:
            return full
        filled = min(end, cap)
        return keys[..., cap - filled :, :], values[..., cap - filled :, :]

    def _shift_in(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shift the buffers left by the call's new tokens, in place, the new states in the last slots; returns them."""
        keys, values = self._buffers()
        new = key_states.shape[-2]
        keys.copy_(torch.cat([keys[..., new:, :], key_states], dim=-2))
        values.copy_(torch.cat([values[..., new:, :], value_states], dim=-2))
        return keys, values

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        return keys, values

    def get_seq_length(self) -> int:
        """Tokens seen so far (including those the buffer no longer holds): positions stay absolute. Under
        ``torch.compile`` in the slot layout, :attr:`length` (a tensor, as transformers' static layers return)."""
        if torch.compiler.is_compiling() and self.slots:
            return self.length  # type: ignore[return-value]
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, Any]:
        """``(kv_length, kv_offset)`` of the call's mask. The slot layout: the buffer's ``capacity`` slots from
        position ``seen + query_length - capacity`` (negative while slots are empty), the offset as a 0-dim tensor
        (which tells the swap's mask function to build the slots' positions); otherwise the whole sequence from 0
        (the swap's attention reads the position of its first cached key from the difference)."""
        if self.slot_call(query_length):
            cap = self.max_cache_len
            if torch.compiler.is_compiling():
                return cap, self.length + (query_length - cap)
            return cap, torch.tensor(self.seen + query_length - cap)
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        """The capacity in the slot layout (the keys a decoding step attends over, as transformers' static layers
        say); ``-1`` otherwise: the masks then cover the sequence (Falcon and MPT)."""
        return self.max_cache_len if self.slots else -1

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
        self._seen = self.seen - r
        self.length.fill_(self._seen)

    def reset(self) -> None:
        super().reset()
        self.length.zero_()
        self._seen = 0


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
        reaches = [swap.key_reach(i, training=False) for i in range(num_layers)]
        # One capacity for every layer: the model's layers share one mask (the slots' positions).
        capacity = max_cache_len
        if reaches and all(r is not None for r in reaches):
            capacity = min(max_cache_len, max(cast("list[int]", reaches)) + chunk)
        slots = swap.family in SLOT_FAMILIES
        layers = [LiveKeyStaticLayer(capacity, reach, chunk, slots=slots) for reach in reaches]
        self.max_cache_len = max_cache_len
        Cache.__init__(self, layers=cast("list[Any]", layers))

    def capacities(self) -> list[int]:
        """Slots per layer."""
        return [layer.max_cache_len for layer in cast("list[LiveKeyStaticLayer]", self.layers)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return cast("list[LiveKeyStaticLayer]", self.layers)[layer_idx].get_seq_length()


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
