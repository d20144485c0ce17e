"""positional-lsh: ALiBi attention approximated by averaging random contiguous block-diagonal masks.

Core ops (:func:`plsh_attention`, :func:`alibi_attention`, :func:`sample_partitions`) and the language model
(:class:`TransformerLM`, :func:`load_shipped_model`) are re-exported here; the theory lives in
:mod:`positional_lsh.theory`, the transformers integration in :mod:`positional_lsh.hf`.
"""

from .attention import PositionalLSHAttention, plsh_attention
from .model import ModelConfig, TransformerLM, load_checkpoint, load_shipped_model
from .reference import alibi_attention, alibi_bias, alibi_matrix, dense_plsh_attention
from .sampling import Partitions, sample_partitions
from .slopes import alibi_slopes

__all__ = [
    "ModelConfig",
    "Partitions",
    "PositionalLSHAttention",
    "TransformerLM",
    "alibi_attention",
    "alibi_bias",
    "alibi_matrix",
    "alibi_slopes",
    "dense_plsh_attention",
    "load_checkpoint",
    "load_shipped_model",
    "plsh_attention",
    "sample_partitions",
]
__version__ = "0.1.0"
