"""``attn_implementation="positional_lsh"`` on its own: a saved swapped checkpoint describes itself.

A swapped model's ``save_pretrained`` records the swap's settings in ``config.json`` (under
:data:`~positional_lsh.integrations.hf.saved.CONFIG_KEY`) as well as in
:data:`~positional_lsh.integrations.hf.saved.SWAP_FILE`. Then

    ``AutoModelForCausalLM.from_pretrained(folder, attn_implementation="positional_lsh")``

(or ``from_config(config, attn_implementation="positional_lsh")`` of such a config) gives the saved model: the
swap is installed from the config's settings (or, when the config has none, from the folder's
:data:`~positional_lsh.integrations.hf.saved.SWAP_FILE`) at the model's first forward call, before any attention
runs (in the registered mask function, which transformers calls at the start of the forward, before the rotary
embedding and the layers). transformers offers no hook after a model is built, so the models built with the
registered name are noted when they are built (a torch module-registration hook: :func:`note_model`) and
installed on first use (a copy made before that call is found on the call stack at its own first call).
``hf.current_swap(model)`` is ``None`` until that first call. A model compiled before its first call installs it
the same way, outside the graph (:func:`torch.compiler.disable`), at its first compiled call. Several models built
with the name on one config are each installed at their own first call (the calling model is found on the call
stack).

A model built with the name and no saved settings raises one clear error at its first call (unless it was swapped
by :func:`~positional_lsh.integrations.hf.use_positional_lsh` / ``use_alibi`` before). A swapped checkpoint loaded
*without* the name (a plain ``from_pretrained``: the model's own attention) warns once per checkpoint, naming the
settings and the fix, as long as this package is imported.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from positional_lsh.integrations.hf.configs import own_config
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION, padding_mask_interface
from positional_lsh.integrations.hf.saved import CONFIG_KEY, SWAP_FILE, check_swap_settings, read_swap_settings
from positional_lsh.integrations.hf.swap import apply_swap_settings, current_swap, model_family
from positional_lsh.ops.errors import UserError

# id(config) -> the models built on that config with attn_implementation="positional_lsh", not yet installed.
_PENDING: dict[int, list[weakref.ref[PreTrainedModel]]] = {}
_SEEN: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# id(config) -> the config, for the configs whose model was found installed at a call (no more look-ups).
_INSTALLED: dict[int, weakref.ref[PretrainedConfig]] = {}
_WARNED: set[str] = set()
_QUIET: list[bool] = []  # non-empty while a loader that applies (or declines) the saved swap itself is loading


class Quiet:
    """Context manager: no warning about a saved swap while a loader that handles it itself loads the model."""

    def __enter__(self) -> None:
        _QUIET.append(True)

    def __exit__(self, *exc: object) -> None:
        _QUIET.pop()


def saved_settings_source(config: PretrainedConfig) -> str | None:
    """Where ``config``'s saved swap settings are: ``".../config.json"`` (its
    :data:`~positional_lsh.integrations.hf.saved.CONFIG_KEY`), the folder's
    :data:`~positional_lsh.integrations.hf.saved.SWAP_FILE`, or ``None``."""
    folder = str(getattr(config, "_name_or_path", "") or "")
    if CONFIG_KEY in config.__dict__:
        return str(Path(folder) / "config.json") if folder else f"config.{CONFIG_KEY}"
    if folder and (Path(folder) / SWAP_FILE).exists():
        return str(Path(folder) / SWAP_FILE)
    return None


def _settings(config: PretrainedConfig, family: str) -> dict[str, Any] | None:
    """The checked settings saved with ``config`` (config key first, then the folder's file), or ``None``."""
    source = saved_settings_source(config)
    if source is None:
        return None
    if CONFIG_KEY in config.__dict__:
        return check_swap_settings(config.__dict__[CONFIG_KEY], f"{source} ['{CONFIG_KEY}']", family=family)
    folder = Path(str(config._name_or_path))
    return read_swap_settings(folder, family=family)


def note_model(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """torch module-registration hook: notes each transformers model when it gets its first submodule (its config
    and attention implementation are set by then): pending if built with ``attn_implementation="positional_lsh"``,
    a warning once if built otherwise from a checkpoint holding a saved swap."""
    if not isinstance(parent, PreTrainedModel) or parent in _SEEN:
        return
    _SEEN.add(parent)
    config = getattr(parent, "config", None)
    if not isinstance(config, PretrainedConfig):
        return
    if getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        alive = [r for r in _PENDING.get(id(config), []) if (m := r()) is not None and m.config is config]
        _PENDING[id(config)] = [*alive, weakref.ref(parent)]
        for key in [k for k, refs in _PENDING.items() if all(r() is None for r in refs)]:
            del _PENDING[key]
        return
    source = saved_settings_source(config)
    if source is None or _QUIET or source in _WARNED:
        return
    _WARNED.add(source)
    warnings.warn(
        f"{source} holds a positional-LSH swap, but this model is built with attn_implementation="
        f"{config._attn_implementation!r}: it runs the model's own attention, not the saved model's. Pass "
        f"attn_implementation={ATTN_IMPLEMENTATION!r} to from_pretrained (or use hf.load_local_model, or "
        "hf.apply_saved_swap(model, folder)) to get the saved model",
        UserWarning,
        stacklevel=2,
    )


def _installed(config: PretrainedConfig) -> bool:
    """Whether the model on ``config`` was seen installed (or swapped by hand) at a call."""
    ref = _INSTALLED.get(id(config))
    return ref is not None and ref() is config


def _outermost(models: list[PreTrainedModel]) -> PreTrainedModel:
    """The model that holds every other one (e.g. the ``...ForCausalLM`` around its base model)."""
    for m in models:
        inside = {id(x) for x in m.modules()}
        if all(id(o) in inside for o in models):
            return m
    return models[-1]


def _calling_model(config: PretrainedConfig) -> PreTrainedModel | None:
    """The outermost transformers model on ``config`` whose ``forward`` is running (found on the call stack)."""
    frame: FrameType | None = sys._getframe(1)
    found = None
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, PreTrainedModel) and obj.config is config:
            found = obj
        frame = frame.f_back
    return found


def install_pending(config: PretrainedConfig, q_offset: object) -> None:
    """Install the saved swap on the model built on ``config`` with the registered name, at its first call.

    Several models may share ``config`` (``from_config(config, ...)`` twice): the one whose forward is running (found
    on the call stack) is installed; the others stay pending. A copy (``copy.deepcopy``) of such a model made before
    its first call is found the same way.
    """
    refs = _PENDING.pop(id(config), None)
    pending = [m for r in refs or [] if (m := r()) is not None and m.config is config]
    caller = _calling_model(config)
    if caller is None and pending:  # (not on the stack: the pending models of one model, e.g. ...ForCausalLM)
        outer = _outermost(pending)
        caller = outer if all(any(x is o for x in outer.modules()) for o in pending) else None
    if caller is None:
        if pending:
            _PENDING[id(config)] = [weakref.ref(m) for m in pending]
        return
    inside = {id(x) for x in caller.modules()}
    others = [m for m in pending if id(m) not in inside]
    if others:
        _PENDING[id(config)] = [weakref.ref(m) for m in others]
    models = [caller, *(m for m in pending if id(m) in inside and m is not caller)]
    for key in [k for k, r in _INSTALLED.items() if r() is None]:
        del _INSTALLED[key]
    if not others:
        _INSTALLED[id(config)] = weakref.ref(config)
    model = caller
    if current_swap(model) is not None:  # swapped by hand (use_positional_lsh / use_alibi / load_local_model)
        return
    settings = _settings(config, model_family(model))
    if settings is None:
        _PENDING[id(config)] = [weakref.ref(m) for m in models + others]  # refused at every call, not only the first
        _INSTALLED.pop(id(config), None)
        raise UserError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the swap's settings, and this "
            f"{config.model_type} model has none (no {CONFIG_KEY!r} in its config, no {SWAP_FILE} in its folder): "
            "load a checkpoint saved by a swapped model, or install a swap with "
            "positional_lsh.integrations.hf.use_positional_lsh(model, ...) or use_alibi(model)"
        )
    # The model gets its own config (others may share this one), whose attention implementation is the model's own
    # (transformers' default for it): restoring the swap gives that, not the registered name without a swap.
    own = own_config(model, model.config)
    own._attn_implementation_internal = model.get_correct_attn_implementation(None)
    try:
        swap = apply_swap_settings(model, settings, source=saved_settings_source(config))
    except BaseException:
        own._attn_implementation_internal = ATTN_IMPLEMENTATION
        raise
    if model.training and int(q_offset) == 0:  # type: ignore[call-overload]
        swap.advance_step()  # what the swap's forward pre-hook does at a training call (it was installed too late)


def mask_function(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered as ``"positional_lsh"``: installs a pending saved swap (first call), then
    :func:`~positional_lsh.integrations.hf.masks.padding_mask_interface`."""
    config = kwargs.get("config")
    if isinstance(config, PretrainedConfig):
        if torch.compiler.is_compiling():
            if _PENDING and id(config) in _PENDING:  # (traced: no graph break once installed)
                _install_outside_the_graph(config, kwargs.get("q_offset", 0))
        elif id(config) in _PENDING or (CONFIG_KEY in config.__dict__ and not _installed(config)):
            install_pending(config, kwargs.get("q_offset", 0))
    return padding_mask_interface(*args, **kwargs)


@torch.compiler.disable
def _install_outside_the_graph(config: PretrainedConfig, q_offset: object) -> None:
    """A model compiled before its first call: :func:`install_pending` runs outside the graph (a graph break)."""
    install_pending(config, q_offset)


torch.nn.modules.module.register_module_module_registration_hook(note_model)
