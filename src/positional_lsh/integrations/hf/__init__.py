"""transformers integration: positional-LSH or exact/windowed ALiBi attention inside Hugging Face models.

Two kinds of models are supported (transformers >= 5; tested with 5.24):

* **Native ALiBi models** — BLOOM, MPT and Falcon with ``alibi=True``. Their attention modules get a new
  ``forward`` (an instance attribute; the class is untouched) that runs the model's own projections and
  KV cache, then :func:`~positional_lsh.plsh_attention` or :func:`~positional_lsh.alibi_attention` instead
  of the eager ``n x n`` score matrix. The model's own slopes and convention are kept exactly:
  BLOOM and MPT add ``slope * j`` per key after scaling (equal to ``-slope |i - j|`` up to a per-row
  constant); Falcon adds ``slope * j`` *before* dividing by ``sqrt(d)``, i.e. an effective slope of
  ``slope / sqrt(d)`` in this library's convention. (transformers 5.24's Falcon *eager* path adds the bias
  a second time, ``2 slope / sqrt(d)``; we match its ``sdpa`` path and the original Falcon code.)
* **Llama-family models** (Llama, Mistral, Qwen2, Qwen3) — the paper's setup: the rotary embedding is
  neutralized (it returns ``cos = 1, sin = 0``, so ``apply_rotary_pos_emb`` is the identity) and attention is
  dispatched through transformers' registry: an attention function and a mask function are registered
  under the name ``"positional_lsh"`` (:class:`transformers.AttentionInterface`,
  :class:`transformers.masking_utils.AttentionMaskInterface`) and selected with
  ``model.set_attn_implementation``. Default slopes are the standard ALiBi schedule for the number of
  query heads; the paper used one constant ``sigma = 256`` (``slopes=1/256``).

For every family the registered mask function replaces the ``(B, 1, n, n)`` causal mask by a
``(B, n)`` boolean key-validity mask, so no ``n x n`` tensor is built anywhere.

Partitions. Positional-LSH partitions are drawn per layer, **independently across layers**, from a seed
derived from ``(seed, layer_idx)``; the law of a partition does not depend on the length, so one draw per
layer serves every length (:meth:`Partitions.with_seq_len`). In eval mode the partitions are therefore
fixed: decoding with a KV cache (each new query attends within its own block in every sample) gives
exactly the same attention as recomputing the whole sequence, and one seed reproduces every result. In
training mode (``resample_in_training=True``) every forward pass of the model draws fresh partitions from
``(seed, layer_idx, step)``; the step counter advances once per model call, so recomputation by gradient
checkpointing within a step reuses the step's partitions.

Padding. Each batch row may be left- and/or right-padded (its valid tokens one contiguous run); the row
is then computed on its valid tokens only, with positions counted from its first valid token — exactly
what the same row would give without padding. Masks with holes, 4-D or custom masks, packed sequences,
sliding windows, static caches, attention dropout in training and ``output_attentions`` raise
``ValueError``.

Usage::

    from positional_lsh import hf
    swap = hf.use_positional_lsh(model, num_samples=16, seed=0)   # or hf.use_alibi(model, window=None)
    out = model.generate(ids, max_new_tokens=20)
    hf.restore(model)                                           # or: with hf.use_alibi(model): ...
"""

from __future__ import annotations

import math
import numbers
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

try:
    import transformers
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"positional_lsh.integrations.hf needs transformers >= 5 (pip install 'transformers>=5'); import failed: {exc}"
    ) from exc

from positional_lsh.ops._checks import as_slopes, as_window, positive_int
from positional_lsh.ops._kernels import BACKENDS
from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.reference import alibi_attention
from positional_lsh.ops.sampling import Partitions, sample_partitions
from positional_lsh.ops.slopes import alibi_slopes

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(f"positional_lsh.integrations.hf needs transformers >= 5, found {transformers.__version__}")

__all__ = [
    "ATTN_IMPLEMENTATION",
    "NATIVE_ALIBI_TYPES",
    "ROPE_TYPES",
    "AttentionSwap",
    "LoadedModel",
    "current_swap",
    "load_local_model",
    "model_family",
    "restore",
    "use_alibi",
    "use_positional_lsh",
]

#: Name under which the attention and mask functions are registered in transformers.
ATTN_IMPLEMENTATION = "positional_lsh"
#: ``config.model_type`` values of native ALiBi models (Falcon only with ``alibi=True``).
NATIVE_ALIBI_TYPES = ("bloom", "mpt", "falcon")
#: ``config.model_type`` values of rotary models run in the paper's setup (RoPE neutralized).
ROPE_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_NATIVE_ATTENTION_CLASS = {"bloom": "BloomAttention", "mpt": "MptAttention", "falcon": "FalconAttention"}
_SWAP_ATTR = "_positional_lsh_swap"


# --------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------


def _mask_interface(
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


def _key_valid(attention_mask: object, batch: int, k_len: int) -> torch.Tensor | None:
    """The ``(B, Lk)`` key-validity mask handed down by :func:`_mask_interface` (or ``None``)."""
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


def _row_ranges(key_valid: torch.Tensor) -> list[tuple[int, int]]:
    """``(first, end)`` of the contiguous run of valid keys of every row; ``ValueError`` for holes."""
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


# --------------------------------------------------------------------------------------------------
# The swap
# --------------------------------------------------------------------------------------------------


def _layer_seed(seed: int, *keys: int) -> int:
    """A 63-bit generator seed derived from ``(seed, *keys)`` (independent streams per layer and step)."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint64)[0]
    return int(state) >> 1


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
        num_samples, scheme, seed: positional-LSH settings (``None`` in ``"alibi"`` mode).
        window: ``(H,)`` float64 largest kept distance ``|i - j|`` for windowed ALiBi, or ``None``.
        resample_in_training: draw fresh partitions at every forward pass in training mode.
        backend: kernel backend passed to the attention functions.
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
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _step: int = field(default=0, repr=False)
    _eval_partitions: dict[int, Partitions] = field(default_factory=dict, repr=False)
    _train_partitions: dict[int, tuple[int, Partitions]] = field(default_factory=dict, repr=False)
    _active: bool = field(default=True, repr=False)

    @property
    def active(self) -> bool:
        """Whether the swap is still installed."""
        return self._active

    def partitions(self, layer_idx: int, seq_len: int, *, training: bool = False) -> Partitions:
        """The partitions layer ``layer_idx`` uses for ``seq_len`` keys (eval mode unless ``training``).

        In training mode these are the current step's partitions (the step advances at each model call).
        """
        if self.mode != "plsh":
            raise ValueError("partitions exist only in positional-LSH mode (use_positional_lsh)")
        layer_idx = int(layer_idx)
        seq_len = positive_int("seq_len", seq_len)
        assert self.seed is not None and self.num_samples is not None and self.scheme is not None
        if training and self.resample_in_training:
            cached = self._train_partitions.get(layer_idx)
            if cached is None or cached[0] != self._step:
                gen = _layer_seed(self.seed, layer_idx, self._step)
                cached = (self._step, self._draw(gen))
                self._train_partitions[layer_idx] = cached
            return cached[1].with_seq_len(seq_len)
        parts = self._eval_partitions.get(layer_idx)
        if parts is None:
            parts = self._eval_partitions[layer_idx] = self._draw(_layer_seed(self.seed, layer_idx))
        return parts.with_seq_len(seq_len)

    def _draw(self, seed: int) -> Partitions:
        assert self.num_samples is not None and self.scheme is not None
        return sample_partitions(1, self.slopes, self.num_samples, scheme=self.scheme, generator=seed)

    def _kernel(
        self, layer_idx: int, training: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self.mode == "alibi":
            return alibi_attention(
                q, k, v, self.slopes, causal=True, window=self.window, scale=scale, backend=self.backend
            )
        parts = self.partitions(layer_idx, k.shape[-2], training=training)
        return plsh_attention(q, k, v, partitions=parts, causal=True, scale=scale, backend=self.backend)

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

        ``key_valid`` is ``None`` or a ``(B, Lk)`` bool mask; each row's valid keys must be contiguous and the
        row is computed on them alone (positions counted from its first valid key). Query rows at padded
        positions get zeros. Returns ``(B, Hq, Lq, d)``.
        """
        lq, lk = q.shape[-2], k.shape[-2]
        if key_valid is None or bool(key_valid.all()):
            return self._kernel(layer_idx, training, q, k, v, scale)
        groups: dict[tuple[int, int], list[int]] = {}
        for row, rng in enumerate(_row_ranges(key_valid)):
            groups.setdefault(rng, []).append(row)
        q0 = lk - lq  # key position of the first query
        out = q.new_zeros(q.shape)
        for (first, end), rows in groups.items():
            qs = max(first, q0)
            if end <= qs:
                continue  # every query of these rows is a padding position
            idx = torch.tensor(rows, device=q.device)
            sub = self._kernel(
                layer_idx,
                training,
                q[idx][:, :, qs - q0 : end - q0],
                k[idx][:, :, first:end],
                v[idx][:, :, first:end],
                scale,
            )
            out[idx, :, qs - q0 : end - q0] = sub
        return out

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


# --------------------------------------------------------------------------------------------------
# Model inspection
# --------------------------------------------------------------------------------------------------


def model_family(model: nn.Module) -> str:
    """``"bloom"``, ``"mpt"``, ``"falcon"`` (native ALiBi) or ``"rope"`` (Llama family); ``ValueError`` otherwise."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt == "falcon" and not getattr(cfg, "alibi", False):
        raise ValueError(
            "this Falcon model uses rotary embeddings (config.alibi=False); only Falcon with alibi=True is supported"
        )
    if mt in NATIVE_ALIBI_TYPES:
        return str(mt)
    if mt in ROPE_TYPES:
        return "rope"
    raise ValueError(
        f"unsupported model type {mt!r}: supported are the native ALiBi models {list(NATIVE_ALIBI_TYPES)} "
        f"and the rotary models {list(ROPE_TYPES)}"
    )


def _num_heads(model: nn.Module, family: str) -> int:
    cfg = model.config
    if family == "bloom":
        return int(cfg.n_head)
    if family == "mpt":
        return int(cfg.n_heads)
    return int(cfg.num_attention_heads)


def _native_slopes(model: nn.Module, family: str) -> torch.Tensor:
    """The model's own ALiBi slopes, read from its own code, in this library's convention (float64)."""
    base = model.base_model
    h = _num_heads(model, family)
    if family == "bloom":
        alibi = base.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), h, torch.float32)  # (H, 1, 2): m * j
        return alibi[:, 0, 1].double()
    if family == "mpt":
        alibi = base.build_mpt_alibi_tensor(h, 2)  # (H, 1, 2): m * (j - 1)
        return (-alibi[:, 0, 0]).double()
    # Falcon: bias m * j (slopes rounded to bfloat16) added before dividing by sqrt(head_dim).
    build = sys.modules[type(base).__module__].build_alibi_tensor
    alibi = build(torch.ones(1, 2, dtype=torch.long), h, torch.float64)
    head_dim = model.config.hidden_size // h
    return alibi[:, 0, 1] / math.sqrt(head_dim)


def _attention_modules(model: nn.Module, family: str) -> list[nn.Module]:
    if family == "rope":
        mods = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]
    else:
        cls = getattr(sys.modules[type(model.base_model).__module__], _NATIVE_ATTENTION_CLASS[family])
        mods = [m for m in model.modules() if isinstance(m, cls)]
    if not mods:
        raise ValueError(f"found no attention modules in this {family} model")
    for i, m in enumerate(mods):
        if getattr(m, "layer_idx", None) is None:
            m.layer_idx = i  # pragma: no cover - every supported class sets it
    return mods


def current_swap(model: nn.Module) -> AttentionSwap | None:
    """The :class:`AttentionSwap` installed on ``model``, or ``None``."""
    swap = getattr(model, _SWAP_ATTR, None)
    return swap if isinstance(swap, AttentionSwap) and swap.active else None


def restore(model: nn.Module) -> bool:
    """Put the model's own attention back; returns whether a swap was installed."""
    swap = current_swap(model)
    if swap is None:
        return False
    swap.restore()
    return True


# --------------------------------------------------------------------------------------------------
# Replacement forwards
# --------------------------------------------------------------------------------------------------


def _swap_of(module: nn.Module) -> AttentionSwap:
    swap = getattr(module, _SWAP_ATTR, None)
    if not isinstance(swap, AttentionSwap) or not swap.active:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is set but this model was not prepared with "
            "positional_lsh.integrations.hf.use_positional_lsh or use_alibi"
        )
    return swap


def _check_dropout(module: nn.Module, p: float) -> None:
    if module.training and p > 0:
        raise ValueError(
            f"attention dropout (p={p}) is not supported by positional_lsh attention; set the model's attention "
            "dropout to 0 for training, or call model.eval()"
        )


def _check_no_attentions(output_attentions: object) -> None:
    if output_attentions:
        raise ValueError(
            "output_attentions=True is not supported: positional_lsh attention never materializes attention "
            "probabilities"
        )


def _bloom_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    _check_no_attentions(output_attentions)
    swap = _swap_of(self)
    _check_dropout(self, self.attention_dropout.p)
    b, lq, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # (B, H, L, d) each
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    ctx = swap.attend(
        self.layer_idx, self.training, q, k, v, _key_valid(attention_mask, b, k.shape[-2]), self.inv_norm_factor
    )
    ctx = ctx.transpose(1, 2).reshape(b, lq, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        out = torch.zeros_like(ctx)
        for i in range(self.pretraining_tp):
            a, z = int(i * slices), int((i + 1) * slices)
            out = out + F.linear(ctx[:, :, a:z], self.dense.weight[:, a:z])
    else:
        out = self.dense(ctx)
    out = residual + F.dropout(out, p=self.hidden_dropout, training=self.training)
    return out, None


def _mpt_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_bias: torch.Tensor | None = None,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    swap = _swap_of(self)
    _check_dropout(self, self.attn_dropout_p)
    b, lq = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (x.reshape(b, lq, self.n_heads, self.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    ctx = swap.attend(
        self.layer_idx, self.training, q, k, v, _key_valid(attention_mask, b, k.shape[-2]), self.softmax_scale
    )
    ctx = ctx.transpose(1, 2).reshape(b, lq, -1)
    return self.out_proj(ctx), None


def _falcon_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    alibi: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    layer_past: Any = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    _check_no_attentions(output_attentions)
    swap = _swap_of(self)
    _check_dropout(self, self.attention_dropout.p)
    num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    q, k, v = self._split_heads(self.query_key_value(hidden_states))  # (B, L, heads, d)
    b, lq = q.shape[:2]
    q = q.transpose(1, 2).reshape(b, self.num_heads, lq, self.head_dim)
    k = k.transpose(1, 2).reshape(b, num_kv_heads, lq, self.head_dim)
    v = v.transpose(1, 2).reshape(b, num_kv_heads, lq, self.head_dim)
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    ctx = swap.attend(
        self.layer_idx, self.training, q, k, v, _key_valid(attention_mask, b, k.shape[-2]), self.inv_norm_factor
    )
    ctx = ctx.transpose(1, 2).reshape(b, lq, self.num_heads * self.head_dim)
    return self.dense(ctx), None


_NATIVE_FORWARDS: dict[str, Callable[..., tuple[torch.Tensor, None]]] = {
    "bloom": _bloom_forward,
    "mpt": _mpt_forward,
    "falcon": _falcon_forward,
}


def _attention_function(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"positional_lsh"`` in transformers' ``AttentionInterface``.

    ``query (B, Hq, Lq, d)``, ``key, value (B, Hkv, Lk, d)`` (after the model's — neutralized — rotary
    embedding and KV cache); returns ``((B, Lq, Hq, d), None)``.
    """
    swap = _swap_of(module)
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError("positional_lsh attention is causal only; this module asked for non-causal attention")
    if sliding_window is not None:
        raise ValueError("sliding-window layers are not supported by positional_lsh attention")
    if softcap is not None:
        raise ValueError("attention logit soft-capping is not supported by positional_lsh attention")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks are not supported by positional_lsh attention")
    _check_no_attentions(kwargs.get("output_attentions", False))
    if dropout:
        _check_dropout(module, float(dropout))
    b, lk = query.shape[0], key.shape[-2]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = swap.attend(module.layer_idx, module.training, query, key, value, _key_valid(attention_mask, b, lk), scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_function)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask_interface)


# --------------------------------------------------------------------------------------------------
# Installing and removing
# --------------------------------------------------------------------------------------------------


def _set_instance_attr(obj: object, name: str, value: object, undo: list[Callable[[], None]]) -> None:
    """Set ``obj.name`` in the instance ``__dict__``, recording how to undo it exactly."""
    had, old = name in obj.__dict__, obj.__dict__.get(name)

    def _undo() -> None:
        if had:
            obj.__dict__[name] = old
        else:
            obj.__dict__.pop(name, None)

    obj.__dict__[name] = value
    undo.append(_undo)


def _neutral_rotary(original: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = original(*args, **kwargs)
        return torch.ones_like(cos), torch.zeros_like(sin)

    return forward


def _install(model: nn.Module, swap: AttentionSwap) -> None:
    undo = swap._undo
    family = swap.family
    cfg = model.config
    mods = _attention_modules(model, family)
    if family == "rope":
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            raise ValueError(
                "models with sliding-window layers (config.layer_types) are not supported; positional_lsh and "
                "ALiBi attention need every layer to see (and cache) all keys"
            )
        rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
        if not rotary:
            raise ValueError(f"found no rotary embedding module in this {cfg.model_type} model")
    # From here on every change is recorded in `undo`.
    try:
        if family == "rope":
            if getattr(cfg, "sliding_window", None) is not None:
                # Mistral: a full-attention cache and the plain causal mask (ALiBi/positional LSH replace it).
                old_window = cfg.sliding_window
                cfg.sliding_window = None
                undo.append(lambda: setattr(cfg, "sliding_window", old_window))
            for m in rotary:
                _set_instance_attr(m, "forward", types.MethodType(_neutral_rotary(m.forward), m), undo)
            old_impl = cfg._attn_implementation
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            undo.append(lambda: model.set_attn_implementation(old_impl))
            if cfg._attn_implementation != ATTN_IMPLEMENTATION:
                raise ValueError(f"{type(model).__name__} refused attn_implementation={ATTN_IMPLEMENTATION!r}")
        else:
            old_internal = cfg._attn_implementation_internal
            # Only selects the registered mask function (a (B, n) padding mask instead of (B, 1, n, n)).
            cfg._attn_implementation_internal = ATTN_IMPLEMENTATION
            undo.append(lambda: setattr(cfg, "_attn_implementation_internal", old_internal))
            fwd = _NATIVE_FORWARDS[family]
            for m in mods:
                _set_instance_attr(m, "forward", types.MethodType(fwd, m), undo)
        for m in mods:
            _set_instance_attr(m, _SWAP_ATTR, swap, undo)
        base = model.base_model

        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            _check_no_attentions(kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False))
            if module.training:
                # A new step per model call, except calls continuing a KV cache (they keep the step's partitions).
                cache = kwargs.get("cache", kwargs.get("past_key_values"))
                if cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0:
                    swap._step += 1

        handle = base.register_forward_pre_hook(pre_hook, with_kwargs=True)
        undo.append(handle.remove)
        _set_instance_attr(model, _SWAP_ATTR, swap, undo)
    except BaseException:
        while undo:
            undo.pop()()
        raise


def _prepare(model: nn.Module, slopes: object, backend: object) -> tuple[str, torch.Tensor, str]:
    family = model_family(model)
    h = _num_heads(model, family)
    if slopes is None:
        m = _native_slopes(model, family) if family != "rope" else alibi_slopes(h).double()
    else:
        m = as_slopes(slopes, h)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return family, m, backend


def use_positional_lsh(
    model: nn.Module,
    *,
    num_samples: int = 8,
    scheme: str = "discrete",
    seed: int | None = 0,
    slopes: torch.Tensor | float | list[float] | None = None,
    resample_in_training: bool = True,
    backend: str = "auto",
) -> AttentionSwap:
    """Replace the attention of ``model`` by positional-LSH attention (the ALiBi estimator with ``T`` samples).

    Args:
        model: a BLOOM, MPT, Falcon (``alibi=True``), Llama, Mistral, Qwen2 or Qwen3 transformers model.
        num_samples: ``T``, sampled partitions per head and layer.
        scheme: ``"discrete"`` (exactly unbiased, fastest), ``"gamma"`` (the paper's) or ``"fixed"`` (ablation).
        seed: seed of the partitions (independent per layer); ``None`` draws one from torch's global RNG
            (recorded in the returned swap's ``seed``).
        slopes: ``(H,)`` slopes or one float, in this library's convention (``-slope |i - j|`` after scaling).
            Default: the model's own slopes (native ALiBi models; Falcon's effective ``slope / sqrt(d)``) or the
            standard ALiBi schedule (Llama family). The paper's constant ``sigma = 256`` is ``slopes=1/256``.
        resample_in_training: in training mode draw fresh partitions at every call of the model.
        backend: ``"auto"``, ``"flash"`` or ``"math"`` (see :func:`positional_lsh.plsh_attention`).

    Returns:
        the installed :class:`AttentionSwap` (also a context manager that restores the model on exit).
        A previous swap on the model is restored first.
    """
    num_samples = positive_int("num_samples", num_samples)
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    elif seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not isinstance(resample_in_training, bool):
        raise TypeError(f"resample_in_training must be a bool, got {type(resample_in_training).__name__}")
    family, m, backend = _prepare(model, slopes, backend)
    sample_partitions(1, m, 1, scheme=scheme, generator=0)  # validates the scheme
    swap = AttentionSwap(
        model,
        family,
        "plsh",
        m,
        num_samples=num_samples,
        scheme=scheme,
        seed=int(seed),
        resample_in_training=resample_in_training,
        backend=backend,
    )
    restore(model)
    _install(model, swap)
    return swap


def use_alibi(
    model: nn.Module,
    *,
    window: torch.Tensor | float | list[float] | None = None,
    slopes: torch.Tensor | float | list[float] | None = None,
    backend: str = "auto",
) -> AttentionSwap:
    """Replace the attention of ``model`` by the library's exact (or windowed) ALiBi attention.

    For native ALiBi models with default slopes this computes what the model computes (to rounding), with
    ``O(n)`` memory instead of ``n x n`` scores and masks, and without MPT's ``max_seq_len`` limit.

    Args:
        model: see :func:`use_positional_lsh`.
        window: ``None`` (exact), or the largest kept distance ``|i - j|`` (one number or one per head).
        slopes: see :func:`use_positional_lsh`.
        backend: ``"auto"``, ``"flash"`` or ``"math"`` (see :func:`positional_lsh.alibi_attention`).

    Returns:
        the installed :class:`AttentionSwap` (a context manager that restores the model on exit).
    """
    family, m, backend = _prepare(model, slopes, backend)
    win = as_window(window, m.numel())
    swap = AttentionSwap(model, family, "alibi", m, window=win, backend=backend)
    restore(model)
    _install(model, swap)
    return swap


# --------------------------------------------------------------------------------------------------
# Loading a local checkpoint
# --------------------------------------------------------------------------------------------------

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


class LoadedModel(NamedTuple):
    """A local checkpoint: the causal LM (eval mode) and its tokenizer (``None`` if the folder has none)."""

    model: PreTrainedModel
    tokenizer: Any | None


def load_local_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a transformers causal LM (and its tokenizer) from a local folder, never touching the network.

    Args:
        path: folder written by ``save_pretrained`` (``config.json`` plus weights, optionally tokenizer files).
        dtype: ``torch.float32``, ``"bfloat16"``, ``"auto"`` (the checkpoint's dtype), ... ; default float32.
        device: device to move the model to.
        attn_implementation: passed to ``from_pretrained`` (e.g. ``"eager"``, ``"sdpa"``); the positional-LSH
            swap is installed afterwards with :func:`use_positional_lsh` / :func:`use_alibi`.
        trust_remote_code: allow custom modeling code stored in the folder.

    Returns:
        :class:`LoadedModel` ``(model, tokenizer)``, the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"path {str(folder)!r} is not a directory (a local transformers checkpoint is needed)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"path {str(folder)!r} has no config.json: not a transformers checkpoint folder")
    if dtype is not None and not isinstance(dtype, (torch.dtype, str)):
        raise TypeError(f"dtype must be a torch.dtype, a str or None, got {type(dtype).__name__}")
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (e.g. 'float32', 'bfloat16') or be 'auto', got {dtype!r}")
        dtype = resolved
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer = None
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
    return LoadedModel(model, tokenizer)
