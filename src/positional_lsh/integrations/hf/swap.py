"""The installer: :func:`use_positional_lsh`, :func:`use_alibi`, :func:`restore` and friends.

The model's family (:mod:`positional_lsh.integrations.families`) says how the attention is replaced: native
ALiBi families (BLOOM, MPT, Falcon) get their family's replacement ``forward`` as an instance attribute of each
attention module; the RoPE family goes through transformers' attention registry
(:mod:`positional_lsh.integrations.hf.rope`). The installed :class:`AttentionSwap`
(:mod:`~positional_lsh.integrations.hf.attention_swap`, re-exported here) records every change, and
:meth:`AttentionSwap.restore` undoes them.

**What a swap changes, and how it is undone.** Installing compares the instance attributes of every module of the
model and of its configs before and after, and records each one that changed as data — ``(object, name, had it,
old value)`` — plus the forward pre-hook it registered (a callable object holding its swap, not a closure). So
``copy.deepcopy`` of a swapped model copies the records onto the copy's own objects: the copy is swapped like the
original, and restoring one leaves the other alone.

**Swaps stack.** ``use_*`` on a swapped model installs the new swap *on top*: its records hold the swap below
as the old values, so restoring it (``swap.restore()``, or leaving its ``with`` block) brings the swap below back,
with its partitions and its training step. Restoring a swap first restores every swap stacked on it;
:func:`restore` restores them all (the model's own attention).

**peft.** A ``PeftModel`` (LoRA, ...) is accepted: the swap is installed on its base transformers model (the
attention modules are the same objects whether the adapter is active, disabled or merged), and recorded on the
``PeftModel`` too, so ``current_swap`` / ``restore`` accept either, and a model from ``merge_and_unload()`` keeps
the swap.

**Saving.** While swapped, the model's ``save_pretrained`` (and a ``PeftModel``'s) also writes the swap's settings,
:data:`~positional_lsh.integrations.hf.saved.SWAP_FILE`, next to the weights, with the configs as they were
before the swap (e.g. Mistral's ``sliding_window``); :func:`apply_saved_swap` re-applies them.

Partitions are drawn per layer, independently across layers, by a
:class:`~positional_lsh.ops.partitions.sampling.PartitionSampler` seeded with ``layer_seed(seed, layer)``
(:func:`positional_lsh.ops.partitions.sampling.layer_seed`, the formula the project's language model uses); in training
mode
step ``c`` draws from ``layer_seed(layer_seed(seed, layer), c)``.
"""

from __future__ import annotations

import os
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from positional_lsh.integrations.families import FAMILIES, Family, attention_modules, family_of, native_slopes
from positional_lsh.integrations.hf import bloom, rope
from positional_lsh.integrations.hf.attention_swap import SWAP_ATTR, AttentionSwap
from positional_lsh.integrations.hf.cache import LiveKeyCache
from positional_lsh.integrations.hf.configs import own_config
from positional_lsh.integrations.hf.forward import asks_for_attentions, custom_mask_inputs, packed_inputs
from positional_lsh.integrations.hf.generation import set_generation_defaults
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION
from positional_lsh.integrations.hf.saved import (
    CONFIG_KEY,
    MAX_NUM_SAMPLES,
    MAX_SEED,
    SWAP_FILE,
    read_swap_settings,
    swap_settings,
    write_swap_settings,
)
from positional_lsh.integrations.hf.static_cache import StaticCacheFactory
from positional_lsh.ops.checks import as_slopes, as_window, check_bool, check_int
from positional_lsh.ops.errors import UserError
from positional_lsh.ops.options import (
    ALIBI_BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_METHOD,
    check_backend,
    check_method,
)
from positional_lsh.ops.partitions.partition import check_draw_size
from positional_lsh.ops.partitions.sampling import PartitionSampler
from positional_lsh.ops.partitions.slopes import alibi_slopes

#: ``config.model_type`` values of native ALiBi models (Falcon only with ``alibi=True``).
NATIVE_ALIBI_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES if f.forward is not None for t in f.model_types)
#: ``config.model_type`` values of rotary models run in the paper's setup (RoPE neutralized).
ROPE_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES if f.registry for t in f.model_types)

_STACK_ATTR = "_positional_lsh_changes"  # on the model: the records of every installed swap, bottom first


# --------------------------------------------------------------------------------------------------
# Model inspection
# --------------------------------------------------------------------------------------------------


def unwrap_model(model: object) -> PreTrainedModel:
    """The transformers model to swap: ``model`` itself, or the base model of a peft ``PeftModel``.

    ``TypeError`` for anything else (naming ``model.module`` for a ``DistributedDataParallel`` wrapper).
    """
    if isinstance(model, PreTrainedModel):
        return model
    if isinstance(model, nn.Module) and callable(getattr(type(model), "get_base_model", None)):
        inner = getattr(model, "get_base_model")()  # noqa: B009  peft's PeftModel (LoRA, prefix tuning, ...)
        if isinstance(inner, PreTrainedModel):
            return inner
    hint = ""
    if isinstance(getattr(model, "module", None), nn.Module):
        hint = " (a DistributedDataParallel or DataParallel wrapper: pass its .module, or swap before wrapping)"
    raise TypeError(
        f"model must be a transformers PreTrainedModel or a peft PeftModel wrapping one, got {type(model).__name__}"
        + hint
    )


def _swappable_family(model: PreTrainedModel) -> Family:
    """The model's swappable :class:`Family`; ``ValueError`` otherwise."""
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
    """``"bloom"``, ``"mpt"``, ``"falcon"`` (native ALiBi) or ``"rope"`` (Llama family); ``ValueError`` otherwise.

    A peft ``PeftModel`` is looked through (its base model's family).
    """
    return _swappable_family(unwrap_model(model)).name


def _attention_modules(model: nn.Module, family: Family) -> list[nn.Module]:
    mods = attention_modules(model, family)
    if not mods:
        raise ValueError(f"found no attention modules in this {family.name} model")
    for i, m in enumerate(mods):
        if getattr(m, "layer_idx", None) is None:
            # Every supported class sets it. nn.Module.__setattr__ is typed for tensors and modules only; it stores
            # any value at runtime.
            m.layer_idx = i  # type: ignore[assignment]  # pragma: no cover
    return mods


def current_swap(model: nn.Module) -> AttentionSwap | None:
    """The :class:`AttentionSwap` in effect on ``model`` (the top of the stack; a ``PeftModel`` or the model
    inside it), or ``None``."""
    swap = getattr(model, "__dict__", {}).get(SWAP_ATTR)
    if swap is None and not isinstance(model, PreTrainedModel) and isinstance(model, nn.Module):
        try:
            swap = unwrap_model(model).__dict__.get(SWAP_ATTR)
        except TypeError:
            swap = None
    return swap if isinstance(swap, AttentionSwap) and swap.active else None


def restore(model: nn.Module) -> bool:
    """Put the model's own attention back (every stacked swap); returns whether a swap was installed."""
    restored = False
    while (swap := current_swap(model)) is not None:
        swap.restore()
        restored = True
    return restored


# --------------------------------------------------------------------------------------------------
# What a swap changes: data records (deep-copyable), undone in reverse order
# --------------------------------------------------------------------------------------------------

_MISSING = object()


@dataclass(eq=False)
class SwapChanges:
    """Every change one swap made, as data: calling it undoes them (the swap's restore does).

    Attributes:
        swap: the swap these changes installed.
        entries: ``(object, attribute, had it, old value)`` for each instance attribute of a module or config that
            installing set, in the order found; undone in reverse.
        hook_module, hook_id: the module holding the swap's forward pre-hook and the hook's id.
    """

    swap: AttentionSwap
    entries: list[tuple[Any, str, bool, Any]] = field(default_factory=list)
    hook_module: nn.Module | None = None
    hook_id: int | None = None

    def __call__(self) -> None:
        if self.hook_module is not None and self.hook_id is not None:
            for hooks in (self.hook_module._forward_pre_hooks, self.hook_module._forward_pre_hooks_with_kwargs):
                hooks.pop(self.hook_id, None)
            self.hook_module = None
        while self.entries:
            obj, name, had, old = self.entries.pop()
            if had:
                obj.__dict__[name] = old
            else:
                obj.__dict__.pop(name, None)

    def config_entries(self) -> list[tuple[Any, str, bool, Any]]:
        """The entries of config objects, the generation config's included (what a save writes as it was before the
        swap)."""
        return [e for e in self.entries if isinstance(e[0], (PretrainedConfig, GenerationConfig))]


@dataclass(eq=False)
class _RestoreAbove:
    """An undo record of a swap with another stacked on it: restoring the lower one restores the upper one first."""

    above: AttentionSwap

    def __call__(self) -> None:
        self.above.restore()


def _watched(outer: nn.Module) -> list[Any]:
    """The modules of ``outer`` and every config they hold, generation configs included (the objects an install may
    change)."""
    objs: list[Any] = list(outer.modules())
    seen = {id(o) for o in objs}
    models = [m for m in objs if isinstance(m, PreTrainedModel)]
    configs = [getattr(m, "config", None) for m in models]
    for gen in (m.__dict__.get("generation_config") for m in models):
        if isinstance(gen, GenerationConfig) and id(gen) not in seen:
            seen.add(id(gen))
            objs.append(gen)
    while configs:
        cfg = configs.pop()
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in seen:
            seen.add(id(cfg))
            objs.append(cfg)
            configs.extend(getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", {}) or {})
    return objs


def _snapshot(objs: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    return [(o, dict(o.__dict__)) for o in objs]


def _diff(before: list[tuple[Any, dict[str, Any]]]) -> list[tuple[Any, str, bool, Any]]:
    """The instance attributes that changed since ``before`` (by identity), as undo entries."""
    out = []
    for obj, old in before:
        new = obj.__dict__
        for name in list(old) + [n for n in new if n not in old]:
            if old.get(name, _MISSING) is not new.get(name, _MISSING):
                out.append((obj, name, name in old, old.get(name)))
    return out


@dataclass(eq=False)
class StepHook:
    """The base model's forward pre-hook of one swap: records ``output_attentions`` and advances the training step.

    It acts only while its swap is the one in effect (not shadowed by a swap stacked on top). A new step per
    training-mode model call, except calls continuing a KV cache (they keep the step's partitions). Every input is
    checked here, before any layer runs (a refused call changes no KV cache). A changed attention implementation
    (``model.set_attn_implementation("eager")``) is put back, with a warning: the swap stays in force until it is
    restored. ``registry``: the swap goes through transformers' attention registry (the RoPE family; a native
    family's name selects only the mask function of its replacement forward);
    ``bloom``: a BLOOM call without a mask gets the all-valid view."""

    swap: AttentionSwap
    registry: bool = False
    bloom: bool = False

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if module.__dict__.get(SWAP_ATTR) is not self.swap:
            return None
        config: Any = module.config  # a transformers PretrainedConfig: read by name
        if (changed := config._attn_implementation) != ATTN_IMPLEMENTATION:
            if self.registry:
                self.swap.model.set_attn_implementation(ATTN_IMPLEMENTATION)
            else:  # a native family: the name selects only the mask function (the (B, n) padding mask)
                config._attn_implementation_internal = ATTN_IMPLEMENTATION
            why = "the rotary embedding is neutralized" if self.registry else "the attention runs the swap's forward"
            msg = f"the attention implementation of this swapped model was changed to {changed!r}; the positional-LSH"
            msg += f" swap stays in force ({why}): hf.restore(model) first for the model's own attention"
            warnings.warn(msg, UserWarning, stacklevel=2)
        self.swap.output_attentions = asks_for_attentions(config, kwargs)
        custom = custom_mask_inputs(self.swap, self.registry, args, kwargs)  # a 4-D mask (RoPE family): no cache
        packed = custom if custom is not None else packed_inputs(module, kwargs)  # packed sequences: no cache either
        if packed is not None:
            kwargs = packed
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, LiveKeyCache) and not torch.compiler.is_compiling():
            cache.check_continues(kwargs)  # a reused cache must continue its sequence
        if module.training:
            if cache is None or not hasattr(cache, "get_seq_length") or cache.get_seq_length() == 0:
                self.swap.advance_step()
        if self.bloom:  # no (B H, 1, n) ALiBi tensor per call (bloom.NoAlibi, bloom.all_valid_mask)
            bloom.all_valid_mask(args, kwargs)
        return None if packed is None and not self.bloom else (args, kwargs)


@dataclass(eq=False)
class SaveWithSwap:
    """A swapped model's ``save_pretrained``: the model's own, with the configs as before the swap, then the
    swap's settings (:data:`~positional_lsh.integrations.hf.saved.SWAP_FILE`) in the same folder (main process).

    It stays after the swap is restored: a model saved with no swap in effect writes no swap's settings, and
    removes a :data:`~positional_lsh.integrations.hf.saved.SWAP_FILE` left in the folder by an earlier save (which
    would re-apply a swap the model no longer has)."""

    owner: nn.Module
    original: Any

    def __call__(self, save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        swap = current_swap(self.owner)
        stack: list[SwapChanges] = list(unwrap_model(self.owner).__dict__.get(_STACK_ATTR, []))
        entries = [e for changes in stack for e in changes.config_entries()]
        current = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _, _ in entries]
        for obj, name, had, old in reversed(entries):  # the configs as they were before the first swap
            if had:
                obj.__dict__[name] = old
            else:
                obj.__dict__.pop(name, None)
        config = unwrap_model(self.owner).config
        recorded = config.__dict__.get(CONFIG_KEY, _MISSING)
        if swap is not None:  # config.json describes the swap too (attn_implementation="positional_lsh" reads it)
            config.__dict__[CONFIG_KEY] = swap_settings(swap)
        else:  # (a config loaded from a swapped checkpoint holds the key)
            config.__dict__.pop(CONFIG_KEY, None)
        try:
            result = self.original(save_directory, *args, **kwargs)
        finally:
            if recorded is _MISSING:
                config.__dict__.pop(CONFIG_KEY, None)
            else:
                config.__dict__[CONFIG_KEY] = recorded
            for obj, name, value in current:
                if value is _MISSING:
                    obj.__dict__.pop(name, None)
                else:
                    obj.__dict__[name] = value
        if kwargs.get("is_main_process", True):
            if swap is not None:
                write_swap_settings(swap, save_directory)
            elif os.path.isfile(stale := os.path.join(save_directory, SWAP_FILE)):
                os.remove(stale)
        return result


# --------------------------------------------------------------------------------------------------
# Installing and removing
# --------------------------------------------------------------------------------------------------


def _install(outer: nn.Module, inner: PreTrainedModel, swap: AttentionSwap, family: Family) -> None:
    """Install ``swap`` on ``inner`` (``outer``: the object the caller passed, e.g. a ``PeftModel``).

    Every change is recorded on the swap (:class:`SwapChanges`), or undone if installing fails.
    """
    below = current_swap(inner)
    mods = _attention_modules(inner, family)
    rotary = rope.check_installable(inner) if family.registry else []
    # Kept after a restore (not recorded): the model's own config object, and its save_pretrained (SaveWithSwap).
    own_config(outer, inner.config)
    for obj in {id(o): o for o in (inner, outer)}.values():
        if not isinstance(obj.__dict__.get("save_pretrained"), SaveWithSwap):
            obj.__dict__["save_pretrained"] = SaveWithSwap(obj, obj.save_pretrained)
    watched = _watched(outer)
    before = _snapshot(watched)
    changes = SwapChanges(swap)
    try:
        if family.registry:
            rope.install(inner, rotary)
        else:
            # Only selects the registered mask function (a (B, n) padding mask instead of (B, 1, n, n)).
            inner.config._attn_implementation_internal = ATTN_IMPLEMENTATION
            fwd = family.load_forward()
            for m in mods:
                m.__dict__["forward"] = types.MethodType(fwd, m)
        for obj in {id(o): o for o in (*mods, inner.base_model, inner, outer)}.values():
            obj.__dict__[SWAP_ATTR] = swap
        # generate(cache_implementation="static") builds the swap's fixed-capacity cache instead of a StaticCache.
        inner.__dict__["_prepare_static_cache"] = StaticCacheFactory(swap)
        # A plain generate() holds the live keys only and prefills in chunks (bounded swaps; module generation).
        set_generation_defaults(inner, swap, inner.__dict__.get(_STACK_ATTR, []))
        inner.__dict__[_STACK_ATTR] = [*inner.__dict__.get(_STACK_ATTR, []), changes]
        if family.name == "bloom":  # no ALiBi tensor (the replacement reads none); a static cache's slot masks
            bloom.install(inner)
        hook = StepHook(swap, family.registry, family.name == "bloom")
        handle = inner.base_model.register_forward_pre_hook(hook, with_kwargs=True)
        changes.hook_module, changes.hook_id = inner.base_model, handle.id
        changes.entries = _diff(before)
    except BaseException:
        changes.entries = _diff(before)
        changes()
        raise
    swap.add_undo(changes)
    if below is not None:
        below.add_undo(_RestoreAbove(swap))


def _family_and_slopes(model: PreTrainedModel, slopes: Any) -> tuple[Family, torch.Tensor]:
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
        model: a BLOOM, MPT, Falcon (``alibi=True``), Llama, Mistral, Qwen2 or Qwen3 transformers model, or a peft
            ``PeftModel`` wrapping one (the swap goes on its base model).
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
        the installed :class:`AttentionSwap` (also a context manager that restores it on exit). On a swapped
        model the new swap is stacked on the one in effect, which comes back when the new one is restored.

    Example:
        >>> import torch
        >>> from transformers import BloomConfig, BloomForCausalLM
        >>> from positional_lsh.integrations.hf import use_positional_lsh
        >>> _ = torch.manual_seed(0)
        >>> model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)).eval()
        >>> ids = torch.randint(0, 64, (1, 48))
        >>> with torch.no_grad():
        ...     exact = model(ids).logits
        ...     with use_positional_lsh(model, num_samples=8, seed=0):  # the swap is undone on exit
        ...         approx = model(ids).logits
        ...     after = model(ids).logits
        >>> approx.shape == exact.shape, torch.equal(after, exact)
        (True, True)
    """
    inner = unwrap_model(model)
    if seed is not None:
        seed = check_int("seed", seed, minimum=0)
        if seed > MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}] (a torch.Generator seed, 2**64 - 1 at most), got {seed}")
    resample_in_training = check_bool("resample_in_training", resample_in_training)
    backend, method = check_backend(backend), check_method(method)
    with torch.device("cpu"):  # the swap's tensors, also for a model built under torch.device("meta")
        return _use_positional_lsh(model, inner, num_samples, scheme, seed, slopes, resample_in_training, backend,
                                   method)  # fmt: skip


def _use_positional_lsh(
    model: nn.Module,
    inner: PreTrainedModel,
    num_samples: int,
    scheme: str,
    seed: int | None,
    slopes: Any,
    resample_in_training: bool,
    backend: str,
    method: str,
) -> AttentionSwap:
    family, m = _family_and_slopes(inner, slopes)
    # Validates num_samples and scheme (a layer's sampler is built the same way, AttentionSwap.sampler).
    PartitionSampler(m.numel(), m, num_samples=num_samples, scheme=scheme, seed=0, eval_seed=0)
    # One forward draws T partitions per head in every layer (each layer keeps its eval draw): refuse up front
    # what those draws cannot do.
    layers = max(1, len(attention_modules(inner, family)))
    what = f"use_positional_lsh with num_samples={num_samples} ({m.numel()} heads, {layers} layers)"
    check_draw_size(num_samples, m.numel() * layers, what, scheme)
    if num_samples > MAX_NUM_SAMPLES:  # (the bound of a saved swap: what save_pretrained writes must load)
        raise ValueError(f"num_samples must be <= {MAX_NUM_SAMPLES} (2**20), got {num_samples}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    swap = AttentionSwap(
        inner,
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
    _install(model, inner, swap, family)
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
        the installed :class:`AttentionSwap` (a context manager that restores it on exit; stacked as in
        :func:`use_positional_lsh`).
    """
    inner = unwrap_model(model)
    try:
        backend = check_backend(backend, ALIBI_BACKENDS)
    except ValueError:
        raise ValueError(
            f"backend={backend!r} is not available for use_alibi: use one of {ALIBI_BACKENDS} (exact and windowed "
            "ALiBi, alibi_attention, have no Triton kernels; those serve use_positional_lsh)"
        ) from None
    with torch.device("cpu"):  # the swap's tensors, also for a model built under torch.device("meta")
        family, m = _family_and_slopes(inner, slopes)
        win = as_window(window, m.numel())
        swap = AttentionSwap(inner, family.name, "alibi", m, window=win, backend=backend)
    _install(model, inner, swap, family)
    return swap


# --------------------------------------------------------------------------------------------------
# Saved settings
# --------------------------------------------------------------------------------------------------


def apply_swap_settings(model: nn.Module, settings: dict[str, Any], *, source: str | None = None) -> AttentionSwap:
    """Install the swap described by ``settings`` (as :func:`~positional_lsh.integrations.hf.saved.swap_settings`
    writes them, checked by ``read_swap_settings``), at the saved training step.

    ``backend`` and ``method`` are not re-applied (they choose how to compute, not what): the defaults are used.
    Settings recording another model family than ``model``'s raise ``UserError``; so do settings this model cannot
    take (e.g. slopes for another number of heads), naming ``source`` (where they were read) when given.
    """
    recorded, family = settings.get("family"), model_family(model)
    where = "these swap settings" if source is None else str(source)
    if recorded is not None and recorded != family:
        raise UserError(f"{where} were saved for a {recorded!r} model, but this model is {family!r}")
    position = settings["position"]
    try:
        if position == "plsh":
            swap = use_positional_lsh(
                model,
                num_samples=settings["num_samples"],
                scheme=settings["scheme"],
                seed=settings["seed"],
                slopes=settings["slopes"],
                resample_in_training=settings.get("resample_in_training", True),
            )
        elif position in ("alibi", "window-alibi"):
            swap = use_alibi(model, window=settings.get("window"), slopes=settings["slopes"])
        else:
            raise ValueError(f"settings['position'] must be 'plsh', 'alibi' or 'window-alibi', got {position!r}")
    except (TypeError, ValueError) as exc:
        if source is None:
            raise
        raise UserError(f"{source}: {exc}") from None
    swap.set_step(int(settings.get("step", 0)))
    return swap


def apply_saved_swap(model: nn.Module, folder: str | os.PathLike[str]) -> AttentionSwap | None:
    """Re-apply the swap saved in ``folder`` (its :data:`~positional_lsh.integrations.hf.saved.SWAP_FILE`) to
    ``model``, e.g. after a plain ``from_pretrained(folder)``; ``None`` (nothing changed) if there is none."""
    settings = read_swap_settings(folder, family=model_family(model))
    return None if settings is None else apply_swap_settings(model, settings, source=str(Path(folder) / SWAP_FILE))
