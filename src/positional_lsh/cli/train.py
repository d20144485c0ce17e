"""Train a decoder-only LM on the shipped corpus (or --data). Works under torchrun for data-parallel training:
torchrun --nproc_per_node N -m positional_lsh.cli train --out DIR ... (add --context-parallel C to also split each
sequence over C ranks).

``plsh train`` is the command line of :func:`positional_lsh.lm.train.train` (the paragraph above is its ``--help``
description). Its flags are generated from :class:`~positional_lsh.lm.train.TrainConfig`, from the fields of
:class:`~positional_lsh.lm.config.ModelConfig` named in :data:`MODEL_FLAGS` and from :class:`TrainCommand`
(``--quick``, ``--resume``). Every argparse default is ``None``: the dataclasses' defaults apply, after
``--quick``'s preset, to what is not given. Under ``torchrun``: ``torchrun --nproc_per_node N -m positional_lsh.cli
train ...``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from positional_lsh.cli import command_main
from positional_lsh.cli.parsers import Flag, add_arguments, add_parser_command, option, values_from_args
from positional_lsh.lm.config import ALIBI_IMPLS, POSITIONS, ModelConfig
from positional_lsh.lm.run_dir import RESUME_MAY_CHANGE, read_train_config
from positional_lsh.lm.train import TrainConfig, TrainResult, train
from positional_lsh.lm.train_config import AUTOCAST_CHOICES, QUICK_PRESET, check_learn_slopes_run
from positional_lsh.ops.errors import UserError
from positional_lsh.ops.options import BACKENDS, METHODS

__all__ = [
    "MODEL_FLAGS",
    "SHARED_TRAIN_FLAGS",
    "TRAIN_FLAGS",
    "TrainCommand",
    "add_train_arguments",
    "check_resume_or_overwrite",
    "configs_from_args",
    "main",
    "shared_train_flags",
    "train_exit_code",
]

SHARED_TRAIN_FLAGS = {
    "vocab_size": Flag("BPE vocabulary when training a tokenizer", group="data"),
    "cache_dir": Flag("token cache directory (default: $PLSH_CACHE_DIR or ~/.cache/positional_lsh; '' disables)",
                      group="data"),
    "batch_size": Flag("windows per micro-batch per process", group="optimization"),
    "grad_accum": Flag("micro-batches per step", group="optimization"),
    "steps": Flag("optimizer steps", group="optimization"),
    "lr": Flag("peak learning rate", group="optimization"),
    "min_lr": Flag("final learning rate", group="optimization"),
    "warmup": Flag("warm-up steps", group="optimization"),
    "weight_decay": Flag("AdamW weight decay on matrices", group="optimization"),
    "beta1": Flag("AdamW beta1", group="optimization"),
    "beta2": Flag("AdamW beta2", group="optimization"),
    "grad_clip": Flag("gradient-norm clip, 0 disables", group="optimization"),
    "eval_interval": Flag("validate every N steps", group="run"),
    "eval_batches": Flag("validation batches", group="run"),
    "ckpt_interval": Flag("resumable checkpoint every N steps", group="run"),
    "autocast": Flag("mixed precision (auto: bf16 where native)", choices=AUTOCAST_CHOICES, group="run"),
    "device": Flag("auto, cpu, cuda, cuda:1 ...", group="run"),
    "threads": Flag("torch intra-op threads", group="run"),
    "stop_after": Flag("stop at this step with a resumable checkpoint", group="run"),
    "progress": Flag("no progress bar", name="--no-progress", group="run"),
}  # fmt: skip
"""The flags ``plsh train`` and ``plsh train-hf`` share (the same settings of ``TrainConfig`` and ``HFTrainConfig``);
pick them in order with :func:`shared_train_flags`."""


def shared_train_flags(*names: str) -> dict[str, Flag]:
    """The :data:`SHARED_TRAIN_FLAGS` named ``names``, in that order (the order of the ``--help`` listing)."""
    return {name: SHARED_TRAIN_FLAGS[name] for name in names}


TRAIN_FLAGS = {
    "out_dir": Flag("run directory (checkpoint, trainer state, log)", name="--out"),
    "data": Flag("'default' (shipped corpus), hf:PATH[:NAME], a .jsonl[.xz] file, or text files/dir (split by "
                 "document; under 3 documents, e.g. one file: by position, 90/5/5%)", group="data"),
    "tokenizer": Flag("reuse this tokenizer.json (or a checkpoint directory) instead of training one", group="data"),
    **shared_train_flags("vocab_size", "cache_dir", "batch_size", "grad_accum", "steps", "lr", "min_lr", "warmup",
                         "weight_decay", "beta1", "beta2", "grad_clip", "eval_interval", "eval_batches",
                         "ckpt_interval"),
    "seed": Flag("seed of init, data order and partitions", group="run"),
    **shared_train_flags("autocast", "device", "threads"),
    "save_dtype": Flag("weights storage", choices=("float32", "float16", "bfloat16"), group="run"),
    **shared_train_flags("stop_after", "progress"),
    "context_parallel": Flag("split each sequence over C consecutive ranks (under torchrun; --position plsh; C "
                             "must divide the number of processes = data x C)", group="run"),
}  # fmt: skip
"""``plsh train``'s flags for :class:`~positional_lsh.lm.train.TrainConfig` (defaults: the dataclass's)."""

MODEL_FLAGS = {
    "position": Flag("attention position mode", choices=POSITIONS, group="model"),
    "num_samples": Flag("positional-LSH samples T per step", group="model"),
    "scheme": Flag("positional-LSH scheme: discrete, gamma, fixed, ...", group="model"),
    "sigma": Flag("one constant sigma for every head (default: per-head ALiBi slopes)", group="model"),
    "window": Flag("window-alibi: largest kept distance in tokens", parse=float, group="model"),
    "window_factor": Flag("window-alibi: window = factor * sigma_h per head", group="model"),
    "n_layer": Flag("layers", group="model"),
    "n_head": Flag("attention heads", group="model"),
    "d_model": Flag("width", group="model"),
    "mlp_ratio": Flag("MLP width / d_model", group="model"),
    "dropout": Flag("dropout", group="model"),
    "seq_len": Flag("training context length", group="model"),
    "rope_base": Flag("RoPE base", group="model"),
    "alibi_impl": Flag("exact ALiBi kernel", choices=ALIBI_IMPLS, group="model"),
    "attn_backend": Flag("plsh/alibi kernel backend", choices=BACKENDS, group="model"),
    "plsh_method": Flag("positional-LSH method: per-sample blocks, multiplicity tiles or auto (same result)",
                        choices=METHODS, group="model"),
    "seed": Flag("seed of the positional-LSH training partitions (default: --seed)", name="--partition-seed",
                 dest="partition_seed", group="model", show_default=False),
    "attn_fp32": Flag("run attention in the autocast dtype too (default: float32 attention; see "
                      "ModelConfig.attn_fp32)", name="--attn-low-precision", group="model"),
    "learn_slopes": Flag("learn the ALiBi slopes (log-slopes per layer and head, from the --sigma or standard "
                         "ones; --position alibi, window-alibi, plsh; not with --context-parallel)", group="model"),
}  # fmt: skip
"""``plsh train``'s flags for :class:`~positional_lsh.lm.config.ModelConfig` fields (defaults: the dataclass's)."""


@dataclass
class TrainCommand:
    """``plsh train``'s own switches (the settings are in ``TrainConfig`` and ``ModelConfig``)."""

    quick: bool = option(False, f"tiny ~1-minute preset for smoke tests and CI: {QUICK_PRESET}")
    resume: bool = option(
        False,
        "continue the run in --out from its latest checkpoint (the run's settings are kept; "
        "a conflicting flag is refused, more --steps are applied)",
    )
    overwrite: bool = option(False, "replace the previous run in --out (its log, checkpoints and trainer state)")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``plsh train``'s options to a parser (every default is ``None``: presets fill in what is not given)."""
    add_arguments(p, TrainConfig, flags={"out_dir": TRAIN_FLAGS["out_dir"]}, none_defaults=True)
    add_arguments(p, TrainCommand, none_defaults=True)
    groups = {title: p.add_argument_group(title) for title in ("data", "model", "optimization", "run")}
    rest = {k: v for k, v in TRAIN_FLAGS.items() if k != "out_dir"}
    add_arguments(p, TrainConfig, flags={k: v for k, v in rest.items() if v.group == "data"}, groups=groups,
                  none_defaults=True)  # fmt: skip
    add_arguments(p, ModelConfig, flags=MODEL_FLAGS, groups=groups, none_defaults=True)
    add_arguments(p, TrainConfig, flags={k: v for k, v in rest.items() if v.group != "data"}, groups=groups,
                  none_defaults=True)  # fmt: skip


def configs_from_args(args: argparse.Namespace) -> tuple[TrainConfig, ModelConfig]:
    """Build the configs: defaults, then ``--quick``'s preset, then the flags given explicitly."""
    preset = QUICK_PRESET if args.quick else {}
    train_kw = {k: v for k, v in preset.items() if k in TRAIN_FLAGS}
    train_kw.update(values_from_args(args, TrainConfig, flags=TRAIN_FLAGS, given_only=True))
    cfg = TrainConfig(**train_kw)
    model_kw = {k: v for k, v in preset.items() if k in MODEL_FLAGS}
    model_kw.update(values_from_args(args, ModelConfig, flags=MODEL_FLAGS, given_only=True))
    model_kw.setdefault("seed", cfg.seed)
    return cfg, ModelConfig(**model_kw)


def _main(args: argparse.Namespace) -> int:
    """``plsh train``'s ``func``: 0 when steps were trained (or the run was already finished), 1 when none were,
    ``128 + signal`` when stopped by a signal. Refused settings raise (``positional_lsh.cli.guarded``: exit 2)."""
    cfg, model_cfg = configs_from_args(args)
    cfg.validate()
    if not args.resume:
        check_learn_slopes_run(cfg, model_cfg)
    if cfg.context_parallel > 1 and not args.resume:
        from positional_lsh.distributed.training import check_context_parallel

        check_context_parallel(cfg.context_parallel, model_cfg.position, int(os.environ.get("WORLD_SIZE", "1")))
    changes: dict[str, Any] = {}
    if args.resume:
        check_resume_or_overwrite(args)
        changes = resume_changes(args, Path(cfg.out_dir))
    result = train(cfg, model_cfg, resume=bool(args.resume), overwrite=bool(args.overwrite), changes=changes,
                   command=getattr(args, "command_line", None))  # fmt: skip
    return train_exit_code(result)


def check_resume_or_overwrite(args: argparse.Namespace) -> None:
    """``UserError`` when both ``--resume`` and ``--overwrite`` are given (``args``: a training command's)."""
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --out and --overwrite replaces it: pass one of them")


def train_exit_code(result: TrainResult) -> int:
    """A training command's exit code: 0 when steps were trained (or the run was already finished), 1 when none
    were, ``128 + signal`` when stopped by a signal."""
    if result.interrupted is not None:
        return 128 + int(getattr(signal, result.interrupted))
    return 0 if result.step > 0 or result.finished else 1


def _flag(name: str, flags: dict[str, Flag]) -> str:
    """The command-line flag of setting ``name``."""
    flag = flags.get(name)
    return flag.name if flag is not None and flag.name else "--" + name.replace("_", "-")


def resume_changes(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Compare the flags given with ``--resume`` to the run's saved settings.

    Per-job flags (``--stop-after``, ``--no-progress``, ``--device``) apply; a flag equal to the saved value is
    fine; a changed setting of :data:`~positional_lsh.lm.run_dir.RESUME_MAY_CHANGE` (e.g. more ``--steps``) is
    returned to be applied, and said on stderr; any other change raises ``UserError`` naming the flag and both
    values.
    """
    saved = read_train_config(out)
    if args.quick:
        print("plsh train: --resume: --quick is ignored (the run keeps its own settings)", file=sys.stderr)
    given = [("train", k, v, TRAIN_FLAGS) for k, v in values_from_args(args, TrainConfig, flags=TRAIN_FLAGS,
                                                                        given_only=True).items()]  # fmt: skip
    given += [("model", k, v, MODEL_FLAGS) for k, v in values_from_args(args, ModelConfig, flags=MODEL_FLAGS,
                                                                         given_only=True).items()]  # fmt: skip
    changes: dict[str, Any] = {}
    for part, name, value, flags in given:
        if part == "train" and name in ("out_dir", "stop_after", "progress", "device"):
            continue
        old = saved[part].get(name)
        if value == old or (name == "threads" and old is None):
            continue
        if part == "train" and name in RESUME_MAY_CHANGE:
            changes[name] = value
            print(f"plsh train: --resume: {_flag(name, flags)} changes from {old} to {value}", file=sys.stderr)
            continue
        raise UserError(f"--resume: {_flag(name, flags)} {value} conflicts with the run's {old} (saved in "
                        f"{out / 'train_config.json'}); drop the flag, or start a new run")  # fmt: skip
    return changes


def register_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``plsh train`` to the ``plsh`` command line."""
    help = "train a language model with alibi / plsh / window-alibi / rope / nope attention"
    add_parser_command(sub, "train", add_train_arguments, _main, help=help, doc=__doc__)


def main(argv: Sequence[str] | None = None) -> int:
    """``plsh train ARGS`` as a function (``argv``: the arguments after ``train``; default ``sys.argv[1:]``).

    It is :func:`positional_lsh.cli.main` with ``train`` in front: the same parser and the same error handling
    (one line and exit code 2, see :func:`positional_lsh.cli.guarded`).
    """
    return command_main("train", argv)
