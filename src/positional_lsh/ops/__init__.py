"""The op layer: slopes, the scheme registry and partitions, the positional-LSH estimator and its KV-cache
entry point, exact references.

This is everything ``import positional_lsh`` loads; it imports nothing from the rooms above it (theory, lm,
integrations, cli). Tensors are ``(batch, heads, length, head_dim)``; the ALiBi bias of head ``h`` is
``-slopes[h] * |i - j|``, added to the scaled score.
"""

from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.exact.alibi import alibi_attention, decay_attention
from positional_lsh.ops.exact.bias import alibi_bias
from positional_lsh.ops.exact.reference import alibi_matrix, dense_plsh_attention
from positional_lsh.ops.kvcache import DecodeState, plsh_attention_with_kvcache
from positional_lsh.ops.module import PositionalLSHAttention
from positional_lsh.ops.partitions.partition import Partitions, sample_partitions
from positional_lsh.ops.partitions.sampling import PartitionSampler
from positional_lsh.ops.partitions.schemes import Scheme, get_scheme, register_scheme, scheme_names, unregister_scheme
from positional_lsh.ops.partitions.slopes import alibi_slopes

__all__ = [
    "DecodeState",
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
    "plsh_attention_with_kvcache",
    "register_scheme",
    "sample_partitions",
    "scheme_names",
    "unregister_scheme",
]
