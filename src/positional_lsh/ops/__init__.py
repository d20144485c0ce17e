"""The op layer: slopes, the scheme registry and partitions, the positional-LSH estimator and its KV-cache
entry point, exact references.

This is everything ``import positional_lsh`` loads; it imports nothing from the rooms above it (theory, lm,
integrations, cli). Tensors are ``(batch, heads, length, head_dim)``; the ALiBi bias of head ``h`` is
``-slopes[h] * |i - j|``, added to the scaled score.

The names below are imported once here, for :mod:`positional_lsh`, which lists them as the front door; this package
declares no ``__all__``: each name is documented in the module that defines it (docs/architecture.md, "One home per
public name").
"""

from positional_lsh.ops.attention import plsh_attention as plsh_attention
from positional_lsh.ops.exact.alibi import alibi_attention as alibi_attention
from positional_lsh.ops.exact.alibi import decay_attention as decay_attention
from positional_lsh.ops.exact.bias import alibi_bias as alibi_bias
from positional_lsh.ops.exact.reference import alibi_matrix as alibi_matrix
from positional_lsh.ops.exact.reference import dense_plsh_attention as dense_plsh_attention
from positional_lsh.ops.kvcache import DecodeState as DecodeState
from positional_lsh.ops.kvcache import plsh_attention_with_kvcache as plsh_attention_with_kvcache
from positional_lsh.ops.module import PositionalLSHAttention as PositionalLSHAttention
from positional_lsh.ops.partitions.partition import Partitions as Partitions
from positional_lsh.ops.partitions.partition import sample_partitions as sample_partitions
from positional_lsh.ops.partitions.sampling import PartitionSampler as PartitionSampler
from positional_lsh.ops.partitions.schemes import Scheme as Scheme
from positional_lsh.ops.partitions.schemes import get_scheme as get_scheme
from positional_lsh.ops.partitions.schemes import register_scheme as register_scheme
from positional_lsh.ops.partitions.schemes import scheme_names as scheme_names
from positional_lsh.ops.partitions.schemes import unregister_scheme as unregister_scheme
from positional_lsh.ops.partitions.slopes import alibi_slopes as alibi_slopes
