"""Checkpoints of :class:`~positional_lsh.lm.model.TransformerLM`, and the small model shipped in the package.

A checkpoint is a directory holding ``config.json`` (the :class:`~positional_lsh.lm.config.ModelConfig` and
metadata), ``model.safetensors`` (float32, or float16/bfloat16 storage that loads back as float32) and, when a
tokenizer is given, ``tokenizer.json``. :func:`save_checkpoint` writes one, :func:`load_checkpoint` reads one
(optionally changing the position mode, e.g. to evaluate an ALiBi-trained model with positional LSH), and
:func:`load_shipped_model` loads the ALiBi model in ``positional_lsh/lm/checkpoints/alibi-lm``.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from positional_lsh.lm.config import ModelConfig
from positional_lsh.lm.data.tokenizer import BPETokenizer
from positional_lsh.lm.model import TransformerLM

__all__ = [
    "CHECKPOINT_FORMAT",
    "CONFIG_FILE",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "Checkpoint",
    "is_checkpoint",
    "load_checkpoint",
    "load_shipped_model",
    "save_checkpoint",
    "shipped_checkpoint_path",
]

CHECKPOINT_FORMAT = "positional-lsh-lm"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"

_SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Checkpoint(NamedTuple):
    """A loaded checkpoint: the model (eval mode), its tokenizer (``None`` if absent) and the metadata."""

    model: TransformerLM
    tokenizer: BPETokenizer | None
    metadata: dict[str, Any]


def _as_dir(name: str, value: object) -> Path:
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name} must be a str or os.PathLike path, got {type(value).__name__}")
    return Path(value)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: TransformerLM,
    tokenizer: BPETokenizer | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and (if given) ``tokenizer.json`` into directory ``path``.

    ``dtype``: storage dtype of the weights, ``"float32"``, ``"float16"`` or ``"bfloat16"`` (loading always
    restores float32). ``metadata`` (JSON-serializable) is stored in ``config.json`` under ``"metadata"``.
    Files are written to temporary names and renamed, so an interrupted save never leaves a torn checkpoint.
    """
    from safetensors.torch import save_file

    p = _as_dir("path", path)
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if tokenizer is not None and not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"tokenizer must be a BPETokenizer or None, got {type(tokenizer).__name__}")
    dtype = _storage_dtype(dtype)
    if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.cfg.vocab_size}")
    p.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", _SAVE_DTYPES[dtype]).contiguous()
        for k, v in model.state_dict().items()
        if k != "head.weight"  # tied to embed.weight
    }
    tmp = p / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": CHECKPOINT_FORMAT, "dtype": dtype})
    os.replace(tmp, p / WEIGHTS_FILE)
    config = {
        "format": CHECKPOINT_FORMAT,
        "version": 1,
        "model": model.cfg.to_dict(),
        "weights_dtype": dtype,
        "num_params": model.num_params(),
        "tokenizer_fingerprint": None if tokenizer is None else tokenizer.fingerprint,
        "metadata": metadata or {},
    }
    _write_text(p / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        _write_text(p / TOKENIZER_FILE, tokenizer.to_str())
    return p


def _storage_dtype(dtype: object) -> str:
    """The name (``"float32"``, ``"float16"``, ``"bfloat16"``) of a storage dtype given by name or torch dtype."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in _SAVE_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype}")
        return names[dtype]
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
    return str(dtype)


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name and rename it, so an interrupted save leaves no torn file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding one of this library's checkpoints."""
    p = Path(path)
    cfg = p / CONFIG_FILE
    if not (cfg.is_file() and (p / WEIGHTS_FILE).is_file()):
        return False
    try:
        return json.loads(cfg.read_text(encoding="utf-8")).get("format") == CHECKPOINT_FORMAT
    except (OSError, ValueError):
        return False


def load_checkpoint(
    path: str | os.PathLike[str], *, device: torch.device | str | None = None, **overrides: Any
) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint`: float32 model in eval mode, tokenizer, metadata.

    ``overrides`` replace :class:`ModelConfig` fields (e.g. ``position="plsh", num_samples=16`` to evaluate
    an ALiBi-trained model with positional LSH; only settings without weights can change).
    """
    from safetensors.torch import load_file

    p = _as_dir("path", path)
    if not p.is_dir():
        raise ValueError(f"path {p} is not a directory")
    if not (p / CONFIG_FILE).is_file() or not (p / WEIGHTS_FILE).is_file():
        raise ValueError(f"path {p} is not a checkpoint directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads((p / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"path {p}: {CONFIG_FILE} is not a {CHECKPOINT_FORMAT} config (format={config.get('format')})")
    model_cfg = dict(config["model"])
    model_cfg.update(overrides)
    cfg = ModelConfig.from_dict(model_cfg)
    model = TransformerLM(cfg)
    state = {k: v.float() for k, v in load_file(str(p / WEIGHTS_FILE)).items()}
    state["head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True)
    if device is not None:
        model.to(device)
    model.eval()
    tokenizer = BPETokenizer.load(p / TOKENIZER_FILE) if (p / TOKENIZER_FILE).is_file() else None
    meta = dict(config.get("metadata") or {})
    meta.update({"weights_dtype": config.get("weights_dtype"), "num_params": config.get("num_params")})
    return Checkpoint(model, tokenizer, meta)


def shipped_checkpoint_path() -> Path:
    """Directory of the small ALiBi language model shipped inside the package (``lm/checkpoints/alibi-lm``).

    Trained by ``plsh train`` on the shipped corpus; its recipe is ``lm/checkpoints/alibi-lm/RECIPE.md``.
    """
    return Path(str(importlib.resources.files("positional_lsh.lm") / "checkpoints" / "alibi-lm"))


def load_shipped_model(*, device: torch.device | str | None = None, **overrides: Any) -> Checkpoint:
    """Load the shipped model (float32, eval mode) with its tokenizer; ``overrides`` as in :func:`load_checkpoint`
    (e.g. ``position="plsh", num_samples=16``)."""
    path = shipped_checkpoint_path()
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"the shipped model is missing from {path} (a broken installation?)")
    return load_checkpoint(path, device=device, **overrides)
