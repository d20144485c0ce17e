"""The training loop that ``plsh train`` (:mod:`positional_lsh.lm.train`) and ``plsh train-hf``
(:mod:`positional_lsh.integrations.hf.train`) share.

:func:`run_loop` runs optimizer steps until ``steps`` (or ``stop_after``, or SIGINT/SIGTERM) with the progress bar,
``log.jsonl`` records, validation, the stop request all processes agree on, the checkpoint cadence and the final
status line; the model-specific parts (the loss of a batch, the parameters to clip, writing a checkpoint) come in
as arguments. :func:`optimizer_step` and :func:`validation_loss` are one optimizer step and the mean validation
loss for any model whose loss :data:`LossFn` computes; the small helpers (:func:`adamw`, :func:`autocast`,
:func:`train_batches`, :func:`stop_requested`, :func:`default_command`, :func:`end_distributed`) are the rest of
the machinery both commands use.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from positional_lsh.lm import data as D
from positional_lsh.lm import run_dir as R
from positional_lsh.lm.signals import StopOnSignal
from positional_lsh.lm.train_config import lr_at
from positional_lsh.lm.train_dist import Dist

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""The mean next-token loss of a model on inputs ``x`` and targets ``y``."""


@dataclass
class TrainResult:
    """What :func:`positional_lsh.lm.train.train` (and ``train_hf``) returns."""

    out_dir: Path
    step: int
    tokens: int
    train_loss: float
    val_loss: float | None
    seconds: float
    finished: bool
    interrupted: str | None = None
    """The signal (``"SIGINT"``, ``"SIGTERM"``) that stopped the run early, after saving a checkpoint."""


class LoopSettings(Protocol):
    """The training settings the loop reads (both ``TrainConfig`` and ``HFTrainConfig`` have them)."""

    @property
    def steps(self) -> int: ...
    @property
    def stop_after(self) -> int | None: ...
    @property
    def eval_interval(self) -> int: ...
    @property
    def ckpt_interval(self) -> int: ...
    @property
    def progress(self) -> bool: ...
    @property
    def grad_accum(self) -> int: ...
    @property
    def grad_clip(self) -> float: ...
    @property
    def lr(self) -> float: ...
    @property
    def min_lr(self) -> float: ...
    @property
    def warmup(self) -> int: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...


@dataclass
class RunState:
    """What the loop reads and updates of one run; each command's run state extends it (with its settings,
    tokenizer, ...)."""

    out: Path
    info: Dist
    device: torch.device
    command: str
    model: torch.nn.Module
    ddp_model: torch.nn.Module
    """The model to call for training: ``model``, or its ``DistributedDataParallel`` wrapper."""
    opt: torch.optim.Optimizer
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


def default_command(command: str | None) -> str:
    """``command``, or the command line of this process (``sys.argv``, program name without its folder)."""
    return command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def end_distributed(info: Dist) -> None:
    """Destroy a process group the run created: first the garbage that may still hold it (a freed DDP or FSDP
    wrapper's reference cycles: the caller drops its model before), then a barrier (no rank tears gloo down while
    another talks), then the group, while every rank is still in it. A group whose last holder is freed later, after
    another rank has exited, was seen to hang that rank's exit in gloo's teardown (``torchrun`` then never returns)."""
    if info.owns_group and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def adamw(params: Iterable[torch.Tensor], cfg: LoopSettings, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``params`` with weight decay on the matrices only (fused on CUDA, foreach elsewhere)."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **extra)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to ``dtype``, or nothing for ``None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def train_batches(
    tokens: torch.Tensor, seq_len: int, batch_size: int, info: Dist, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless micro-batches: every process draws the same global batch and keeps its own rows."""
    while True:
        x, y = D.random_batch(tokens, seq_len, batch_size * info.world, generator=generator)
        rows = slice(info.rank * batch_size, (info.rank + 1) * batch_size)
        yield x[rows], y[rows]


def stop_requested(stopper: StopOnSignal, info: Dist, device: torch.device) -> bool:
    """Whether a process received SIGINT/SIGTERM (all processes agree, so that they stop at the same step)."""
    if not info.enabled:
        return stopper.signal is not None
    flag = torch.tensor([1.0 if stopper.signal is not None else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    info: Dist,
    device: torch.device,
    amp: torch.dtype | None,
    loss_fn: LossFn,
    shard: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Mean loss over the fixed validation batches: each process takes its rows (or, with ``shard``, its part of
    every row), the totals are all-reduced. The model is in eval mode meanwhile."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        rows = slice(info.rank * x.shape[0] // info.world, (info.rank + 1) * x.shape[0] // info.world)
        x, y = (x[rows], y[rows]) if shard is None else (shard(x), shard(y))
        x, y = x.to(device), y.to(device)
        with autocast(device, amp):
            loss = loss_fn(model, x, y)
        total[0] += float(loss) * y.numel()
        total[1] += y.numel()
    if info.enabled:
        dist.all_reduce(total)
    model.train(was_training)
    return float(total[0] / total[1])


def optimizer_step(
    run: RunState, cfg: LoopSettings, loss_fn: LossFn, clip: Iterable[torch.Tensor], *, non_blocking: bool, lr_flag: str
) -> float:
    """One optimizer step (``grad_accum`` micro-batches of ``run.batches``, loss ``loss_fn`` of ``run.ddp_model``,
    gradients of ``clip`` clipped to ``grad_clip``); updates ``step``, ``tokens`` and ``last_loss`` and returns the
    learning rate (of the schedule of ``cfg``). ``FloatingPointError`` (naming ``lr_flag``) on a non-finite loss."""
    info = run.info
    lr = lr_at(run.step, cfg)  # type: ignore[arg-type]  # the schedule reads steps, warmup, lr, min_lr
    for group in run.opt.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        x, y = next(run.batches)
        x, y = x.to(run.device, non_blocking=non_blocking), y.to(run.device, non_blocking=non_blocking)
        # DDP skips the all-reduce of all but the last micro-batch; FSDP reduce-scatters each (no no_sync)
        ddp = isinstance(run.ddp_model, torch.nn.parallel.DistributedDataParallel)
        sync = not ddp or micro == cfg.grad_accum - 1
        ctx = contextlib.nullcontext() if sync else run.ddp_model.no_sync()  # type: ignore[operator]
        with ctx:
            with autocast(run.device, run.amp):
                loss = loss_fn(run.ddp_model, x, y)
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(clip, cfg.grad_clip)
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
        at = step_label(run.step, cfg.grad_accum)
        raise FloatingPointError(f"training loss is {run.last_loss} at {at}; lower {lr_flag} or check the data")
    check_learned_slopes(run.model, run.step, lr_flag)
    return lr


def step_label(step: int, grad_accum: int) -> str:
    """``"step 10"``: optimizer steps; with gradient accumulation the micro-batches too, ``"step 10 (optimizer;
    20 micro-batches)"``, so that neither is taken for the other."""
    if grad_accum == 1:
        return f"step {step}"
    return f"step {step} (optimizer; {step * grad_accum} micro-batches)"


def run_loop(
    run: RunState,
    cfg: LoopSettings,
    *,
    prog: str,
    step: Callable[[], float],
    validate: Callable[[], float],
    save: Callable[[], None],
    val_ppl: Callable[[float], float],
    show_ppl: bool,
    val_extra: Callable[[], dict[str, Any]] | None = None,
    save_on_every_rank: bool = False,
) -> TrainResult:
    """Optimizer steps until ``steps`` (or ``stop_after``, or SIGINT/SIGTERM), with logging, validation and
    checkpoints; returns the :class:`TrainResult`.

    Args:
        run: the run's state (its counters are updated).
        cfg: the run's settings.
        prog: the command for messages, ``"plsh train"`` (the bar is named after its last word).
        step: one optimizer step; returns its learning rate.
        validate: the validation loss.
        save: write a checkpoint (called on rank 0, with ``run.elapsed`` up to date; on every rank with
            ``save_on_every_rank``, for a save that gathers a sharded state first).
        val_ppl: the ``val_ppl`` log field of a validation loss.
        show_ppl: the validation line shows the perplexity.
        val_extra: more fields of each validation's ``log.jsonl`` record (e.g. ``plsh train --learn-slopes``'s
            ``"slopes"``), computed on rank 0 after the validation.
    """
    info = run.info
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    bar = tqdm(total=cfg.steps, initial=run.step, desc=prog.split()[-1], disable=not (cfg.progress and info.main),
               dynamic_ncols=True)  # fmt: skip
    t_start = time.perf_counter() - run.elapsed
    window_t, window_tokens = time.perf_counter(), 0
    with StopOnSignal(prog) as stopper:
        while run.step < stop:
            lr = step()
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
                run.val_loss = val = validate()
                if info.main:
                    record = {"step": run.step, "val_loss": val, "val_ppl": val_ppl(val)}
                    R.append_log(run.out, record if val_extra is None else {**record, **val_extra()})
                    at = step_label(run.step, cfg.grad_accum)
                    bar.write(f"{at}: train loss {run.last_loss:.4f}, val loss {val:.4f}"
                              + (f" (ppl {math.exp(val):.2f})" if show_ppl else ""))  # fmt: skip
            interrupted = stop_requested(stopper, info, run.device)
            if run.step % cfg.ckpt_interval == 0 or run.step == stop or interrupted:
                run.elapsed = time.perf_counter() - t_start
                if info.main or save_on_every_rank:
                    save()
                info.barrier()
            if interrupted:
                break
    bar.close()
    seconds = time.perf_counter() - t_start
    if info.main:
        at = step_label(run.step, cfg.grad_accum)
        status = "finished" if run.step >= cfg.steps else f"stopped at {at} (resume with --resume)"
        if stopper.signal is not None:
            status = f"interrupted by {stopper.signal} at {at}; checkpoint saved (resume with --resume)"
        print(f"{prog}: {status}; {run.tokens:,} tokens in {seconds:.0f} s; checkpoint in {run.out}",
              file=sys.stderr if stopper.signal else sys.stdout, flush=True)  # fmt: skip
    finished = run.step >= cfg.steps
    return TrainResult(run.out, run.step, run.tokens, run.last_loss, run.val_loss, seconds, finished, stopper.signal)


def check_learned_slopes(model: torch.nn.Module, step: int, lr_flag: str) -> None:
    """``FloatingPointError`` (naming ``lr_flag``, like a non-finite loss) when a learned slope of ``model`` (the
    ``exp`` of a ``*log_slopes`` parameter) is no longer a finite number: the optimizer step ``step`` diverged."""
    for name, p in model.named_parameters():
        if name.endswith("log_slopes"):
            slopes = p.detach().float().exp()
            if not bool(torch.isfinite(slopes).all()) or not bool(torch.isfinite(p.detach()).all()):
                layer = re.search(r"(?:^|\.)(\d+)\.", name)
                raise FloatingPointError(
                    f"learned slopes diverged at step {step} ({f'layer {layer.group(1)}' if layer else name}: "
                    f"{[round(x, 4) for x in slopes.flatten().tolist()[:8]]}); lower {lr_flag}"
                )
