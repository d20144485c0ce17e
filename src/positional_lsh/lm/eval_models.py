"""The models ``plsh eval`` evaluates, behind one interface: this library's checkpoints and transformers ones.

:func:`load_for_eval` loads a checkpoint directory and the evaluation token stream encoded with its tokenizer,
and returns a :class:`ModelAdapter`: next-token logits, and exact ALiBi / positional LSH / windowed ALiBi swapped
into the model's attention and back (:class:`LMAdapter` for :class:`~positional_lsh.lm.model.TransformerLM`,
:class:`HFAdapter` for transformers models through :mod:`positional_lsh.integrations.hf`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from positional_lsh.lm import data as D
from positional_lsh.lm.checkpoint import (
    check_tokenizer_fingerprint,
    is_checkpoint,
    load_checkpoint,
    read_checkpoint_config,
    shipped_checkpoint_path,
)
from positional_lsh.lm.model import TransformerLM

__all__ = ["HFAdapter", "LMAdapter", "ModelAdapter", "load_for_eval"]


class ModelAdapter:
    """A model as :func:`~positional_lsh.lm.evaluate.evaluate_model` sees it: logits and attention swaps.

    Attributes:
        model: the wrapped ``torch.nn.Module``.
        label: its name in tables and plots.
        train_len: its training length (evaluation lengths are multiples of it).
        slopes: its ALiBi slopes ``(H,)``, or ``None`` when it has none (no ALiBi-family variants).
        own: a description of the model's own attention.
        sweepable: exact ALiBi, positional LSH and windowed ALiBi can be swapped in.
    """

    sweepable: bool = False

    def __init__(self, model: Any, label: str, train_len: int, slopes: torch.Tensor | None, own: str) -> None:
        self.model = model
        self.label = label
        self.train_len = train_len
        self.slopes = slopes  # None: no ALiBi-family variants
        self.own = own  # description of the model's own attention

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(b, L, V)`` of ids ``x`` ``(b, L)``."""
        raise NotImplementedError

    def set_attention(self, kind: str, **kw: Any) -> None:
        """Swap in ``kind``: ``"alibi"``, ``"plsh"`` (``samples``, ``scheme``) or ``"window"`` (``window``)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Restore the model's own attention."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are."""
        return next(self.model.parameters()).device


class LMAdapter(ModelAdapter):
    """A :class:`~positional_lsh.lm.model.TransformerLM`: attention swaps through ``set_position``."""

    def __init__(self, model: TransformerLM, label: str) -> None:
        cfg = model.cfg
        alibi_family = cfg.position in ("alibi", "plsh", "window-alibi")
        super().__init__(model, label, cfg.seq_len, cfg.slopes() if alibi_family else None, cfg.describe())
        self._own_cfg = cfg
        self.sweepable = cfg.position in ("alibi", "plsh")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def set_attention(self, kind: str, **kw: Any) -> None:
        keep = {"sigma": self._own_cfg.sigma, "eval_seed": kw.get("eval_seed", self._own_cfg.eval_seed)}
        if kind == "alibi":
            self.model.set_position("alibi", **keep)
        elif kind == "plsh":
            self.model.set_position("plsh", num_samples=kw["samples"], scheme=kw["scheme"], **keep)
        elif kind == "window":
            self.model.set_position("window-alibi", window=[float(w) for w in kw["window"]], **keep)
        else:
            raise ValueError(f"unknown attention kind {kind!r}")

    def reset(self) -> None:
        own = self._own_cfg
        self.model.set_position(
            own.position,
            **{f: getattr(own, f) for f in ("num_samples", "scheme", "sigma", "window", "window_factor", "eval_seed")},
        )


class HFAdapter(ModelAdapter):
    """A transformers causal LM: attention swaps through :mod:`positional_lsh.integrations.hf`."""

    def __init__(self, model: Any, label: str, train_len: int, seed: int) -> None:
        from positional_lsh.integrations import hf

        self.hf = hf
        self.seed = seed
        family = hf.model_family(model)
        slopes = None
        if family in hf.NATIVE_ALIBI_TYPES:
            swap = hf.use_alibi(model)
            slopes = swap.slopes.clone()
            hf.restore(model)
        super().__init__(model, label, train_len, slopes, f"native {model.config.model_type}")
        self.sweepable = slopes is not None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def set_attention(self, kind: str, **kw: Any) -> None:
        if kind == "alibi":
            self.hf.use_alibi(self.model)
        elif kind == "plsh":
            self.hf.use_positional_lsh(self.model, num_samples=kw["samples"], scheme=kw["scheme"], seed=self.seed)
        elif kind == "window":
            self.hf.use_alibi(self.model, window=kw["window"])
        else:
            raise ValueError(f"unknown attention kind {kind!r}")

    def reset(self) -> None:
        self.hf.restore(self.model)


def _hf_train_len(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _encode_hf(tokenizer: Any, docs: Sequence[D.Document]) -> torch.Tensor:
    """A transformers tokenizer's token stream: each document's ids followed by its EOS id (if it has one)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d.text, add_special_tokens=False, verbose=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
    return torch.tensor(ids, dtype=torch.long)


def load_for_eval(
    path: str | os.PathLike[str] | None,
    *,
    label: str | None,
    data: str | None,
    split: str,
    train_len: int | None,
    tokenizer: str | None,
    cache_dir: Path | None,
    seed: int,
    device: torch.device,
) -> tuple[ModelAdapter, torch.Tensor]:
    """Load a model (ours or transformers') and the evaluation token stream encoded with its tokenizer.

    ``path``: a ``plsh train`` checkpoint or a transformers ``save_pretrained`` folder (``None``: the shipped
    model). ``data``: the corpus (default: the checkpoint's training corpus); ``train_len``: overrides the
    model's; ``tokenizer``: a ``tokenizer.json`` to encode with instead of the model's; ``seed``: the seed of
    the evaluation partitions.
    """
    p = shipped_checkpoint_path() if path is None else Path(path)
    name = label or (p.name if path is not None else "shipped alibi-lm")
    if path is None and not is_checkpoint(p):
        raise FileNotFoundError(f"the shipped model is missing from {p}; name a checkpoint directory")
    if is_checkpoint(p):
        ckpt = load_checkpoint(p, device=device, eval_seed=seed)
        tok = D.BPETokenizer.load(tokenizer) if tokenizer else ckpt.tokenizer
        if tokenizer and tok is not None:
            check_tokenizer_fingerprint(tok, read_checkpoint_config(p).get("tokenizer_fingerprint"), where=tokenizer)
        if tok is None:
            raise ValueError(f"checkpoint {p} has no tokenizer.json; pass --tokenizer")
        source = data if data is not None else ckpt.metadata.get("train_config", {}).get("data")
        splits = D.load_splits(source)
        if split not in splits:
            raise ValueError(f"split must be one of {sorted(splits)}, got {split!r}")
        stream = D.encode_splits(tok, {split: splits[split]}, cache_dir=cache_dir)[split]
        adapter: ModelAdapter = LMAdapter(ckpt.model, name)
        if train_len is not None:
            adapter.train_len = train_len
        return adapter, stream
    if p.is_dir() and (p / "config.json").is_file():
        from positional_lsh.integrations import hf

        loaded = hf.load_local_model(p, device=device)
        tl = train_len or _hf_train_len(loaded.model.config)
        if tl is None:
            raise ValueError(f"cannot tell the training length of {p} from its config; pass --train-len")
        splits = D.load_splits(data)
        if split not in splits:
            raise ValueError(f"split must be one of {sorted(splits)}, got {split!r}")
        if tokenizer:
            stream = D.encode_documents(D.BPETokenizer.load(tokenizer), splits[split])
        elif loaded.tokenizer is not None:
            stream = _encode_hf(loaded.tokenizer, splits[split])
        else:
            raise ValueError(f"{p} has no tokenizer files; pass --tokenizer")
        return HFAdapter(loaded.model, name, tl, seed), stream
    raise ValueError(
        f"checkpoint {p} is neither a positional-lsh checkpoint (config.json + model.safetensors written by "
        "plsh train) nor a transformers save_pretrained folder"
    )
