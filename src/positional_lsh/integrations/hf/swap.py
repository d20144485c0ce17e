"""The swap: :class:`AttentionSwap`, :func:`use_positional_lsh`, :func:`use_alibi`, :func:`restore` and friends.

The model's family (:mod:`positional_lsh.integrations.families`) says how the attention is replaced: native
ALiBi families (BLOOM, MPT, Falcon) get their family's replacement ``forward`` as an instance attribute of each
attention module; the RoPE family goes through transformers' attention registry
(:mod:`positional_lsh.integrations.hf.rope`). Every change is recorded and undone by :meth:`AttentionSwap.restore`.

Partitions are drawn per layer, independently across layers, from
:func:`positional_lsh.ops._seeds.layer_seed` ``(seed, layer)`` (the formula the project's language model uses);
in training mode from ``layer_seed(layer_seed(seed, layer), step)``.
"""

from __future__ import annotations

import numbers
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from positional_lsh.integrations.families import FAMILIES, Family, attention_modules, family_of, native_slopes
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION, _key_valid, _row_ranges
from positional_lsh.ops._checks import as_slopes, as_window, positive_int
from positional_lsh.ops._kernels import BACKENDS
from positional_lsh.ops._seeds import layer_seed
from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.partitions import Partitions, sample_partitions
from positional_lsh.ops.reference import alibi_attention
from positional_lsh.ops.slopes import alibi_slopes

__all__ = [
    "NATIVE_ALIBI_TYPES",
    "ROPE_TYPES",
    "AttentionSwap",
    "current_swap",
    "model_family",
    "restore",
    "use_alibi",
    "use_positional_lsh",
]

#: ``config.model_type`` values of native ALiBi models (Falcon only with ``alibi=True``).
NATIVE_ALIBI_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES if f.forward is not None for t in f.model_types)
#: ``config.model_type`` values of rotary models run in the paper's setup (RoPE neutralized).
ROPE_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES if f.registry for t in f.model_types)

_SWAP_ATTR = "_positional_lsh_swap"


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
                gen = layer_seed(layer_seed(self.seed, layer_idx), self._step)
                cached = (self._step, self._draw(gen))
                self._train_partitions[layer_idx] = cached
            return cached[1].with_seq_len(seq_len)
        parts = self._eval_partitions.get(layer_idx)
        if parts is None:
            parts = self._eval_partitions[layer_idx] = self._draw(layer_seed(self.seed, layer_idx))
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


def _swappable_family(model: nn.Module) -> Family:
    """The model's swappable :class:`Family`; ``TypeError`` / ``ValueError`` otherwise."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt == "falcon" and not getattr(cfg, "alibi", False):
        raise ValueError(
            "this Falcon model uses rotary embeddings (config.alibi=False); only Falcon with alibi=True is supported"
        )
    fam = family_of(model) if mt in NATIVE_ALIBI_TYPES + ROPE_TYPES else None
    if fam is None or not fam.swappable:
        raise ValueError(
            f"unsupported model type {mt!r}: supported are the native ALiBi models {list(NATIVE_ALIBI_TYPES)} "
            f"and the rotary models {list(ROPE_TYPES)}"
        )
    return fam


def model_family(model: nn.Module) -> str:
    """``"bloom"``, ``"mpt"``, ``"falcon"`` (native ALiBi) or ``"rope"`` (Llama family); ``ValueError`` otherwise."""
    return _swappable_family(model).name


def _attention_modules(model: nn.Module, family: Family) -> list[nn.Module]:
    mods = attention_modules(model, family)
    if not mods:
        raise ValueError(f"found no attention modules in this {family.name} model")
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
# Used by the replacement forwards
# --------------------------------------------------------------------------------------------------


def _swap_of(module: nn.Module) -> AttentionSwap:
    swap = getattr(module, _SWAP_ATTR, None)
    if not isinstance(swap, AttentionSwap) or not swap.active:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is set but this model was not prepared with "
            "positional_lsh.integrations.hf.use_positional_lsh or use_alibi"
        )
    return swap


def _attend_native(
    module: nn.Module,
    swap: AttentionSwap,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """A native forward's attention: ``q (B, Hq, Lq, d)`` on the cached ``k, v``, heads merged: ``(B, Lq, Hq * d)``."""
    b, lq = q.shape[0], q.shape[-2]
    ctx = swap.attend(module.layer_idx, module.training, q, k, v, _key_valid(attention_mask, b, k.shape[-2]), scale)
    return ctx.transpose(1, 2).reshape(b, lq, -1)


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


def _install(model: nn.Module, swap: AttentionSwap, family: Family) -> None:
    from positional_lsh.integrations.hf import rope

    undo = swap._undo
    mods = _attention_modules(model, family)
    rotary = rope._check_installable(model) if family.registry else []
    # From here on every change is recorded in `undo`.
    try:
        if family.registry:
            rope.install(model, rotary, undo)
        else:
            cfg = model.config
            old_internal = cfg._attn_implementation_internal
            # Only selects the registered mask function (a (B, n) padding mask instead of (B, 1, n, n)).
            cfg._attn_implementation_internal = ATTN_IMPLEMENTATION
            undo.append(lambda: setattr(cfg, "_attn_implementation_internal", old_internal))
            fwd = family.load_forward()
            for m in mods:
                _set_instance_attr(m, "forward", types.MethodType(fwd, m), undo)
        for m in mods:
            _set_instance_attr(m, _SWAP_ATTR, swap, undo)
        handle = model.base_model.register_forward_pre_hook(_step_hook(swap), with_kwargs=True)
        undo.append(handle.remove)
        _set_instance_attr(model, _SWAP_ATTR, swap, undo)
    except BaseException:
        while undo:
            undo.pop()()
        raise


def _step_hook(swap: AttentionSwap) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    """Forward pre-hook of the base model: refuses ``output_attentions`` and advances the training step."""

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _check_no_attentions(kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False))
        if module.training:
            # A new step per model call, except calls continuing a KV cache (they keep the step's partitions).
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0:
                swap._step += 1

    return pre_hook


def _prepare(model: nn.Module, slopes: object, backend: object) -> tuple[Family, torch.Tensor, str]:
    family = _swappable_family(model)
    h = family.num_heads(model)
    if slopes is None:
        native = native_slopes(model)
        m = native if native is not None else alibi_slopes(h).double()
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
        family.name,
        "plsh",
        m,
        num_samples=num_samples,
        scheme=scheme,
        seed=int(seed),
        resample_in_training=resample_in_training,
        backend=backend,
    )
    restore(model)
    _install(model, swap, family)
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
    swap = AttentionSwap(model, family.name, "alibi", m, window=win, backend=backend)
    restore(model)
    _install(model, swap, family)
    return swap
