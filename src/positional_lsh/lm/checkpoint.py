"""Checkpoints of :class:`~positional_lsh.lm.model.TransformerLM`, and the small model shipped in the package.

A checkpoint is a directory holding ``config.json`` (the :class:`~positional_lsh.lm.config.ModelConfig` and
metadata), ``model.safetensors`` (float32, or float16/bfloat16 storage that loads back as float32) and, when a
tokenizer is given, ``tokenizer.json``. :func:`save_checkpoint` writes one, :func:`load_checkpoint` reads one
(optionally changing the position mode, e.g. to evaluate an ALiBi-trained model with positional LSH), and
:func:`load_shipped_model` loads the ALiBi model in ``positional_lsh/lm/checkpoints/alibi-lm``.

A ``plsh train`` run directory holds its checkpoints as whole sets: each in a step directory
``steps/step-NNNNNNNN-XXXXXXXX`` that is written completely, then named by the pointer file ``LATEST``
(replaced atomically), so a reader sees the old set or the new one (see docs/reliability.md).
:func:`checkpoint_dir` follows the pointer; every function here accepts a run directory or a plain one.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from positional_lsh.lm.config import ModelConfig
from positional_lsh.lm.data.tokenizer import BPETokenizer
from positional_lsh.lm.model import TransformerLM
from positional_lsh.ops.errors import UserError

CHECKPOINT_FORMAT = "positional-lsh-lm"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
POINTER_FILE = "LATEST"
"""In a ``plsh train`` run directory: names the step directory (``steps/step-...``) of the latest checkpoint."""

_POINTER_RE = re.compile(r"^steps/step-[0-9]{8}-[0-9a-f]{8}$")

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
    restores float32; learned log-slopes are always stored in float32). ``metadata`` (JSON-serializable) is stored
    in ``config.json`` under ``"metadata"``. Files are written to temporary names and renamed, so an interrupted
    save never leaves a torn checkpoint.
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
        # learned log-slopes stay float32: a rounded log-slope moves its slope by up to |log m| / 256 in bfloat16
        k: v.detach().to("cpu", torch.float32 if k.endswith("log_slopes") else _SAVE_DTYPES[dtype]).contiguous()
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


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The directory holding the checkpoint files of ``path``: the step directory named by a run directory's
    ``LATEST`` pointer, or ``path`` itself (a plain checkpoint directory such as the shipped model)."""
    p = Path(path)
    pointer = p / POINTER_FILE
    if not pointer.is_file():
        return p
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{pointer}: unreadable checkpoint pointer ({exc}); delete it to start over") from None
    if not _POINTER_RE.match(name) or not (p / name).is_dir():
        raise UserError(
            f"{pointer} names {name[:80]!r}, which is not a step directory of {p}; restore it or start a new run"
        )
    return p / name


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding one of this library's checkpoints (or a run directory naming one)."""
    try:
        p = checkpoint_dir(path)
    except UserError:
        return True  # a run directory with a broken pointer: loading it says what is wrong
    cfg = p / CONFIG_FILE
    if not (cfg.is_file() and (p / WEIGHTS_FILE).is_file()):
        return False
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # unreadable: loading it says what is wrong (a transformers config would be JSON)
    return isinstance(config, dict) and config.get("format") == CHECKPOINT_FORMAT


def read_checkpoint_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of checkpoint ``path`` (a checkpoint directory, or a run directory), checked.

    Raises :class:`~positional_lsh.ops.errors.UserError` naming the file when it is missing, not JSON or lacks
    the fields of a checkpoint config.
    """
    p = checkpoint_dir(_as_dir("path", path))
    if not p.is_dir():
        raise UserError(f"{p} is not a directory; name a checkpoint directory")
    file = p / CONFIG_FILE
    if not file.is_file() or not (p / WEIGHTS_FILE).is_file():
        raise UserError(f"{p} is not a checkpoint directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{file} is not valid JSON ({exc}); restore it from a copy or retrain") from None
    if not isinstance(config, dict) or config.get("format") != CHECKPOINT_FORMAT:
        got = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise UserError(f"{file} is not a {CHECKPOINT_FORMAT} config (format={got!r})")
    if not isinstance(config.get("model"), dict):
        raise UserError(f"{file} has no 'model' object; restore it from a copy or retrain")
    if not isinstance(config.get("metadata", {}) or {}, dict):
        raise UserError(f"{file}: 'metadata' must be an object")
    return config


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``model.safetensors`` as float32; a corrupt or truncated file is a ``UserError``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return {k: v.float() for k, v in load_file(str(file)).items()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise UserError(f"{file} is corrupt or truncated ({str(exc).splitlines()[0][:120]}); "
                        "restore it from a copy or retrain") from None  # fmt: skip


def _load_tokenizer_checked(p: Path, expected: str | None) -> BPETokenizer | None:
    """The checkpoint's ``tokenizer.json`` (``None`` if absent), refused unless its fingerprint is ``expected``."""
    file = p / TOKENIZER_FILE
    if not file.is_file():
        return None
    try:
        tok = BPETokenizer.load(file)
    except (OSError, ValueError) as exc:
        raise UserError(f"{file} is not a valid tokenizer ({str(exc).splitlines()[0][:120]})") from None
    check_tokenizer_fingerprint(tok, expected, where=str(file))
    return tok


def check_tokenizer_fingerprint(tokenizer: BPETokenizer, expected: str | None, *, where: str) -> None:
    """Refuse (``UserError`` with both fingerprints) a tokenizer other than the one a checkpoint was trained with.

    ``expected``: the checkpoint's ``tokenizer_fingerprint`` (``None``: nothing recorded, nothing checked).
    """
    if expected is not None and tokenizer.fingerprint != expected:
        raise UserError(
            f"{where}: tokenizer fingerprint {tokenizer.fingerprint[:16]}... differs from the checkpoint's "
            f"{expected[:16]}... (the model was trained with another tokenizer); use the checkpoint's tokenizer.json"
        )


def load_checkpoint(
    path: str | os.PathLike[str], *, device: torch.device | str | None = None, **overrides: Any
) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint`: float32 model in eval mode, tokenizer, metadata.

    ``path``: a checkpoint directory or a ``plsh train`` run directory (its latest complete checkpoint).
    ``overrides`` replace :class:`ModelConfig` fields (e.g. ``position="plsh", num_samples=16`` to evaluate
    an ALiBi-trained model with positional LSH; only settings without weights can change: not ``learn_slopes``, nor
    the ``sigma`` of a model that learned its slopes, whose learned slopes are kept). A corrupt, truncated
    or mismatched file, and a tokenizer whose fingerprint differs from the recorded one, raise
    :class:`~positional_lsh.ops.errors.UserError` naming the file.
    """
    config = read_checkpoint_config(path)
    p = checkpoint_dir(path)
    try:
        cfg = ModelConfig.from_dict(dict(config["model"]))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{p / CONFIG_FILE}: bad 'model' settings ({exc}); restore it from a copy or retrain") from None
    if overrides:
        _check_slope_overrides(cfg, overrides, p / CONFIG_FILE)
        cfg = ModelConfig.from_dict({**config["model"], **overrides})
    model = TransformerLM(cfg)
    state = _read_weights(p / WEIGHTS_FILE)
    if "embed.weight" not in state:
        raise UserError(f"{p / WEIGHTS_FILE} holds no embed.weight; it is not this model's weights")
    check_log_slopes(state, p / WEIGHTS_FILE)
    state["head.weight"] = state["embed.weight"]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{p / WEIGHTS_FILE} does not match {p / CONFIG_FILE} "
                        f"({' '.join(str(exc).split())[:160]})") from None  # fmt: skip
    if device is not None:
        model.to(device)
    model.eval()
    tokenizer = _load_tokenizer_checked(p, config.get("tokenizer_fingerprint"))
    meta = dict(config.get("metadata") or {})
    meta.update({"weights_dtype": config.get("weights_dtype"), "num_params": config.get("num_params")})
    return Checkpoint(model, tokenizer, meta)


def check_log_slopes(state: dict[str, Any], where: str | os.PathLike[str]) -> None:
    """Refuse (``UserError`` naming ``where`` and the layer) learned slopes that cannot be: a ``*log_slopes`` tensor
    of the weights ``state`` holding ``nan`` or ``inf``, or a log-slope whose slope ``exp`` overflows float32.

    Such slopes come from a damaged file or a diverged run; they would train on (and score) a broken attention
    silently. :func:`load_checkpoint` and ``plsh train --resume`` check with it.
    """
    for key, value in state.items():
        if not key.endswith("log_slopes") or not isinstance(value, torch.Tensor):
            continue
        v = value.detach().float()
        if not (torch.isfinite(v).all() and torch.isfinite(v.exp()).all()):
            layer = re.search(r"(?:^|\.)(\d+)\.", key)
            name = f"layer {layer.group(1)}" if layer else key
            raise UserError(
                f"{where}: the learned slopes of {name} are not finite (log_slopes {v.flatten().tolist()[:8]}); "
                "the file is damaged or the run diverged: restore it from a copy or retrain"
            )


def _check_slope_overrides(cfg: ModelConfig, overrides: dict[str, Any], where: Path) -> None:
    """Refuse overrides that would silently drop or ignore learned slopes: ``learn_slopes`` is part of the weights
    (the ``log_slopes`` parameters), and the ``sigma`` of a learned-slopes model only set their starting value."""
    if "learn_slopes" in overrides and overrides["learn_slopes"] != cfg.learn_slopes:
        raise UserError(
            f"{where}: learn_slopes={cfg.learn_slopes} is part of the weights (the log_slopes parameters) and cannot "
            f"be overridden to {overrides['learn_slopes']!r}"
        )
    if cfg.learn_slopes and "sigma" in overrides and overrides["sigma"] != cfg.sigma:
        raise UserError(
            f"{where}: the model learned its slopes; sigma={cfg.sigma} only set their starting value and cannot be "
            f"overridden to {overrides['sigma']!r}"
        )


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
