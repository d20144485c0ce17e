"""The installer: :func:`use_positional_lsh`, :func:`use_alibi`, :func:`restore` and friends.

The model's family (:mod:`positional_lsh.integrations.families`) says how the attention is replaced: native
ALiBi families (BLOOM, MPT, Falcon) get their family's replacement ``forward`` as an instance attribute of each
attention module; the RoPE family goes through transformers' attention registry
(:mod:`positional_lsh.integrations.hf.rope`). The installed :class:`AttentionSwap`
(:mod:`~positional_lsh.integrations.hf.attention_swap`, re-exported here) records every change, and
:meth:`AttentionSwap.restore` undoes them.

Partitions are drawn per layer, independently across layers, by a
:class:`~positional_lsh.ops.sampling.PartitionSampler` seeded with ``layer_seed(seed, layer)``
(:func:`positional_lsh.ops.sampling.layer_seed`, the formula the project's language model uses); in training mode
step ``c`` draws from ``layer_seed(layer_seed(seed, layer), c)``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from positional_lsh.integrations.families import FAMILIES, Family, attention_modules, family_of, native_slopes
from positional_lsh.integrations.hf import rope
from positional_lsh.integrations.hf.attention_swap import SWAP_ATTR, AttentionSwap
from positional_lsh.integrations.hf.forward import check_no_attentions, set_instance_attr
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION
from positional_lsh.ops._checks import as_slopes, as_window, check_bool, check_int
from positional_lsh.ops.options import (
    ALIBI_BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_METHOD,
    check_backend,
    check_method,
)
from positional_lsh.ops.sampling import PartitionSampler
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

#: ``backend=`` values of :func:`use_alibi`: :data:`~positional_lsh.ops.options.BACKENDS` without ``"triton"``
#: (exact and windowed ALiBi, :func:`~positional_lsh.alibi_attention`, have no Triton kernels).


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
    swap = getattr(model, SWAP_ATTR, None)
    return swap if isinstance(swap, AttentionSwap) and swap.active else None


def restore(model: nn.Module) -> bool:
    """Put the model's own attention back; returns whether a swap was installed."""
    swap = current_swap(model)
    if swap is None:
        return False
    swap.restore()
    return True


# --------------------------------------------------------------------------------------------------
# Installing and removing
# --------------------------------------------------------------------------------------------------


def _install(model: nn.Module, swap: AttentionSwap, family: Family) -> None:
    """Install ``swap`` on ``model``: every change is recorded on the swap, or undone if installing fails."""
    mods = _attention_modules(model, family)
    rotary = rope.check_installable(model) if family.registry else []
    undo: list[Callable[[], None]] = []  # from here on every change is recorded
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
                set_instance_attr(m, "forward", types.MethodType(fwd, m), undo)
        for m in mods:
            set_instance_attr(m, SWAP_ATTR, swap, undo)
        handle = model.base_model.register_forward_pre_hook(_step_hook(swap), with_kwargs=True)
        undo.append(handle.remove)
        set_instance_attr(model, SWAP_ATTR, swap, undo)
    except BaseException:
        while undo:
            undo.pop()()
        raise
    for change in undo:
        swap.add_undo(change)


def _step_hook(swap: AttentionSwap) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    """Forward pre-hook of the base model: refuses ``output_attentions`` and advances the training step."""

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        check_no_attentions(kwargs.get("output_attentions") or getattr(module.config, "output_attentions", False))
        if module.training:
            # A new step per model call, except calls continuing a KV cache (they keep the step's partitions).
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0:
                swap.advance_step()

    return pre_hook


def _family_and_slopes(model: nn.Module, slopes: object) -> tuple[Family, torch.Tensor]:
    """The model's swappable family and the ``(H,)`` float64 slopes to use (default: the model's own)."""
    family = _swappable_family(model)
    h = family.num_heads(model)
    if slopes is None:
        native = native_slopes(model)
        return family, native if native is not None else alibi_slopes(h).double()
    return family, as_slopes(slopes, h)


def use_positional_lsh(
    model: nn.Module,
    *,
    num_samples: int = 8,
    scheme: str = "discrete",
    seed: int | None = 0,
    slopes: torch.Tensor | float | list[float] | None = None,
    resample_in_training: bool = True,
    backend: str = DEFAULT_BACKEND,
    method: str = DEFAULT_METHOD,
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
        resample_in_training: in training mode draw fresh partitions at every call of the model (``False``:
            the eval partitions in training mode too).
        backend: one of ``positional_lsh.ops.options.BACKENDS`` (``"auto"``, ``"flash"``, ``"math"``,
            ``"triton"``), passed to :func:`positional_lsh.plsh_attention`.
        method: one of ``positional_lsh.ops.options.METHODS`` (``"auto"``, ``"samples"``, ``"multiplicity"``),
            passed to :func:`positional_lsh.plsh_attention`.

    Returns:
        the installed :class:`AttentionSwap` (also a context manager that restores the model on exit).
        A previous swap on the model is restored first.
    """
    if seed is not None:
        seed = check_int("seed", seed, minimum=0)
    resample_in_training = check_bool("resample_in_training", resample_in_training)
    backend, method = check_backend(backend), check_method(method)
    family, m = _family_and_slopes(model, slopes)
    # Validates num_samples and scheme (a layer's sampler is built the same way, AttentionSwap.sampler).
    PartitionSampler(m.numel(), m, num_samples=num_samples, scheme=scheme, seed=0, eval_seed=0)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    swap = AttentionSwap(
        model,
        family.name,
        "plsh",
        m,
        num_samples=int(num_samples),
        scheme=scheme,
        seed=seed,
        resample_in_training=resample_in_training,
        backend=backend,
        method=method,
    )
    restore(model)
    _install(model, swap, family)
    return swap


def use_alibi(
    model: nn.Module,
    *,
    window: torch.Tensor | float | list[float] | None = None,
    slopes: torch.Tensor | float | list[float] | None = None,
    backend: str = DEFAULT_BACKEND,
) -> AttentionSwap:
    """Replace the attention of ``model`` by the library's exact (or windowed) ALiBi attention.

    For native ALiBi models with default slopes this computes what the model computes (to rounding), with
    ``O(n)`` memory instead of ``n x n`` scores and masks, and without MPT's ``max_seq_len`` limit.

    Args:
        model: see :func:`use_positional_lsh`.
        window: ``None`` (exact), or the largest kept distance ``|i - j|`` (one number or one per head).
        slopes: see :func:`use_positional_lsh`.
        backend: one of :data:`ALIBI_BACKENDS` (``"auto"``, ``"flash"``, ``"math"``; see
            :func:`positional_lsh.alibi_attention`). ``"triton"`` raises ``ValueError``: exact and windowed ALiBi
            have no Triton kernels.

    Returns:
        the installed :class:`AttentionSwap` (a context manager that restores the model on exit).
    """
    if backend == "triton":
        raise ValueError(
            "backend='triton' is not available for use_alibi: exact and windowed ALiBi (alibi_attention) have no "
            f"Triton kernels; use one of {ALIBI_BACKENDS} (the Triton kernels serve use_positional_lsh)"
        )
    backend = check_backend(backend, ALIBI_BACKENDS)
    family, m = _family_and_slopes(model, slopes)
    win = as_window(window, m.numel())
    swap = AttentionSwap(model, family.name, "alibi", m, window=win, backend=backend)
    restore(model)
    _install(model, swap, family)
    return swap
