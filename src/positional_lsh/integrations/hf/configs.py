"""A model's own config object: :func:`own_config`.

transformers shares one config object between the models built from it (``from_config(cfg)``, ``Model(cfg)``), and a
swap changes its model's config (the attention implementation, Mistral's ``sliding_window``). So before its first swap
a model gets a config object of its own: a swap then changes its own model only. Imports nothing else from the
integration.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

from torch import nn
from transformers import PretrainedConfig

# id(config) -> the config, for the configs own_config made (a model holding one needs no new copy).
_OWN_CONFIGS: dict[int, weakref.ref[PretrainedConfig]] = {}


def own_config(model: nn.Module, config: PretrainedConfig) -> PretrainedConfig:
    """Give the modules of ``model`` (a transformers model, or a peft model around one) that hold ``config`` (the
    transformers model's config) or one of its sub-configs a deep copy of it instead; returns the config they hold.

    Equal values, another object, kept after a swap is restored (like the config of a model from
    ``from_pretrained``). A config this function made is kept as it is (stacked swaps share it).
    """
    ref = _OWN_CONFIGS.get(id(config))
    if ref is not None and ref() is config:
        return config
    mine = copy.deepcopy(config)
    pairs: dict[int, Any] = {}
    todo: list[tuple[Any, Any]] = [(config, mine)]
    while todo:
        old, new = todo.pop()
        if isinstance(old, PretrainedConfig) and isinstance(new, PretrainedConfig) and id(old) not in pairs:
            pairs[id(old)] = new
            todo.extend((getattr(old, k, None), getattr(new, k, None)) for k in getattr(old, "sub_configs", {}) or {})
    for module in model.modules():
        for name, value in list(module.__dict__.items()):
            if isinstance(value, PretrainedConfig) and id(value) in pairs:
                module.__dict__[name] = pairs[id(value)]
    for key in [k for k, r in _OWN_CONFIGS.items() if r() is None]:
        del _OWN_CONFIGS[key]
    _OWN_CONFIGS[id(mine)] = weakref.ref(mine)
    return mine
