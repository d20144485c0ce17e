"""``plsh eval``: sliding-window perplexity at and beyond the training length, and the positional-LSH sweep.

The command line of :mod:`positional_lsh.lm.evaluate`: :class:`EvalConfig` holds the settings (its parser is
generated from it), :func:`run_eval` loads every checkpoint named, evaluates it (loss, perplexity, bits per token,
top-1/top-10 accuracy, mean reciprocal rank, mean predictive entropy, loss by position within the window), prints
the rows as they come and writes ``results.csv``, ``loss_by_position.csv``, ``results.md`` and the plots
(``extrapolation.png``, ``sweep.png``, ``loss_by_position.png``) into ``--out``. A checkpoint trained with
``--learn-slopes`` also has its learned slopes printed (a table per layer and head) and written to ``slopes.csv``
(and ``results.md``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from positional_lsh.cli import command_main
from positional_lsh.cli.parsers import (
    MIN_SIGMA,
    add_command,
    comma_list,
    option,
    positive_float_text,
    positive_int_text,
    sigma_text,
)
from positional_lsh.lm.eval_models import HF_POSITION_CHOICES, HFAttention, load_for_eval
from positional_lsh.lm.eval_results import EvalRow, LearnedSlopes, format_slopes, format_table, write_results
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
from positional_lsh.ops.attention import check_call_size
from positional_lsh.ops.checks import nonnegative_int, positive_int
from positional_lsh.ops.partitions.schemes import get_scheme

__all__ = ["EvalConfig", "main", "register_cli", "run_eval"]


def _stride_text(text: str) -> int | str:
    """``"window"`` or a positive integer."""
    if text == "window":
        return text
    try:
        return positive_int_text(text)
    except ValueError:
        raise ValueError(f"expected 'window' or a positive integer, got {text!r}") from None


def _sigma_text(text: str) -> float:
    """A finite ``--sigma`` in :func:`~positional_lsh.cli.parsers.sigma_text`'s range."""
    value = sigma_text(text)
    if value == float("inf"):
        raise ValueError(f"--sigma must be a finite number >= {MIN_SIGMA:g}, got {text!r}")
    return value


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
    train_len: int | None = option(
        None, "training length (default: the one saved with the swap, a plsh train-hf run's seq_len, or the config's)"
    )
    tokenizer: str | None = option(None, "tokenizer.json to encode the data with (instead of the checkpoint's)")
    position: str = option(
        "saved", "transformers checkpoints: their own attention is the swap saved with them (saved; else native), the "
        "model's own (native), or alibi, window-alibi, plsh", choices=HF_POSITION_CHOICES,
    )  # fmt: skip
    num_samples: int | None = option(None, "--position plsh: T (default: the saved swap's, else 16)",
                                     parse=positive_int_text)  # fmt: skip
    scheme: str | None = option(None, "--position plsh: the scheme (default: the saved swap's, else discrete)",
                                parse=_scheme_text)  # fmt: skip
    sigma: float | None = option(None, "--position alibi/window-alibi/plsh: one slope 1/sigma for every head "
                                 "(default: the saved swap's, the model's own, or the ALiBi schedule)",
                                 parse=_sigma_text)  # fmt: skip
    slopes: tuple[float, ...] | None = option(
        None, "--position alibi/window-alibi/plsh: one slope per head, comma-separated (instead of --sigma)",
        parse=comma_list(float),
    )  # fmt: skip
    window: float | None = option(None, "--position window-alibi: the largest kept distance in tokens",
                                  parse=positive_float_text)  # fmt: skip
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
        nonnegative_int("eval_seed", self.eval_seed)
        for name in ("max_tokens", "train_len", "threads"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        self.attention().check()  # bad --position settings are refused before any work
        if self.num_samples is not None:  # the own attention's T: a lower bound too (one head, one query)
            check_call_size(self.num_samples, 1, 1, 1, 64, True, "auto", what=f"--num-samples {self.num_samples}")
        for t in self.samples:  # a lower bound (one head, one query) before anything is loaded; run_eval checks more
            check_call_size(t, 1, 1, 1, 64, True, "auto", what=f"--samples {t}")

    def attention(self) -> HFAttention:
        """How transformers checkpoints are scored (``--position`` and its settings)."""
        return HFAttention(self.position, self.num_samples, self.scheme, self.sigma, self.slopes, self.window)


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
    slopes: list[LearnedSlopes] = []

    def on_row(r: EvalRow) -> None:
        rows.append(r)
        print(
            f"{r.model} | {r.attention} | L={r.eval_len} ({r.factor:g}x) | loss {r.loss:.4f} ppl {r.ppl:.2f} "
            f"mrr {r.mrr:.3f} entropy {r.entropy:.3f} top1 {r.top1:.3f} top10 {r.top10:.3f} | {r.seconds:.0f} s",
            flush=True,
        )
        if out is not None:  # keep partial results of long evaluations
            write_results(rows, out, plots=False, slopes=slopes)

    for path, label in zip(paths, labels, strict=True):
        adapter, stream = load_for_eval(
            path, label=label, data=cfg.data, split=cfg.split, train_len=cfg.train_len, tokenizer=cfg.tokenizer,
            cache_dir=cache, seed=cfg.eval_seed, device=device, attention=cfg.attention(),
        )  # fmt: skip
        learned = getattr(adapter, "learned", None)
        if learned is not None:  # a model trained with learned slopes: show them (slopes.csv with --out)
            slopes.append(learned)
            print(format_slopes(learned), flush=True)
        check_something_to_score(adapter.train_len, cfg.factors, stream.numel(), cfg.max_tokens,
                                 what=f"{cfg.split} split")  # fmt: skip
        _check_sweep_size(cfg, adapter)
        evaluate_model(
            adapter, stream, factors=cfg.factors, stride=cfg.stride, max_tokens=cfg.max_tokens, samples=cfg.samples,
            schemes=cfg.schemes, sweep_factors=cfg.sweep_factors, equal_cost=cfg.equal_cost,
            batch_tokens=cfg.batch_tokens, progress=cfg.progress, on_row=on_row,
        )  # fmt: skip
    print()
    print(format_table(rows))
    if out is not None:
        for p in write_results(rows, out, slopes=slopes):
            print(f"wrote {p}")
    return rows


def _check_sweep_size(cfg: EvalConfig, adapter: Any) -> None:
    """Every sweep call (``--samples`` at every ``--sweep-factors`` length, the model's heads) checked as
    ``plsh_attention`` checks one call (memory and time, with the estimate), before any scoring."""
    if not getattr(adapter, "sweepable", True):
        return
    heads = getattr(adapter, "num_heads", None) or (1 if adapter.slopes is None else int(adapter.slopes.numel()))
    for f in cfg.sweep_factors or cfg.factors:
        n = max(1, round(f * adapter.train_len))
        for t in cfg.samples:
            check_call_size(t, heads, n, n, 64, True, "auto", what=f"--samples {t} at {n} tokens ({heads} heads)")


def register_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``plsh eval`` to the ``plsh`` command line."""
    help = "sliding-window perplexity at 1x-16x the training length; positional-LSH sweep vs windowed ALiBi"
    add_command(sub, "eval", EvalConfig, run_eval, help=help, doc=__doc__)


def main(argv: Sequence[str] | None = None) -> int:
    """``plsh eval ARGS`` as a function (``argv``: the arguments after ``eval``; default ``sys.argv[1:]``).

    It is :func:`positional_lsh.cli.main` with ``eval`` in front: the same parser and the same error handling.
    """
    return command_main("eval", argv)
