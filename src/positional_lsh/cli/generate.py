"""``plsh generate``: continue the text of a prompt file with a model, the new text printed as it comes.

The model is the shipped one (no checkpoint named), a ``plsh train`` checkpoint or run directory, or a transformers
folder or ``plsh train-hf`` run directory (its latest checkpoint, with the swap saved with it), loaded as ``plsh eval``
loads them. Generation is bounded where the model's attention allows it (``plsh`` and windowed ALiBi: only the keys a
later query can reach are kept and the prompt is prefilled in chunks, so memory and the cost of a token do not grow
with the prompt; :meth:`positional_lsh.lm.TransformerLM.generate`, and a swapped transformers model's ``generate``,
docs/hf.md). Greedy unless ``--temperature`` is above 0. Writes nothing to disk.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from positional_lsh.cli import command_main
from positional_lsh.cli.parsers import add_command, option, positive_int_text, seed_text
from positional_lsh.lm.generation import PREFILL_CHUNK
from positional_lsh.lm.train_dist import check_device
from positional_lsh.ops.checks import nonnegative_int, positive_int
from positional_lsh.ops.errors import UserError

__all__ = ["GenerateConfig", "main", "register_cli", "run_generate"]


@dataclass
class GenerateConfig:
    """Settings of ``plsh generate``."""

    checkpoint: tuple[str, ...] = option(
        (),
        "a plsh train checkpoint or run directory, a transformers folder or a plsh train-hf run directory; default: "
        "the shipped model",
        positional=True,
        show_default=False,
    )
    prompt_file: str | None = option(None, "the prompt: a UTF-8 text file (required)")
    max_new_tokens: int = option(64, "tokens to generate", parse=positive_int_text)
    temperature: float = option(0.0, "0: greedy; above 0: sampling at this temperature")
    top_k: int | None = option(None, "sample among the k most likely tokens", parse=positive_int_text)
    seed: int = option(0, "seed of the sampling", parse=seed_text)
    prefill_chunk: int = option(PREFILL_CHUNK, "prompt tokens per chunk of a bounded model's prefill",
                                parse=positive_int_text)  # fmt: skip
    device: str = option("auto", "auto, cpu, cuda ...")
    threads: int | None = option(None, "torch intra-op threads", parse=positive_int_text)

    def __post_init__(self) -> None:
        if len(self.checkpoint) > 1:
            raise ValueError(f"plsh generate takes one checkpoint, got {len(self.checkpoint)}: {list(self.checkpoint)}")
        if self.prompt_file is None:
            raise ValueError("--prompt-file is required: the text file to continue")
        positive_int("max_new_tokens", self.max_new_tokens)
        positive_int("prefill_chunk", self.prefill_chunk)
        nonnegative_int("seed", self.seed)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")


def _read_prompt(path: str) -> str:
    """The prompt file's text; ``UserError`` naming ``--prompt-file`` when it cannot be read or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--prompt-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--prompt-file {path}: cannot read it as UTF-8 text ({exc})") from None
    if not text:
        raise UserError(f"--prompt-file {path}: the file is empty")
    return text


class _Printer:
    """Prints the text of the tokens generated so far as it grows (the whole text decoded each time, so that a
    character split over tokens comes out whole)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, token: torch.Tensor) -> None:
        self.ids.extend(int(t) for t in token.reshape(-1).tolist())
        text = self.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text

    def end(self) -> None:
        text = self.decode(self.ids)
        print(text[len(self.shown) :] if text.startswith(self.shown) else "", flush=True)


class _Streamer:
    """A transformers ``generate`` streamer around :class:`_Printer` (the prompt, put first, is skipped)."""

    def __init__(self, printer: _Printer) -> None:
        self.printer = printer
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.printer(value)

    def end(self) -> None:
        self.printer.end()


def run_generate(cfg: GenerateConfig) -> torch.Tensor:
    """Generate from ``cfg``'s prompt file with its model; prints the new text as it comes; returns the new ids."""
    from positional_lsh.lm.checkpoint import checkpoint_dir, is_checkpoint, load_checkpoint, shipped_checkpoint_path

    assert cfg.prompt_file is not None
    text = _read_prompt(cfg.prompt_file)
    device = check_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    path = Path(cfg.checkpoint[0]) if cfg.checkpoint else shipped_checkpoint_path()
    sampling: dict[str, Any] = {"temperature": cfg.temperature, "top_k": cfg.top_k}
    if is_checkpoint(path):
        ckpt = load_checkpoint(path, device=device)
        if ckpt.tokenizer is None:
            raise UserError(f"{path}: the checkpoint has no tokenizer.json to encode the prompt with")
        ids = _prompt_ids(ckpt.tokenizer.encode(text), cfg.prompt_file, device)
        printer = _Printer(ckpt.tokenizer.decode)
        with torch.no_grad():
            out = ckpt.model.generate(
                ids, cfg.max_new_tokens, **sampling, generator=cfg.seed, prefill_chunk=cfg.prefill_chunk,
                on_token=printer,
            )  # fmt: skip
        printer.end()
        return out[0, ids.shape[1] :]
    folder = checkpoint_dir(path) if path.is_dir() else path
    if not (folder.is_dir() and any((folder / f).is_file() for f in ("config.json", "adapter_config.json"))):
        raise UserError(f"{path}: not a plsh train checkpoint, a transformers folder or a plsh train-hf run directory")
    return _generate_hf(cfg, folder, text, device)


def _prompt_ids(ids: Sequence[int], prompt_file: str, device: torch.device) -> torch.Tensor:
    if not ids:
        raise UserError(f"--prompt-file {prompt_file}: the text encodes to no tokens")
    return torch.tensor([list(ids)], dtype=torch.long, device=device)


def _generate_hf(cfg: GenerateConfig, folder: Path, text: str, device: torch.device) -> torch.Tensor:
    """A transformers model's plain ``generate`` (bounded after its saved swap: docs/hf.md)."""
    from positional_lsh.integrations import hf

    loaded = hf.load_local_model(folder, device=device)
    model: Any = loaded.model  # a transformers model: its generate is read by name
    tok = loaded.tokenizer
    if tok is None:
        raise UserError(f"{folder}: no tokenizer files to encode the prompt with")
    assert cfg.prompt_file is not None
    ids = _prompt_ids(tok(text, add_special_tokens=False)["input_ids"], cfg.prompt_file, device)
    printer = _Printer(lambda t: tok.decode(t, skip_special_tokens=True))
    sample = cfg.temperature > 0
    kwargs: dict[str, Any] = {"do_sample": sample, "prefill_chunk_size": cfg.prefill_chunk, "use_cache": True}
    if sample:
        kwargs.update(temperature=cfg.temperature, top_k=cfg.top_k or 0)
        torch.manual_seed(cfg.seed)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens, min_new_tokens=0,
            streamer=_Streamer(printer), pad_token_id=tok.pad_token_id or tok.eos_token_id or 0, **kwargs,
        )  # fmt: skip
    return out[0, ids.shape[1] :]


def register_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``plsh generate`` to the ``plsh`` command line."""
    add_command(sub, "generate", GenerateConfig, run_generate, help="continue a prompt file's text with a model",
                doc=__doc__)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """``plsh generate ARGS`` as a function (``argv``: the arguments after ``generate``; default ``sys.argv[1:]``)."""
    return command_main("generate", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
