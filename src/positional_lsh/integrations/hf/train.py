"""Training transformers models with positional LSH (or exact / windowed ALiBi, or their own attention):
``plsh train-hf``.

The same guarantees as ``plsh train`` (:mod:`positional_lsh.lm.train`), from the same machinery: the run directory
of :mod:`positional_lsh.lm.run_dir` (``train_config.json``, ``log.jsonl``, whole checkpoint sets under
``steps/`` named by ``LATEST``), exact resume (weights of the trained parameters, optimizer, data order, every
random-number state and the swap's training step), SIGINT/SIGTERM stop with a checkpoint
(:class:`~positional_lsh.lm.signals.StopOnSignal`), ``torchrun`` data parallelism
(:mod:`positional_lsh.lm.train_dist`: every process draws the same global batch and the same partitions), or FSDP2
sharding over those processes (``fsdp``: :mod:`positional_lsh.integrations.hf.train_fsdp`), and
refusals as one line (:class:`~positional_lsh.ops.errors.UserError`).

* **The model**: from a transformers config (``config``: a ``config.json``, a folder holding one, or a built-in
  name of ``hf_train_config.BUILTIN_CONFIGS``; random weights from ``seed``), or from a local checkpoint
  (``checkpoint``: a ``save_pretrained`` folder, a peft adapter folder, or a ``plsh train-hf`` run directory) to
  fine-tune, fully or with LoRA (``finetune="lora"``, needs peft).
* **Attention**: ``position`` ``plsh`` (:func:`~positional_lsh.integrations.hf.use_positional_lsh` with
  ``num_samples``, ``scheme``, fresh partitions every step), ``alibi``, ``window-alibi``
  (:func:`~positional_lsh.integrations.hf.use_alibi`) or ``native`` (the model's own); slopes ``sigma`` (one for
  every head: slope ``1 / sigma``) or ``slopes`` (one per head), default the model's own (native ALiBi models) or
  the standard ALiBi schedule.
* **Data**: a :func:`positional_lsh.lm.data.load_splits` source (the shipped corpus, text files, ``hf:PATH``) or a
  folder written by ``datasets``' ``save_to_disk``; windows of ``seq_len + 1`` tokens, as ``plsh train``.
  Tokenizer: the checkpoint's, ``tokenizer`` (a ``tokenizer.json`` or a transformers tokenizer folder), or a
  byte-level BPE trained on the training split (from scratch).
* **Settings**: :class:`~positional_lsh.integrations.hf_train_config.HFTrainConfig` and its presets
  (:mod:`positional_lsh.integrations.hf_train_config`, importable without transformers).
* **Precision**: float32 master weights and AdamW state for every trained parameter (a LoRA base may be bfloat16:
  ``dtype``) with ``autocast`` bf16/fp16; gradient checkpointing (``gradient_checkpointing``).

A checkpoint set holds the model (``save_pretrained``: ``config.json`` + ``model.safetensors``, or the LoRA
adapter), its tokenizer (transformers format), the swap's settings (``positional_lsh_swap.json``, with the step
and the training length) and ``trainer_state.pt``: ``plsh eval RUN_DIR`` and
:func:`~positional_lsh.integrations.hf.load_local_model` load it with its swap. Presets: :data:`PRESETS`.

This module holds the run (settings, setup, the step loop, checkpoints); the data and tokenizer are
:mod:`positional_lsh.integrations.hf.train_data`, the model, its memory estimate and ``--dry-run``
:mod:`positional_lsh.integrations.hf.train_model`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from positional_lsh.integrations.hf.loading import ADAPTER_CONFIG
from positional_lsh.integrations.hf.saved import write_swap_settings
from positional_lsh.integrations.hf.swap import current_swap, unwrap_model
from positional_lsh.integrations.hf.train_data import TrainTokenizer, load_training_splits, run_tokenizer, token_streams
from positional_lsh.integrations.hf.train_fsdp import full_state, load_full_state, shard_model
from positional_lsh.integrations.hf.train_model import (
    build_model,
    checkpoint_folder,
    config_dict,
    dry_run,
    memory_estimate_line,
    probe_attention,
)
from positional_lsh.integrations.hf_train_config import PRESETS, HFTrainConfig
from positional_lsh.lm import data as D
from positional_lsh.lm import run_dir as R
from positional_lsh.lm import train_loop as L
from positional_lsh.lm.train_config import resolve_autocast_dtype
from positional_lsh.lm.train_dist import Dist, check_device, init_distributed
from positional_lsh.lm.train_loop import TrainResult
from positional_lsh.ops.errors import UserError

__all__ = ["PRESETS", "HFTrainConfig", "dry_run", "train_hf"]


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _optimizer(model: nn.Module, cfg: HFTrainConfig, device: torch.device) -> torch.optim.AdamW:
    return L.adamw(_trainable(model).values(), cfg, device)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Run(L.RunState):
    cfg: HFTrainConfig
    tok: TrainTokenizer


def resolve_settings(cfg: HFTrainConfig, resume: bool, overwrite: bool, changes: dict[str, Any]) -> tuple[
    HFTrainConfig, dict[str, Any] | None
]:  # fmt: skip
    """The settings the run uses (on resume: the saved ones, with the per-job fields of ``cfg`` and ``changes``)
    and the saved trainer state (``None`` for a new run, whose ``out_dir`` is checked or cleared)."""
    out = Path(cfg.out_dir)
    if not resume:
        cfg.validate()
        check_fsdp_world(cfg)
        if cfg.config is not None:  # the model's source exists and reads, before anything on disk changes
            config_dict(cfg.config)
        else:
            checkpoint_folder(str(cfg.checkpoint))
        cfg = dataclasses.replace(cfg, threads=cfg.threads or torch.get_num_threads())
        if not overwrite or int(os.environ.get("RANK", "0")) == 0:
            R.prepare_new_run(out, overwrite=overwrite)
        return cfg, None
    saved = R.read_train_config(out)
    if saved.get("kind") != "transformers":
        raise UserError(f"--resume: {out} is a plsh train run, not a plsh train-hf run; resume it with plsh train")
    keep = R.per_job_settings(cfg, saved["train"])
    try:
        train = dict(saved["train"])
        for key in ("lora_targets", "slopes"):
            if isinstance(train.get(key), list):
                train[key] = tuple(train[key])
        cfg = dataclasses.replace(HFTrainConfig(**train), **keep, **R.check_changes(changes))
        cfg.validate()
    except (TypeError, ValueError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(f"{out / R.TRAIN_CONFIG_FILE}: bad settings ({exc}); the run cannot be resumed") from None
    need = ("step", "tokens", "elapsed", "val_loss", "trainable", "optimizer", "data_generator", "torch_rng",
            "swap_step", "world_size", "tokenizer_fingerprint")  # fmt: skip
    check_fsdp_world(cfg, resume=True)
    state, _ = R.read_state_file(out, need, "plsh train-hf")
    if cfg.steps < state["step"]:
        raise UserError(f"--resume: --steps {cfg.steps} is below the checkpoint's step {state['step']}")
    return cfg, state


def check_fsdp_world(cfg: HFTrainConfig, resume: bool = False) -> None:
    """``UserError`` for ``--fsdp`` outside a ``torchrun`` launch of 2 or more processes (nothing to shard over)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.fsdp and world < 2:
        how = ("the run was started with it: resume it under torchrun with its number of processes" if resume
               else "launch torchrun --nproc_per_node N -m positional_lsh.cli train-hf ... (N >= 2), or drop --fsdp")
        raise UserError(f"--fsdp shards the model over torchrun processes, but this is {world} process; {how}")


def train_hf(
    cfg: HFTrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    changes: dict[str, Any] | None = None,
    command: str | None = None,
) -> TrainResult:
    """Train a transformers model; see the module docstring.

    Args:
        cfg: the settings (``cfg.out_dir`` receives the run).
        resume: continue the run in ``cfg.out_dir`` from its latest checkpoint, with its saved settings (of ``cfg``
            only ``stop_after``, ``progress``, ``threads`` and ``device`` apply).
        overwrite: a new run may replace a previous run in ``cfg.out_dir``.
        changes: on resume, saved settings to change (:data:`~positional_lsh.lm.run_dir.RESUME_MAY_CHANGE`).
        command: the command line to record (default ``sys.argv``).

    Returns:
        :class:`~positional_lsh.lm.train.TrainResult`; under ``torchrun`` every process returns it and rank 0 writes.
    """
    if not isinstance(cfg, HFTrainConfig):
        raise TypeError(f"cfg must be an HFTrainConfig, got {type(cfg).__name__}")
    check_device(cfg.device)
    cfg, state = resolve_settings(cfg, resume, overwrite, changes or {})
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    command = L.default_command(command)
    info, device = init_distributed(cfg.device)
    run = None
    try:
        run = _setup(cfg, state, info, device, command)
        return _loop(run)
    finally:
        run = None  # the model (a DDP / FSDP wrapper holds the process group) freed before the group
        L.end_distributed(info)


def _setup(cfg: HFTrainConfig, state: dict[str, Any] | None, info: Dist, device: torch.device, command: str) -> _Run:
    out = Path(cfg.out_dir)
    splits = load_training_splits(cfg.data)
    checkpoint_tok = None
    if cfg.checkpoint is not None and not cfg.tokenizer:
        folder = checkpoint_folder(cfg.checkpoint)
        tok_dirs = [folder] + ([Path(json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])]
                               if (folder / ADAPTER_CONFIG).is_file() else [])  # fmt: skip
        for d in tok_dirs:
            if (d / "tokenizer_config.json").is_file() or (d / "tokenizer.json").is_file():
                from transformers import AutoTokenizer

                checkpoint_tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
                break
    tok, new_tok = run_tokenizer(cfg, out, info, splits, checkpoint_tok, resume=state is not None)
    if state is not None and state["tokenizer_fingerprint"] != tok.fingerprint():
        raise UserError(f"--resume: the tokenizer ({cfg.tokenizer or cfg.checkpoint or out / 'tokenizer.json'}) "
                        "differs from the one the run was trained with; restore it")  # fmt: skip
    streams = token_streams(tok, splits, cfg)
    for name, s in streams.items():
        if s.numel() < cfg.seq_len + 2:
            raise UserError(f"--data {cfg.data or 'default'}: the {name} split has {s.numel()} tokens, fewer than "
                            f"--seq-len {cfg.seq_len} + 2; pass more text or a smaller --seq-len")  # fmt: skip
    model, _ = build_model(cfg, tok.size if cfg.config is not None else None)
    inner = unwrap_model(model)
    if tok.size > inner.config.vocab_size:
        raise UserError(f"the tokenizer has {tok.size} ids but the model's vocabulary only {inner.config.vocab_size}")
    if info.main:
        n_all, n_train = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in _trainable(model).values())
        print(memory_estimate_line(cfg, inner.config, n_params=n_all, n_trained=n_train, world=info.world), flush=True)
    if cfg.fsdp:
        shard_model(model, info.world, device)  # moves the shards to the device
    else:
        model.to(device)
    opt = _optimizer(model, cfg, device)
    amp = resolve_autocast_dtype(cfg.autocast, device)
    probe_attention(model, cfg, device, amp)
    # Every check has passed: only now is anything written in --out.
    if info.main:
        out.mkdir(parents=True, exist_ok=True)
        if new_tok:
            assert tok.bpe is not None
            tok.bpe.save(out / "tokenizer.json")
    info.barrier()
    data_gen = torch.Generator().manual_seed(cfg.seed)
    counters: dict[str, Any] = {}
    if state is not None:
        counters = _restore_state(state, model, opt, data_gen, info.world, sharded=cfg.fsdp)
    elif info.main:
        R.write_train_config(out, {"kind": "transformers", "train": dataclasses.asdict(cfg),
                                   "model": inner.config.to_dict(), "command": command})  # fmt: skip
        (out / R.LOG_FILE).write_text("", encoding="utf-8")
    if state is not None and info.main:
        R.truncate_log(out, state["step"])
        R.clean_stale(out)
    model.train()
    ddp_model: nn.Module = model
    if info.enabled and not cfg.fsdp:
        device_ids = [device.index] if device.type == "cuda" else None
        ddp_model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    val_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    run = _Run(
        out, info, device, command, model, ddp_model, opt, data_gen, cfg=cfg, tok=tok,
        amp=amp,
        batches=L.train_batches(streams["train"], cfg.seq_len, cfg.batch_size, info, data_gen),
        val_batches=[D.random_batch(streams["validation"], cfg.seq_len, cfg.batch_size * info.world,
                                    generator=val_gen) for _ in range(cfg.eval_batches)],
        tokens_per_step=cfg.batch_size * cfg.grad_accum * info.world * cfg.seq_len,
        **counters,
    )  # fmt: skip
    if info.main:
        n_train = sum(p.numel() for p in _trainable(model).values())
        n_all = sum(p.numel() for p in model.parameters())
        swap = current_swap(model)
        attn = "native" if swap is None else f"{cfg.position}" + (f" T={cfg.num_samples}" if cfg.position == "plsh"
                                                                    else "")  # fmt: skip
        print(f"plsh train-hf: {inner.config.model_type} {n_all:,} params ({n_train:,} trained, "
              f"{cfg.finetune}) | attention {attn} | seq_len {cfg.seq_len} | {run.tokens_per_step} tokens/optimizer "
              "step "
              f"({cfg.grad_accum} micro-batch{'es' if cfg.grad_accum > 1 else ''}) x {cfg.steps} optimizer steps "
              f"| device {device} x {info.world}{' (FSDP)' if cfg.fsdp else ''} | autocast {run.amp or 'off'} | train "
              f"{streams['train'].numel():,} tokens", flush=True)  # fmt: skip
    return run


def _restore_state(state: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer, data_gen: torch.Generator,
                   world: int, *, sharded: bool = False) -> dict[str, Any]:  # fmt: skip
    if state["world_size"] != world:
        raise UserError(f"--resume: the run was saved with {state['world_size']} processes; resume it with the same "
                        f"number (got {world}) so that the batches stay the same")  # fmt: skip
    params = _trainable(model)
    if set(params) != set(state["trainable"]):
        raise UserError(f"{R.STATE_FILE} does not fit the run's model (other trained parameters)")
    try:
        if sharded:
            load_full_state(model, opt, state["trainable"], state["optimizer"])
        else:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(state["trainable"][name])
            opt.load_state_dict(state["optimizer"])
        data_gen.set_state(state["data_generator"])
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{R.STATE_FILE} does not fit the run's model ({' '.join(str(exc).split())[:160]})") from None
    swap = current_swap(model)
    if swap is not None:
        swap.set_step(int(state["swap_step"]))
    return {k: state[k] for k in ("step", "tokens", "elapsed", "val_loss")}


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _save(run: _Run) -> None:
    """One checkpoint set: the model (or adapter) with its swap and tokenizer, and the exact resume state. Under
    ``--fsdp`` every process calls it (gathering the full state is a collective) and rank 0 writes."""
    cfg, model = run.cfg, run.model
    swap = current_swap(model)
    weights: dict[str, torch.Tensor] | None = None
    if cfg.fsdp:
        weights, optim = full_state(model, run.opt)
        if not run.info.main:
            return
        trained = {n: weights[n] for n in _trainable(model)}
    else:
        trained = {n: p.detach().cpu().clone() for n, p in _trainable(model).items()}
        optim = run.opt.state_dict()
    state = {
        "step": run.step, "tokens": run.tokens, "elapsed": run.elapsed, "val_loss": run.val_loss,
        "trainable": trained, "optimizer": optim, "data_generator": run.data_gen.get_state(),
        "torch_rng": torch.get_rng_state(), "swap_step": swap.step if swap is not None else 0,
        "world_size": run.info.world, "tokenizer_fingerprint": run.tok.fingerprint(),
    }  # fmt: skip
    meta = {"step": run.step, "tokens": run.tokens, "train_loss": run.last_loss, "val_loss": run.val_loss,
            "finished": run.step >= cfg.steps, "command": run.command}  # fmt: skip

    def write(folder: Path) -> None:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every checkpoint
        try:
            saved: Any = model  # a transformers (or peft) model: save_pretrained is untyped here
            saved.save_pretrained(str(folder), **({} if weights is None else {"state_dict": weights}))
            run.tok.as_transformers().save_pretrained(str(folder))
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        if swap is not None:
            write_swap_settings(swap, folder, train_len=cfg.seq_len)
        (folder / "plsh_train_hf.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    R.write_checkpoint_set(run.out, state, write)


def _loop(run: _Run) -> TrainResult:
    return L.run_loop(
        run,
        run.cfg,
        prog="plsh train-hf",
        step=lambda: L.optimizer_step(run, run.cfg, _loss, list(_trainable(run.model).values()), non_blocking=False,
                                      lr_flag="--lr"),
        validate=lambda: L.validation_loss(run.model, run.val_batches, run.info, run.device, run.amp, _loss),
        save=lambda: _save(run),
        save_on_every_rank=run.cfg.fsdp,
        val_ppl=lambda v: math.exp(min(v, 700)),
        show_ppl=False,
    )  # fmt: skip
