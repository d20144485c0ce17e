"""``plsh train-hf --fsdp``: the model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) over the
``torchrun`` processes, and its full (unsharded) state for checkpoints and resume.

Every decoder layer (the classes of the transformers model's ``_no_split_modules``) is one FSDP unit, then the whole
model: each process keeps ``1 / world`` of the weights, gradients and AdamW state, and all-gathers one layer's
weights at a time. The weights stay float32 (master weights); ``autocast`` casts them for compute, as in one
process, so that a sharded run computes what one process computes. In a layer whose parameters have several
dtypes (LoRA adapters, float32, on a bfloat16 base) each module holding the odd ones out is its own unit first
(FSDP2 all-gathers one dtype per unit).

Checkpoints hold full state dicts (gathered to rank 0 on the CPU): ``save_pretrained`` writes the same folder as an
unsharded run (``plsh eval`` and ``from_pretrained`` load it), and ``trainer_state.pt`` the full trained parameters
and AdamW state keyed by parameter name, which :func:`load_full_state` shards again on resume.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.swap import unwrap_model
from positional_lsh.ops.errors import UserError


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers (or peft) model: its modules whose class is one of the transformers
    model's ``_no_split_modules``."""
    names = set(getattr(unwrap_model(model), "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: nn.Module, world: int, device: torch.device) -> None:
    """Apply FSDP2 in place: every decoder layer, then the transformers model (the root), over ``world`` processes
    of the default process group; the shards move to ``device``. ``UserError`` for a model without decoder layers
    to shard."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # pragma: no cover - torch 2.5 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import fully_shard

    layers = decoder_layers(model)
    if not layers:
        kind = type(unwrap_model(model)).__name__
        raise UserError(f"--fsdp: {kind} names no decoder layer class (_no_split_modules) to shard; drop --fsdp")
    mesh = init_device_mesh(device.type, (world,))
    for layer in layers:
        dtypes = [p.dtype for p in layer.parameters()]
        if len(set(dtypes)) > 1:
            common = max(set(dtypes), key=dtypes.count)
            for sub in layer.modules():
                own = list(sub.parameters(recurse=False))
                if own and sub is not layer and any(p.dtype != common for p in own):
                    fully_shard(sub, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    # the root reshards after its forward too: a forward without a backward (the attention probe, validation)
    # leaves no unsharded weights behind for a checkpoint or a resume to meet
    fully_shard(unwrap_model(model), mesh=mesh, reshard_after_forward=True)


def _options(*, cpu_offload: bool = False, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=strict)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full model state dict and AdamW state (keyed by parameter name) of a sharded model, on the CPU of rank 0
    (other ranks get empty dicts). A collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights: dict[str, Any] = get_model_state_dict(model, options=_options(cpu_offload=True))
    optim: dict[str, Any] = dict(get_optimizer_state_dict(model, opt, options=_options(cpu_offload=True)))
    return weights, optim


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, trained: dict[str, Any],
                    optim: dict[str, Any]) -> None:  # fmt: skip
    """Shard the full trained parameters ``trained`` and AdamW state ``optim`` (of :func:`full_state`) into the
    sharded ``model`` and ``opt``; every process calls it with the same dicts."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, trained, options=_options(strict=False))
    set_optimizer_state_dict(model, opt, optim, options=_options())
