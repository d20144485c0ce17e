"""Loading a local transformers checkpoint (a ``save_pretrained`` folder, or a peft adapter folder), offline.

When the folder holds a saved swap (:data:`~positional_lsh.integrations.hf.saved.SWAP_FILE`, written by a swapped
model's ``save_pretrained`` or by ``plsh train-hf``, or only the
:data:`~positional_lsh.integrations.hf.saved.CONFIG_KEY` of its ``config.json``:
:func:`~positional_lsh.integrations.hf.saved.read_saved_swap`), :func:`load_local_model` re-applies it at its saved
training step and says so in one line on stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from positional_lsh.integrations.hf.autoload import Quiet
from positional_lsh.integrations.hf.saved import (
    check_swap_settings,
    describe_swap_settings,
    read_saved_swap,
)
from positional_lsh.integrations.hf.swap import apply_swap_settings, model_family
from positional_lsh.ops.checks import check_bool
from positional_lsh.ops.errors import UserError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")
ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter folder marker (``PeftModel.save_pretrained``)."""


class LoadedModel(NamedTuple):
    """A local checkpoint: the causal LM (eval mode) and its tokenizer (``None`` if the folder has none)."""

    model: PreTrainedModel
    tokenizer: Any | None


def _resolve_dtype(dtype: object) -> torch.dtype | str | None:
    if dtype is not None and not isinstance(dtype, (torch.dtype, str)):
        raise TypeError(f"dtype must be a torch.dtype, a str or None, got {type(dtype).__name__}")
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (e.g. 'float32', 'bfloat16') or be 'auto', got {dtype!r}")
        return resolved
    return dtype


def adapter_base_path(folder: Path) -> Path:
    """The local base-model folder a peft adapter folder names (``base_model_name_or_path``); ``UserError`` if it
    names none or one that is not a local directory (nothing is downloaded)."""
    file = folder / ADAPTER_CONFIG
    try:
        base = json.loads(file.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise UserError(f"{file} is not a valid peft adapter config ({exc})") from None
    if not isinstance(base, str) or not base:
        raise UserError(f"{file} names no base_model_name_or_path; cannot load the adapter's base model")
    path = Path(base).expanduser()
    if not path.is_absolute() and not path.is_dir():
        path = folder / base
    if not (path / "config.json").is_file():
        raise UserError(f"{file}: base model {base!r} is not a local transformers folder (nothing is downloaded)")
    return path


def load_local_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    apply_swap: bool = True,
    merge_adapter: bool = True,
    quiet: bool = False,
) -> LoadedModel:
    """Load a transformers causal LM (and its tokenizer) from a local folder, never touching the network.

    Args:
        path: folder written by ``save_pretrained`` (``config.json`` plus weights, optionally tokenizer files), or a
            peft adapter folder (``adapter_config.json``; needs peft) whose ``base_model_name_or_path`` is a local
            folder: the base is loaded and the adapter applied.
        dtype: ``torch.float32``, ``"bfloat16"``, ``"auto"`` (the checkpoint's dtype), ... ; default float32.
        device: device to move the model to.
        attn_implementation: passed to ``from_pretrained`` (e.g. ``"eager"``, ``"sdpa"``).
        trust_remote_code: allow custom modeling code stored in the folder.
        apply_swap: re-apply the swap saved in the folder (``positional_lsh_swap.json``, else the
            ``positional_lsh_swap`` key of ``config.json``), at its training step, and
            print one line on stderr saying so (unless ``quiet``). ``False``: the model's own attention.
        merge_adapter: for an adapter folder, merge the adapter into the base weights (``merge_and_unload``) and
            return the plain transformers model; ``False``: the ``PeftModel``.
        quiet: print nothing.

    Returns:
        :class:`LoadedModel` ``(model, tokenizer)``, the model in eval mode (``hf.current_swap(model)`` is the
        re-applied swap, if any). The tokenizer comes from the folder, or for an adapter from its base folder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    apply_swap = check_bool("apply_swap", apply_swap)
    merge_adapter = check_bool("merge_adapter", merge_adapter)
    quiet = check_bool("quiet", quiet)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"path {str(folder)!r} is not a directory (a local transformers checkpoint is needed)")
    adapter = (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file()
    weights_dir = adapter_base_path(folder) if adapter else folder
    if not (weights_dir / "config.json").is_file():
        raise ValueError(f"path {str(folder)!r} has no config.json: not a transformers checkpoint folder")
    dtype = _resolve_dtype(dtype)
    found = read_saved_swap(folder) if apply_swap else None  # checked before anything is loaded
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with Quiet():  # this loader applies (or, apply_swap=False, declines) the saved swap itself
        model: Any = AutoModelForCausalLM.from_pretrained(str(weights_dir), **kwargs)
    if adapter:
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise ImportError(f"{folder} is a peft adapter folder: loading it needs peft (pip install "
                              f"'positional-lsh[peft]'); import failed: {exc}") from exc  # fmt: skip
        model = PeftModel.from_pretrained(model, str(folder), is_trainable=False)
        if merge_adapter:
            model = model.merge_and_unload()
    if device is not None:
        model = model.to(device)
    model.eval()
    if found is not None:
        settings, source = found
        check_swap_settings(settings, source, family=model_family(model))
        # (then attn_implementation="positional_lsh" finds it installed)
        apply_swap_settings(model, settings, source=source)
        if not quiet:
            print(f"positional_lsh: re-applied the swap saved in {source}: "
                  f"{describe_swap_settings(settings)} (hf.restore(model) for the model's own attention)",
                  file=sys.stderr, flush=True)  # fmt: skip
    tokenizer = None
    for tok_dir in dict.fromkeys((folder, weights_dir)):
        if any((tok_dir / name).is_file() for name in _TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(
                str(tok_dir), local_files_only=True, trust_remote_code=trust_remote_code
            )
            break
    return LoadedModel(model, tokenizer)
