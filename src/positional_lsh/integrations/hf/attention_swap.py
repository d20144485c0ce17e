""":class:`AttentionSwap`: the replacement installed on one model — its settings, partitions and attention call.

The replacement forwards (:mod:`~positional_lsh.integrations.hf.forward`) find the swap attached to their module
under :data:`SWAP_ATTR` and call :meth:`AttentionSwap.attend`; :mod:`~positional_lsh.integrations.hf.swap` creates
and installs it. Partitions are drawn by one :class:`~positional_lsh.ops.partitions.sampling.PartitionSampler` per
layer,
with ``seed = eval_seed = layer_seed(swap.seed, layer)``: eval mode draws from ``layer_seed(seed, layer)``,
training step ``c`` from ``layer_seed(layer_seed(seed, layer), c)`` (the formula the project's language model uses).

How :meth:`AttentionSwap.attend` runs a call:

* **mixed precision**: under ``torch.autocast``, ``q, k, v`` are cast to the autocast dtype (float64 stays), as
  the stock attention (``scaled_dot_product_attention`` or eager matmuls) computes them, and the op runs with
  autocast off (it accumulates in float32 itself);
* **decoding**: an eager call that continues a cache (fewer queries than keys, or a cache that dropped dead keys:
  :mod:`~positional_lsh.integrations.hf.cache`) goes to the op layer's KV-cache entry point,
  :func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache`, with the swap's partitions (or slopes and
  window), ``backend`` and ``method``, the padding, and the layer's :class:`~positional_lsh.ops.kvcache.DecodeState`:
  that of the :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` layer that returned the keys (which also
  vouches that they are finite), or the swap's own for another cache (:meth:`AttentionSwap._decode_state`). The entry
  point decides how the call runs (a decoded token reuses its bias row from token to token);
* **a static cache's slots** (:mod:`~positional_lsh.integrations.hf.static_cache`): the ``(B, Lk)`` int32 positions
  of the buffer's keys go to the KV-cache entry point as its ``key_positions`` (one dense call over the buffer, the
  same graph at every compiled step);
* **padding**: the ``(B, Lk)`` key validity is the ops' ``key_padding_mask`` (any pattern, holes included; read
  inside the op: a padding mask never breaks a ``torch.compile`` graph);
* **packed sequences**: ``(B, Lk)`` int64 segment ids (:func:`~positional_lsh.integrations.hf.masks.packed_segments`)
  become the ops' ``cu_seqlens``, one call per distinct row (:meth:`AttentionSwap._packed`): each document its own
  sequence, with the layer's partitions applied to it as ``partitions.with_seq_len(its length)``;
* **torch.compile**: the training step is an int64 tensor advanced in place and the partitions are drawn by the
  sampling op, so ``fullgraph=True`` traces the whole attention.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from positional_lsh.integrations.hf.masks import custom_mask_bias, uniform
from positional_lsh.ops import alibi_attention, plsh_attention
from positional_lsh.ops.checks import nonnegative_int
from positional_lsh.ops.exact.weights import alibi_attention_weights, plsh_attention_weights, weighted_values
from positional_lsh.ops.kvcache import DecodeState, key_reach, plsh_attention_with_kvcache, slot_attention_weights
from positional_lsh.ops.partitions.partition import MAX_DENSE_ELEMENTS, Partitions
from positional_lsh.ops.partitions.sampling import PartitionSampler, layer_seed


def packed_rows(segments: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(rows, cu_seqlens)`` of every group of batch rows that ``segments (B, n)`` (int64 segment ids, ``1, 2, ...``
    along each row, non-decreasing) packs alike: the rows as an index tensor and their documents' boundaries
    ``[0, ..., n]``."""
    n = segments.shape[-1]
    starts = torch.cat([torch.ones_like(segments[:, :1], dtype=torch.bool), segments[:, 1:] != segments[:, :-1]], -1)
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, bounds in enumerate(starts.cpu().tolist()):
        cu = (*[i for i, s in enumerate(bounds) if s], n)
        groups.setdefault(cu, []).append(row)
    for cu, rows in groups.items():
        dev = segments.device
        yield torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(cu, dtype=torch.long, device=dev)


#: Attribute under which the installed :class:`AttentionSwap` is attached to the model and to each of its
#: attention modules (in the instance ``__dict__``; removed by :meth:`AttentionSwap.restore`).
SWAP_ATTR = "_positional_lsh_swap"


@dataclass(eq=False)
class AttentionSwap:
    """The attention replacement installed on one model; returned by :func:`use_positional_lsh` / :func:`use_alibi`.

    Use :meth:`restore` (or :func:`restore`, or the object as a context manager) to put the model's own
    attention back. The attributes are read-only settings.

    Attributes:
        model: the model the swap is installed on.
        family: ``"bloom"``, ``"mpt"``, ``"falcon"`` or ``"rope"`` (Llama family).
        mode: ``"plsh"`` (positional LSH) or ``"alibi"`` (exact or windowed ALiBi).
        slopes: ``(H,)`` float64 slopes in this library's convention (bias ``-slope |i - j|`` added after
            scaling by ``1/sqrt(d)``).
        num_samples, scheme, seed, method: positional-LSH settings (``None`` in ``"alibi"`` mode); ``method`` is
            passed to :func:`~positional_lsh.plsh_attention` (one of ``positional_lsh.ops.options.METHODS``).
        window: ``(H,)`` float64 largest kept distance ``|i - j|`` for windowed ALiBi, or ``None``.
        resample_in_training: draw fresh partitions at every forward pass in training mode.
        backend: kernel backend passed to the attention functions (one of ``positional_lsh.ops.options.BACKENDS``;
            never ``"triton"`` in ``"alibi"`` mode).
        output_attentions: whether the model call in progress asked for its attention weights (set at every call
            of the model from its ``output_attentions`` argument or config; the replacement forwards then return
            :meth:`attention_weights`).
        mask_positions: the position ids of the model call in progress when it has a custom 4-D attention mask
            (:meth:`attend_custom_mask`), else ``None``.
    """

    model: nn.Module = field(repr=False)
    family: str
    mode: str
    slopes: torch.Tensor
    num_samples: int | None = None
    scheme: str | None = None
    seed: int | None = None
    window: torch.Tensor | None = None
    resample_in_training: bool = True
    backend: str = "auto"
    method: str | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # The training step, an int64 tensor advanced in place: torch.compile traces it (an int would be a constant
    # of the graph, recompiled at every step) and the sampling op reads it.
    _step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long), repr=False)
    _samplers: dict[int, PartitionSampler] = field(default_factory=dict, repr=False)
    _active: bool = field(default=True, repr=False)
    output_attentions: bool = field(default=False, repr=False)
    mask_positions: torch.Tensor | None = field(default=None, repr=False)
    # Decoding: per layer, the partitions of the current (mode, step), drawn for a length that grows geometrically,
    # and their key reach; so that a decoded token does not build partitions.
    _decoding: dict[int, tuple[tuple[bool, int], Partitions, int | None]] = field(default_factory=dict, repr=False)
    # Per layer, the LiveKeyCache layer that returned the layer's keys last (weakly: a cache is the caller's).
    _cache_layers: dict[int, weakref.ref[Any]] = field(default_factory=dict, repr=False)
    # Per layer, the decoding state of tokens whose keys come from another cache (e.g. a DynamicCache).
    _row_states: dict[int, DecodeState] = field(default_factory=dict, repr=False)
    # The last key-validity mask found all valid, and its version (see _all_valid).
    _valid_seen: tuple[torch.Tensor, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode == "plsh":
            # Build every layer's sampler now, outside any torch.compile trace (its constructor checks the scheme
            # with a draw).
            config = getattr(self.model, "config", None)
            layers = getattr(config, "num_hidden_layers", None)
            for layer_idx in range(layers if isinstance(layers, int) else 0):
                self.sampler(layer_idx)

    @property
    def active(self) -> bool:
        """Whether the swap is still installed."""
        return self._active

    @property
    def step(self) -> int:
        """The training step: how many training-mode model calls have started a step (see :meth:`advance_step`)."""
        return int(self._step)

    def advance_step(self) -> None:
        """Start a new training step: the next training-mode draws are fresh partitions (in place: traceable)."""
        self._step.add_(1)

    def set_step(self, step: int) -> None:
        """Set the training step, e.g. to the one saved with a checkpoint when a run resumes (exact resume)."""
        self._step.fill_(nonnegative_int("step", step))

    def add_undo(self, undo: Callable[[], None]) -> None:
        """Record how to undo one change made to the model; :meth:`restore` runs them in reverse order."""
        self._undo.append(undo)

    def sampler(self, layer_idx: int) -> PartitionSampler:
        """The partition sampler of layer ``layer_idx``: ``seed = eval_seed = layer_seed(self.seed, layer_idx)``."""
        if self.mode != "plsh":
            raise ValueError("partitions exist only in positional-LSH mode (use_positional_lsh)")
        layer_idx = nonnegative_int("layer_idx", layer_idx)
        sampler = self._samplers.get(layer_idx)
        if sampler is None:
            assert self.seed is not None and self.num_samples is not None and self.scheme is not None
            seed = layer_seed(self.seed, layer_idx)
            sampler = PartitionSampler(
                self.slopes.numel(),
                self.slopes,
                num_samples=self.num_samples,
                scheme=self.scheme,
                seed=seed,
                eval_seed=seed,
            )
            self._samplers[layer_idx] = sampler
        return sampler

    def partitions(self, layer_idx: int, seq_len: int, *, training: bool = False) -> Partitions:
        """The partitions layer ``layer_idx`` uses for ``seq_len`` keys (eval mode unless ``training``).

        Eval mode: drawn from ``layer_seed(seed, layer_idx)``. Training mode with ``resample_in_training``: the
        current step's, drawn from ``layer_seed(layer_seed(seed, layer_idx), step)`` (the step advances at each
        model call); without ``resample_in_training``, the eval partitions.
        """
        resample = bool(training) and self.resample_in_training
        return self.sampler(layer_idx).draw(seq_len, training=resample, step=self._step)

    def _decode_partitions(self, layer_idx: int, seq_len: int, training: bool) -> tuple[Partitions, int | None]:
        """The layer's partitions for at least ``seq_len`` positions, and their key reach, reused across decoding
        steps (the same pitches and shifts as :meth:`partitions`; redrawn when the step or the mode changes)."""
        resample = bool(training) and self.resample_in_training
        key = (resample, int(self._step) if resample else 0)
        held = self._decoding.get(layer_idx)
        if held is None or held[0] != key or held[1].seq_len < seq_len:
            length = max(2 * seq_len, 1024)  # redrawn about log2(n) times in a generation of n tokens
            parts = self.partitions(layer_idx, length, training=training)
            held = (key, parts, key_reach(parts, backend=self.backend, method=self.method or "auto"))
            self._decoding[layer_idx] = held
        return held[1], held[2]

    def key_reach(self, layer_idx: int, *, training: bool = False) -> int | None:
        """How far back a query of layer ``layer_idx`` can reach: no query at position ``i`` (nor any later one)
        attends to a key before ``i - key_reach``; ``None`` when every key may be reached (exact ALiBi, a slope 0).

        Positional LSH: :func:`positional_lsh.ops.kvcache.key_reach` of the layer's partitions (eval mode unless
        ``training``; ``None`` when the swap's ``backend`` or ``method`` runs the full op, which needs every key);
        windowed ALiBi: the largest window. Used by :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` to
        drop dead keys.
        """
        if self.mode == "plsh":
            return self._decode_partitions(layer_idx, 1, training)[1]
        if self.window is None:
            return None
        return int(torch.floor(self.window).max().item())

    def attach_cache_layer(self, layer_idx: int, cache_layer: Any) -> None:
        """Record that ``cache_layer`` (a :class:`~positional_lsh.integrations.hf.cache.LiveKeyLayer`) has just
        returned layer ``layer_idx``'s keys: the attention that receives exactly those tensors decodes with the
        :class:`~positional_lsh.ops.kvcache.DecodeState` the cache layer keeps (:meth:`_decode_state`). Called by the
        cache on every update."""
        self._cache_layers[layer_idx] = weakref.ref(cache_layer)

    def new_cache(self) -> Any:
        """A fresh :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` for this swap's model: a KV cache
        that keeps only the keys a later query can reach (``model.generate(ids, use_cache=True, cache=...)``).
        """
        from positional_lsh.integrations.hf.cache import LiveKeyCache

        return LiveKeyCache(self)

    # ------------------------------------------------------------------------------------------------------------
    # The attention call
    # ------------------------------------------------------------------------------------------------------------

    def _decode_state(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[DecodeState, bool]:
        """The :class:`~positional_lsh.ops.kvcache.DecodeState` of a call on keys ``k, v``, and whether they are known
        to be finite: when ``k, v`` are the tensors a :class:`~positional_lsh.integrations.hf.cache.LiveKeyLayer` has
        just returned, the state is that cache layer's (consecutive tokens of one sequence share it) and the cache
        vouches for the keys (it checked each one for NaN and inf when it came in); otherwise (another cache) the
        swap's own for the layer, and the entry point scans the keys it reads."""
        ref = self._cache_layers.get(layer_idx)
        layer = None if ref is None else ref()
        if layer is not None and layer.keys is k and layer.values is v:
            if not isinstance(layer.decode_state, DecodeState):
                layer.decode_state = DecodeState()
            return layer.decode_state, layer.keys_finite()
        state = self._row_states.get(layer_idx)
        if state is None:
            state = self._row_states[layer_idx] = DecodeState()
        return state, False

    def _with_kvcache(
        self, layer_idx: int, training: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        key_valid: torch.Tensor | None, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """An eager call that continues a cache: the op layer's KV-cache entry point, which decides how it runs.
        ``key_valid`` is ``None`` or the ``(B, m)`` validity of the sequence's ``m >= Lk`` positions (``k`` holds the
        last ``Lk``: the cache dropped the ``m - Lk`` before)."""
        offset = 0 if key_valid is None else key_valid.shape[-1] - k.shape[-2]
        if key_valid is not None and self._all_valid(key_valid):
            key_valid = None
        state, finite = self._decode_state(layer_idx, k, v)
        if self.mode == "plsh":
            parts, _ = self._decode_partitions(layer_idx, offset + k.shape[-2], training)
            return plsh_attention_with_kvcache(
                q, k, v, parts, key_offset=offset, scale=scale, backend=self.backend, method=self.method or "auto",
                key_padding_mask=key_valid, state=state, keys_finite=finite,
            )  # fmt: skip
        return plsh_attention_with_kvcache(
            q, k, v, slopes=self.slopes, window=self.window, key_offset=offset, scale=scale, backend=self.backend,
            key_padding_mask=key_valid, state=state, keys_finite=finite,
        )  # fmt: skip

    def _position_bias(self, layer_idx: int, training: bool, seq_len: int | None = None) -> dict[str, Any]:
        """The bias arguments of a call whose keys' positions are given (``key_positions``): positional LSH's
        ``partitions`` (the call's for ``seq_len`` positions, else the decoding ones: the same pitches and shifts),
        or exact / windowed ALiBi's ``slopes`` and ``window``."""
        if self.mode == "alibi":
            return {"slopes": self.slopes, "window": self.window}
        if seq_len is None:
            return {"partitions": self._decode_partitions(layer_idx, 1, training)[0]}
        return {"partitions": self.partitions(layer_idx, seq_len, training=training)}

    def _kernel(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        key_padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One call of the full ops on every key (a prompt, or any call under ``torch.compile``);
        ``key_padding_mask``: ``None`` or the ``(B, Lk)`` key validity, and ``cu_seqlens`` (packed sequences),
        passed to the op."""
        if self.mode == "alibi":
            return alibi_attention(
                q, k, v, self.slopes, causal=True, window=self.window, scale=scale, backend=self.backend,
                key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
            )  # fmt: skip
        assert self.method is not None
        parts = self.partitions(layer_idx, k.shape[-2], training=training)
        return plsh_attention(
            q, k, v, partitions=parts, causal=True, scale=scale, backend=self.backend, method=self.method,
            key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
        )  # fmt: skip

    def attend(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q (B, Hq, Lq, d)`` on ``k, v (B, Hkv, Lk, d)``, queries aligned to the last keys.

        ``key_valid`` is ``None`` or a ``(B, m)`` bool mask of the sequence's ``m >= Lk`` positions, of which ``k``
        holds the last ``Lk`` (``m > Lk`` when a :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`
        dropped the first ones); each row's valid keys must be contiguous and the row is computed on them alone
        (positions counted from its first valid key). Query rows at padded positions get zeros. Under
        ``torch.autocast`` the inputs are cast to the autocast dtype first (module docstring). Returns
        ``(B, Hq, Lq, d)``.
        """
        device = q.device.type
        if torch.is_autocast_enabled(device):
            low = torch.get_autocast_dtype(device)
            q, k, v = (x.to(low) if x.is_floating_point() and x.dtype != torch.float64 else x for x in (q, k, v))
            with torch.autocast(device, enabled=False):
                return self._attend(layer_idx, training, q, k, v, key_valid, scale)
        return self._attend(layer_idx, training, q, k, v, key_valid, scale)

    def _all_valid(self, key_valid: torch.Tensor) -> bool:
        """``bool(key_valid.all())``, remembered for the last mask found all valid: the layers of one model call get
        the same mask tensor (unchanged: its version counter says so), so only the first layer reads it."""
        seen = self._valid_seen
        if seen is not None and seen[0] is key_valid and seen[1] == key_valid._version:
            return True
        if uniform(key_valid):  # a view of one value (the all-valid mask): one element read, not n
            return bool(key_valid[(0,) * key_valid.dim()])
        ok = bool(key_valid.all())
        self._valid_seen = (key_valid, key_valid._version) if ok else None
        return ok

    def _attend(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """A static cache's slots (``key_valid`` int32 positions, eager or compiled) go to the KV-cache entry point
        with ``key_positions``; packed sequences (int64 segment ids) to :meth:`_packed`; a call that continues a cache
        (eager) to the KV-cache entry point (:meth:`_with_kvcache`); any other call, and every other call under
        ``torch.compile``, to the full ops with the padding as their ``key_padding_mask``."""
        lq, lk = q.shape[-2], k.shape[-2]
        if key_valid is not None and key_valid.dtype == torch.int64:
            return self._packed(layer_idx, training, q, k, v, key_valid, scale)
        if key_valid is not None and key_valid.dtype == torch.int32:  # a static cache's slots
            bias = self._position_bias(layer_idx, training)
            return plsh_attention_with_kvcache(q, k, v, scale=scale, key_positions=key_valid, **bias)
        dropped = key_valid is not None and key_valid.shape[-1] != lk
        if torch.compiler.is_compiling():
            if dropped:
                raise ValueError("a KV cache that drops keys (LiveKeyCache) is not supported under torch.compile")
        elif dropped or lq < lk:
            return self._with_kvcache(layer_idx, training, q, k, v, key_valid, scale)
        return self._kernel(layer_idx, training, q, k, v, scale, key_padding_mask=key_valid)

    def _packed(
        self, layer_idx: int, training: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        segments: torch.Tensor, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """Packed sequences: ``segments (B, Lk)`` int64 segment ids (``q``, ``k`` of one length, no cache); the ops
        with ``cu_seqlens``, one call per group of rows packed alike."""
        if q.shape[-2] != k.shape[-2]:
            raise ValueError("packed sequences (position ids that restart) cannot continue a KV cache")
        out = None
        for rows, cu in packed_rows(segments):
            part = self._kernel(layer_idx, training, q[rows], k[rows], v[rows], scale, cu_seqlens=cu)
            if rows.numel() == q.shape[0]:
                return part
            if out is None:
                out = q.new_zeros(q.shape)
            out[rows] = part
        assert out is not None
        return out

    @torch.compiler.disable
    def attention_weights(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        key_valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """The ``(B, Hq, Lq, Lk)`` attention weights of the call :meth:`attend` makes with the same arguments
        (``output_attentions=True``): positional LSH's ``softmax(s + log Mbar)`` with the call's partitions (those
        of a prompt, or the decoding ones when the call continues a cache), or exact / windowed ALiBi's weights;
        causal, queries aligned to the last keys, padded keys weight 0, padded query rows zeros. Dense: refused up
        front above the dense oracles' size (:mod:`positional_lsh.ops.exact.weights`). Eager: under
        ``torch.compile`` the call is a graph break (``torch.compiler.disable``; ``fullgraph=True`` refuses it)."""
        device = q.device.type
        if torch.is_autocast_enabled(device):
            low = torch.get_autocast_dtype(device)
            q, k = (x.to(low) if x.is_floating_point() and x.dtype != torch.float64 else x for x in (q, k))
        lq, lk = q.shape[-2], k.shape[-2]
        if key_valid is not None and key_valid.dtype == torch.int64:  # packed: block-diagonal, document by document
            weights = q.new_zeros((q.shape[0], q.shape[1], lq, lk))
            for rows, cu in packed_rows(key_valid):
                bounds = cu.tolist()
                for a, b in itertools.pairwise(bounds):
                    doc = slice(a, b)
                    weights[rows, :, doc, doc] = self.attention_weights(
                        layer_idx, training, q[rows][:, :, doc], k[rows][:, :, doc], None, scale
                    )
            return weights
        if key_valid is not None and key_valid.dtype == torch.int32:  # a static cache's slots
            bias = self._position_bias(layer_idx, training)
            return slot_attention_weights(q, k, key_valid, scale=scale, **bias).to(q.dtype)
        offset = 0 if key_valid is None else key_valid.shape[-1] - lk
        if self.mode == "alibi":
            return alibi_attention_weights(
                q, k, self.slopes, causal=True, window=self.window, scale=scale, key_padding_mask=key_valid,
                key_offset=offset,
            )  # fmt: skip
        if offset > 0 or lq < lk:  # the call continued a cache: the decoding partitions (_with_kvcache)
            parts, _ = self._decode_partitions(layer_idx, offset + lk, training)
        else:
            parts = self.partitions(layer_idx, lk, training=training)
        return plsh_attention_weights(
            q, k, parts, causal=True, scale=scale, key_padding_mask=key_valid, key_offset=offset
        )

    def attend_with_weights(
        self, layer_idx: int, training: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        key_valid: torch.Tensor | None, scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The call of :meth:`attend` with its weights (``output_attentions=True``): ``(out, weights)``, the output
        computed as ``weights @ v`` from the very weights returned (:meth:`attention_weights`,
        :func:`~positional_lsh.ops.exact.weights.weighted_values`), as transformers' eager attention does, so that
        the weights are on the output's path (``weights.retain_grad()`` gets a gradient). The estimator's output is
        ``softmax(s + log Mbar) v`` for every method, so ``out`` and the gradients of ``q, k, v`` equal
        :meth:`attend`'s up to float rounding (in the weights' dtype: under ``torch.autocast``, the autocast
        dtype's rounding of the weights, as eager attention's). Dense and eager, as :meth:`attention_weights`.

        After a :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` dropped keys (``key_valid`` covers
        ``m > Lk`` positions), the weights returned span the whole sequence, ``(B, Hq, Lq, m)``, as transformers'
        eager attention's do: the dropped keys weigh 0, exactly (a key is dropped once it is beyond every later
        query's reach or window, where the weight is 0)."""
        weights = self.attention_weights(layer_idx, training, q, k, key_valid, scale)
        dropped = 0 if key_valid is None or key_valid.dtype != torch.bool else key_valid.shape[-1] - k.shape[-2]
        if dropped > 0:
            weights = F.pad(weights, (dropped, 0))
            return weighted_values(weights[..., dropped:], v), weights
        return weighted_values(weights, v), weights

    @torch.compiler.disable
    def attend_custom_mask(
        self, layer_idx: int, training: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Attention under a custom 4-D ``mask`` (a RoPE-family call without a cache: ``Lq == Lk``): ``(out,
        weights)``, dense and eager (a graph break under ``torch.compile``), as transformers' eager attention.

        The weights are ``softmax(scale q k^T + bias(p_i, p_j) + mask)``: ``mask`` ``(B or 1, 1 or Hq, L, L)``,
        bool (``True``: attend) or float (added; transformers' ``finfo.min`` for masked), which alone decides which
        keys a query sees (causality included); ``p`` the call's position ids (:attr:`mask_positions`, else
        ``0 .. L-1``); the bias ALiBi's ``-m |p_i - p_j|`` (``-inf`` beyond a window) or positional LSH's
        ``log Mbar(p_i, p_j)`` over the layer's partitions (a key never in the query's block in any sample weighs
        0). So a shared prefix with branches at repeated positions gives each branch the attention it would get as
        a sequence of its own. A row with no key gets zeros. ``out = weights @ v``."""
        hq, lq = q.shape[1], q.shape[2]
        if mask.shape[1] not in (1, hq) or k.shape[-2] != lq:
            raise ValueError(f"a custom 4-D attention_mask must be (batch or 1, 1 or {hq}, {lq}, {lq}) without a KV "
                             f"cache, got {tuple(mask.shape)} for {k.shape[-2]} keys")  # fmt: skip
        pos = self.mask_positions
        if pos is None:
            pos = torch.arange(lq, device=q.device)[None]
        dense = q.shape[0] * hq * lq * lq * (1 if self.mode == "alibi" else 1 + (self.num_samples or 1))
        if dense > MAX_DENSE_ELEMENTS:
            raise ValueError(
                f"a custom 4-D attention_mask is computed densely: this call would hold {dense:,} entries (more than "
                f"{MAX_DENSE_ELEMENTS:,}); use shorter sequences or smaller batches"
            )
        # Every position is a query and a key: the slots' weights of the whole call, the mask deciding causality.
        bias = self._position_bias(layer_idx, training, None if self.mode == "alibi" else int(pos.max()) + 1)
        extra = custom_mask_bias(mask, torch.float64 if q.dtype == torch.float64 else torch.float32)
        weights = slot_attention_weights(q, k, pos.expand(q.shape[0], lq), causal=False, scale=scale, attn_mask=extra,
                                         **bias).to(q.dtype)  # fmt: skip
        return weighted_values(weights, v), weights

    def restore(self) -> None:
        """Put the model's own attention back (idempotent)."""
        if not self._active:
            return
        while self._undo:
            self._undo.pop()()
        self._active = False

    def __enter__(self) -> AttentionSwap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
