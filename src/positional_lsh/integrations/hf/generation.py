"""Bounded generation by default: what a swap sets so that a plain ``model.generate(ids, max_new_tokens=...)`` holds
about ``key_reach`` keys per layer and prefills the prompt in chunks, whatever the prompt's length.

A swap whose queries reach a bounded number of keys back (positional LSH, windowed ALiBi:
:meth:`~positional_lsh.integrations.hf.attention_swap.AttentionSwap.key_reach` is finite for every layer) installs
two generation defaults on the model, recorded with the swap's other changes and undone by its ``restore``:

* :class:`GenerationCacheFactory` as the model's ``_prepare_cache_for_generation`` (what ``generate`` calls to build
  its KV cache): where ``generate`` would build its default ``DynamicCache`` (no ``cache`` passed, ``use_cache`` not
  off, no ``cache_implementation``; greedy search, sampling or beam search) it builds the swap's
  :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`, which drops the keys no later query can reach.
  Anything else (a cache the user passed, ``cache_implementation="dynamic"`` / ``"static"`` / ..., assisted
  decoding, which crops its cache) goes to transformers' own;
* ``generation_config.prefill_chunk_size = PREFILL_CHUNK`` (:data:`PREFILL_CHUNK`), unless the user set one: the
  prompt runs in chunks, each attending to its own keys and the live keys of the cache, the dead ones dropped chunk
  by chunk. A ``prefill_chunk_size`` passed to ``generate`` (``None``: one piece) wins, as any ``generate`` argument;
* :class:`NoPositionIds` as the model's ``_prepare_position_ids_for_generation``: no ``(B, n)`` position ids grown
  by a column per token (the swapped attention does not read them); position ids passed to ``generate`` are used;
* :class:`~positional_lsh.integrations.hf.generation_loop.BoundedGenerate` as the model's ``generate``:
  transformers' ``generate`` whose greedy and sampling loop keeps the ids (and the mask) in buffers instead of
  growing them by ``torch.cat`` per token (:mod:`~positional_lsh.integrations.hf.generation_loop`), unless the model
  instance has a ``generate`` of its own (e.g. a Hub repository's ``custom_generate`` that transformers installed):
  that one is kept.

Exact ALiBi (``use_alibi`` without a window) reaches every key: its swap sets neither, and a plain ``generate`` keeps
transformers' full ``DynamicCache`` and one-piece prefill (stacked on a bounded swap, it takes the chunk size that swap
set back off for as long as it is in effect). A saved swapped model writes its generation config as it was before
the swap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from positional_lsh.integrations.hf.attention_swap import AttentionSwap
from positional_lsh.integrations.hf.cache import LiveKeyCache
from positional_lsh.integrations.hf.generation_loop import BoundedGenerate, compiled

#: Prompt tokens per chunk of a bounded swap's default chunked prefill (``generation_config.prefill_chunk_size``).
PREFILL_CHUNK = 4096

#: The generation modes whose default cache a bounded swap replaces (assisted decoding crops its cache: not these).
BOUNDED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH)


def is_bounded(swap: AttentionSwap) -> bool:
    """Whether every layer's queries reach a bounded number of keys back (eval mode): positional LSH (unless a slope
    0 or a forced ``backend`` / ``method`` runs the full op on every key) and windowed ALiBi."""
    model: Any = swap.model  # a transformers PreTrainedModel: its config is read by name
    config = model.config.get_text_config(decoder=True)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    return layers > 0 and all(swap.key_reach(i) is not None for i in range(layers))


@dataclass(eq=False)
class GenerationCacheFactory:
    """A bounded swap's ``_prepare_cache_for_generation`` (installed on the model instance): where ``generate`` would
    build its default ``DynamicCache``, the swap's :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`
    (module docstring); every other case goes to transformers' own. ``chunk``: the ``prefill_chunk_size`` the swap
    set as the default (``None``: the user's was kept), taken back off for a call without a cache (``use_cache=False``,
    which transformers refuses to chunk), for a compiled forward and for a prompt given as ``inputs_embeds``
    (transformers' chunked prefill splits the ids only, and would cut the attention mask to no column), and for a
    static cache (transformers runs each chunk through the compiled forward: the prompt is prefilled eagerly, whole,
    and only the decoding steps are compiled)."""

    swap: AttentionSwap
    chunk: int | None = None

    def __call__(
        self,
        generation_config: GenerationConfig,
        model_kwargs: dict[str, Any],
        generation_mode: GenerationMode,
        batch_size: int,
        max_cache_length: int,
    ) -> Any:
        if self.chunk is not None and generation_config.prefill_chunk_size == self.chunk:
            # our default, taken off where transformers cannot chunk: no cache (refused), a compiled forward, or a
            # prompt given as inputs_embeds (transformers' chunks split the ids only: the mask would be cut to none)
            if (
                generation_config.use_cache is False
                or compiled(self.swap.model)
                or model_kwargs.get("inputs_embeds") is not None
                or generation_config.cache_implementation == "static"
                or getattr(model_kwargs.get("cache"), "is_compileable", False)
            ):
                generation_config.prefill_chunk_size = None
        default = (
            not compiled(self.swap.model)
            and model_kwargs.get("cache") is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
            and generation_mode in BOUNDED_MODES
            and not getattr(generation_config, "is_assistant", False)
        )
        if default and self.swap.active:
            model_kwargs["cache"] = self.swap.new_cache()
            return None
        model: Any = self.swap.model  # a transformers PreTrainedModel (GenerationMixin): the class's own method
        return type(model)._prepare_cache_for_generation(
            model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )


@dataclass(eq=False)
class NoPositionIds:
    """A bounded swap's ``_prepare_position_ids_for_generation``: ``None``, where ``generate`` would build ``(B, n)``
    position ids for the prompt and grow them by one column per token (an ``O(n)`` buffer and copy per token). The
    swapped attention reads positions from the cache and the padding mask (the RoPE family's rotary embedding is
    neutralized), so the model's own default (the new tokens' positions after the cached ones) serves. A generate
    that continues a cache passed to it keeps transformers' position ids (the cache checks with them that the new
    prompt continues its sequence)."""

    swap: AttentionSwap

    def __call__(self, inputs_tensor: Any, model_kwargs: dict[str, Any]) -> Any:
        cache = model_kwargs.get("cache")
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
            model: Any = self.swap.model  # a transformers GenerationMixin: the class's own method
            return type(model)._prepare_position_ids_for_generation(model, inputs_tensor, model_kwargs)
        return None


@dataclass(eq=False)
class NoPositionGrowth:
    """A bounded swap's ``_update_model_kwargs_for_generation``: transformers' own, except that once the model call
    ran on a :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` of the swap in effect, the ``(B, n)``
    position ids are dropped rather than grown by one column per generated token (an ``O(n)`` copy per token). The
    swapped attention reads the positions from the cache (as with :class:`NoPositionIds`), so the decoded tokens
    need none."""

    swap: AttentionSwap

    def __call__(self, outputs: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        cache = outputs.get("cache") if hasattr(outputs, "get") else None
        if cache is None:
            cache = model_kwargs.get("cache")
        if self.swap.active and isinstance(cache, LiveKeyCache) and cache.get_seq_length() > 0:
            model_kwargs.pop("position_ids", None)
        model: Any = self.swap.model  # a transformers GenerationMixin: the class's own method
        return type(model)._update_model_kwargs_for_generation(model, outputs, model_kwargs, *args, **kwargs)


def set_generation_defaults(model: PreTrainedModel, swap: AttentionSwap, below: list[Any]) -> None:
    """Install ``swap``'s generation defaults on ``model`` (module docstring); the caller records the changed instance
    attributes (the swap's undo). ``below``: the records of the swaps installed before (``SwapChanges``), whose
    entries say whether one of them set the chunk size now in the generation config."""
    config = model.__dict__.get("generation_config")
    if is_bounded(swap):
        chunk = None
        if isinstance(config, GenerationConfig) and config.prefill_chunk_size is None:
            config.prefill_chunk_size = chunk = PREFILL_CHUNK
        model.__dict__["_prepare_cache_for_generation"] = GenerationCacheFactory(swap, chunk)
        model.__dict__["_prepare_position_ids_for_generation"] = NoPositionIds(swap)
        model.__dict__["_update_model_kwargs_for_generation"] = NoPositionGrowth(swap)
        if not callable(model.__dict__.get("generate")) or isinstance(model.__dict__["generate"], BoundedGenerate):
            model.__dict__["generate"] = BoundedGenerate(swap)  # (a generate of the instance's own is kept)
        return
    for name in ("_prepare_cache_for_generation", "_prepare_position_ids_for_generation",
                 "_update_model_kwargs_for_generation"):  # fmt: skip
        model.__dict__.pop(name, None)  # (a bounded swap's below: back when this one goes)
    if isinstance(model.__dict__.get("generate"), BoundedGenerate):
        del model.__dict__["generate"]
    if isinstance(config, GenerationConfig):
        set_below = any(
            obj is config and name == "prefill_chunk_size" for changes in below for obj, name, _, _ in changes.entries
        )
        if set_below and config.prefill_chunk_size == PREFILL_CHUNK:
            config.prefill_chunk_size = None
