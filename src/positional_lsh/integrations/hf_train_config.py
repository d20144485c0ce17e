"""Settings of ``plsh train-hf`` (:func:`positional_lsh.integrations.hf.train.train_hf`): :class:`HFTrainConfig`, the
presets (:data:`PRESETS`) and the built-in model configs (:data:`BUILTIN_CONFIGS`).

Kept apart from :mod:`positional_lsh.integrations.hf.train` so that the ``plsh`` command line can build its parser
without importing transformers (``positional_lsh.integrations.hf`` needs it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from positional_lsh.lm.train_config import BaseTrainConfig
from positional_lsh.ops.checks import check_bool, check_choice, check_int, positive_int
from positional_lsh.ops.options import BACKENDS, METHODS
from positional_lsh.ops.partitions.schemes import get_scheme

HF_POSITIONS = ("plsh", "alibi", "window-alibi", "native")
FINETUNE_MODES = ("full", "lora")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")

_QWEN3_06B = {  # Qwen3-0.6B's published shape (config.json of Qwen/Qwen3-0.6B)
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_dropout": 0.0,
}  # fmt: skip
_TINY_QWEN3 = {  # CI scale: the same architecture, ~0.1 M parameters besides the embeddings
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "tie_word_embeddings": True, "attention_dropout": 0.0,
}  # fmt: skip
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {"qwen3-0.6b": _QWEN3_06B, "tiny-qwen3": _TINY_QWEN3}
"""Model configs ``config`` may name instead of a file (``vocab_size`` is replaced by the tokenizer's)."""

_PAPER_DATA = "hf:wikitext:wikitext-103-raw-v1"
PRESETS: dict[str, dict[str, Any]] = {
    # The paper's §5.1, first setting: Qwen3-0.6B from scratch at 8192 tokens, T = 100, sigma = 256 (GPU).
    "paper-qwen3-0.6b": {
        "config": "qwen3-0.6b", "data": _PAPER_DATA, "vocab_size": 32768, "seq_len": 8192, "position": "plsh",
        "num_samples": 100, "sigma": 256.0, "batch_size": 1, "grad_accum": 8, "steps": 20000, "lr": 3e-4,
        "min_lr": 3e-5, "warmup": 1000, "eval_interval": 1000, "eval_batches": 16, "ckpt_interval": 1000,
        "autocast": "bfloat16", "gradient_checkpointing": True, "device": "cuda",
    },
    # The paper's §5.1, second setting: Mistral-7B fine-tuned with LoRA r = 16 at 4096 tokens, T = 15, sigma = 256
    # (GPU; --checkpoint names the local Mistral-7B folder; --finetune full for the full fine-tune).
    "paper-mistral-7b": {
        "finetune": "lora", "lora_r": 16, "lora_alpha": 32, "data": _PAPER_DATA, "seq_len": 4096,
        "position": "plsh", "num_samples": 15, "sigma": 256.0, "batch_size": 1, "grad_accum": 16, "steps": 2000,
        "lr": 2e-4, "min_lr": 2e-5, "warmup": 100, "eval_interval": 250, "eval_batches": 16, "ckpt_interval": 250,
        "dtype": "bfloat16", "autocast": "bfloat16", "gradient_checkpointing": True, "device": "cuda",
    },
    # CI scale: a tiny Qwen3 from scratch on the shipped corpus, seconds on a CPU.
    "tiny": {
        "config": "tiny-qwen3", "vocab_size": 512, "seq_len": 64, "position": "plsh", "num_samples": 4,
        "sigma": 16.0, "batch_size": 4, "steps": 20, "lr": 3e-3, "min_lr": 3e-4, "warmup": 4, "eval_interval": 10,
        "eval_batches": 2, "ckpt_interval": 10, "autocast": "float32", "device": "cpu",
    },
}  # fmt: skip
"""``plsh train-hf --preset NAME``: settings applied before the flags given. The paper states the models, lengths,
``T``, ``sigma`` and the LoRA rank; the optimizer settings, steps and batch sizes are this library's choices. A preset
applies only the settings that apply to the run's position and fine-tuning mode (:func:`inapplicable_settings`): with
``--position native`` its ``sigma`` and ``T`` are not applied, with ``--position alibi`` its ``T``."""

_PLSH_ONLY = ("num_samples", "scheme")
_SLOPED = ("sigma", "slopes")
_LORA_ONLY = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")


def inapplicable_settings(position: str, finetune: str) -> dict[str, str]:
    """``{field: why}`` for the settings of :class:`HFTrainConfig` that a run with ``position`` and ``finetune``
    does not use: ``num_samples``/``scheme`` (positional LSH only), ``sigma``/``slopes`` (not ``native``),
    ``window`` (``window-alibi`` only) and the LoRA settings and ``dtype`` (``finetune="lora"`` only: full training
    keeps float32 master weights). A preset does not apply
    them; ``plsh train-hf`` refuses them as flags (they would be ignored)."""
    out: dict[str, str] = {}
    if position != "plsh":
        out.update(dict.fromkeys(_PLSH_ONLY, f"applies to --position plsh only, not {position}"))
    if position == "native":
        out.update(dict.fromkeys(_SLOPED, "sets the ALiBi slopes of --position plsh, alibi or window-alibi; "
                                           "--position native keeps the model's own attention"))  # fmt: skip
    if position != "window-alibi":
        out["window"] = f"applies to --position window-alibi only, not {position}"
    if finetune != "lora":
        out.update(dict.fromkeys(_LORA_ONLY, f"applies to --finetune lora only, not {finetune}"))
        out["dtype"] = (f"sets the frozen base of --finetune lora; --finetune {finetune} trains float32 master weights "
                        "and AdamW state (bf16 compute: --autocast bfloat16)")  # fmt: skip
    return out


@dataclass
class HFTrainConfig(BaseTrainConfig):
    """Settings of :func:`train_hf` (``plsh train-hf``): those of
    :class:`~positional_lsh.lm.train_config.BaseTrainConfig` (as ``plsh train``, with their own defaults) and these.

    Attributes:
        config: from scratch: a transformers ``config.json``, a folder holding one, or a :data:`BUILTIN_CONFIGS`
            name. Exactly one of ``config`` and ``checkpoint``.
        checkpoint: fine-tune: a local ``save_pretrained`` folder, a peft adapter folder or a ``plsh train-hf`` run.
        finetune: ``"full"`` (every weight trains) or ``"lora"`` (peft LoRA adapters on ``lora_targets``).
        lora_r, lora_alpha, lora_dropout, lora_targets: the LoRA adapter.
        position: ``"plsh"``, ``"alibi"``, ``"window-alibi"`` or ``"native"`` (the model's own attention).
        num_samples, scheme: positional LSH's ``T`` and partition scheme.
        sigma: one slope ``1 / sigma`` for every head; ``slopes``: one slope per head (default: the model's own
            or the ALiBi schedule).
        window: ``window-alibi``'s largest kept distance.
        partition_seed: seed of the training partitions (default: ``seed``).
        attn_backend, plsh_method: passed to the attention (how it computes, not what).
        seq_len: training window length in tokens.
        dtype: the frozen base's weights dtype with ``finetune="lora"`` (``"bfloat16"`` halves it; the adapters
            stay float32, as peft keeps them). ``finetune="full"`` trains float32 master weights and AdamW state
            (as PyTorch's mixed precision does; ``autocast`` sets the compute dtype): any other ``dtype`` is refused.
        gradient_checkpointing: recompute activations in the backward (same gradients, less memory).
        fsdp: shard the weights, gradients and optimizer state over the ``torchrun`` processes (FSDP2
            ``fully_shard`` of every decoder layer and of the model) instead of replicating them (DDP); needs at
            least 2 processes.
    """

    batch_size: int = 8
    steps: int = 1000
    lr: float = 3e-4
    min_lr: float = 3e-5
    eval_batches: int = 8
    config: str | None = None
    checkpoint: str | None = None
    finetune: str = "full"
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    position: str = "plsh"
    num_samples: int = 8
    scheme: str = "discrete"
    sigma: float | None = None
    slopes: tuple[float, ...] | None = None
    window: float | None = None
    partition_seed: int | None = None
    attn_backend: str = "auto"
    plsh_method: str = "auto"
    seq_len: int = 512
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    fsdp: bool = False

    def validate(self, positive: tuple[str, ...] = (), nonnegative: tuple[str, ...] = ()) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first bad field (nothing is loaded)."""
        if (self.config is None) == (self.checkpoint is None):
            raise ValueError("give exactly one of config (train from scratch) and checkpoint (fine-tune), got "
                             f"config={self.config!r}, checkpoint={self.checkpoint!r}")  # fmt: skip
        check_choice("finetune", self.finetune, FINETUNE_MODES)
        if self.finetune == "lora" and self.checkpoint is None:
            raise ValueError("finetune='lora' needs a checkpoint to fine-tune (a model from a config trains fully)")
        check_choice("position", self.position, HF_POSITIONS)
        check_choice("dtype", self.dtype, WEIGHT_DTYPES)
        if self.finetune != "lora" and self.dtype != "float32":
            raise ValueError(f"dtype {self.dtype!r} sets the frozen base of finetune='lora'; finetune="
                             f"{self.finetune!r} trains float32 master weights and AdamW state (compute in bf16 with "
                             "autocast='bfloat16')")  # fmt: skip
        check_choice("attn_backend", self.attn_backend, BACKENDS)
        check_choice("plsh_method", self.plsh_method, METHODS)
        get_scheme(self.scheme)
        super().validate(("lora_r", "num_samples", "seq_len", *positive), ("lora_dropout", *nonnegative))
        if self.partition_seed is not None:
            check_int("partition_seed", self.partition_seed, minimum=0)
        positive_int("lora_alpha", self.lora_alpha)
        if self.lora_dropout >= 1:
            raise ValueError(f"lora_dropout must be < 1, got {self.lora_dropout}")
        check_bool("gradient_checkpointing", self.gradient_checkpointing)
        check_bool("fsdp", self.fsdp)
        if self.sigma is not None and self.slopes is not None:
            raise ValueError("give sigma (one slope 1/sigma for every head) or slopes (one per head), not both")
        if self.sigma is not None and (isinstance(self.sigma, bool) or not self.sigma > 0 or math.isinf(self.sigma)):
            raise ValueError(f"sigma must be a finite number > 0, got {self.sigma!r}")
        for name in ("slopes", "window"):
            value = getattr(self, name)
            values = () if value is None else value if isinstance(value, tuple | list) else (value,)
            if any(isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < math.inf for v in values):
                raise ValueError(f"{name} must hold finite numbers >= 0, got {value!r}")
            if isinstance(value, tuple | list) and not value:
                raise ValueError(f"{name} must not be empty")
        if self.position == "native" and (self.sigma is not None or self.slopes):
            raise ValueError("sigma/slopes set the ALiBi slopes of position plsh, alibi or window-alibi; "
                             "position 'native' keeps the model's own attention")  # fmt: skip
        if (self.position == "window-alibi") != (self.window is not None):
            raise ValueError("window is needed by position 'window-alibi' and only by it, got "
                             f"position={self.position!r}, window={self.window!r}")  # fmt: skip
        if not self.lora_targets and self.finetune == "lora":
            raise ValueError("lora_targets must name at least one module (e.g. q_proj,v_proj)")

    def slopes_arg(self) -> float | list[float] | None:
        """The ``slopes=`` of the swap: ``1 / sigma``, the per-head slopes, or ``None`` (the model's own)."""
        if self.sigma is not None:
            return 1.0 / self.sigma
        return list(self.slopes) if self.slopes else None
