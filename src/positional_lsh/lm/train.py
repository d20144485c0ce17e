"""Training of a :class:`~positional_lsh.lm.model.TransformerLM` language model.

AdamW (decoupled weight decay on matrices only) with linear warm-up and cosine decay to ``min_lr``, gradient
clipping, optional bf16/fp16 autocast, gradient accumulation, a progress bar with loss and tokens/s,
periodic validation on fixed held-out windows, checkpoints (``safetensors`` weights + JSON config + tokenizer,
plus a ``trainer_state.pt`` with the optimizer and every random-number state) and exact resume: a run that is
interrupted and resumed ends with the same weights as an uninterrupted one.

Data parallelism: launched with ``torchrun --nproc_per_node N`` the same command trains with
``torch.distributed`` (gloo on CPU, NCCL on GPU). Every process draws the same global batch of
``N * batch_size`` windows from the shared seed and trains on its own slice, and all processes use the same
positional-LSH partitions, so ``N`` processes with ``batch_size`` B compute the same updates as one process
with ``batch_size`` ``N * B`` (up to floating-point summation order).

Batches are random windows of ``seq_len + 1`` tokens from the training stream (documents joined by the
end-of-document token); validation uses ``eval_batches`` fixed windows of the validation split.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from positional_lsh.lm import data as D
from positional_lsh.lm.checkpoint import save_checkpoint
from positional_lsh.lm.config import ModelConfig
from positional_lsh.lm.model import TransformerLM
from positional_lsh.ops._checks import check_int, positive_int

__all__ = [
    "QUICK_PRESET",
    "TrainConfig",
    "TrainResult",
    "default_cache_dir",
    "lr_at",
    "resolve_autocast_dtype",
    "train",
]

STATE_FILE = "trainer_state.pt"
TRAIN_CONFIG_FILE = "train_config.json"
LOG_FILE = "log.jsonl"

AUTOCAST_CHOICES = ("auto", "float32", "bfloat16", "float16")


def default_cache_dir() -> Path:
    """Where encoded token streams are cached: ``$PLSH_CACHE_DIR`` or ``~/.cache/positional_lsh``."""
    env = os.environ.get("PLSH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "positional_lsh"


@dataclass
class TrainConfig:
    """Training hyperparameters (the model's are in :class:`~positional_lsh.lm.config.ModelConfig`).

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
        seed: seeds the model initialization, the data order and (unless the model config sets its own) the
            positional-LSH training partitions.
        autocast: ``"auto"`` (see :func:`resolve_autocast_dtype`), ``"float32"`` (off), ``"bfloat16"``, ``"float16"``.
        device: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``...
        threads: torch intra-op threads (``None``: torch's default).
        save_dtype: storage dtype of the exported weights (``"float32"``, ``"float16"``, ``"bfloat16"``).
        stop_after: stop (with a resumable checkpoint) once this step is reached, to split one run into several
            jobs; the learning-rate schedule still follows ``steps``.
        progress: show a progress bar.
    """

    out_dir: str
    data: str | None = None
    tokenizer: str | None = None
    vocab_size: int = D.DEFAULT_VOCAB_SIZE
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
    save_dtype: str = "float32"
    stop_after: int | None = None
    progress: bool = True

    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first bad field."""
        if not isinstance(self.out_dir, str | os.PathLike) or not str(self.out_dir):
            raise TypeError("out_dir must be a non-empty path")
        names = ("vocab_size", "batch_size", "grad_accum", "steps", "eval_interval", "eval_batches", "ckpt_interval")
        for name in names:
            positive_int(name, getattr(self, name))
        for name in ("warmup", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("threads", "stop_after"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr})")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"{name} must be in [0, 1), got {v}")
        if self.autocast not in AUTOCAST_CHOICES:
            raise ValueError(f"autocast must be one of {AUTOCAST_CHOICES}, got {self.autocast!r}")
        if self.save_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"save_dtype must be float32, float16 or bfloat16, got {self.save_dtype!r}")


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


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    out_dir: Path
    step: int
    tokens: int
    train_loss: float
    val_loss: float | None
    seconds: float
    finished: bool


# --------------------------------------------------------------------------------------------------
# Distributed helpers
# --------------------------------------------------------------------------------------------------


@dataclass
class _Dist:
    """This process's place in the run; ``owns_group``: :func:`_init_distributed` created the process group."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def _init_distributed(device_choice: str) -> tuple[_Dist, torch.device]:
    """Join (creating it under ``torchrun`` if needed) the process group and choose the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = device_choice.startswith("cuda") or (device_choice == "auto" and torch.cuda.is_available())
    if world > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if want_cuda:
            torch.cuda.set_device(local_rank)
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group(backend="nccl" if want_cuda else "gloo")
        info = _Dist(dist.get_rank(), dist.get_world_size(), local_rank, owns)
        device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
        return info, device
    if device_choice == "auto":
        return _Dist(), torch.device("cuda" if want_cuda else "cpu")
    return _Dist(), torch.device(device_choice)


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def _prepare_data(cfg: TrainConfig, out: Path, info: _Dist) -> tuple[D.BPETokenizer, dict[str, torch.Tensor]]:
    """Tokenizer (reused, or trained on the training split by rank 0) and the encoded train/validation streams."""
    cache = None if cfg.cache_dir == "" else Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    saved_tok = out / "tokenizer.json"
    tok: D.BPETokenizer | None = None
    splits = None
    if info.main:
        splits = D.load_splits(cfg.data)
        if cfg.tokenizer:
            tok = D.BPETokenizer.load(cfg.tokenizer)
        elif saved_tok.is_file():
            tok = D.BPETokenizer.load(saved_tok)  # resume, or a run directory prepared in advance
        else:
            tok = D.train_tokenizer(splits["train"], vocab_size=cfg.vocab_size)
        tok.save(saved_tok)
        streams = D.encode_splits(tok, {"train": splits["train"], "validation": splits["validation"]}, cache_dir=cache)
    info.barrier()
    if not info.main:
        tok = D.BPETokenizer.load(saved_tok)
        splits = D.load_splits(cfg.data)
        streams = D.encode_splits(tok, {"train": splits["train"], "validation": splits["validation"]}, cache_dir=cache)
    assert tok is not None
    return tok, streams


def _train_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, info: _Dist, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless micro-batches: every process draws the same global batch and keeps its own rows."""
    while True:
        x, y = D.random_batch(tokens, seq_len, batch_size * info.world, generator=generator)
        rows = slice(info.rank * batch_size, (info.rank + 1) * batch_size)
        yield x[rows], y[rows]


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def _optimizer(model: TransformerLM, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **extra)


@torch.no_grad()
def _validate(
    model: TransformerLM,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    info: _Dist,
    device: torch.device,
    amp: torch.dtype | None,
) -> float:
    """Mean loss over the fixed validation batches (each process takes its rows, then all-reduce)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        rows = slice(info.rank * x.shape[0] // info.world, (info.rank + 1) * x.shape[0] // info.world)
        x, y = x[rows], y[rows]
        with _autocast(device, amp):
            _, loss = model(x.to(device), y.to(device))
        total[0] += float(loss) * y.numel()
        total[1] += y.numel()
    if info.enabled:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to ``dtype``, or nothing for ``None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _save_state(run: _Run) -> None:
    """Export the checkpoint (config + weights + tokenizer) and the exact resume state."""
    cfg, info = run.cfg, run.info
    meta = {
        "step": run.step,
        "tokens": run.tokens,
        "train_loss": run.last_loss,
        "val_loss": run.val_loss,
        "train_seconds": round(run.elapsed, 1),
        "world_size": info.world,
        "finished": run.step >= cfg.steps,
        "train_config": dataclasses.asdict(cfg),
        "command": run.command,
        "torch": torch.__version__,
    }
    save_checkpoint(run.out, run.model, run.tok, dtype=cfg.save_dtype, metadata=meta)
    state = {
        "step": run.step,
        "tokens": run.tokens,
        "elapsed": run.elapsed,
        "val_loss": run.val_loss,
        "model": {k: v.detach().cpu() for k, v in run.model.state_dict().items()},
        "optimizer": run.opt.state_dict(),
        "data_generator": run.data_gen.get_state(),
        "partition_generators": run.model.rng_state(),
        "torch_rng": torch.get_rng_state(),
        "world_size": info.world,
    }
    tmp = run.out / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, run.out / STATE_FILE)


def _log(out: Path, record: dict[str, Any]) -> None:
    """Append one JSON record to the run's ``log.jsonl``."""
    with open(out / LOG_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


@dataclass
class _Run:
    """One training run's state, shared by the steps of :func:`train`."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    out: Path
    info: _Dist
    device: torch.device
    command: str
    tok: D.BPETokenizer
    model: TransformerLM
    ddp_model: torch.nn.Module
    opt: torch.optim.AdamW
    data_gen: torch.Generator
    amp: torch.dtype | None
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    tokens_per_step: int
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    val_loss: float | None = None
    last_loss: float = float("nan")


def train(
    cfg: TrainConfig,
    model_cfg: ModelConfig | None = None,
    *,
    resume: bool = False,
    command: str | None = None,
) -> TrainResult:
    """Train a language model; see the module docstring.

    Args:
        cfg: training settings; ``cfg.out_dir`` receives the checkpoint.
        model_cfg: the model (its ``vocab_size`` is replaced by the tokenizer's). Default ``ModelConfig()``.
        resume: continue the run in ``cfg.out_dir`` from its ``trainer_state.pt``. The saved training and model
            settings are used; of ``cfg`` only ``stop_after``, ``progress``, ``threads`` and ``device`` apply.
        command: the command line to record in the checkpoint (default: ``sys.argv``).

    Returns:
        :class:`TrainResult`. Under ``torchrun`` every process returns it; only rank 0 writes files. A process
        group this call creates is destroyed before it returns (after a barrier).
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    if model_cfg is not None and not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig or None, got {type(model_cfg).__name__}")
    cfg, model_cfg, state = _resolve_configs(cfg, model_cfg, resume)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    command = command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    info, device = _init_distributed(cfg.device)
    try:
        run = _setup(cfg, model_cfg, state, info, device, command)
        return _loop(run)
    finally:
        if info.owns_group and dist.is_initialized():
            dist.barrier()  # no rank tears gloo down while another is still talking to it
            dist.destroy_process_group()


def _resolve_configs(
    cfg: TrainConfig, model_cfg: ModelConfig | None, resume: bool
) -> tuple[TrainConfig, ModelConfig, dict[str, Any] | None]:
    """The run's configs (on resume: the saved ones, with ``cfg``'s per-job settings) and the saved state."""
    out = Path(cfg.out_dir)
    state: dict[str, Any] | None = None
    if resume:
        if not (out / STATE_FILE).is_file() or not (out / TRAIN_CONFIG_FILE).is_file():
            raise ValueError(f"resume: {out} holds no {STATE_FILE} / {TRAIN_CONFIG_FILE} to resume from")
        saved = json.loads((out / TRAIN_CONFIG_FILE).read_text(encoding="utf-8"))
        keep = {k: getattr(cfg, k) for k in ("out_dir", "stop_after", "progress", "threads", "device")}
        cfg = dataclasses.replace(TrainConfig(**saved["train"]), **keep)
        model_cfg = ModelConfig.from_dict(saved["model"])
        state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=False)
    cfg.validate()
    return cfg, model_cfg if model_cfg is not None else ModelConfig(seed=cfg.seed), state


def _setup(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    state: dict[str, Any] | None,
    info: _Dist,
    device: torch.device,
    command: str,
) -> _Run:
    """Data, model, optimizer and batches of a run (restored from ``state`` on resume); rank 0 records the run."""
    out = Path(cfg.out_dir)
    if info.main:
        out.mkdir(parents=True, exist_ok=True)
    info.barrier()
    tok, streams = _prepare_data(cfg, out, info)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=tok.vocab_size)
    if info.main and state is None:
        record = {"train": dataclasses.asdict(cfg), "model": model_cfg.to_dict(), "command": command}
        (out / TRAIN_CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        (out / LOG_FILE).write_text("", encoding="utf-8")
    torch.manual_seed(cfg.seed)
    model = TransformerLM(model_cfg).to(device)
    opt = _optimizer(model, cfg, device)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    counters = _restore(state, model, opt, data_gen, info) if state is not None else {}
    model.train()
    ddp_model: torch.nn.Module = model
    if info.enabled:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    seq_len = model_cfg.seq_len
    val_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    run = _Run(
        cfg, model_cfg, out, info, device, command, tok, model, ddp_model, opt, data_gen,
        amp=resolve_autocast_dtype(cfg.autocast, device),
        batches=_train_batches(streams["train"], seq_len, cfg.batch_size, info, data_gen),
        val_batches=[
            D.random_batch(streams["validation"], seq_len, cfg.batch_size * info.world, generator=val_gen)
            for _ in range(cfg.eval_batches)
        ],
        tokens_per_step=cfg.batch_size * cfg.grad_accum * info.world * seq_len,
        **counters,
    )  # fmt: skip
    if info.main:
        print(
            f"plsh train: {model_cfg.describe()} | {model.num_params() / 1e6:.2f} M params | seq_len {seq_len} | "
            f"{run.tokens_per_step} tokens/step x {cfg.steps} steps | device {device} x {info.world} | "
            f"autocast {run.amp or 'off'} | train {streams['train'].numel():,} tokens",
            flush=True,
        )
    return run


def _restore(
    state: dict[str, Any], model: TransformerLM, opt: torch.optim.Optimizer, data_gen: torch.Generator, info: _Dist
) -> dict[str, Any]:
    """Load a saved ``trainer_state.pt`` into the model, optimizer and generators; return the run's counters."""
    if state["world_size"] != info.world:
        raise ValueError(
            f"resume: the run was saved with {state['world_size']} processes; resume it with the same number "
            f"(got {info.world}) so that the batches stay the same"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    data_gen.set_state(state["data_generator"])
    model.set_rng_state(state["partition_generators"])
    torch.set_rng_state(state["torch_rng"])
    return {k: state[k] for k in ("step", "tokens", "elapsed", "val_loss")}


def _loop(run: _Run) -> TrainResult:
    """Optimizer steps until ``steps`` (or ``stop_after``), with logging, validation and checkpoints."""
    cfg, info = run.cfg, run.info
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    bar = tqdm(
        total=cfg.steps, initial=run.step, desc="train", disable=not (cfg.progress and info.main), dynamic_ncols=True
    )
    t_start = time.perf_counter() - run.elapsed
    window_t, window_tokens = time.perf_counter(), 0
    while run.step < stop:
        lr = _optimizer_step(run)
        window_tokens += run.tokens_per_step
        now = time.perf_counter()
        tps = window_tokens / max(1e-9, now - window_t)
        if now - window_t > 30:
            window_t, window_tokens = now, 0
        bar.update(1)
        bar.set_postfix(loss=f"{run.last_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
        if info.main:
            _log(run.out, {"step": run.step, "loss": run.last_loss, "lr": lr, "tokens": run.tokens,
                           "tok_s": round(tps, 1), "elapsed": round(now - t_start, 2)})  # fmt: skip
        if run.step % cfg.eval_interval == 0 or run.step == cfg.steps:
            run.val_loss = _validate(run.model, run.val_batches, info, run.device, run.amp)
            if info.main:
                _log(run.out, {"step": run.step, "val_loss": run.val_loss, "val_ppl": math.exp(run.val_loss)})
                bar.write(
                    f"step {run.step}: train loss {run.last_loss:.4f}, val loss {run.val_loss:.4f} "
                    f"(ppl {math.exp(run.val_loss):.2f})"
                )
        if run.step % cfg.ckpt_interval == 0 or run.step == stop:
            run.elapsed = time.perf_counter() - t_start
            if info.main:
                _save_state(run)
            info.barrier()
    bar.close()
    seconds = time.perf_counter() - t_start
    if info.main:
        status = "finished" if run.step >= cfg.steps else f"stopped at step {run.step} (resume with --resume)"
        print(f"plsh train: {status}; {run.tokens:,} tokens in {seconds:.0f} s; checkpoint in {run.out}", flush=True)
    finished = run.step >= cfg.steps
    return TrainResult(run.out, run.step, run.tokens, run.last_loss, run.val_loss, seconds, finished)


def _optimizer_step(run: _Run) -> float:
    """One optimizer step (``grad_accum`` micro-batches); updates the step, token count and loss; returns the lr."""
    cfg, info = run.cfg, run.info
    lr = lr_at(run.step, cfg)
    for group in run.opt.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        x, y = next(run.batches)
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        sync = not info.enabled or micro == cfg.grad_accum - 1
        ctx = contextlib.nullcontext() if sync else run.ddp_model.no_sync()  # type: ignore[operator]
        with ctx:
            with _autocast(run.device, run.amp):
                _, loss = run.ddp_model(x, y)
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    run.tokens += run.tokens_per_step
    loss_t = loss_sum / cfg.grad_accum
    if info.enabled:
        dist.all_reduce(loss_t)
        loss_t /= info.world
    run.last_loss = float(loss_t)
    if not math.isfinite(run.last_loss):
        raise FloatingPointError(f"training loss is {run.last_loss} at step {run.step}; lower lr or check the data")
    return lr


if __name__ == "__main__":  # `python -m positional_lsh.lm.train` (older torchrun commands) is `plsh train`
    from positional_lsh.cli.train import main

    sys.exit(main())
