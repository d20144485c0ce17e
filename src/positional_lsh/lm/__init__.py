"""Language models: config, model, checkpoints, data, training and evaluation."""

from positional_lsh.lm.model import ModelConfig, TransformerLM, load_checkpoint, load_shipped_model

__all__ = ["ModelConfig", "TransformerLM", "load_checkpoint", "load_shipped_model"]
