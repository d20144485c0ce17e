"""A bounded swap's decoding loop: ``model.generate`` with a per-token cost that does not grow with the prompt.

transformers' greedy / sampling loop (``GenerationMixin._sample``) appends every new token to the ``(B, n)`` ids with
``torch.cat`` (and a column to the ``(B, n)`` attention mask, when one is carried): a fresh ``O(n)`` buffer and copy
per token, at a million tokens an 8 MiB allocation whose pages fault in every time. A bounded swap (positional LSH,
windowed ALiBi: :mod:`~positional_lsh.integrations.hf.generation`) installs :class:`BoundedGenerate` as the model's
``generate``. It is transformers' ``generate``, unchanged, except that a greedy or sampling call hands its decoding
loop to :class:`DecodeLoop` (transformers' ``custom_generate=<callable>``: every preparation step of ``generate``,
the logits processors, stopping criteria, special tokens and the cache, are transformers' own). The loop is
``_sample``'s, step by step, except where the ids and the mask live: buffers with room for ``max_length`` tokens
(twice as large when a stopping criterion of the user's runs past it), written in place, handed to the model, the
logits processors and the stopping criteria as views of their first ``length`` columns; the position ids are dropped
after the prefill (the swapped attention reads positions from the cache). Everything else is transformers': the
(chunked) prefill (``_prefill``), ``prepare_inputs_for_generation``, ``streamer`` (``StopCheck``), ``eos_token_id``
and pad handling, ``return_dict_in_generate`` with ``output_scores`` / ``output_logits`` / ``output_attentions`` /
``output_hidden_states``. It gives transformers' tokens and scores exactly.

Whatever the loop does not take goes to transformers' own, unchanged: beam search and the other modes, assisted
decoding (``assistant_model``, ``prompt_lookup_num_tokens``, ...), a ``custom_generate`` of the user's, ``tokenizer``
(``stop_strings``), ``synced_gpus`` or a distributed run, a compiled forward, a cache that is not a
:class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` of the swap in effect (a ``DynamicCache`` passed or asked
for, ``use_cache=False``), an encoder-decoder model, token type ids, an ``mps`` device (transformers defers its stop
check there), a model class with its own ``_sample``.

A logits processor that reads the whole ids (``repetition_penalty``, ``no_repeat_ngram_size``, ...) still costs
``O(n)`` per token: the user's choice. So does a left-padded batch's ``(B, n)`` attention mask, which the swap's mask
function reads per model call (a batch without padding carries none).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin, StopCheck

from positional_lsh.integrations.hf.attention_swap import AttentionSwap
from positional_lsh.integrations.hf.cache import LiveKeyCache

#: The generation modes :class:`DecodeLoop` runs (transformers' ``_sample``); every other goes to transformers.
LOOP_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

#: ``generate`` arguments that :class:`DecodeLoop` cannot receive (transformers drops them for a callable
#: ``custom_generate``) or that ask for another loop: a call with one of them goes to transformers' own loop.
STOCK_ARGUMENTS = ("tokenizer", "assistant_tokenizer", "assistant_model", "custom_generate")

#: Model inputs that transformers' loop grows per token and :class:`DecodeLoop` does not.
GROWN_INPUTS = ("token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids", "decoder_attention_mask")


def compiled(model: Any) -> bool:
    """Whether the model's forward is compiled (``model.forward = torch.compile(model.forward)`` or
    ``model.compile()``): :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` is eager only, so ``generate``
    then keeps transformers' default cache, prefill and loop."""
    forward = model.__dict__.get("forward")
    return hasattr(forward, "_torchdynamo_orig_callable") or model.__dict__.get("_compiled_call_impl") is not None


def distributed() -> bool:
    """Whether this process is one of several of an initialized ``torch.distributed`` group (``synced_gpus`` may
    then be needed: transformers' own loop)."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


@dataclass(eq=False)
class BoundedGenerate:
    """A bounded swap's ``generate`` (installed on the model instance, undone by ``restore``): transformers'
    ``generate`` with :class:`DecodeLoop` as its decoding loop for greedy search and sampling, transformers' own loop
    for anything else (module docstring)."""

    swap: AttentionSwap

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model: Any = self.swap.model  # a transformers PreTrainedModel (GenerationMixin): the class's own generate
        stock = type(model).generate
        bound = inspect.signature(stock).bind(model, *args, **kwargs)
        loop = self.loop_for(bound.arguments)
        if loop is None:
            return stock(model, *args, **kwargs)
        bound.arguments["custom_generate"] = loop
        return stock(*bound.args, **bound.kwargs)

    def loop_for(self, arguments: dict[str, Any]) -> DecodeLoop | None:
        """The :class:`DecodeLoop` for a ``generate`` call with these (bound) arguments, or ``None`` where the call
        goes to transformers' own loop."""
        model: Any = self.swap.model
        extra: dict[str, Any] = dict(arguments.get("kwargs", {}))
        if (
            not self.swap.active
            or type(model)._sample is not GenerationMixin._sample
            or model.config.is_encoder_decoder
            or any(arguments.get(name) is not None or extra.get(name) is not None for name in STOCK_ARGUMENTS)
            or arguments.get("synced_gpus")
            or distributed()
            or compiled(model)
        ):
            return None
        config, _ = model._prepare_generation_config(arguments.get("generation_config"), **extra)
        if config.get_generation_mode(None) not in LOOP_MODES or config.cache_implementation is not None:
            return None
        return DecodeLoop(self.swap, arguments.get("streamer"))


@dataclass(eq=False)
class DecodeLoop:
    """The decoding loop a bounded swap's ``generate`` hands to transformers (``custom_generate``): transformers'
    ``_sample`` with the ids and the attention mask in preallocated buffers (module docstring).

    Args:
        swap: the swap in effect (its :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` is the one the
            loop takes).
        streamer: the ``generate`` call's streamer (transformers does not pass it to a callable loop).
    """

    swap: AttentionSwap
    streamer: Any = None

    def takes(self, model: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict[str, Any]) -> bool:
        """Whether this loop runs the call (else transformers' ``_sample`` does): the cache is a ``LiveKeyCache``
        of the swap in effect, nothing the loop does not grow is carried, no compiled forward, not ``mps``."""
        cache = model_kwargs.get("cache")
        return (
            self.swap.active
            and isinstance(cache, LiveKeyCache)
            and all(getattr(layer, "swap", None) is self.swap for layer in cache.layers)
            and input_ids.dim() == 2
            and input_ids.device.type != "mps"
            and not getattr(generation_config, "is_assistant", False)
            and all(model_kwargs.get(name) is None for name in GROWN_INPUTS)
            and not model._valid_auto_compile_criteria(model_kwargs, generation_config)
        )

    def __call__(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        **model_kwargs: Any,
    ) -> Any:
        lm: Any = model  # a transformers GenerationMixin: its generation helpers are read by name
        if not self.takes(lm, input_ids, generation_config, model_kwargs):
            return type(lm)._sample(
                lm,
                input_ids,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                generation_config=generation_config,
                streamer=self.streamer,
                **model_kwargs,
            )
        return self.decode(lm, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)

    def decode(
        self,
        model: Any,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        model_kwargs: dict[str, Any],
    ) -> Any:
        """transformers' ``_sample`` (decoder-only, no ``synced_gpus``, the plain stop check), with the ids and the
        mask as growing views of buffers."""
        pad_token_id = generation_config._pad_token_tensor
        return_dict = generation_config.return_dict_in_generate
        output_scores = return_dict and generation_config.output_scores
        output_logits = return_dict and generation_config.output_logits
        output_attentions = return_dict and generation_config.output_attentions
        output_hidden_states = return_dict and generation_config.output_hidden_states
        has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        scores: tuple[torch.Tensor, ...] = ()
        raw_logits: tuple[torch.Tensor, ...] = ()
        attentions: tuple[Any, ...] = ()
        hidden_states: tuple[Any, ...] = ()

        batch_size = input_ids.shape[0]
        unfinished = torch.ones(batch_size, dtype=torch.long, device=input_ids.device)
        if pad_token_id is not None:
            pad_token_id = pad_token_id.to(input_ids.device)

        ids = GrowingColumns(input_ids, generation_config.max_length)
        mask = model_kwargs.get("attention_mask")
        masks = None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            masks = GrowingColumns(mask, mask.shape[1] + ids.capacity - ids.length, fill=1)
            model_kwargs["attention_mask"] = masks.view()

        outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
        stop_check = StopCheck(self.streamer)
        first = True
        with model._optimize_model_for_decode():
            while True:
                if not first:
                    model_inputs = model.prepare_inputs_for_generation(
                        ids.view(), next_sequence_length=1, **model_kwargs
                    )
                    outputs = model(**model_inputs, return_dict=True)
                first = False
                if "cache" in outputs:
                    model_kwargs["cache"] = outputs["cache"]
                model_kwargs.pop("position_ids", None)  # (the swapped attention reads positions from the cache)

                next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
                next_token_scores = logits_processor(ids.view(), next_token_logits)
                if output_scores:
                    scores += (next_token_scores,)
                if output_logits:
                    raw_logits += (next_token_logits,)
                if output_attentions:
                    attentions += (outputs.attentions,)
                if output_hidden_states:
                    hidden_states += (outputs.hidden_states,)

                if generation_config.do_sample:
                    probs = nn.functional.softmax(next_token_scores, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(next_token_scores, dim=-1)
                if has_eos_stopping_criteria:
                    next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)

                ids.append(next_tokens)
                if masks is not None:
                    masks.append(None)
                    model_kwargs["attention_mask"] = masks.view()
                unfinished = unfinished & ~stopping_criteria(ids.view(), scores if output_scores else None)
                if stop_check(unfinished, next_tokens, ids.length):
                    break
                del outputs

        stop_check.finish()
        if self.streamer is not None:
            self.streamer.end()
        sequences = ids.result()
        if masks is not None:
            model_kwargs["attention_mask"] = masks.result()
        if not return_dict:
            return sequences
        return GenerateDecoderOnlyOutput(
            sequences=sequences,  # type: ignore[arg-type]
            scores=scores if output_scores else None,  # type: ignore[arg-type]
            logits=raw_logits if output_logits else None,  # type: ignore[arg-type]
            attentions=attentions if output_attentions else None,
            hidden_states=hidden_states if output_hidden_states else None,
            cache=model_kwargs.get("cache"),
        )


class GrowingColumns:
    """A ``(B, length)`` tensor that grows by one column at a time without a copy of what it holds: a ``(B,
    capacity)`` buffer whose first ``length`` columns are handed out as a view (:meth:`view`). A full buffer moves
    to one twice as large (``O(1)`` copied columns per appended one, amortized).

    Args:
        start: the first columns (copied into the buffer once).
        capacity: columns to make room for (at least one more than ``start`` has); ``None``: 64 more.
        fill: what the columns after ``length`` hold (``None``: left unset).
    """

    def __init__(self, start: torch.Tensor, capacity: int | None, fill: int | None = None) -> None:
        self.length = start.shape[1]
        self.capacity = max(int(capacity) if capacity is not None else 0, self.length + 1)
        self.fill = fill
        self.buffer = self.allocate(start, self.capacity)
        self.buffer[:, : self.length].copy_(start)

    def allocate(self, like: torch.Tensor, capacity: int) -> torch.Tensor:
        """A ``(B, capacity)`` buffer of ``like``'s dtype and device (filled with :attr:`fill` when set)."""
        shape = (like.shape[0], capacity)
        if self.fill is None:
            return like.new_empty(shape)
        return like.new_full(shape, self.fill)

    def view(self) -> torch.Tensor:
        """The ``(B, length)`` tensor: a view of the buffer's first ``length`` columns."""
        return self.buffer[:, : self.length]

    def append(self, column: torch.Tensor | None) -> None:
        """Append a ``(B,)`` column (``None``: the fill value, already in place)."""
        if self.length == self.capacity:
            self.capacity *= 2
            grown = self.allocate(self.buffer, self.capacity)
            grown[:, : self.length].copy_(self.buffer)
            self.buffer = grown
        if column is not None:
            self.buffer[:, self.length].copy_(column)
        self.length += 1

    def result(self) -> torch.Tensor:
        """The ``(B, length)`` tensor to return: the buffer itself when full, else a compact copy (no room held)."""
        if self.length == self.buffer.shape[1]:
            return self.buffer
        return self.view().clone()
