"""Settings of :func:`positional_lsh.lm.train.train`: :class:`TrainConfig`, the ``--quick`` preset, the
learning-rate schedule (:func:`lr_at`), the autocast choice and the token-cache directory.

Everything here is re-exported by :mod:`positional_lsh.lm.train`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from positional_lsh.lm.data.tokenizer import DEFAULT_VOCAB_SIZE
from positional_lsh.ops.checks import check_choice, check_int, positive_int

AUTOCAST_CHOICES = ("auto", "float32", "bfloat16", "float16")


def check_out_dir(cfg: Any) -> None:
    """``TypeError`` unless ``cfg.out_dir`` (of a training settings dataclass) is a non-empty path."""
    if not isinstance(cfg.out_dir, str | os.PathLike) or not str(cfg.out_dir):
        raise TypeError("out_dir must be a non-empty path")


def check_step_counts(cfg: Any, positive: tuple[str, ...]) -> None:
    """Check the counts of a training settings dataclass ``cfg``, naming the first bad field: the fields
    ``positive`` are ints > 0, ``warmup`` an int >= 0, ``seed`` an int in ``[0, 2**63)`` (it seeds torch generators),
    ``threads`` and ``stop_after`` ``None`` or > 0."""
    for name in positive:
        positive_int(name, getattr(cfg, name))
    for name in ("warmup", "seed"):
        check_int(name, getattr(cfg, name), minimum=0)
    if cfg.seed >= 2**63:
        raise ValueError(f"seed must be an integer in [0, 2^63) (--seed), got {cfg.seed}")
    for name in ("steps", "stop_after"):  # step counters are int64 (the partition steps)
        if getattr(cfg, name) is not None and getattr(cfg, name) >= 2**63:
            raise ValueError(f"{name} must be < 2^63, got {getattr(cfg, name)}")
    for name in ("threads", "stop_after"):
        if getattr(cfg, name) is not None:
            positive_int(name, getattr(cfg, name))


def check_nonnegative_numbers(cfg: Any, names: tuple[str, ...]) -> None:
    """``ValueError`` naming the first of the fields ``names`` of ``cfg`` that is not a finite number >= 0."""
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def check_betas(cfg: Any) -> None:
    """``ValueError`` unless AdamW's ``beta1`` and ``beta2`` of ``cfg`` are in [0, 1)."""
    for name in ("beta1", "beta2"):
        v = getattr(cfg, name)
        if not 0 <= v < 1:
            raise ValueError(f"{name} must be in [0, 1), got {v}")


def check_learn_slopes_run(cfg: TrainConfig, model_cfg: Any) -> None:
    """``ValueError`` naming ``learn_slopes`` when a run cannot learn the slopes: with ``context_parallel > 1`` the
    sharded attention (``positional_lsh.distributed``) carries no gradient for them, so it is refused rather than
    training them with none. ``model_cfg``: the run's :class:`~positional_lsh.lm.config.ModelConfig`."""
    if getattr(model_cfg, "learn_slopes", False) and cfg.context_parallel > 1:
        raise ValueError(
            f"--learn-slopes (learn_slopes=True) cannot run with --context-parallel {cfg.context_parallel}: the "
            "sharded attention carries no gradient for the slopes; drop one of them"
        )


def default_cache_dir() -> Path:
    """Where encoded token streams are cached: ``$PLSH_CACHE_DIR`` or ``~/.cache/positional_lsh``."""
    env = os.environ.get("PLSH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "positional_lsh"


@dataclass
class BaseTrainConfig:
    """The settings ``plsh train`` (:class:`TrainConfig`) and ``plsh train-hf``
    (:class:`~positional_lsh.integrations.hf_train_config.HFTrainConfig`) share: the run directory, the data, the
    optimizer and the run's schedule. Each subclass sets its own defaults and adds its own settings.

    Attributes:
        out_dir: the run directory: checkpoint files, ``trainer_state.pt``, ``log.jsonl``, ``train_config.json``.
        data: a ``positional_lsh.lm.data.load_splits`` source (``None``: the shipped corpus).
        tokenizer: a ``tokenizer.json`` (or directory holding one) to reuse; ``None`` trains a byte-level BPE
            with ``vocab_size`` on the training split.
        cache_dir: where encoded token streams are cached (``None``: :func:`default_cache_dir`; ``""`` disables).
        batch_size: windows per micro-batch per process.
        grad_accum: micro-batches per optimizer step. Tokens per step:
            ``batch_size * grad_accum * world_size * seq_len``.
        steps: optimizer steps in the whole run.
        lr, min_lr, warmup: peak learning rate, final learning rate, linear warm-up steps; cosine in between.
        weight_decay, beta1, beta2: AdamW (weight decay on 2-D weights only).
        grad_clip: global gradient-norm clip (0 disables).
        eval_interval, eval_batches: validate every ``eval_interval`` steps on ``eval_batches`` fixed batches.
        ckpt_interval: save a resumable checkpoint every this many steps (and at the end).
        seed: seeds the model initialization, the data order and (unless the run sets their own seed) the
            positional-LSH training partitions.
        autocast: ``"auto"`` (see :func:`resolve_autocast_dtype`), ``"float32"`` (off), ``"bfloat16"``, ``"float16"``.
        device: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``...
        threads: torch intra-op threads (``None``: torch's default).
        stop_after: stop (with a resumable checkpoint) once this step is reached, to split one run into several
            jobs; the learning-rate schedule still follows ``steps``.
        progress: show a progress bar.
    """

    out_dir: str
    data: str | None = None
    tokenizer: str | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE
    cache_dir: str | None = None
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_batches: int = 16
    ckpt_interval: int = 500
    seed: int = 0
    autocast: str = "auto"
    device: str = "auto"
    threads: int | None = None
    stop_after: int | None = None
    progress: bool = True

    _POSITIVE = ("vocab_size", "batch_size", "grad_accum", "steps", "eval_interval", "eval_batches", "ckpt_interval")

    def validate(self, positive: tuple[str, ...] = (), nonnegative: tuple[str, ...] = ()) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first bad field of the shared settings; a subclass passes
        its own ``positive`` counts (ints > 0) and ``nonnegative`` numbers (finite, >= 0) to be checked with them."""
        check_out_dir(self)
        check_step_counts(self, (*self._POSITIVE, *positive))
        check_nonnegative_numbers(self, ("lr", "min_lr", "weight_decay", "grad_clip", *nonnegative))
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        check_betas(self)
        check_choice("autocast", self.autocast, AUTOCAST_CHOICES)


@dataclass
class TrainConfig(BaseTrainConfig):
    """Training hyperparameters of ``plsh train`` (the model's are in :class:`~positional_lsh.lm.config.ModelConfig`):
    the settings of :class:`BaseTrainConfig` and these.

    Attributes:
        save_dtype: storage dtype of the exported weights (``"float32"``, ``"float16"``, ``"bfloat16"``).
        context_parallel: ``C`` > 1 splits every sequence over ``C`` consecutive ranks (``position="plsh"`` only;
            ``C`` must divide the world size: world = data x context); see ``docs/distributed.md``.
    """

    save_dtype: str = "float32"
    context_parallel: int = 1

    def validate(self, positive: tuple[str, ...] = (), nonnegative: tuple[str, ...] = ()) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first bad field."""
        super().validate(("context_parallel", *positive), nonnegative)
        check_choice("save_dtype", self.save_dtype, ("float32", "float16", "bfloat16"))

QUICK_PRESET: dict[str, Any] = {
    # ~1 minute on 2 CPU cores: a tiny model on the shipped corpus, for smoke tests and CI.
    "vocab_size": 2048,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 128,
    "seq_len": 128,
    "batch_size": 8,
    "steps": 150,
    "warmup": 15,
    "lr": 2e-3,
    "min_lr": 2e-4,
    "eval_interval": 50,
    "eval_batches": 4,
    "ckpt_interval": 150,
}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine decay to ``min_lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def resolve_autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``choice`` on ``device`` (``None``: no autocast).

    ``"auto"``: bfloat16 on CUDA devices that support it; on CPU, bfloat16 only when the CPU has native
    bf16 matrix instructions (AMX / AVX512-BF16, as reported by oneDNN) — there, with attention kept in float32
    (``ModelConfig.attn_fp32``), it was faster than float32 for the models of docs/experiments.md; without
    them bf16 is emulated and slower. Otherwise float32.
    """
    if choice == "float32":
        return None
    if choice == "bfloat16":
        return torch.bfloat16
    if choice == "float16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        try:
            native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            native = False
        return torch.bfloat16 if native else None
    return None


def estimate_step_bytes(cfg: TrainConfig, model_cfg: Any) -> float:
    """A rough lower bound on the activation memory of one micro-batch of training on one rank (bytes): every layer
    keeps ``num_samples`` attention outputs (``plsh``), the MLP activations and the logits for the backward. With
    context parallelism (``cfg.context_parallel = C``) a rank holds ``ceil(seq_len / C)`` positions of each
    sequence (plus a halo of keys/values, left out of this lower bound)."""
    tokens = cfg.batch_size * -(-model_cfg.seq_len // cfg.context_parallel)
    samples = model_cfg.num_samples  # counted for every position mode: a run may switch to plsh later
    per_layer = tokens * model_cfg.d_model * (2 * samples + 4 + 2 * model_cfg.mlp_ratio)
    return 4.0 * (model_cfg.n_layer * per_layer + tokens * cfg.vocab_size * 2)
