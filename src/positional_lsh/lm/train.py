"""Training of a :class:`~positional_lsh.lm.model.TransformerLM` language model.

AdamW (decoupled weight decay on matrices only) with linear warm-up and cosine decay to ``min_lr``, gradient
clipping, optional bf16/fp16 autocast, gradient accumulation, a progress bar with loss and tokens/s,
periodic validation on fixed held-out windows, checkpoints (``safetensors`` weights + JSON config + tokenizer,
plus a ``trainer_state.pt`` with the optimizer and every random-number state, written as one atomic set: see
:mod:`positional_lsh.lm.run_dir`) and exact resume: a run that is interrupted (a kill, Ctrl-C, SIGTERM) and
resumed ends with the same weights as an uninterrupted one. Settings: :mod:`positional_lsh.lm.train_config`.

Data parallelism: launched with ``torchrun --nproc_per_node N`` the same command trains with
``torch.distributed`` (gloo on CPU, NCCL on GPU). Every process draws the same global batch of
``N * batch_size`` windows from the shared seed and trains on its own slice, and all processes use the same
positional-LSH partitions, so ``N`` processes with ``batch_size`` B compute the same updates as one process
with ``batch_size`` ``N * B`` (up to floating-point summation order). ``context_parallel = C`` (positional LSH
only) splits every sequence over ``C`` consecutive ranks, ``world = data x C``: the same updates as ``world / C``
data-parallel processes (``positional_lsh.distributed.training``; ``docs/distributed.md``).

Batches are random windows of ``seq_len + 1`` tokens from the training stream (documents joined by the
end-of-document token); validation uses ``eval_batches`` fixed windows of the validation split.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from positional_lsh.lm import run_dir as R
from positional_lsh.lm.config import ModelConfig
from positional_lsh.lm.model import TransformerLM
from positional_lsh.lm.run_dir import LOG_FILE, STATE_FILE, TRAIN_CONFIG_FILE
from positional_lsh.lm.signals import StopOnSignal
from positional_lsh.lm.train_config import (
    AUTOCAST_CHOICES,
    QUICK_PRESET,
    TrainConfig,
    default_cache_dir,
    estimate_step_bytes,
    lr_at,
    resolve_autocast_dtype,
)
from positional_lsh.lm.train_dist import Dist as _Dist
from positional_lsh.lm.train_dist import check_device
from positional_lsh.lm.train_dist import init_distributed as _init_distributed
from positional_lsh.ops.errors import UserError, check_memory

__all__ = [
    "AUTOCAST_CHOICES",
    "LOG_FILE",
    "QUICK_PRESET",
    "STATE_FILE",
    "TRAIN_CONFIG_FILE",
    "TrainConfig",
    "TrainResult",
    "default_cache_dir",
    "lr_at",
    "resolve_autocast_dtype",
    "resolve_run_configs",
    "train",
]


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
    interrupted: str | None = None
    """The signal (``"SIGINT"``, ``"SIGTERM"``) that stopped the run early, after saving a checkpoint."""


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def _prepare_data(
    cfg: TrainConfig, out: Path, info: _Dist, resumed: D.BPETokenizer | None
) -> tuple[D.BPETokenizer, dict[str, torch.Tensor]]:
    """Tokenizer (``resumed``: the checkpoint's; else reused, or trained on the training split by rank 0) and the
    encoded train/validation streams."""
    cache = None if cfg.cache_dir == "" else Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    saved_tok = out / "tokenizer.json"
    tok: D.BPETokenizer | None = None
    splits = None
    if info.main:
        splits = D.load_splits(cfg.data)
        if resumed is not None:
            tok = resumed
        elif cfg.tokenizer:
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


def _check_stream_lengths(cfg: TrainConfig, streams: dict[str, torch.Tensor], seq_len: int) -> None:
    """``UserError`` naming ``--data`` and ``--seq-len`` when a split holds fewer than ``seq_len + 1`` tokens (one
    training window and its next-token targets), before the model is built."""
    for split in ("train", "validation"):
        have = int(streams[split].numel())
        if have < seq_len + 1:
            raise UserError(
                f"--data {cfg.data or 'default'}: its {split} split has {have} tokens, but --seq-len {seq_len} needs "
                f"at least {seq_len + 1} per split; give more text or a smaller --seq-len"
            )


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
    cp: Any = None,
) -> float:
    """Mean loss over the fixed validation batches (each process takes its rows, ``cp``: its shard; all-reduce)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        rows = slice(info.rank * x.shape[0] // info.world, (info.rank + 1) * x.shape[0] // info.world)
        x, y = (x[rows], y[rows]) if cp is None else (cp.local(x), cp.local(y))
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
    counters = {"step": run.step, "tokens": run.tokens, "elapsed": run.elapsed, "val_loss": run.val_loss}
    state = R.trainer_state(run.model, run.opt, run.data_gen, counters)
    state.update(world_size=info.world, tokenizer_fingerprint=run.tok.fingerprint)
    R.save_run_checkpoint(run.out, run.model, run.tok, dtype=cfg.save_dtype, metadata=meta, state=state)
    run.saved_step = run.step


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
    saved_step: int = -1
    cp: Any = None  # positional_lsh.distributed.training.ContextParallel of a context-parallel run


def train(
    cfg: TrainConfig,
    model_cfg: ModelConfig | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    changes: dict[str, Any] | None = None,
    command: str | None = None,
) -> TrainResult:
    """Train a language model; see the module docstring.

    Args:
        cfg: training settings; ``cfg.out_dir`` receives the checkpoint.
        model_cfg: the model (its ``vocab_size`` is replaced by the tokenizer's). Default ``ModelConfig()``.
        resume: continue the run in ``cfg.out_dir`` from its latest checkpoint. The saved training and model
            settings are used (the thread count included, unless ``cfg.threads`` is set); of ``cfg`` only
            ``stop_after``, ``progress``, ``threads`` and ``device`` apply. ``log.jsonl`` is cut back to the
            checkpoint's step.
        overwrite: a new run may replace a previous run in ``cfg.out_dir`` (default: ``UserError``).
        changes: on resume, saved training settings to change (:data:`~positional_lsh.lm.run_dir.RESUME_MAY_CHANGE`,
            e.g. more ``steps``).
        command: the command line to record in the checkpoint (default: ``sys.argv``).

    Returns:
        :class:`TrainResult`. Under ``torchrun`` every process returns it; only rank 0 writes files. A process
        group this call creates is destroyed before it returns (after a barrier).
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    if model_cfg is not None and not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig or None, got {type(model_cfg).__name__}")
    check_device(cfg.device)  # before anything on disk changes
    cfg, model_cfg, state = resolve_run_configs(cfg, model_cfg, resume, overwrite, changes or {})
    if cfg.context_parallel > 1:
        from positional_lsh.distributed.training import check_context_parallel  # lazily: lm never needs it

        check_context_parallel(cfg.context_parallel, model_cfg.position, int(os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    command = command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    info, device = _init_distributed(cfg.device)
    try:
        run = _setup(cfg, model_cfg, state, info, device, command)
        return _loop(run)
    finally:
        if info.owns_group and dist.is_initialized():
            dist.barrier()  # no rank tears gloo down while another is still talking to it
            dist.destroy_process_group()


def resolve_run_configs(
    cfg: TrainConfig, model_cfg: ModelConfig | None, resume: bool, overwrite: bool, changes: dict[str, Any]
) -> tuple[TrainConfig, ModelConfig, dict[str, Any] | None]:
    """The settings a :func:`train` call runs with: ``(train config, model config, saved state or None)``.

    On resume: the saved configs of ``cfg.out_dir``, with ``cfg``'s per-job settings and ``changes``, and the saved
    state (with the checkpoint's tokenizer under ``"tokenizer"``). A new run: ``cfg`` validated (its thread count
    recorded), the memory pre-check of one step (when ``model_cfg`` is given), and ``out_dir`` checked (or cleared
    with ``overwrite``); ``model_cfg`` defaults to ``ModelConfig(seed=cfg.seed)``. Arguments as for :func:`train`.

    Raises:
        UserError: on resume, unreadable or bad saved settings, a change outside
            :data:`~positional_lsh.lm.run_dir.RESUME_MAY_CHANGE` or ``steps`` below the checkpoint's step; for a
            new run, a step that does not fit in memory or an ``out_dir`` that cannot take the run.
    """
    out = Path(cfg.out_dir)
    state: dict[str, Any] | None = None
    if resume:
        saved, state = R.load_run(out)
        keep = {k: getattr(cfg, k) for k in ("out_dir", "stop_after", "progress", "device")}
        keep["threads"] = cfg.threads or saved["train"].get("threads")
        try:
            cfg = dataclasses.replace(TrainConfig(**saved["train"]), **keep, **R.check_changes(changes))
            cfg.validate()
            model_cfg = ModelConfig.from_dict(saved["model"])
        except (TypeError, ValueError) as exc:
            raise UserError(f"{out / TRAIN_CONFIG_FILE}: bad settings ({exc}); the run cannot be resumed") from None
        if cfg.steps < state["step"]:
            raise UserError(f"--resume: --steps {cfg.steps} is below the checkpoint's step {state['step']}")
    else:
        cfg.validate()
        cfg = dataclasses.replace(cfg, threads=cfg.threads or torch.get_num_threads())  # recorded for resume
        if model_cfg is not None:
            what = (
                f"--num-samples {model_cfg.num_samples}, --batch-size {cfg.batch_size}, --seq-len {model_cfg.seq_len}"
                + (f", --context-parallel {cfg.context_parallel}" if cfg.context_parallel > 1 else "")
            )
            check_memory(estimate_step_bytes(cfg, model_cfg), what)
        if not overwrite or int(os.environ.get("RANK", "0")) == 0:
            R.prepare_new_run(out, overwrite=overwrite)
    return cfg, model_cfg if model_cfg is not None else ModelConfig(seed=cfg.seed), state


def _parallel_model(
    cfg: TrainConfig, model: TransformerLM, info: _Dist, device: torch.device
) -> tuple[torch.nn.Module, Any]:
    """``(model to call, context-parallel shard or None)``: the model itself, DDP, or context parallelism."""
    if cfg.context_parallel > 1:  # world = data x context: shards of every sequence, DDP over the whole world
        from positional_lsh.distributed.training import setup_context_parallel

        cp, ddp_model = setup_context_parallel(cfg.context_parallel, model, model.cfg.seq_len, device)
        return ddp_model, cp
    if info.enabled:
        device_ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids), None
    return model, None


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
    tok, streams = _prepare_data(cfg, out, info, state["tokenizer"] if state is not None else None)
    _check_stream_lengths(cfg, streams, model_cfg.seq_len)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=tok.vocab_size)
    if info.main and state is None:
        record = {"train": dataclasses.asdict(cfg), "model": model_cfg.to_dict(), "command": command}
        R.write_train_config(out, record)
        (out / LOG_FILE).write_text("", encoding="utf-8")
    elif info.main and state is not None:
        R.truncate_log(out, state["step"])
        R.clean_stale(out)
    torch.manual_seed(cfg.seed)
    model = TransformerLM(model_cfg).to(device)
    opt = _optimizer(model, cfg, device)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    counters = R.restore_trainer_state(state, model, opt, data_gen, info.world) if state is not None else {}
    model.train()
    ddp_model, cp = _parallel_model(cfg, model, info, device)
    seq_len = model_cfg.seq_len
    val_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    run = _Run(
        cfg, model_cfg, out, info, device, command, tok, model, ddp_model, opt, data_gen,
        amp=resolve_autocast_dtype(cfg.autocast, device),
        batches=_train_batches(streams["train"], seq_len, cfg.batch_size, info, data_gen) if cp is None else
        cp.shard_batches(_train_batches(streams["train"], seq_len, cfg.batch_size * cp.data_world, _Dist(), data_gen)),
        val_batches=[
            D.random_batch(streams["validation"], seq_len, cfg.batch_size * (info.world // cfg.context_parallel),
                           generator=val_gen)
            for _ in range(cfg.eval_batches)
        ],
        tokens_per_step=cfg.batch_size * cfg.grad_accum * (info.world // cfg.context_parallel) * seq_len,
        cp=cp,
        **counters,
    )  # fmt: skip
    if info.main:
        print(
            f"plsh train: {model_cfg.describe()} | {model.num_params() / 1e6:.2f} M params | seq_len {seq_len} | "
            f"{run.tokens_per_step} tokens/step x {cfg.steps} steps | device {device} x {info.world}"
            f"{f' ({cp.describe()})' if cp is not None else ''} | "
            f"autocast {run.amp or 'off'} | train {streams['train'].numel():,} tokens",
            flush=True,
        )
    return run


def _loop(run: _Run) -> TrainResult:
    """Optimizer steps until ``steps`` (or ``stop_after``, or SIGINT/SIGTERM), with logging, validation and
    checkpoints."""
    cfg, info = run.cfg, run.info
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    bar = tqdm(
        total=cfg.steps, initial=run.step, desc="train", disable=not (cfg.progress and info.main), dynamic_ncols=True
    )
    t_start = time.perf_counter() - run.elapsed
    window_t, window_tokens = time.perf_counter(), 0
    with StopOnSignal() as stopper:
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
                R.append_log(run.out, {"step": run.step, "loss": run.last_loss, "lr": lr, "tokens": run.tokens,
                                       "tok_s": round(tps, 1), "elapsed": round(now - t_start, 2)})  # fmt: skip
            if run.step % cfg.eval_interval == 0 or run.step == cfg.steps:
                _validate_and_log(run, bar)
            interrupted = _stop_requested(stopper, info, run.device)
            if run.step % cfg.ckpt_interval == 0 or run.step == stop or interrupted:
                run.elapsed = time.perf_counter() - t_start
                if info.main:
                    _save_state(run)
                info.barrier()
            if interrupted:
                break
    bar.close()
    seconds = time.perf_counter() - t_start
    if info.main:
        status = "finished" if run.step >= cfg.steps else f"stopped at step {run.step} (resume with --resume)"
        if stopper.signal is not None:
            status = f"interrupted by {stopper.signal} at step {run.step}; checkpoint saved (resume with --resume)"
        print(f"plsh train: {status}; {run.tokens:,} tokens in {seconds:.0f} s; checkpoint in {run.out}",
              file=sys.stderr if stopper.signal else sys.stdout, flush=True)  # fmt: skip
    finished = run.step >= cfg.steps
    return TrainResult(run.out, run.step, run.tokens, run.last_loss, run.val_loss, seconds, finished, stopper.signal)


def _validate_and_log(run: _Run, bar: Any) -> None:
    """Validate, and on rank 0 log and print the validation loss."""
    run.val_loss = _validate(run.model, run.val_batches, run.info, run.device, run.amp, run.cp)
    if run.info.main:
        R.append_log(run.out, {"step": run.step, "val_loss": run.val_loss, "val_ppl": math.exp(run.val_loss)})
        bar.write(
            f"step {run.step}: train loss {run.last_loss:.4f}, val loss {run.val_loss:.4f} "
            f"(ppl {math.exp(run.val_loss):.2f})"
        )


def _stop_requested(stopper: StopOnSignal, info: _Dist, device: torch.device) -> bool:
    """Whether a process received SIGINT/SIGTERM (all processes agree, so that they stop at the same step)."""
    if not info.enabled:
        return stopper.signal is not None
    flag = torch.tensor([1.0 if stopper.signal is not None else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


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
