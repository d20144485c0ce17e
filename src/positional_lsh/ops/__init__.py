"""The op layer: slopes, schemes and partitions, the positional-LSH estimator, exact references.

This is everything ``import positional_lsh`` loads; it imports nothing from the rooms above it (theory, lm,
integrations, cli). Tensors are ``(batch, heads, length, head_dim)``; the ALiBi bias of head ``h`` is
``-slopes[h] * |i - j|``, added to the scaled score.
"""

from positional_lsh.ops.attention import PositionalLSHAttention, plsh_attention
from positional_lsh.ops.reference import alibi_attention, alibi_bias, alibi_matrix, dense_plsh_attention
from positional_lsh.ops.sampling import Partitions, register_scheme, sample_partitions
from positional_lsh.ops.slopes import alibi_slopes

__all__ = [
    "Partitions",
    "PositionalLSHAttention",
    "alibi_attention",
    "alibi_bias",
    "alibi_matrix",
    "alibi_slopes",
    "dense_plsh_attention",
    "plsh_attention",
    "register_scheme",
    "sample_partitions",
]
