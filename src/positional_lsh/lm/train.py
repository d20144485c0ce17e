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

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from positional_lsh.lm import data as D
from positional_lsh.lm import run_dir as R
from positional_lsh.lm import train_loop as L
from positional_lsh.lm.checkpoint import check_log_slopes, checkpoint_dir
from positional_lsh.lm.config import ModelConfig
from positional_lsh.lm.model import TransformerLM
from positional_lsh.lm.run_dir import LOG_FILE, TRAIN_CONFIG_FILE
from positional_lsh.lm.train_config import (
    TrainConfig,
    check_learn_slopes_run,
    default_cache_dir,
    estimate_step_bytes,
    resolve_autocast_dtype,
)
from positional_lsh.lm.train_dist import Dist as _Dist
from positional_lsh.lm.train_dist import check_device
from positional_lsh.lm.train_dist import init_distributed as _init_distributed
from positional_lsh.lm.train_loop import TrainResult
from positional_lsh.ops.errors import UserError, check_memory

__all__ = ["TrainConfig", "TrainResult", "train"]


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


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def _optimizer(model: TransformerLM, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only."""
    return L.adamw(model.parameters(), cfg, device)


def _lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's mean next-token loss."""
    _, loss = model(x, y)
    return loss


def _context_loss(shards: Any) -> L.LossFn:
    """:func:`_lm_loss` of this rank's shard of a context-parallel run (``shards``: its
    ``positional_lsh.distributed.ContextShards``, passed as the model's ``context=``)."""

    def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, value = model(x, y, context=shards)
        return cast(torch.Tensor, value)

    return loss


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
    model = cast(TransformerLM, run.model)
    state = R.trainer_state(model, run.opt, run.data_gen, counters)
    state.update(world_size=info.world, tokenizer_fingerprint=run.tok.fingerprint)
    R.save_run_checkpoint(run.out, model, run.tok, dtype=cfg.save_dtype, metadata=meta, state=state)
    run.saved_step = run.step


@dataclass(kw_only=True)
class _Run(L.RunState):
    """One training run's state, shared by the steps of :func:`train`."""

    cfg: TrainConfig
    model_cfg: ModelConfig
    tok: D.BPETokenizer
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
    if model_cfg is not None and not resume:
        check_learn_slopes_run(cfg, model_cfg)
    cfg, model_cfg, state = resolve_run_configs(cfg, model_cfg, resume, overwrite, changes or {})
    check_learn_slopes_run(cfg, model_cfg)  # a resumed run's saved settings too
    if cfg.context_parallel > 1:
        from positional_lsh.distributed.training import check_context_parallel  # lazily: lm never needs it

        check_context_parallel(cfg.context_parallel, model_cfg.position, int(os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    command = L.default_command(command)
    info, device = _init_distributed(cfg.device)
    run = None
    try:
        run = _setup(cfg, model_cfg, state, info, device, command)
        return _loop(run)
    finally:
        run = None  # the model (a DDP / FSDP wrapper holds the process group) freed before the group
        L.end_distributed(info)


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
        _check_saved_state(out, state)
        keep = R.per_job_settings(cfg, saved["train"])
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


def _check_saved_state(out: Path, state: dict[str, Any]) -> None:
    """Refuse (``UserError`` naming the file) a trainer state that cannot be resumed although it loads: a step
    outside ``[0, 2**63)`` (the partition steps are int64) or learned slopes that are not finite."""
    file = checkpoint_dir(out) / R.STATE_FILE
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise UserError(f"{file}: step must be an integer in [0, 2^63), got {str(step)[:40]}; "
                        "the run cannot be resumed")  # fmt: skip
    if isinstance(state["model"], dict):
        check_log_slopes(state["model"], file)


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
        out, info, device, command, model, ddp_model, opt, data_gen, cfg=cfg, model_cfg=model_cfg, tok=tok,
        amp=resolve_autocast_dtype(cfg.autocast, device),
        batches=L.train_batches(streams["train"], seq_len, cfg.batch_size, info, data_gen) if cp is None else
        cp.shard_batches(L.train_batches(streams["train"], seq_len, cfg.batch_size * cp.data_world, _Dist(), data_gen)),
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
    return L.run_loop(
        run,
        run.cfg,
        prog="plsh train",
        step=lambda: L.optimizer_step(run, run.cfg, _lm_loss, run.model.parameters(), non_blocking=True, lr_flag="lr"),
        validate=lambda: L.validation_loss(run.model, run.val_batches, run.info, run.device, run.amp,
                                           _lm_loss if run.cp is None else _context_loss(run.cp.shards),
                                           None if run.cp is None else run.cp.local),
        save=lambda: _save_state(run),
        val_ppl=math.exp,
        show_ppl=True,
        val_extra=(lambda: {"slopes": slopes_record(cast(TransformerLM, run.model))}) if run.model_cfg.learn_slopes
        else None,
    )  # fmt: skip


def slopes_record(model: TransformerLM) -> list[list[float]] | None:
    """The learned slopes of ``model`` for ``log.jsonl``: one list per layer, one value per head (6 significant
    digits); ``None`` when it does not learn its slopes."""
    slopes = model.learned_slopes()
    if slopes is None:
        return None
    return [[float(f"{v:.6g}") for v in row] for row in slopes.tolist()]
