"""Loading a local transformers checkpoint (a ``save_pretrained`` folder), offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

__all__ = ["LoadedModel", "load_local_model"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


class LoadedModel(NamedTuple):
    """A local checkpoint: the causal LM (eval mode) and its tokenizer (``None`` if the folder has none)."""

    model: PreTrainedModel
    tokenizer: Any | None


def load_local_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a transformers causal LM (and its tokenizer) from a local folder, never touching the network.

    Args:
        path: folder written by ``save_pretrained`` (``config.json`` plus weights, optionally tokenizer files).
        dtype: ``torch.float32``, ``"bfloat16"``, ``"auto"`` (the checkpoint's dtype), ... ; default float32.
        device: device to move the model to.
        attn_implementation: passed to ``from_pretrained`` (e.g. ``"eager"``, ``"sdpa"``); the positional-LSH
            swap is installed afterwards with :func:`use_positional_lsh` / :func:`use_alibi`.
        trust_remote_code: allow custom modeling code stored in the folder.

    Returns:
        :class:`LoadedModel` ``(model, tokenizer)``, the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"path {str(folder)!r} is not a directory (a local transformers checkpoint is needed)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"path {str(folder)!r} has no config.json: not a transformers checkpoint folder")
    if dtype is not None and not isinstance(dtype, (torch.dtype, str)):
        raise TypeError(f"dtype must be a torch.dtype, a str or None, got {type(dtype).__name__}")
    if isinstance(dtype, str) and dtype != "auto":
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (e.g. 'float32', 'bfloat16') or be 'auto', got {dtype!r}")
        dtype = resolved
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer = None
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
    return LoadedModel(model, tokenizer)
