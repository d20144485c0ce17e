"""Context-parallel training: what :func:`positional_lsh.lm.train.train` calls for ``context_parallel > 1``.

World layout: ``world = data x context``; consecutive ranks form a context group (:func:`init_context_groups`),
so global rank ``r`` is context rank ``r % C`` of data replica ``r // C``. Each data replica draws its rows of
the global batch exactly as data parallelism does with ``data`` processes, and its ``C`` context ranks take
contiguous pieces of those rows' sequence (inputs and targets), in rank order.

Loss and gradients: every rank's loss is the sum of its own tokens' losses divided by the global token count,
times the world size (:class:`ContextParallelLoss`). ``DistributedDataParallel`` over the whole world averages
the gradients over ``world`` ranks, which cancels that factor: the result is the gradient of the global mean
loss, i.e. the per-replica gradients summed over the context ranks and averaged over the data ranks — exactly
what data parallelism alone computes. With equal shards (``seq_len % C == 0``) the factor is 1 and each rank's
loss is simply the mean over its tokens. The partitions of every positional-LSH layer are drawn by the layer's
``ops.partitions.sampling.PartitionSampler`` (seeded per layer by ``ops.partitions.sampling.layer_seed``; training step
``c`` draws from
``layer_seed(seed, c)``), whose step counter every rank advances identically; the attention verifies it by a
checksum. The layer's ``attn_backend`` and ``plsh_method`` reach the sharded attention. Context parallelism is an
argument: :attr:`ContextParallel.shards` (a :class:`~positional_lsh.distributed.ContextShards`) is passed as
``model(x, y, context=...)`` by :class:`ContextParallelLoss` in training and by the caller in validation; the model
itself is never changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from positional_lsh.distributed.context import ContextShards, init_context_groups, shard_lengths


def check_context_parallel(context_parallel: int, position: str, world: int) -> None:
    """Refuse a context-parallel run that cannot work, with a one-line ``ValueError`` (before any collective)."""
    if context_parallel == 1:
        return
    if position != "plsh":
        raise ValueError(
            f"--context-parallel {context_parallel} needs --position plsh (only positional-LSH attention is "
            f"sharded over the sequence), got position={position!r}"
        )
    if world % context_parallel:
        raise ValueError(
            f"--context-parallel {context_parallel} must divide the number of processes ({world}; world = data x "
            f"context): launch with torchrun --nproc_per_node a multiple of {context_parallel}"
        )


@dataclass
class ContextParallel:
    """This rank's place in a ``data x context`` run and the sequence shard it owns.

    Attributes:
        size: ``C``, ranks per context group.
        seq_len: the training sequence length ``L`` (shards: :func:`shard_lengths` of ``L`` over ``C``).
        data_group, context_group: this rank's process groups (from :func:`init_context_groups`).
        data_rank, data_world: this rank's data replica and the number of replicas (``world / C``).
        context_rank: this rank's place in its context group.
        head_chunk: see :class:`~positional_lsh.distributed.ContextShards` (``None``: one attention call per layer).
        shards: the ``context=`` argument of this rank's model calls (the context group, the shard lengths and
            ``head_chunk``).
    """

    size: int
    seq_len: int
    data_group: Any
    context_group: Any
    data_rank: int
    data_world: int
    context_rank: int
    head_chunk: int | None = None
    lengths: list[int] = field(init=False)
    shards: ContextShards = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = shard_lengths(self.seq_len, self.size)
        self.shards = ContextShards(self.context_group, self.lengths, self.head_chunk)

    @property
    def start(self) -> int:
        """First position of this rank's shard."""
        return sum(self.lengths[: self.context_rank])

    @property
    def end(self) -> int:
        """One past the last position of this rank's shard."""
        return self.start + self.lengths[self.context_rank]

    @property
    def loss_factor(self) -> float:
        """``C * L_local / L``: turns the mean over this rank's tokens into (its token sum / global count) x world."""
        return self.size * self.lengths[self.context_rank] / self.seq_len

    def local(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a global ``(rows, L)`` batch: its data replica's rows, its shard of the sequence."""
        if batch.shape[0] % self.data_world:
            raise ValueError(f"a batch of {batch.shape[0]} rows does not split over {self.data_world} data replicas")
        rows = batch.shape[0] // self.data_world
        return batch[self.data_rank * rows : (self.data_rank + 1) * rows, self.start : self.end]

    def shard_batches(
        self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's pieces (:meth:`local`) of an iterator of global ``(inputs, targets)`` batches."""
        for x, y in batches:
            yield self.local(x), self.local(y)

    def describe(self) -> str:
        """``data D x context C`` for the run's banner."""
        return f"data {self.data_world} x context {self.size}"


class ContextParallelLoss(nn.Module):
    """``model(x, y, context=shards) -> (logits, loss * factor)``: a rank's loss as its token sum / global count x
    world size, its attention context-parallel over ``shards``.

    Wrapped in ``DistributedDataParallel`` over the whole world (which averages gradients over ``world``), the
    gradients are those of the global mean loss. ``factor`` is :attr:`ContextParallel.loss_factor` (1 for equal
    shards, in which case the loss is returned untouched); ``shards`` is :attr:`ContextParallel.shards`.
    """

    def __init__(self, model: nn.Module, factor: float, shards: ContextShards) -> None:
        super().__init__()
        self.model = model
        self.factor = float(factor)
        self.shards = shards

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, loss = self.model(idx, targets, context=self.shards)
        return logits, loss if self.factor == 1.0 else loss * self.factor


def setup_context_parallel(
    context_parallel: int, model: nn.Module, seq_len: int, device: torch.device, head_chunk: int | None = None
) -> tuple[ContextParallel, nn.Module]:
    """Build the groups and wrap ``model`` for context-parallel training (collective call).

    Returns ``(cp, ddp_model)``: ``ddp_model(x, y)`` on this rank's piece (``cp.local``) calls
    ``model(x, y, context=cp.shards)`` and returns ``(logits, loss)`` whose backward leaves the gradients of the
    global mean loss in ``model``'s parameters, identical on every rank. ``model`` itself is unchanged (a call
    without ``context=`` is the single-process model; validation passes ``context=cp.shards`` itself).
    ``head_chunk`` goes to :class:`~positional_lsh.distributed.ContextShards` (``None``: the attention's default,
    one call per layer).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if seq_len < context_parallel:
        raise ValueError(f"seq_len={seq_len} is shorter than --context-parallel {context_parallel}")
    data_group, ctx_group = init_context_groups(context_parallel)
    cp = ContextParallel(
        size=context_parallel,
        seq_len=seq_len,
        data_group=data_group,
        context_group=ctx_group,
        data_rank=rank // context_parallel,
        data_world=world // context_parallel,
        context_rank=rank % context_parallel,
        head_chunk=head_chunk,
    )
    wrapped = ContextParallelLoss(model, cp.loss_factor, cp.shards)
    ddp = nn.parallel.DistributedDataParallel(wrapped, device_ids=[device.index] if device.type == "cuda" else None)
    return cp, ddp
