"""Context parallelism for positional-LSH attention over ``torch.distributed`` (halo-only exchange).

The sequence is split into contiguous shards, one per rank of a process group. Because every sampled block
is contiguous, a rank needs only the keys/values of the blocks that cross its shard boundaries (its *halo*),
computed exactly from the partitions: see ``docs/distributed.md``.

* :func:`context_parallel_plsh_attention`: this rank's shard of :func:`positional_lsh.plsh_attention` on the
  whole sequence, with exact gradients (halo gradients are sent back to their owners).
* :class:`ContextShards`: the same for a :class:`~positional_lsh.TransformerLM` or a
  :class:`~positional_lsh.PositionalLSHAttention`, as the ``context=`` argument of a call;
  :func:`init_context_groups` and :func:`shard_sequence` set up the groups and the shards.
* :func:`halo_plan`, :func:`bytes_per_rank`, :func:`exchange_bytes` (ring attention's and the all-gather's):
  exact byte accounting, no process group needed; :func:`comm_stats` counts what actually went through ``isend``.

This room imports only the op layer (the public ``positional_lsh`` names, ``ops.options``,
``ops.partitions.partition``, the validators of ``ops.checks`` and ``ops.module``'s ``ShardedCall``), not even
inside a function: the op layer never imports it, and the language model loads it only inside functions
(context-parallel training). Context parallelism is an argument: :class:`ContextShards` is passed as ``context=`` to
the model or module, which draws the partitions and calls it through the op layer's
:class:`~positional_lsh.ops.module.ShardedAttention` protocol.
"""

from __future__ import annotations

from positional_lsh.distributed.attention import context_parallel_plsh_attention
from positional_lsh.distributed.context import ContextShards, init_context_groups, shard_lengths, shard_sequence
from positional_lsh.distributed.exchange import comm_stats, halo_exchange, reset_comm_stats
from positional_lsh.distributed.halo import (
    HaloPlan,
    Transfer,
    block_extents,
    bytes_per_rank,
    crop_partitions,
    exchange_bytes,
    halo_plan,
)

__all__ = [
    "ContextShards",
    "HaloPlan",
    "Transfer",
    "block_extents",
    "bytes_per_rank",
    "comm_stats",
    "context_parallel_plsh_attention",
    "crop_partitions",
    "exchange_bytes",
    "halo_exchange",
    "halo_plan",
    "init_context_groups",
    "reset_comm_stats",
    "shard_lengths",
    "shard_sequence",
]
