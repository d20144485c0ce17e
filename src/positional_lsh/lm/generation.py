"""The language model's generation: :func:`generate` (what :meth:`TransformerLM.generate` runs) and its bounded KV
cache, :class:`LiveKV`.

A layer whose queries reach a bounded number of keys back (``plsh``: :func:`~positional_lsh.ops.kvcache.key_reach` of
its partitions; ``window-alibi``: its largest window) keeps only the keys a later query can reach: its
:class:`LiveKV` drops the keys before ``first query - reach`` as the sequence goes on, and the prompt is prefilled in
chunks of ``prefill_chunk`` tokens (each attending to its own keys and the live ones), with logits for the last
position only. Generation then holds about ``reach`` keys per layer, and a token costs the same after a prompt of
any length. Exact ALiBi, ``rope`` and ``nope`` reach every key: their cache keeps every key (the prompt in one piece,
as before). Both give the same tokens (the bounded one is the full computation on the keys the queries reach).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from positional_lsh.ops.checks import nonnegative_int, positive_int
from positional_lsh.ops.kvcache import key_reach

#: Prompt tokens per chunk of a bounded generation's prefill (the default of :meth:`TransformerLM.generate`).
PREFILL_CHUNK = 4096


class LiveKV:
    """One layer's KV cache that keeps only the keys a later query can reach.

    Args:
        reach: no query at position ``i`` (nor a later one) attends to a key before ``i - reach``.

    Keys and values sit in a buffer with room to grow (a token writes its key and value in place; a full buffer moves
    to a fresh one twice what it then holds, dropping the dead keys: ``O(1)`` copies per token on average).

    Attributes:
        seen: tokens seen so far (the next query's position).
        offset: position of the first cached key.
    """

    def __init__(self, reach: int) -> None:
        self.reach = nonnegative_int("reach", reach)
        self.seen = 0
        self.offset = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._end = 0  # keys held: buffer slots 0 .. _end - 1 hold positions offset .. offset + _end - 1

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append the new ``(B, H, L, d)`` keys and values, drop those before ``first query - reach``; returns the
        cached keys and values (views of the buffer) and the position of the first."""
        first, new = self.seen, k.shape[2]
        self.seen += new
        dead = min(self._end, max(0, first - self.reach - self.offset))
        if self._k is None or self._v is None or self._end + new > self._k.shape[2]:
            live = self._end - dead
            width = 2 * (live + new) + 64
            keys = k.new_empty((*k.shape[:2], width, k.shape[3]))
            values = v.new_empty((*v.shape[:2], width, v.shape[3]))
            if self._k is not None and self._v is not None and live:
                keys[:, :, :live].copy_(self._k[:, :, dead : self._end])
                values[:, :, :live].copy_(self._v[:, :, dead : self._end])
            self._k, self._v, self._end, self.offset = keys, values, live, self.offset + dead
            dead = 0
        self._k[:, :, self._end : self._end + new].copy_(k)
        self._v[:, :, self._end : self._end + new].copy_(v)
        self._end += new
        return self._k[:, :, dead : self._end], self._v[:, :, dead : self._end], self.offset + dead

    def cached_length(self) -> int:
        """Keys held now (the live ones and those not yet moved out)."""
        return self._end


def layer_reach(layer: Any, length: int) -> int | None:
    """How far back a query of ``layer`` (a ``CausalSelfAttention`` in eval mode) reaches in a sequence of up to
    ``length`` positions; ``None`` when it may reach every key (``alibi``, ``rope``, ``nope``, a slope 0, a backend or
    method that runs the full op)."""
    if layer.position == "plsh":
        cfg = layer.cfg
        return key_reach(layer.partitions(max(2 * length, 1024)), backend=cfg.attn_backend, method=cfg.plsh_method)
    window = layer.current_window() if layer.position == "window-alibi" else None
    if window is None or not bool(torch.isfinite(window).all()):
        return None
    return int(torch.floor(window).max().item())


def sampling_generator(generator: object) -> torch.Generator | None:
    """A CPU generator for token sampling from a ``torch.Generator``, an int seed or ``None``."""
    if isinstance(generator, bool):
        raise TypeError("generator must be a torch.Generator, an int seed or None")
    if isinstance(generator, numbers.Integral):
        return torch.Generator().manual_seed(int(generator))
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator)}")
    return generator


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """``(B, 1)`` next token ids from last-position ``logits (B, V)``: greedy at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)


def generate(
    model: Any,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    use_cache: bool,
    stop_token: int | None,
    prefill_chunk: int | None,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The loop of :meth:`TransformerLM.generate` (its arguments checked there; ``model`` in eval mode): returns
    ``(B, L + new)``; ``on_token`` gets each ``(B, 1)`` new token as it comes. With ``use_cache`` a model whose every
    layer reaches a bounded number of keys back runs bounded (module docstring), the others keep every key."""
    if prefill_chunk is not None:
        prefill_chunk = positive_int("prefill_chunk", prefill_chunk)
    layers = [block.attn for block in model.blocks]
    length = idx.shape[1] + max_new_tokens
    reaches = [layer_reach(layer, length) for layer in layers] if use_cache else [None]
    bounded = all(r is not None for r in reaches)
    new: list[torch.Tensor] = []
    done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    cache: Any = [LiveKV(int(r)) for r in reaches if r is not None] if bounded else None
    step = idx.shape[1] if not bounded or prefill_chunk is None else prefill_chunk
    for i in range(max_new_tokens):
        if not use_cache:
            logits = model.forward(torch.cat([idx, *new], dim=1))
        elif i == 0:
            for chunk in idx.split(step, dim=1):
                logits, cache = model.forward_with_cache(chunk, cache, last=True)
        else:
            logits, cache = model.forward_with_cache(new[-1], cache, last=True)
        token = next_token(logits[:, -1, :], temperature, top_k, generator)
        new.append(token)
        if on_token is not None:
            on_token(token)
        if stop_token is not None:
            done |= token[:, 0] == stop_token
            if bool(done.all()):
                break
    return torch.cat([idx, *new], dim=1)
