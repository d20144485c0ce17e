"""``plsh eval``: sliding-window perplexity at and beyond the training length, and the positional-LSH sweep.

The command line of :mod:`positional_lsh.lm.evaluate`: :class:`EvalConfig` holds the settings (its parser is
generated from it), :func:`run_eval` loads every checkpoint named, evaluates it (loss, perplexity, bits per token,
top-1/top-10 accuracy, mean reciprocal rank, mean predictive entropy, loss by position within the window), prints
the rows as they come and writes ``results.csv``, ``loss_by_position.csv``, ``results.md`` and the plots
(``extrapolation.png``, ``sweep.png``, ``loss_by_position.png``) into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from positional_lsh.cli import main as plsh_main
from positional_lsh.cli.parsers import (
    add_arguments,
    comma_list,
    option,
    positive_float_text,
    positive_int_text,
    run_command,
)
from positional_lsh.lm.eval_models import load_for_eval
from positional_lsh.lm.eval_results import EvalRow, format_table, write_results
from positional_lsh.lm.evaluate import (
    DEFAULT_FACTORS,
    DEFAULT_SAMPLES,
    DEFAULT_SCHEMES,
    check_something_to_score,
    evaluate_model,
)
from positional_lsh.lm.run_dir import check_output_dir
from positional_lsh.lm.train import default_cache_dir
from positional_lsh.lm.train_dist import check_device
from positional_lsh.ops._checks import positive_int
from positional_lsh.ops.schemes import get_scheme

__all__ = ["EvalConfig", "main", "register_cli", "run_eval"]


def _stride_text(text: str) -> int | str:
    """``"window"`` or a positive integer."""
    return text if text == "window" else positive_int_text(text)


def _scheme_text(text: str) -> str:
    """A registered scheme name."""
    return get_scheme(text).name


@dataclass
class EvalConfig:
    """Settings of ``plsh eval`` (see :func:`~positional_lsh.lm.evaluate.evaluate_model` for the protocol)."""

    checkpoints: tuple[str, ...] = option(
        (),
        "checkpoint directories (plsh train output or a local transformers folder); default: the shipped model",
        positional=True,
        show_default=False,
    )
    labels: tuple[str, ...] | None = option(None, "comma-separated names for the checkpoints in tables and plots")
    out: str | None = option(None, "directory for results.csv, loss_by_position.csv, results.md and the PNG plots")
    data: str | None = option(None, "evaluation corpus (load_splits source); default: the checkpoint's training corpus")
    split: str = option("test", "split to evaluate")
    factors: tuple[float, ...] = option(
        DEFAULT_FACTORS, "evaluation lengths / training length", parse=comma_list(positive_float_text)
    )
    stride: int | str | None = option(
        None, "window stride in tokens, or 'window' for disjoint windows (default: the training length)",
        parse=_stride_text,
    )  # fmt: skip
    max_tokens: int | None = option(None, "score only the first N tokens of the split (default: all)")
    samples: tuple[int, ...] = option(DEFAULT_SAMPLES, "sweep T values ('none': no sweep)",
                                      parse=comma_list(positive_int_text))  # fmt: skip
    schemes: tuple[str, ...] = option(DEFAULT_SCHEMES, "sweep schemes", parse=comma_list(_scheme_text))
    sweep_factors: tuple[float, ...] | None = option(
        None, "lengths of the sweep (default: --factors)", parse=comma_list(positive_float_text)
    )
    equal_cost: bool = option(True, "skip windowed ALiBi at equal cost", name="--no-equal-cost")
    eval_seed: int = option(0, "seed of the evaluation partitions")
    train_len: int | None = option(None, "training length (transformers models without one in the config)")
    tokenizer: str | None = option(None, "tokenizer.json to encode the data with (instead of the checkpoint's)")
    batch_tokens: int = option(8192, "tokens per forward pass")
    cache_dir: str | None = option(
        None, "token cache directory (default: $PLSH_CACHE_DIR or ~/.cache/positional_lsh; '' disables)"
    )
    device: str = option("auto", "auto, cpu, cuda ...")
    threads: int | None = option(None, "torch intra-op threads")
    progress: bool = option(True, "no progress bars", name="--no-progress")

    def __post_init__(self) -> None:
        if not self.factors:
            raise ValueError("factors must not be empty")
        if self.labels is not None and len(self.labels) != max(1, len(self.checkpoints)):
            raise ValueError(f"--labels has {len(self.labels)} names for {max(1, len(self.checkpoints))} checkpoints")
        positive_int("batch_tokens", self.batch_tokens)
        for name in ("max_tokens", "train_len", "threads"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))


def run_eval(cfg: EvalConfig) -> list[EvalRow]:
    """Evaluate every checkpoint of ``cfg``; print the rows as they come, then the table; write the results."""
    out = Path(cfg.out) if cfg.out else None
    if out is not None:
        check_output_dir(out, "--out")  # before the work, not after it
    device = check_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cache = None if cfg.cache_dir == "" else Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    paths: list[str | None] = list(cfg.checkpoints) or [None]
    labels: Sequence[str | None] = cfg.labels if cfg.labels is not None else [None] * len(paths)
    rows: list[EvalRow] = []

    def on_row(r: EvalRow) -> None:
        rows.append(r)
        print(
            f"{r.model} | {r.attention} | L={r.eval_len} ({r.factor:g}x) | loss {r.loss:.4f} ppl {r.ppl:.2f} "
            f"mrr {r.mrr:.3f} entropy {r.entropy:.3f} top1 {r.top1:.3f} top10 {r.top10:.3f} | {r.seconds:.0f} s",
            flush=True,
        )
        if out is not None:  # keep partial results of long evaluations
            write_results(rows, out, plots=False)

    for path, label in zip(paths, labels, strict=True):
        adapter, stream = load_for_eval(
            path, label=label, data=cfg.data, split=cfg.split, train_len=cfg.train_len, tokenizer=cfg.tokenizer,
            cache_dir=cache, seed=cfg.eval_seed, device=device,
        )  # fmt: skip
        check_something_to_score(adapter.train_len, cfg.factors, stream.numel(), cfg.max_tokens,
                                 what=f"{cfg.split} split")  # fmt: skip
        evaluate_model(
            adapter, stream, factors=cfg.factors, stride=cfg.stride, max_tokens=cfg.max_tokens, samples=cfg.samples,
            schemes=cfg.schemes, sweep_factors=cfg.sweep_factors, equal_cost=cfg.equal_cost,
            batch_tokens=cfg.batch_tokens, progress=cfg.progress, on_row=on_row,
        )  # fmt: skip
    print()
    print(format_table(rows))
    if out is not None:
        for p in write_results(rows, out):
            print(f"wrote {p}")
    return rows


def _main(args: argparse.Namespace) -> int:
    return run_command(args, EvalConfig, run_eval)


def register_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``plsh eval`` to the ``plsh`` command line."""
    p = sub.add_parser(
        "eval",
        help="sliding-window perplexity at 1x-16x the training length; positional-LSH sweep vs windowed ALiBi",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    add_arguments(p, EvalConfig)
    p.set_defaults(func=_main)


def main(argv: Sequence[str] | None = None) -> int:
    """``plsh eval ARGS`` as a function (``argv``: the arguments after ``eval``; default ``sys.argv[1:]``).

    It is :func:`positional_lsh.cli.main` with ``eval`` in front: the same parser and the same error handling.
    """
    return plsh_main(["eval", *(sys.argv[1:] if argv is None else argv)])
