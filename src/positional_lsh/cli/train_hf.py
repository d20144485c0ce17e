"""Train a transformers model from a config, or fine-tune a local checkpoint (full or LoRA), with positional-LSH (or
ALiBi) attention; the run directory, resume and torchrun of plsh train. Needs transformers (and peft for LoRA): pip
install 'positional-lsh[train]'.

``plsh train-hf`` trains or fine-tunes a transformers model with positional LSH: the command line of
:func:`positional_lsh.integrations.hf.train.train_hf` (the paragraph above is its ``--help`` description). Its flags
are generated from :class:`~positional_lsh.integrations.hf.train.HFTrainConfig` (:data:`HF_TRAIN_FLAGS`) and from
:class:`TrainHFCommand` (``--preset``, ``--resume``, ``--overwrite``). Every argparse default is ``None``: the
dataclass's defaults apply, after the preset's, to what is not given. Under ``torchrun``:
``torchrun --nproc_per_node N -m positional_lsh.cli train-hf ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from positional_lsh.cli import command_main
from positional_lsh.cli.parsers import Flag, add_arguments, add_parser_command, comma_list, option, values_from_args
from positional_lsh.cli.train import check_resume_or_overwrite, shared_train_flags, train_exit_code
from positional_lsh.integrations.hf_train_config import (
    FINETUNE_MODES,
    HF_POSITIONS,
    PRESETS,
    WEIGHT_DTYPES,
    HFTrainConfig,
    inapplicable_settings,
)
from positional_lsh.lm.run_dir import RESUME_MAY_CHANGE, TRAIN_CONFIG_FILE, read_train_config
from positional_lsh.ops.errors import UserError
from positional_lsh.ops.options import BACKENDS, METHODS

__all__ = [
    "HF_TRAIN_FLAGS",
    "TrainHFCommand",
    "add_train_hf_arguments",
    "check_flags_apply",
    "config_from_args",
    "describe_preset",
    "main",
    "preset_settings",
]

HF_TRAIN_FLAGS = {
    "out_dir": Flag("run directory (checkpoints, trainer state, log)", name="--out"),
    "config": Flag("train from scratch: a transformers config.json, a folder holding one, or a built-in config "
                   "(qwen3-0.6b, tiny-qwen3)", group="model"),
    "checkpoint": Flag("fine-tune: a local save_pretrained folder, a peft adapter folder or a plsh train-hf run",
                       group="model"),
    "finetune": Flag("full: every weight; lora: peft LoRA adapters (needs peft)", choices=FINETUNE_MODES,
                     group="model"),
    "lora_r": Flag("LoRA rank", group="model"),
    "lora_alpha": Flag("LoRA alpha", group="model"),
    "lora_dropout": Flag("LoRA dropout", group="model"),
    "lora_targets": Flag("modules that get LoRA adapters", group="model"),
    "dtype": Flag("weights dtype of a frozen LoRA base (--finetune full trains float32 master weights and AdamW "
                  "state; bf16 compute: --autocast bfloat16)", choices=WEIGHT_DTYPES, group="model"),
    "gradient_checkpointing": Flag("recompute activations in the backward (same gradients, less memory)",
                                   name="--gradient-checkpointing", group="model"),
    "fsdp": Flag("shard weights, gradients and optimizer state over the torchrun processes (FSDP2) instead of "
                 "replicating them (DDP); needs torchrun with 2 or more processes", group="run"),
    "position": Flag("attention: plsh (positional LSH), alibi, window-alibi, or native (the model's own)",
                     choices=HF_POSITIONS, group="attention"),
    "num_samples": Flag("positional-LSH samples T", group="attention"),
    "scheme": Flag("positional-LSH scheme: discrete, gamma, fixed, ...", group="attention"),
    "sigma": Flag("one slope 1/sigma for every head (the paper: 256); default: the model's own slopes or the ALiBi "
                  "schedule", group="attention", show_default=False),
    "slopes": Flag("one slope per head, comma-separated (instead of --sigma)", parse=comma_list(float),
                   group="attention", show_default=False),
    "window": Flag("window-alibi: largest kept distance in tokens", group="attention", show_default=False),
    "partition_seed": Flag("seed of the training partitions (default: --seed)", group="attention",
                           show_default=False),
    "attn_backend": Flag("attention kernel backend", choices=BACKENDS, group="attention"),
    "plsh_method": Flag("positional-LSH method (same result)", choices=METHODS, group="attention"),
    "data": Flag("'default' (shipped corpus), hf:PATH[:NAME], a .jsonl[.xz] file, text files/dir, or a datasets "
                 "save_to_disk folder", group="data"),
    "tokenizer": Flag("a tokenizer.json or a transformers tokenizer folder (default: the checkpoint's, or a BPE "
                      "trained on the data)", group="data"),
    **shared_train_flags("vocab_size", "cache_dir"),
    "seq_len": Flag("training window in tokens", group="data"),
    **shared_train_flags("batch_size", "grad_accum", "steps", "lr", "min_lr", "warmup", "weight_decay", "beta1",
                         "beta2", "grad_clip", "eval_interval", "eval_batches", "ckpt_interval"),
    "seed": Flag("seed of init, LoRA init, data order and partitions", group="run"),
    **shared_train_flags("autocast", "device", "threads", "stop_after", "progress"),
}  # fmt: skip
"""``plsh train-hf``'s flags for :class:`~positional_lsh.integrations.hf.train.HFTrainConfig`."""

_PER_JOB = ("out_dir", "stop_after", "progress", "device", "threads")


@dataclass
class TrainHFCommand:
    """``plsh train-hf``'s own switches (the settings are in ``HFTrainConfig``)."""

    preset: str | None = option(
        None,
        "settings to start from: paper-qwen3-0.6b, paper-mistral-7b (the paper's §5.1, GPU) or tiny (CI, CPU); a "
        "preset sets only what applies to the chosen --position and --finetune (e.g. no sigma or T with --position "
        "native), one line lists the values it set, and flags given override them",
        choices=tuple(PRESETS),
    )
    resume: bool = option(False, "continue the run in --out from its latest checkpoint (its settings are kept; a "
                          "conflicting flag is refused, more --steps are applied)")  # fmt: skip
    overwrite: bool = option(False, "replace the previous run in --out")
    dry_run: bool = option(False, "print the memory estimate (parameters, gradients, optimizer state, activations "
                           "at --seq-len and T) from the model config alone and exit: no weights are loaded, "
                           "nothing is written")  # fmt: skip
    nproc: int | None = option(None, "with --dry-run: the number of torchrun processes to estimate for (with --fsdp "
                               "each holds 1/N of the weights, gradients and optimizer state; default: WORLD_SIZE, "
                               "else 1)")  # fmt: skip


def add_train_hf_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``plsh train-hf``'s options to a parser (every default ``None``: presets fill in what is not given)."""
    add_arguments(p, HFTrainConfig, flags={"out_dir": HF_TRAIN_FLAGS["out_dir"]}, none_defaults=True)
    add_arguments(p, TrainHFCommand, none_defaults=True)
    groups = {title: p.add_argument_group(title) for title in ("model", "attention", "data", "optimization", "run")}
    add_arguments(p, HFTrainConfig, flags={k: v for k, v in HF_TRAIN_FLAGS.items() if k != "out_dir"}, groups=groups,
                  none_defaults=True)  # fmt: skip


def _flag(name: str) -> str:
    return HF_TRAIN_FLAGS[name].name or "--" + name.replace("_", "-")


def preset_settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The preset's settings that apply (``{field: value}``: not overridden by a flag given, and used by the run's
    position and fine-tuning mode) and those it does not apply (``{field: why}``)."""
    if not args.preset:
        return {}, {}
    preset = dict(PRESETS[args.preset])
    given = values_from_args(args, HFTrainConfig, flags=HF_TRAIN_FLAGS, given_only=True)
    overridden = set(given)
    if "checkpoint" in given:
        overridden.add("config")  # a checkpoint given replaces the preset's config
    if "slopes" in given:
        overridden.add("sigma")  # --slopes replaces the preset's one slope 1/sigma (and --sigma its slopes)
    if "sigma" in given:
        overridden.add("slopes")
    position = given.get("position", preset.get("position", HFTrainConfig.position))
    finetune = given.get("finetune", preset.get("finetune", HFTrainConfig.finetune))
    unused = inapplicable_settings(position, finetune)
    applied = {k: v for k, v in preset.items() if k not in overridden and k not in unused}
    skipped = {k: unused[k] for k in preset if k not in overridden and k in unused}
    return applied, skipped


def check_flags_apply(args: argparse.Namespace) -> None:
    """``UserError`` naming the first flag given that the run would ignore (``--scheme`` with ``--position native``,
    ``--lora-r`` without ``--finetune lora``, ...: :func:`~positional_lsh.integrations.hf_train_config.
    inapplicable_settings`)."""
    given = values_from_args(args, HFTrainConfig, flags=HF_TRAIN_FLAGS, given_only=True)
    preset = PRESETS[args.preset] if args.preset else {}
    position = given.get("position", preset.get("position", HFTrainConfig.position))
    finetune = given.get("finetune", preset.get("finetune", HFTrainConfig.finetune))
    unused = inapplicable_settings(position, finetune)
    for name in given:
        if name in unused and not (name == "dtype" and given[name] == "float32"):
            raise UserError(f"{_flag(name)} {unused[name]} (it would be ignored); drop it")


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~positional_lsh.integrations.hf.train.HFTrainConfig`: defaults, the preset's settings that apply
    (:func:`preset_settings`), the flags given."""
    kw, _ = preset_settings(args)
    kw.update(values_from_args(args, HFTrainConfig, flags=HF_TRAIN_FLAGS, given_only=True))
    return HFTrainConfig(**kw)


def describe_preset(args: argparse.Namespace) -> str | None:
    """The line ``plsh train-hf`` prints for ``--preset``: the values it set, and those it did not apply."""
    if not args.preset:
        return None
    applied, skipped = preset_settings(args)
    text = ", ".join(f"{k}={v}" for k, v in applied.items()) or "nothing (every value is overridden by a flag)"
    line = f"plsh train-hf: preset {args.preset} sets {text}"
    if skipped:
        line += f"; not applied (unused by this run): {', '.join(skipped)}"
    return line


def _resume_changes(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The flags given with ``--resume`` against the saved settings: per-job flags apply, equal values are fine,
    changes of :data:`~positional_lsh.lm.run_dir.RESUME_MAY_CHANGE` are applied (and said), others refused."""
    saved = read_train_config(out)["train"]
    if args.preset:
        print("plsh train-hf: --resume: --preset is ignored (the run keeps its own settings)", file=sys.stderr)
    changes: dict[str, Any] = {}
    for name, value in values_from_args(args, HFTrainConfig, flags=HF_TRAIN_FLAGS, given_only=True).items():
        old = saved.get(name)
        if name in _PER_JOB or value == old or (isinstance(value, tuple) and list(value) == old):
            continue
        flag = HF_TRAIN_FLAGS[name].name or "--" + name.replace("_", "-")
        if name in RESUME_MAY_CHANGE:
            changes[name] = value
            print(f"plsh train-hf: --resume: {flag} changes from {old} to {value}", file=sys.stderr)
            continue
        raise UserError(f"--resume: {flag} {value} conflicts with the run's {old} (saved in {out / TRAIN_CONFIG_FILE});"
                        " drop the flag, or start a new run")  # fmt: skip
    return changes


def _main(args: argparse.Namespace) -> int:
    """0 when steps were trained (or the run was finished), 1 when none were, ``128 + signal`` when stopped."""
    from positional_lsh.integrations.hf.train import train_hf

    check_resume_or_overwrite(args)
    if args.resume:
        if args.out_dir is None:
            raise UserError("--resume needs --out, the run directory to continue")
        out = Path(args.out_dir)
        changes = _resume_changes(args, out)
        saved = read_train_config(out)["train"]
        cfg = config_from_args(argparse.Namespace(**{**vars(args), "preset": None, "config": saved.get("config"),
                                                     "checkpoint": saved.get("checkpoint")}))  # fmt: skip
    else:
        check_flags_apply(args)
        cfg, changes = config_from_args(args), {}
        cfg.validate()
        line = describe_preset(args)
        if line is not None and os.environ.get("RANK", "0") == "0":  # once under torchrun
            print(line, flush=True)
    if args.nproc is not None and not args.dry_run:
        raise UserError("--nproc sets the processes of --dry-run's estimate; a run takes them from torchrun "
                        "(--nproc_per_node); drop --nproc or add --dry-run")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be an integer >= 1, got {args.nproc}")
    if args.dry_run:
        from positional_lsh.integrations.hf.train import dry_run

        print(dry_run(cfg, args.nproc or int(os.environ.get("WORLD_SIZE", "1"))), flush=True)
        return 0
    result = train_hf(cfg, resume=bool(args.resume), overwrite=bool(args.overwrite), changes=changes,
                      command=getattr(args, "command_line", None))  # fmt: skip
    return train_exit_code(result)


def register_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``plsh train-hf`` to the ``plsh`` command line."""
    help = "train or fine-tune (full or LoRA) a transformers model with plsh / alibi / window-alibi / native"
    add_parser_command(sub, "train-hf", add_train_hf_arguments, _main, help=help, doc=__doc__)


def main(argv: Sequence[str] | None = None) -> int:
    """``plsh train-hf ARGS`` as a function: :func:`positional_lsh.cli.main` with ``train-hf`` in front."""
    return command_main("train-hf", argv)
