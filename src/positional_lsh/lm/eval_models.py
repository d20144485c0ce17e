"""The models ``plsh eval`` evaluates, behind one interface: this library's checkpoints and transformers ones.

:func:`load_for_eval` loads a checkpoint directory and the evaluation token stream encoded with its tokenizer,
and returns a :class:`ModelAdapter`: next-token logits, and exact ALiBi / positional LSH / windowed ALiBi swapped
into the model's attention and back (:class:`LMAdapter` for :class:`~positional_lsh.lm.model.TransformerLM`,
:class:`HFAdapter` for transformers models through :mod:`positional_lsh.integrations.hf`).

A transformers checkpoint is scored with the swap saved next to its weights (``positional_lsh_swap.json``), or as
``--position`` says (:class:`HFAttention`: ``native``, ``alibi``, ``window-alibi`` or ``plsh``, at a chosen
``sigma`` or per-head slopes); the choice is said in one line on stderr, and a mode that cannot apply is refused.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from positional_lsh.lm import data as D
from positional_lsh.lm.checkpoint import (
    check_tokenizer_fingerprint,
    checkpoint_dir,
    is_checkpoint,
    load_checkpoint,
    read_checkpoint_config,
    shipped_checkpoint_path,
)
from positional_lsh.lm.eval_results import LearnedSlopes
from positional_lsh.lm.model import TransformerLM
from positional_lsh.lm.run_dir import STEPS_DIR, TRAIN_CONFIG_FILE
from positional_lsh.ops.errors import UserError

HF_POSITION_CHOICES = ("saved", "native", "alibi", "window-alibi", "plsh")
"""``plsh eval --position`` values (:class:`HFAttention`)."""


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
    """A :class:`~positional_lsh.lm.model.TransformerLM`: attention swaps through ``set_position``.

    With learned slopes (``cfg.learn_slopes``) every swap keeps each layer's learned slopes; ``slopes`` is then
    the ``(n_layer * n_head,)`` learned slopes of all layers (so that the cost accounting averages over every
    layer's heads) and ``learned`` the :class:`~positional_lsh.lm.eval_results.LearnedSlopes` that ``plsh eval``
    shows; without, ``slopes`` is ``cfg.slopes()`` as always and ``learned`` is ``None``.
    """

    def __init__(self, model: TransformerLM, label: str) -> None:
        cfg = model.cfg
        alibi_family = cfg.position in ("alibi", "plsh", "window-alibi")
        slopes = cfg.slopes() if alibi_family else None
        learned = model.learned_slopes()
        if learned is not None:
            slopes = learned.reshape(-1)
        super().__init__(model, label, cfg.seq_len, slopes, cfg.describe())
        self._own_cfg = cfg
        self.sweepable = cfg.position in ("alibi", "plsh")
        self.num_heads = cfg.n_head
        self.learned = None if learned is None else LearnedSlopes(label, learned.tolist(), cfg.slopes().tolist())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def set_attention(self, kind: str, **kw: Any) -> None:
        keep = {"sigma": self._own_cfg.sigma, "eval_seed": kw.get("eval_seed", self._own_cfg.eval_seed)}
        if kind == "alibi":
            self.model.set_position("alibi", **keep)
        elif kind == "plsh":
            self.model.set_position("plsh", num_samples=kw["samples"], scheme=kw["scheme"], **keep)
        elif kind == "window":
            window = torch.as_tensor(kw["window"], dtype=torch.float64).reshape(-1, self.num_heads)
            self.model.set_position("window-alibi", window=[float(w) for w in window[0]], **keep)
            if window.shape[0] > 1:  # learned slopes: one window per layer and head (reset() undoes it)
                for block, w in zip(self.model.blocks, window, strict=True):
                    block.attn.window = w.clone()
        else:
            raise ValueError(f"unknown attention kind {kind!r}")

    def reset(self) -> None:
        own = self._own_cfg
        self.model.set_position(
            own.position,
            **{f: getattr(own, f) for f in ("num_samples", "scheme", "sigma", "window", "window_factor", "eval_seed")},
        )


@dataclass(frozen=True)
class HFAttention:
    """How ``plsh eval`` scores a transformers checkpoint (``--position`` and its settings).

    Attributes:
        position: ``"saved"`` (the swap saved with the checkpoint, else the model's own attention), ``"native"``
            (the model's own attention; a saved swap is not applied), ``"alibi"``, ``"window-alibi"`` or ``"plsh"``.
        num_samples, scheme: ``T`` and the scheme of ``plsh`` (default: the saved swap's, else 16 and discrete).
        sigma: one slope ``1 / sigma`` for every head; ``slopes``: one per head (default: the saved swap's, the
            model's own ALiBi slopes, or the ALiBi schedule).
        window: ``window-alibi``'s largest kept distance.
    """

    position: str = "saved"
    num_samples: int | None = None
    scheme: str | None = None
    sigma: float | None = None
    slopes: tuple[float, ...] | None = None
    window: float | None = None

    def given(self) -> list[str]:
        """The flags set besides ``--position``."""
        names = {"num_samples": "--num-samples", "scheme": "--scheme", "sigma": "--sigma", "slopes": "--slopes",
                 "window": "--window"}  # fmt: skip
        return [flag for name, flag in names.items() if getattr(self, name) is not None]

    def check(self) -> None:
        """Refuse (``UserError``, one line) settings that cannot apply together."""
        if self.position not in HF_POSITION_CHOICES:
            raise UserError(f"--position must be one of {', '.join(HF_POSITION_CHOICES)}, got {self.position!r}")
        if self.sigma is not None and self.slopes is not None:
            raise UserError("--sigma (one slope 1/sigma for every head) and --slopes (one per head): pass one")
        if self.sigma is not None and not 0 < self.sigma < math.inf:
            raise UserError(f"--sigma must be a finite number > 0, got {self.sigma}")
        if self.slopes is not None and (not self.slopes or not all(0 <= s < math.inf for s in self.slopes)):
            got = ",".join(map(str, self.slopes))
            raise UserError(f"--slopes must be finite numbers >= 0, one per head, got {got!r}")
        if self.window is not None and not 0 <= self.window < math.inf:
            raise UserError(f"--window must be a finite number >= 0, got {self.window}")
        if self.position == "native" and self.given():
            raise UserError(f"--position native scores the model's own attention: {', '.join(self.given())} "
                            "cannot apply (use --position alibi, window-alibi or plsh)")  # fmt: skip
        if self.position in ("alibi", "window-alibi") and (self.num_samples is not None or self.scheme is not None):
            raise UserError(f"--num-samples/--scheme apply to --position plsh, not {self.position}")
        if self.window is not None and self.position != "window-alibi":
            raise UserError("--window applies to --position window-alibi only")
        if self.position == "window-alibi" and self.window is None:
            raise UserError("--position window-alibi needs --window (the largest kept distance in tokens)")


class HFAdapter(ModelAdapter):
    """A transformers causal LM: attention swaps through :mod:`positional_lsh.integrations.hf`.

    ``own``: the swap the model is scored with as its own attention (saved with it, or chosen by ``--position``),
    or ``None`` for the model's own attention. The sweep's swaps are stacked on it and popped after each
    measurement, with the own swap's slopes (or the model's native ALiBi slopes).
    """

    def __init__(self, model: Any, label: str, train_len: int, seed: int, own: Any = None, note: str = "") -> None:
        from positional_lsh.integrations import hf
        from positional_lsh.integrations.hf.saved import describe_swap_settings, swap_settings

        self.hf = hf
        self.seed = seed
        self._top: Any = None
        slopes = None
        if own is not None:
            slopes = own.slopes.clone()
            description = describe_swap_settings(swap_settings(own), brief=True) + note
        else:
            try:
                family = hf.model_family(model)
            except (TypeError, ValueError):
                family = None  # a model the swap does not support (GPT-2, ...): its own attention only, no sweep
            if family in ("bloom", "mpt", "falcon"):
                with hf.use_alibi(model) as swap:
                    slopes = swap.slopes.clone()
            description = f"native {model.config.model_type}"
        super().__init__(model, label, train_len, slopes, description)
        self.sweepable = slopes is not None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits

    def set_attention(self, kind: str, **kw: Any) -> None:
        self.reset()
        if kind == "alibi":
            self._top = self.hf.use_alibi(self.model, slopes=self.slopes)
        elif kind == "plsh":
            self._top = self.hf.use_positional_lsh(self.model, num_samples=kw["samples"], scheme=kw["scheme"],
                                                   seed=self.seed, slopes=self.slopes)  # fmt: skip
        elif kind == "window":
            self._top = self.hf.use_alibi(self.model, window=kw["window"], slopes=self.slopes)
        else:
            raise ValueError(f"unknown attention kind {kind!r}")

    def reset(self) -> None:
        """Pop the sweep's swap: the model's own attention (or its own swap) again."""
        if self._top is not None:
            self._top.restore()
            self._top = None


def _hf_train_len(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def recorded_train_len(path: Path, folder: Path) -> int | None:
    """The ``seq_len`` recorded in the ``train_config.json`` of the ``plsh train-hf`` run that ``path`` names (the
    run directory, or ``folder``, one of its step directories), or ``None`` (no such file, or not a train-hf run)."""
    runs = [path] + ([folder.parent.parent] if folder.parent.name == STEPS_DIR else [])
    for file in (run / TRAIN_CONFIG_FILE for run in runs):
        if not file.is_file():
            continue
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        train = record.get("train") if isinstance(record, dict) and record.get("kind") == "transformers" else None
        seq_len = train.get("seq_len") if isinstance(train, dict) else None
        if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0:
            return seq_len
        return None
    return None


def encode_with_hf_tokenizer(tokenizer: Any, docs: Sequence[D.Document]) -> torch.Tensor:
    """A transformers tokenizer's token stream: each document's ids followed by its EOS id (if it has one)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d.text, add_special_tokens=False, verbose=False)["input_ids"])
        if eos is not None:
            ids.append(int(eos))
    return torch.tensor(ids, dtype=torch.long)


def _apply_position(model: Any, folder: Path, attention: HFAttention, seed: int) -> tuple[Any, dict[str, Any] | None]:
    """Install the attention ``plsh eval`` scores ``model`` with: ``(own swap or None, saved settings or None)``."""
    from positional_lsh.integrations import hf
    from positional_lsh.integrations.hf.saved import CONFIG_KEY, read_saved_swap

    found = read_saved_swap(folder)  # the swap file, else the key of config.json
    saved = None if found is None else found[0]
    pos = attention.position
    if pos == "saved":
        if saved is None:
            if attention.given():
                raise UserError(f"{folder} holds no saved swap ({hf.SWAP_FILE}, or {CONFIG_KEY!r} in its "
                                f"config.json): {', '.join(attention.given())} need --position alibi, window-alibi or "
                                "plsh")  # fmt: skip
            return None, None
        pos = saved["position"]
        if pos != "plsh" and (attention.num_samples is not None or attention.scheme is not None):
            raise UserError(f"the swap saved with {folder} is {pos}: --num-samples/--scheme apply to plsh only")
    if pos == "native":
        return None, saved
    try:
        hf.model_family(model)
    except (TypeError, ValueError) as exc:
        raise UserError(f"--position {pos} cannot apply to {folder}: {exc}") from None
    slopes: Any = None
    if attention.sigma is not None:
        slopes = 1.0 / attention.sigma
    elif attention.slopes is not None:
        slopes = list(attention.slopes)
    elif saved is not None:
        slopes = saved["slopes"]
    if pos == "plsh":
        from_saved = saved is not None and saved["position"] == "plsh"
        swap = hf.use_positional_lsh(
            model,
            num_samples=attention.num_samples or (saved["num_samples"] if from_saved else 16),  # type: ignore[index]
            scheme=attention.scheme or (saved["scheme"] if from_saved else "discrete"),  # type: ignore[index]
            seed=saved["seed"] if from_saved else seed,  # type: ignore[index]
            slopes=slopes,
        )
        if from_saved:
            swap.set_step(saved.get("step", 0))  # type: ignore[union-attr]
        return swap, saved
    window = attention.window if attention.window is not None else (saved or {}).get("window")
    return hf.use_alibi(model, window=window if pos == "window-alibi" else None, slopes=slopes), saved


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
    attention: HFAttention | None = None,
) -> tuple[ModelAdapter, torch.Tensor]:
    """Load a model (ours or transformers') and the evaluation token stream encoded with its tokenizer.

    ``path``: a ``plsh train`` checkpoint, a transformers ``save_pretrained`` folder, a peft adapter folder or a
    ``plsh train-hf`` run directory (``None``: the shipped model). ``data``: the corpus (default: the checkpoint's
    training corpus); ``train_len``: overrides the model's (a transformers checkpoint's default: the training length
    saved with its swap, else the ``seq_len`` of its ``plsh train-hf`` run's ``train_config.json``, else its
    config's ``max_position_embeddings``); ``tokenizer``: a ``tokenizer.json`` to encode with instead of the
    model's; ``seed``: the seed of the evaluation partitions; ``attention``: how a transformers checkpoint is
    scored (:class:`HFAttention`; default: its saved swap, else its own attention), said in one line on stderr.
    """
    attention = attention if attention is not None else HFAttention()
    attention.check()
    p = shipped_checkpoint_path() if path is None else Path(path)
    name = label or (p.name if path is not None else "shipped alibi-lm")
    if path is None and not is_checkpoint(p):
        raise FileNotFoundError(f"the shipped model is missing from {p}; name a checkpoint directory")
    if is_checkpoint(p) and (attention.position != "saved" or attention.given()):
        raise UserError(f"--position and its settings apply to transformers checkpoints; {p} is a plsh train "
                        "checkpoint, scored with its own position mode (and the sweep)")  # fmt: skip
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
    folder = checkpoint_dir(p) if p.is_dir() else p  # a plsh train-hf run directory: its latest checkpoint
    if folder.is_dir() and any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
        from positional_lsh.integrations import hf
        from positional_lsh.integrations.hf.saved import describe_swap_settings, swap_settings

        loaded = hf.load_local_model(folder, device=device, apply_swap=False)
        own, saved = _apply_position(loaded.model, folder, attention, seed)
        if own is not None:
            how = "saved with the checkpoint" if attention.position == "saved" else f"--position {attention.position}"
            print(f"plsh eval: {name}: scoring with {describe_swap_settings(swap_settings(own))} ({how})",
                  file=sys.stderr, flush=True)  # fmt: skip
        elif saved is not None:
            print(f"plsh eval: {name}: scoring the model's own attention (--position native; the swap saved with it, "
                  f"{describe_swap_settings(saved)}, is not applied)", file=sys.stderr, flush=True)  # fmt: skip
        tl = (
            train_len
            or (saved or {}).get("train_len")
            or recorded_train_len(p, folder)
            or _hf_train_len(loaded.model.config)
        )
        if tl is None:
            raise ValueError(f"cannot tell the training length of {p} from its config; pass --train-len")
        splits = D.load_splits(data)
        if split not in splits:
            raise ValueError(f"split must be one of {sorted(splits)}, got {split!r}")
        if tokenizer:
            stream = D.encode_documents(D.BPETokenizer.load(tokenizer), splits[split])
        elif loaded.tokenizer is not None:
            stream = encode_with_hf_tokenizer(loaded.tokenizer, splits[split])
        else:
            raise ValueError(f"{p} has no tokenizer files; pass --tokenizer")
        note = " (saved swap)" if own is not None and attention.position == "saved" else ""
        return HFAdapter(loaded.model, name, tl, seed, own=own, note=note), stream
    raise ValueError(
        f"checkpoint {p} is neither a positional-lsh checkpoint (config.json + model.safetensors written by "
        "plsh train) nor a transformers save_pretrained folder, peft adapter folder or plsh train-hf run"
    )
