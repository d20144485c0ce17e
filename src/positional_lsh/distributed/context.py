"""Context parallelism for the language model: shard a batch's sequence across a context group.

World layout (``world = data x context``): consecutive ranks form one context group, so rank ``r`` is context
rank ``r % C`` of data replica ``r // C``. :func:`init_context_groups` builds both kinds of group;
:func:`shard_sequence` gives a rank its contiguous piece of ``(B, L, ...)`` tokens; a :class:`ContextShards` passed
as ``context=`` to a :class:`~positional_lsh.TransformerLM` (or a :class:`~positional_lsh.PositionalLSHAttention`)
makes its positional-LSH attention run as
:func:`~positional_lsh.distributed.context_parallel_plsh_attention` on that call: context parallelism is an
argument, nothing is set on the model. Gradients of the parameters must then be summed over the whole world (each
rank holds the loss of its tokens only, divided by the total token count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from positional_lsh.distributed.attention import context_parallel_plsh_attention
from positional_lsh.ops.module import ShardedCall


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


@dataclass
class ContextShards:
    """This rank's shard of sequences split over a context group: the ``context=`` of a context-parallel call.

    ``model(shard, context=ContextShards(group))`` (a :class:`~positional_lsh.TransformerLM`, or a
    :class:`~positional_lsh.PositionalLSHAttention`) runs every positional-LSH attention as
    :func:`~positional_lsh.distributed.context_parallel_plsh_attention` over ``group``: the module draws the
    partitions of the whole sequence with its own seeds and step (identically on every rank; a checksum verifies
    it), and its ``backend`` and ``method`` (the model's ``attn_backend`` and ``plsh_method``) are passed on, so the
    result equals the single-process rows. It implements :class:`~positional_lsh.ops.module.ShardedAttention`.

    Attributes:
        group: the context group (``None``: the default group; without a process group the call is
            ``plsh_attention``).
        shard_lengths: the per-rank sequence lengths (optional); by default every rank holds ``L / P``.
        head_chunk: see :func:`~positional_lsh.distributed.context_parallel_plsh_attention` (heads in chunks,
            recomputed in the backward: less memory per layer, one more attention forward).
    """

    group: Any = None
    shard_lengths: Sequence[int] | None = None
    head_chunk: int | None = None

    def seq_len(self, local_len: int) -> int:
        """The whole sequence's length: the sum of ``shard_lengths``, or ``local_len`` times the group's size
        (``local_len`` without a process group)."""
        if self.shard_lengths is not None:
            return sum(self.shard_lengths)
        if not (dist.is_available() and dist.is_initialized()):
            return local_len
        return local_len * dist.get_world_size(self.group)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: ShardedCall) -> torch.Tensor:
        """This rank's rows of positional-LSH attention on the whole sequence: ``q, k, v (B, H, L_local, d)`` are its
        shard, ``call.partitions`` those of the whole sequence (``call``: the module's settings)."""
        return context_parallel_plsh_attention(
            q,
            k,
            v,
            partitions=call.partitions,
            causal=call.causal,
            scale=call.scale,
            group=self.group,
            shard_lengths=None if self.shard_lengths is None else list(self.shard_lengths),
            head_chunk=self.head_chunk,
            backend=call.backend,
            method=call.method,
        )
