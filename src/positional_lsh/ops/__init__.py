"""The op layer: slopes, the scheme registry and partitions, the positional-LSH estimator, exact references.

This is everything ``import positional_lsh`` loads; it imports nothing from the rooms above it (theory, lm,
integrations, cli). Tensors are ``(batch, heads, length, head_dim)``; the ALiBi bias of head ``h`` is
``-slopes[h] * |i - j|``, added to the scaled score.
"""

from positional_lsh.ops.alibi import alibi_attention, decay_attention
from positional_lsh.ops.attention import PositionalLSHAttention, plsh_attention
from positional_lsh.ops.partitions import Partitions, sample_partitions
from positional_lsh.ops.reference import alibi_bias, alibi_matrix, dense_plsh_attention
from positional_lsh.ops.sampling import PartitionSampler
from positional_lsh.ops.schemes import Scheme, get_scheme, register_scheme, scheme_names, unregister_scheme
from positional_lsh.ops.slopes import alibi_slopes

__all__ = [
    "PartitionSampler",
    "Partitions",
    "PositionalLSHAttention",
    "Scheme",
    "alibi_attention",
    "alibi_bias",
    "alibi_matrix",
    "alibi_slopes",
    "decay_attention",
    "dense_plsh_attention",
    "get_scheme",
    "plsh_attention",
    "register_scheme",
    "sample_partitions",
    "scheme_names",
    "unregister_scheme",
]
