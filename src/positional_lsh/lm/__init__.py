"""The language-model room: configuration, model, checkpoints, data, training and evaluation.

:mod:`~positional_lsh.lm.config` (``ModelConfig``), :mod:`~positional_lsh.lm.model` (``TransformerLM``),
:mod:`~positional_lsh.lm.checkpoint` (save/load, the shipped model), :mod:`~positional_lsh.lm.data` (corpus,
tokenizer, windows), :mod:`~positional_lsh.lm.train` and :mod:`~positional_lsh.lm.evaluate`. It imports the
op layer (:mod:`positional_lsh.ops`) and nothing above it (docs/architecture.md).
"""

from positional_lsh.lm.checkpoint import Checkpoint, load_checkpoint, load_shipped_model, save_checkpoint
from positional_lsh.lm.config import ModelConfig
from positional_lsh.lm.model import TransformerLM

__all__ = ["Checkpoint", "ModelConfig", "TransformerLM", "load_checkpoint", "load_shipped_model", "save_checkpoint"]
