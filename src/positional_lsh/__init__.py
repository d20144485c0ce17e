"""positional-lsh: ALiBi attention approximated by averaging random contiguous block-diagonal masks.

The op layer (:mod:`positional_lsh.ops`) is re-exported here: :func:`plsh_attention`, :func:`alibi_attention`,
:func:`sample_partitions` and friends. Tensors are ``(batch, heads, length, head_dim)``; head ``h`` adds
``-slopes[h] * |i - j|`` to the scaled score ``q_i . k_j * scale`` (ALiBi's sign convention).

The language model (:class:`TransformerLM`, :class:`ModelConfig`, :func:`load_checkpoint`,
:func:`load_shipped_model`) is re-exported lazily, so ``import positional_lsh`` loads only the op layer.
The rooms (see ``docs/architecture.md``): :mod:`positional_lsh.theory`, :mod:`positional_lsh.lm`,
:mod:`positional_lsh.integrations.hf`, :mod:`positional_lsh.cli`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from positional_lsh.ops import (
    DecodeState,
    Partitions,
    PartitionSampler,
    PositionalLSHAttention,
    Scheme,
    alibi_attention,
    alibi_bias,
    alibi_matrix,
    alibi_slopes,
    decay_attention,
    dense_plsh_attention,
    get_scheme,
    plsh_attention,
    plsh_attention_with_kvcache,
    register_scheme,
    sample_partitions,
    scheme_names,
    unregister_scheme,
)

# Names served from the language-model room on first access (module-level __getattr__, PEP 562).
_LAZY = {
    "ModelConfig": "positional_lsh.lm",
    "TransformerLM": "positional_lsh.lm",
    "load_checkpoint": "positional_lsh.lm",
    "load_shipped_model": "positional_lsh.lm",
}

__all__ = [
    "DecodeState",
    "ModelConfig",
    "PartitionSampler",
    "Partitions",
    "PositionalLSHAttention",
    "Scheme",
    "TransformerLM",
    "alibi_attention",
    "alibi_bias",
    "alibi_matrix",
    "alibi_slopes",
    "decay_attention",
    "dense_plsh_attention",
    "get_scheme",
    "load_checkpoint",
    "load_shipped_model",
    "plsh_attention",
    "plsh_attention_with_kvcache",
    "register_scheme",
    "sample_partitions",
    "scheme_names",
    "unregister_scheme",
]
try:  # one source: the version in pyproject.toml, as installed in the package metadata
    __version__: str = importlib.metadata.version("positional-lsh")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'positional_lsh' has no attribute {name!r}")
