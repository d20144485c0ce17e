"""positional-lsh: ALiBi attention approximated by averaging random contiguous block-diagonal masks."""

from .attention import PositionalLSHAttention, plsh_attention
from .reference import alibi_attention, alibi_bias, alibi_matrix, dense_plsh_attention
from .sampling import Partitions, sample_partitions
from .slopes import alibi_slopes

__all__ = [
    "Partitions",
    "PositionalLSHAttention",
    "alibi_attention",
    "alibi_bias",
    "alibi_matrix",
    "alibi_slopes",
    "dense_plsh_attention",
    "plsh_attention",
    "sample_partitions",
]
__version__ = "0.1.0"
