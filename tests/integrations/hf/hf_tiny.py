"""Tiny random transformers models of the seven supported model types, built from their config classes (nothing is
downloaded). Shared by tests/integrations/hf/test_hf_precision.py, tests/integrations/hf/test_hf_masks.py,
tests/integrations/hf/test_hf_compile.py and
tests/integrations/hf/test_hf_decode.py (and the generation tests: `bounded_swap`)."""

from __future__ import annotations

import copy
import warnings

import torch

#: ``config.model_type`` of every family the swap supports (integrations/families.py).
MODEL_TYPES = ("bloom", "mpt", "falcon", "llama", "mistral", "qwen2", "qwen3")

VOCAB = 97


def tiny_config(name: str, *, hidden: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2):
    """A small config of model type ``name`` (Falcon: ALiBi, multi-query; the RoPE family: grouped KV heads)."""
    import transformers as tf

    d = hidden // heads
    if name == "bloom":
        return tf.BloomConfig(vocab_size=VOCAB, hidden_size=hidden, n_layer=layers, n_head=heads)
    if name == "mpt":
        return tf.MptConfig(vocab_size=VOCAB, d_model=hidden, n_layers=layers, n_heads=heads, max_seq_len=64)
    if name == "falcon":
        return tf.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            alibi=True,
            new_decoder_architecture=False,
            multi_query=True,
        )
    rope = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
    )
    if name == "llama":
        return tf.LlamaConfig(**rope)
    if name == "mistral":
        return tf.MistralConfig(**rope, sliding_window=8)
    if name == "qwen2":
        return tf.Qwen2Config(**rope)
    if name == "qwen3":
        return tf.Qwen3Config(**rope)
    raise ValueError(f"unknown model type {name!r}")


def tiny_model(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **config_kwargs):
    """A random model of type ``name`` in eval mode (seeded, so two calls give the same weights)."""
    import transformers as tf

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.AutoModelForCausalLM.from_config(copy.deepcopy(tiny_config(name, **config_kwargs)))
    model.generation_config.pad_token_id = 0
    return model.eval().to(dtype)


def token_ids(batch: int = 2, length: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def bounded_swap(model, mode: str):
    """The swap of ``mode`` on ``model``: ``"plsh"`` (positional LSH, T = 4, slope 0.3), ``"window"`` (windowed ALiBi,
    window 6) or ``"exact"`` (exact ALiBi, unbounded)."""
    from positional_lsh.integrations import hf

    if mode == "plsh":
        return hf.use_positional_lsh(model, num_samples=4, seed=3, slopes=0.3)
    if mode == "window":
        return hf.use_alibi(model, window=6.0)
    return hf.use_alibi(model)
