"""The data of ``plsh train-hf`` (:mod:`positional_lsh.integrations.hf.train`): the training splits (a
:func:`positional_lsh.lm.data.load_splits` source or a ``datasets`` folder, with a Hub probe for ``hf:`` sources
offline), the run's tokenizer (the checkpoint's, ``--tokenizer``'s or a BPE trained on the training split) and the
encoded token streams."""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from positional_lsh.integrations.hf_train_config import HFTrainConfig
from positional_lsh.lm import data as D
from positional_lsh.lm.eval_models import encode_with_hf_tokenizer
from positional_lsh.lm.train_config import default_cache_dir
from positional_lsh.lm.train_dist import Dist
from positional_lsh.ops.errors import UserError


def load_training_splits(source: str | None) -> dict[str, list[D.Document]]:
    """Train/validation/test documents: :func:`positional_lsh.lm.data.load_splits`, or a ``datasets`` folder
    (``save_to_disk``; a ``DatasetDict`` with train/validation (or valid)/test, or one ``Dataset`` split 90/5/5
    by document) whose ``text`` column holds the documents."""
    if isinstance(source, str) and source.startswith("hf:") and hub_offline():
        return _hub_data_offline(source)
    p = Path(source) if isinstance(source, str) and not source.startswith("hf:") and source != "default" else None
    if p is None or not p.is_dir() or not any((p / f).is_file() for f in ("dataset_dict.json", "state.json")):
        return D.load_splits(source)
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"--data {source} is a datasets folder: reading it needs the optional 'datasets' "
                          "package (pip install 'positional-lsh[data]')") from exc  # fmt: skip
    ds = datasets.load_from_disk(str(p))

    def docs(part: Any, split: str) -> list[D.Document]:
        if "text" not in part.column_names:
            raise UserError(f"--data {source}: split {split!r} has no 'text' column (columns: {part.column_names})")
        rows = [t for t in part["text"] if isinstance(t, str) and t.strip()]
        if not rows:
            raise UserError(f"--data {source}: split {split!r} holds no text")
        return [D.Document(title=f"{p.name}:{split} #{i}", text=t, source=str(p), id=f"{p.name}:{split} #{i}",
                           split=split) for i, t in enumerate(rows)]  # fmt: skip

    if isinstance(ds, datasets.DatasetDict):
        names = {"train": "train", "validation": "validation" if "validation" in ds else "valid", "test": "test"}
        missing = [v for v in names.values() if v not in ds]
        if missing:
            raise UserError(f"--data {source}: the dataset has splits {sorted(ds)}, not {missing}")
        return {s: docs(ds[v], s) for s, v in names.items()}
    return D.split_documents(docs(ds, "all"))


_TRUE = ("1", "ON", "YES", "TRUE")


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub (``HF_ENDPOINT``, default ``huggingface.co``) accepts a TCP connection within
    ``timeout`` seconds; no request is sent."""
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is set, or the Hub cannot be reached (:func:`hub_reachable`)."""
    if any(os.environ.get(k, "").upper() in _TRUE for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True
    return not hub_reachable()


def _hub_data_offline(source: str) -> dict[str, list[D.Document]]:
    """``--data hf:...`` without the Hub: the ``datasets`` cache only (offline mode, so no retries), else one line
    saying what is needed and how to give a local copy."""
    try:
        import datasets.config as datasets_config
        from huggingface_hub import constants as hub_constants
    except ImportError:
        return D.load_splits(source)  # the missing package is said there
    saved = (datasets_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets_config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        return D.load_splits(source)
    except (OSError, ValueError, RuntimeError):
        path, _, name = source[3:].partition(":")
        load = f"datasets.load_dataset({path!r}" + (f", {name!r})" if name else ")")
        raise UserError(
            f"--data {source}: the Hugging Face Hub cannot be reached (offline) and the dataset is not in "
            f"the local datasets cache; run {load} once where online (then HF_HUB_OFFLINE=1 uses the "
            "cache), or pass --data FOLDER: a save_to_disk folder of it, or text files"
        ) from None
    finally:
        datasets_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


@dataclass
class TrainTokenizer:
    """A tokenizer for training: this library's BPE (cached encoding) or a transformers tokenizer."""

    bpe: D.BPETokenizer | None
    hf: Any | None

    @property
    def size(self) -> int:
        return self.bpe.vocab_size if self.bpe is not None else len(self.hf)  # type: ignore[arg-type]

    def fingerprint(self) -> str:
        if self.bpe is not None:
            return self.bpe.fingerprint
        assert self.hf is not None
        return hashlib.sha256(self.hf.backend_tokenizer.to_str().encode()).hexdigest()

    def as_transformers(self) -> Any:
        """A transformers fast tokenizer (ours wrapped, with its end-of-document token as EOS)."""
        if self.hf is not None:
            return self.hf
        from transformers import PreTrainedTokenizerFast

        assert self.bpe is not None
        return PreTrainedTokenizerFast(tokenizer_object=self.bpe.backend, eos_token=D.EOD_TOKEN)


def load_tokenizer_arg(path: str) -> TrainTokenizer:
    """``--tokenizer``: a ``tokenizer.json`` of this library (or a folder holding one), or a transformers folder."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return TrainTokenizer(None, AutoTokenizer.from_pretrained(str(p), local_files_only=True))
    try:
        return TrainTokenizer(D.BPETokenizer.load(p if p.is_file() else p / "tokenizer.json"), None)
    except (OSError, ValueError) as exc:
        raise UserError(f"--tokenizer {path}: not a tokenizer.json or a transformers tokenizer folder "
                        f"({str(exc).splitlines()[0][:120]})") from None  # fmt: skip


def run_tokenizer(cfg: HFTrainConfig, out: Path, info: Dist, splits: dict[str, list[D.Document]],
                  checkpoint_tok: Any, *, resume: bool) -> tuple[TrainTokenizer, bool]:  # fmt: skip
    """The run's tokenizer and whether it is new (to be saved as ``--out``'s ``tokenizer.json`` once every check
    has passed: nothing is written here). A ``tokenizer.json`` already in ``--out`` is reused on resume; in a new
    run it is reused when its size is ``vocab_size`` and refused otherwise (a stale one, not the one asked for)."""
    if cfg.tokenizer:
        return load_tokenizer_arg(cfg.tokenizer), False
    if checkpoint_tok is not None:
        return TrainTokenizer(None, checkpoint_tok), False
    if cfg.checkpoint is not None:
        raise UserError(f"--checkpoint {cfg.checkpoint} has no tokenizer files; pass --tokenizer")
    saved = out / "tokenizer.json"
    if saved.is_file():
        try:
            bpe = D.BPETokenizer.load(saved)
        except (OSError, ValueError) as exc:
            raise UserError(f"{saved}: not a tokenizer.json ({str(exc).splitlines()[0][:120]}); remove it") from None
        if not resume:
            check_prepared_tokenizer(saved, bpe.vocab_size, cfg.vocab_size)
        return TrainTokenizer(bpe, None), False
    text: list[str | None] = [None]
    if info.main:
        text[0] = D.train_tokenizer(splits["train"], vocab_size=cfg.vocab_size).to_str()
    if info.enabled:  # every process uses rank 0's tokenizer (nothing is on disk yet)
        import torch.distributed as dist

        dist.broadcast_object_list(text, src=0)
    assert text[0] is not None
    return TrainTokenizer(D.BPETokenizer.from_str(text[0]), None), True


def check_prepared_tokenizer(path: Path, size: int, vocab_size: int) -> None:
    """Refuse a ``tokenizer.json`` found in a new run's ``--out`` whose size is not the ``--vocab-size`` asked for
    (e.g. left by an earlier attempt): one line naming the file and both sizes."""
    if size != vocab_size:
        raise UserError(f"{path} holds a {size}-token tokenizer but --vocab-size is {vocab_size}; remove the file to "
                        f"train a new one, or pass --vocab-size {size} to use it")  # fmt: skip


def token_streams(
    tok: TrainTokenizer, splits: dict[str, list[D.Document]], cfg: HFTrainConfig
) -> dict[str, torch.Tensor]:
    parts = {"train": splits["train"], "validation": splits["validation"]}
    if tok.bpe is not None:
        cache = None if cfg.cache_dir == "" else Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        return D.encode_splits(tok.bpe, parts, cache_dir=cache)
    return {k: encode_with_hf_tokenizer(tok.hf, v) for k, v in parts.items()}
