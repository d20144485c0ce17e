"""Context parallelism for the language model: shard a batch's sequence across a context group.

World layout (``world = data x context``): consecutive ranks form one context group, so rank ``r`` is context
rank ``r % C`` of data replica ``r // C``. :func:`init_context_groups` builds both kinds of group;
:func:`shard_sequence` gives a rank its contiguous piece of ``(B, L, ...)`` tokens; :func:`set_context_group`
makes every positional-LSH attention layer of a :class:`~positional_lsh.TransformerLM` call
:func:`~positional_lsh.distributed.context_parallel_plsh_attention` (the hook in ``lm/model.py`` calls
:func:`context_parallel_attend`). Gradients of the parameters must then be summed over the whole world (each rank
holds the loss of its tokens only, divided by the total token count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from positional_lsh import Partitions
from positional_lsh.distributed.attention import context_parallel_plsh_attention

__all__ = ["context_parallel_attend", "init_context_groups", "set_context_group", "shard_lengths", "shard_sequence"]


def shard_lengths(seq_len: int, world_size: int) -> list[int]:
    """Contiguous shard lengths of ``seq_len`` positions over ``world_size`` ranks (the first ranks get the extra)."""
    base, extra = divmod(seq_len, world_size)
    return [base + (r < extra) for r in range(world_size)]


def shard_sequence(x: torch.Tensor, group: Any = None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous piece of ``x`` along the sequence dimension ``dim`` (``(B, L)`` tokens: ``dim=1``).

    Lengths follow :func:`shard_lengths`; without a process group the whole tensor is returned.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return x
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = shard_lengths(x.shape[dim], world)
    start = sum(lengths[:rank])
    return x.narrow(dim, start, lengths[rank])


def init_context_groups(context_parallel: int) -> tuple[Any, Any]:
    """``(data_group, context_group)`` of this rank for ``world = data x context_parallel`` (collective call).

    Context groups are blocks of ``context_parallel`` consecutive ranks; data groups hold the ranks with the
    same context rank. Every rank must call this (``new_group`` is collective).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if context_parallel < 1 or world % context_parallel:
        raise ValueError(f"context_parallel={context_parallel} must divide the world size {world}")
    data = world // context_parallel
    ctx_group = data_group = None
    for d in range(data):
        ranks = list(range(d * context_parallel, (d + 1) * context_parallel))
        g = dist.new_group(ranks)
        if rank in ranks:
            ctx_group = g
    for c in range(context_parallel):
        ranks = [d * context_parallel + c for d in range(data)]
        g = dist.new_group(ranks)
        if rank in ranks:
            data_group = g
    return data_group, ctx_group


def set_context_group(
    model: nn.Module, group: Any, shard_lengths: Sequence[int] | None = None, head_chunk: int | None = None
) -> None:
    """Make the positional-LSH attention layers of ``model`` context-parallel over ``group`` (``None``: off).

    ``shard_lengths`` (optional) are the per-rank sequence lengths; by default every rank holds ``L / P``.
    ``head_chunk``: see :func:`~positional_lsh.distributed.context_parallel_plsh_attention` (heads in chunks,
    recomputed in the backward: less memory per layer, one more attention forward).
    """
    for module in model.modules():
        if hasattr(module, "attend") and hasattr(module, "partitions"):
            if group is not None and getattr(module, "position", "plsh") != "plsh":
                raise ValueError(f"context parallelism supports position='plsh' only, got {module.position!r}")
            # nn.Module.__setattr__ is typed for tensors and modules only; it stores any value at runtime.
            module.context_group = group
            lengths = None if shard_lengths is None else list(shard_lengths)  # one list per layer
            module.context_shard_lengths = lengths  # type: ignore[assignment]
            module.context_head_chunk = head_chunk  # type: ignore[assignment]


class _ContextLayer(Protocol):
    """What :func:`context_parallel_attend` reads of a language-model attention layer (``distributed`` does not
    import ``lm``): the settings :func:`set_context_group` stored, its config and its partition draw."""

    context_group: Any
    context_shard_lengths: list[int] | None
    cfg: Any  # positional_lsh.lm.ModelConfig

    def partitions(self, seq_len: int) -> Partitions: ...


def context_parallel_attend(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The hook of ``CausalSelfAttention.attend``: ``q, k, v (B, H, L_local, d)`` are this rank's shard.

    ``attn`` is the language model's attention layer: ``attn.partitions(seq_len)`` gives its next partitions of
    the whole sequence (every rank draws them identically; a checksum verifies it), and its ``ModelConfig``
    (``attn.cfg``) gives the kernel backend (``attn_backend``) and the estimator's method (``plsh_method``), so
    the result equals the single-process layer's rows.
    """
    layer = cast(_ContextLayer, attn)
    group = layer.context_group
    lengths = layer.context_shard_lengths
    total = sum(lengths) if lengths is not None else k.shape[2] * dist.get_world_size(group)
    return context_parallel_plsh_attention(
        q,
        k,
        v,
        partitions=layer.partitions(total),
        causal=True,
        group=group,
        shard_lengths=lengths,
        head_chunk=getattr(layer, "context_head_chunk", None),
        backend=layer.cfg.attn_backend,
        method=layer.cfg.plsh_method,
    )
