"""The swap's settings saved next to a model's weights: ``positional_lsh_swap.json``.

A swapped model's ``save_pretrained`` (and a ``PeftModel``'s, and ``plsh train-hf``'s checkpoints) write
:data:`SWAP_FILE` beside ``config.json``: the position mode (``plsh``, ``alibi``, ``window-alibi``), ``T``, the
scheme, the seed, the slopes and windows (float64, exact in JSON), the training step and, when known, the training
length. :func:`~positional_lsh.integrations.hf.load_local_model` re-applies it (and says so in one line); a plain
``from_pretrained`` does not (transformers knows nothing of it): ``hf.apply_saved_swap(model, folder)`` does.

Only settings of the model are re-applied: ``backend`` and ``method`` are recorded but are choices of how to compute
(every method gives the same result), so a re-applied swap uses the defaults (``"auto"``) and runs on any device.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from positional_lsh.integrations.hf.attention_swap import AttentionSwap
from positional_lsh.ops.errors import UserError
from positional_lsh.ops.partitions.schemes import scheme_names

SWAP_FILE = "positional_lsh_swap.json"
"""The file, next to a checkpoint's ``config.json``, holding the swap's settings."""
CONFIG_KEY = "positional_lsh_swap"
"""The ``config.json`` key (a config attribute) under which a swapped model's ``save_pretrained`` also records the
swap's settings, so that ``from_pretrained(folder, attn_implementation="positional_lsh")`` re-installs it."""
SWAP_FORMAT = "positional-lsh-swap"
_POSITIONS = ("plsh", "alibi", "window-alibi")
MAX_NUM_SAMPLES = 2**20
"""The largest ``num_samples`` a saved swap may hold (larger values are refused before anything is allocated)."""
MAX_STEP = 2**63 - 1
"""The largest training step (an int64 counter)."""
MAX_SEED = 2**64 - 1
"""The largest seed (a ``torch.Generator`` seed)."""


def swap_position(swap: AttentionSwap) -> str:
    """``"plsh"``, ``"alibi"`` (exact) or ``"window-alibi"`` (``use_alibi`` with a window)."""
    if swap.mode == "plsh":
        return "plsh"
    return "alibi" if swap.window is None else "window-alibi"


def swap_settings(swap: AttentionSwap, **extra: Any) -> dict[str, Any]:
    """The JSON-ready settings of ``swap`` (``extra``: more fields, e.g. ``train_len``)."""
    if not isinstance(swap, AttentionSwap):
        raise TypeError(f"swap must be an AttentionSwap, got {type(swap).__name__}")
    out: dict[str, Any] = {
        "format": SWAP_FORMAT,
        "version": 1,
        "position": swap_position(swap),
        "family": swap.family,
        "slopes": [float(s) for s in swap.slopes.tolist()],
        "window": None if swap.window is None else [float(w) for w in swap.window.tolist()],
        "num_samples": swap.num_samples,
        "scheme": swap.scheme,
        "seed": swap.seed,
        "resample_in_training": swap.resample_in_training,
        "step": swap.step,
        "backend": swap.backend,
        "method": swap.method,
    }
    out.update(extra)
    return out


def write_swap_settings(swap: AttentionSwap, folder: str | os.PathLike[str], **extra: Any) -> Path:
    """Write :data:`SWAP_FILE` into ``folder`` (through a temporary name); returns its path."""
    path = Path(folder) / SWAP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(swap_settings(swap, **extra), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _check_integer(file: object, name: str, value: object, low: int, high: int) -> None:
    """``UserError`` naming ``file`` and the field unless ``value`` is an int in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{file}: {name!r} must be an integer in [{low}, {high}], got {value!r:.40}")


def _numbers(file: object, name: str, value: object, *, positive: bool) -> list[float]:
    if not isinstance(value, list) or not value or any(isinstance(v, bool) or not isinstance(v, int | float)
                                                       for v in value):  # fmt: skip
        raise UserError(f"{file}: {name!r} must be a non-empty list of numbers, got {value!r:.80}")
    out = [float(v) for v in value]
    if any(not math.isfinite(v) for v in out) or any(v < 0 or (positive and v == 0) for v in out):
        raise UserError(f"{file}: {name!r} must hold finite numbers {'> 0' if positive else '>= 0'}, "
                        f"got {value!r:.80}")  # fmt: skip
    return out


def read_swap_settings(folder: str | os.PathLike[str], *, family: str | None = None) -> dict[str, Any] | None:
    """The settings saved in ``folder`` (``None`` if it holds no :data:`SWAP_FILE`), checked.

    Raises :class:`~positional_lsh.ops.errors.UserError` naming the file when it is not a file, not JSON, not of
    this format, holds a bad field, or (``family`` given) records another model family than ``family``.
    """
    file = Path(folder) / SWAP_FILE
    if file.exists() and not file.is_file():
        raise UserError(f"{file} is not a file (a {SWAP_FORMAT} file is expected there); remove it to load the "
                        "model with its own attention")  # fmt: skip
    if not file.is_file():
        return None
    try:
        s = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{file} is not valid JSON ({exc}); delete it to load the model with its own "
                        "attention") from None  # fmt: skip
    return check_swap_settings(s, file, family=family)


def read_saved_swap(folder: str | os.PathLike[str], *, family: str | None = None) -> tuple[dict[str, Any], str] | None:
    """The swap saved with the checkpoint in ``folder``, checked, and where it was read; ``None`` if none.

    A swapped model's ``save_pretrained`` records it twice: :data:`SWAP_FILE` (read first: ``plsh train-hf`` adds
    its training length there) and the :data:`CONFIG_KEY` of ``config.json`` (read when the folder has no
    :data:`SWAP_FILE`, e.g. a model loaded with ``attn_implementation="positional_lsh"`` and saved before its first
    call). Errors as :func:`read_swap_settings`, naming the file (and the key).
    """
    settings = read_swap_settings(folder, family=family)
    if settings is not None:
        return settings, str(Path(folder) / SWAP_FILE)
    file = Path(folder) / "config.json"
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # (no config.json, or one transformers refuses when it loads it)
    if not isinstance(record, dict) or record.get(CONFIG_KEY) is None:
        return None
    where = f"{file} ['{CONFIG_KEY}']"
    return check_swap_settings(record[CONFIG_KEY], where, family=family), where


def check_swap_settings(s: object, file: object, *, family: str | None = None) -> dict[str, Any]:
    """``s`` checked as saved swap settings (``file``: where they were read, named in every error); ``family``:
    the family of the model they are for (``UserError`` naming both when the settings record another)."""
    if not isinstance(s, dict) or s.get("format") != SWAP_FORMAT:
        raise UserError(f"{file} is not a {SWAP_FORMAT} file")
    s = dict(s)
    if s.get("version") != 1:
        raise UserError(f"{file}: version {s.get('version')!r} is not supported (this library writes version 1)")
    if s.get("position") not in _POSITIONS:
        raise UserError(f"{file}: 'position' must be one of {list(_POSITIONS)}, got {s.get('position')!r}")
    s["slopes"] = _numbers(file, "slopes", s.get("slopes"), positive=False)
    if s["position"] == "window-alibi":
        s["window"] = _numbers(file, "window", s.get("window"), positive=False)
    elif s.get("window") is not None:
        raise UserError(f"{file}: 'window' must be null for position {s['position']!r}")
    _check_integer(file, "step", s.get("step", 0), 0, MAX_STEP)
    if s["position"] == "plsh":
        _check_integer(file, "num_samples", s.get("num_samples"), 1, MAX_NUM_SAMPLES)
        _check_integer(file, "seed", s.get("seed"), 0, MAX_SEED)
        schemes = scheme_names()
        if not isinstance(s.get("scheme"), str) or s["scheme"] not in schemes:
            raise UserError(f"{file}: 'scheme' must be one of {list(schemes)}, got {s.get('scheme')!r}")
        if not isinstance(s.get("resample_in_training", True), bool):
            raise UserError(f"{file}: 'resample_in_training' must be true or false")
    recorded = s.get("family")
    if family is not None and recorded is not None and recorded != family:
        raise UserError(f"{file} records a swap for a {recorded!r} model, but this model is {family!r}: it was saved "
                        "for another model; remove it (or copy the right one) to load this model")  # fmt: skip
    train_len = s.get("train_len")
    if train_len is not None and (isinstance(train_len, bool) or not isinstance(train_len, int) or train_len < 1):
        raise UserError(f"{file}: 'train_len' must be a positive integer, got {train_len!r}")
    return s


def _slopes_text(slopes: list[float], brief: bool) -> str:
    if len(set(slopes)) == 1:
        s = slopes[0]
        if brief:
            return f"sigma {1 / s:g}" if s > 0 else "slope 0"
        return f"sigma {1 / s:g} (slope {s:g}) for every head" if s > 0 else "slope 0 for every head"
    return f"{len(slopes)} per-head slopes {slopes[0]:.3g}..{slopes[-1]:.3g}"


def describe_swap_settings(settings: dict[str, Any], *, brief: bool = False) -> str:
    """One line: the position mode and its settings (``plsh T=16 discrete, seed 0, sigma 256 ..., step 120``);
    ``brief``: without the seed, the step and the slope (``plsh T=16 discrete, sigma 256``)."""
    pos = settings["position"]
    slopes = _slopes_text(list(settings["slopes"]), brief)
    if pos == "plsh":
        if brief:
            return f"plsh T={settings['num_samples']} {settings['scheme']}, {slopes}"
        text = f"plsh T={settings['num_samples']} {settings['scheme']}, seed {settings['seed']}, {slopes}"
        step = settings.get("step", 0)
        return text + f", training step {step} (training forwards: micro-batches, not optimizer steps)"
    if pos == "window-alibi":
        w = list(settings["window"])
        win = f"window {w[0]:g}" if len(set(w)) == 1 else f"per-head windows {w[0]:g}..{w[-1]:g}"
        return f"window-alibi {win}, {slopes}"
    return f"alibi (exact), {slopes}"
