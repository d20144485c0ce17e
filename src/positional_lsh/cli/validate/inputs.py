"""``plsh validate``'s inputs: captured Q/K/V of the shipped model or a local checkpoint, or Gaussian ones."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from positional_lsh.cli.validate.settings import ValidateConfig, derive_seed, parse_slope_mode
from positional_lsh.ops.errors import UserError
from positional_lsh.ops.partitions.slopes import alibi_slopes
from positional_lsh.theory.capture import (
    LayerQKV,
    capture_qkv,
    load_model_for_capture,
    model_alibi_slopes,
    synthetic_qkv,
    tokenize_contexts,
)

__all__ = ["Context", "load_contexts", "load_shipped", "slope_sets"]


@dataclass
class Context:
    """One input: its index, its length and the captured Q/K/V of the selected layers."""

    index: int
    seq_len: int
    layers: list[LayerQKV]


def load_shipped() -> tuple[torch.nn.Module, Callable[[str], Sequence[int]], str, dict[str, Any]]:
    """The project's shipped model and corpus: ``(model, encode, text, description)``.

    The model is ``positional_lsh.lm.load_shipped_model()`` (a small ALiBi decoder, captured through its
    fused ``qkv`` projections, see :mod:`positional_lsh.theory.capture`); the text is the longest document of the
    shipped corpus' test split (``positional_lsh.lm.data.corpus_splits()["test"]``), cut into consecutive
    contexts. It is the default source of ``plsh validate``.
    """
    try:
        from positional_lsh.lm.checkpoint import load_shipped_model
        from positional_lsh.lm.data import corpus_splits
    except ImportError as exc:
        raise UserError(
            f"the project's shipped model and corpus are not available ({exc}); use --source synthetic, or "
            "--source checkpoint --checkpoint DIR --text FILE"
        ) from None
    ckpt = load_shipped_model()
    if ckpt.tokenizer is None:
        raise FileNotFoundError("the shipped model has no tokenizer")
    doc = max(corpus_splits()["test"], key=lambda d: len(d.text))
    desc = {
        "source": "shipped model (positional_lsh.lm.load_shipped_model)",
        "position": getattr(ckpt.model.cfg, "position", "?"),
        "text": f"shipped corpus, test split: {doc.title}",
    }
    return ckpt.model, ckpt.tokenizer.encode, doc.text, desc


def _read_text(path: str) -> str:
    """``--text``: a UTF-8 text file (binary or other encodings refused, naming the file, as ``plsh train`` does)."""
    from positional_lsh.lm.data.corpus import read_text_file

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file not found: {p}")
    return read_text_file(p, what="--text")


def load_contexts(cfg: ValidateConfig) -> tuple[list[Context], torch.Tensor | None, float | None, dict[str, Any]]:
    """Contexts with captured Q/K/V, the model's ALiBi slopes (or None), the score scale, and a description."""
    layers = None if cfg.layers is None else list(cfg.layers)
    if cfg.source == "synthetic":
        contexts = []
        for n in cfg.seq_lens:
            for i in range(cfg.num_inputs):
                qkv = synthetic_qkv(
                    cfg.synthetic_layers,
                    cfg.synthetic_heads,
                    n,
                    cfg.synthetic_head_dim,
                    generator=derive_seed(cfg.seed, "synthetic", n, i),
                )
                if layers is not None:
                    keep = {(li if li >= 0 else cfg.synthetic_layers + li) for li in layers}
                    bad = [li for li in layers if not -cfg.synthetic_layers <= li < cfg.synthetic_layers]
                    if bad:
                        raise ValueError(f"layers {bad} out of range for {cfg.synthetic_layers} synthetic layers")
                    qkv = [x for x in qkv if x.layer in keep]
                contexts.append(Context(i, n, qkv))
        desc = {
            "source": "synthetic Gaussian Q/K/V",
            "layers": cfg.synthetic_layers,
            "heads": cfg.synthetic_heads,
            "head_dim": cfg.synthetic_head_dim,
        }
        return contexts, None, None, desc
    if cfg.source == "checkpoint":
        assert cfg.checkpoint is not None and cfg.text is not None
        model, tok = load_model_for_capture(cfg.checkpoint, tokenizer=cfg.tokenizer)
        encode: Callable[[str], Sequence[int]] = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        text = _read_text(cfg.text)
        hf_config: Any = model.config  # a transformers PretrainedConfig: read by name
        desc = {
            "source": "checkpoint",
            "checkpoint": str(cfg.checkpoint),
            "model_type": hf_config.model_type,
            "text": str(cfg.text),
        }
    else:
        model, encode, text, desc = load_shipped()
        if cfg.text:
            text = _read_text(cfg.text)
            desc["text"] = str(cfg.text)
    contexts = []
    for n in cfg.seq_lens:
        ids = tokenize_contexts(encode, text, n, cfg.num_inputs)
        for i in range(cfg.num_inputs):
            contexts.append(Context(i, n, capture_qkv(model, ids[i : i + 1], layers=layers)))
    return contexts, model_alibi_slopes(model), _model_scale(model), desc


def _model_scale(model: torch.nn.Module) -> float | None:
    """The model's own score scale when it is not ``1/sqrt(d)`` (MPT's ``softmax_scale``)."""
    attn = getattr(getattr(model, "config", None), "attn_config", None)
    scale = getattr(attn, "softmax_scale", None)
    return float(scale) if scale is not None else None


def slope_sets(cfg: ValidateConfig, num_heads: int, model_slopes: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The ``(H,)`` float64 slopes of each slope set of ``cfg`` (``"standard"``, ``"model"``, ``"sigma=X"``)."""
    out = {}
    for mode in cfg.slopes:
        kind, sigma = parse_slope_mode(mode)
        if kind == "standard":
            out[mode] = alibi_slopes(num_heads).double()
        elif kind == "model":
            if model_slopes is None:
                raise ValueError("slope set 'model' needs a model with ALiBi (BLOOM, MPT, Falcon alibi=True, ...)")
            if model_slopes.numel() != num_heads:
                raise ValueError(f"the model has {model_slopes.numel()} slopes for {num_heads} heads")
            out[mode] = model_slopes.double()
        else:
            assert sigma is not None
            out[mode] = torch.full((num_heads,), 1.0 / sigma, dtype=torch.float64)
    return out
