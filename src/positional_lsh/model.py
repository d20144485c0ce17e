"""The language model's public names under their old home, ``positional_lsh.model`` (kept for existing imports).

The code lives in :mod:`positional_lsh.lm` (:mod:`~positional_lsh.lm.config`, :mod:`~positional_lsh.lm.model`,
:mod:`~positional_lsh.lm.checkpoint`); this module only re-exports it.
"""

from positional_lsh.lm.checkpoint import (
    Checkpoint,
    is_checkpoint,
    load_checkpoint,
    load_shipped_model,
    save_checkpoint,
    shipped_checkpoint_path,
)
from positional_lsh.lm.config import POSITIONS, ModelConfig
from positional_lsh.lm.model import CausalSelfAttention, TransformerLM

__all__ = [
    "POSITIONS",
    "CausalSelfAttention",
    "Checkpoint",
    "ModelConfig",
    "TransformerLM",
    "is_checkpoint",
    "load_checkpoint",
    "load_shipped_model",
    "save_checkpoint",
    "shipped_checkpoint_path",
]
