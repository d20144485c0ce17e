"""Training transformers models with positional LSH (or exact / windowed ALiBi, or their own attention):
``plsh train-hf``.

The same guarantees as ``plsh train`` (:mod:`positional_lsh.lm.train`), from the same machinery: the run directory
of :mod:`positional_lsh.lm.run_dir` (``train_config.json``, ``log.jsonl``, whole checkpoint sets under
``steps/`` named by ``LATEST``), exact resume (weights of the trained parameters, optimizer, data order, every
random-number state and the swap's training step), SIGINT/SIGTERM stop with a checkpoint
(:class:`~positional_lsh.lm.signals.StopOnSignal`), ``torchrun`` data parallelism
(:mod:`positional_lsh.lm.train_dist`: every process draws the same global batch and the same partitions), and
refusals as one line (:class:`~positional_lsh.ops.errors.UserError`).

* **The model**: from a transformers config (``config``: a ``config.json``, a folder holding one, or a built-in
  name of :data:`BUILTIN_CONFIGS`; random weights from ``seed``), or from a local checkpoint (``checkpoint``: a
  ``save_pretrained`` folder, a peft adapter folder, or a ``plsh train-hf`` run directory) to fine-tune, fully or
  with LoRA (``finetune="lora"``, needs peft).
* **Attention**: ``position`` ``plsh`` (:func:`~positional_lsh.integrations.hf.use_positional_lsh` with
  ``num_samples``, ``scheme``, fresh partitions every step), ``alibi``, ``window-alibi``
  (:func:`~positional_lsh.integrations.hf.use_alibi`) or ``native`` (the model's own); slopes ``sigma`` (one for
  every head: slope ``1 / sigma``) or ``slopes`` (one per head), default the model's own (native ALiBi models) or
  the standard ALiBi schedule.
* **Data**: a :func:`positional_lsh.lm.data.load_splits` source (the shipped corpus, text files, ``hf:PATH``) or a
  folder written by ``datasets``' ``save_to_disk``; windows of ``seq_len + 1`` tokens, as ``plsh train``.
  Tokenizer: the checkpoint's, ``tokenizer`` (a ``tokenizer.json`` or a transformers tokenizer folder), or a
  byte-level BPE trained on the training split (from scratch).
* **Settings**: :class:`~positional_lsh.integrations.hf_train_config.HFTrainConfig` and its presets
  (:mod:`positional_lsh.integrations.hf_train_config`, importable without transformers).
* **Precision**: float32 weights (``dtype``; LoRA bases may be bfloat16) with ``autocast`` bf16/fp16; gradient
  checkpointing (``gradient_checkpointing``).

A checkpoint set holds the model (``save_pretrained``: ``config.json`` + ``model.safetensors``, or the LoRA
adapter), its tokenizer (transformers format), the swap's settings (``positional_lsh_swap.json``, with the step
and the training length) and ``trainer_state.pt``: ``plsh eval RUN_DIR`` and
:func:`~positional_lsh.integrations.hf.load_local_model` load it with its swap. Presets: :data:`PRESETS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from positional_lsh.integrations.hf.loading import ADAPTER_CONFIG, load_local_model
from positional_lsh.integrations.hf.saved import write_swap_settings
from positional_lsh.integrations.hf.swap import current_swap, unwrap_model, use_alibi, use_positional_lsh
from positional_lsh.integrations.hf_train_config import BUILTIN_CONFIGS, PRESETS, HFTrainConfig
from positional_lsh.lm import data as D
from positional_lsh.lm import run_dir as R
from positional_lsh.lm.checkpoint import checkpoint_dir
from positional_lsh.lm.eval_models import encode_with_hf_tokenizer
from positional_lsh.lm.signals import StopOnSignal
from positional_lsh.lm.train import TrainResult
from positional_lsh.lm.train_config import default_cache_dir, lr_at, resolve_autocast_dtype
from positional_lsh.lm.train_dist import Dist, check_device, init_distributed
from positional_lsh.ops.errors import UserError

__all__ = [
    "PRESETS",
    "HFTrainConfig",
    "build_model",
    "load_training_splits",
    "resolve_settings",
    "train_hf",
]

# --------------------------------------------------------------------------------------------------
# Data and tokenizers
# --------------------------------------------------------------------------------------------------


def load_training_splits(source: str | None) -> dict[str, list[D.Document]]:
    """Train/validation/test documents: :func:`positional_lsh.lm.data.load_splits`, or a ``datasets`` folder
    (``save_to_disk``; a ``DatasetDict`` with train/validation (or valid)/test, or one ``Dataset`` split 90/5/5
    by document) whose ``text`` column holds the documents."""
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


@dataclass
class _Tokenizer:
    """A tokenizer for training: this library's BPE (cached encoding) or a transformers tokenizer."""

    bpe: D.BPETokenizer | None
    hf: Any | None

    @property
    def size(self) -> int:
        return self.bpe.vocab_size if self.bpe is not None else len(self.hf)  # type: ignore[arg-type]

    @property
    def eos_id(self) -> int | None:
        return self.bpe.eod_id if self.bpe is not None else getattr(self.hf, "eos_token_id", None)

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


def _load_tokenizer_arg(path: str) -> _Tokenizer:
    """``--tokenizer``: a ``tokenizer.json`` of this library (or a folder holding one), or a transformers folder."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return _Tokenizer(None, AutoTokenizer.from_pretrained(str(p), local_files_only=True))
    try:
        return _Tokenizer(D.BPETokenizer.load(p if p.is_file() else p / "tokenizer.json"), None)
    except (OSError, ValueError) as exc:
        raise UserError(f"--tokenizer {path}: not a tokenizer.json or a transformers tokenizer folder "
                        f"({str(exc).splitlines()[0][:120]})") from None  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


def _config_dict(source: str) -> dict[str, Any]:
    if source in BUILTIN_CONFIGS:
        return dict(BUILTIN_CONFIGS[source])
    p = Path(source).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise UserError(f"--config {source}: no such file, folder with a config.json, or built-in config "
                        f"({', '.join(BUILTIN_CONFIGS)})")  # fmt: skip
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"--config {file}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise UserError(f"--config {file}: not a transformers config (no model_type)")
    return cfg


def _checkpoint_folder(source: str) -> Path:
    p = Path(source).expanduser()
    if not p.is_dir():
        raise UserError(f"--checkpoint {source} is not a directory (a local transformers checkpoint is needed)")
    return checkpoint_dir(p)  # a plsh train-hf run directory: its latest checkpoint


def build_model(cfg: HFTrainConfig, vocab: int | None) -> tuple[nn.Module, Any]:
    """The model to train (swapped, with LoRA adapters for ``finetune="lora"``) and the checkpoint's tokenizer.

    From a config: random weights from ``torch.manual_seed(cfg.seed)``, ``vocab_size`` set to ``vocab`` (the
    tokenizer's). From a checkpoint: its weights (an adapter folder is merged into its base). Deterministic: the
    same settings give the same model, which is how a resumed run rebuilds it before loading its state.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)
    tokenizer = None
    if cfg.config is not None:
        d = _config_dict(cfg.config)
        model_type = d.pop("model_type")
        for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
            d.pop(key, None)
        if vocab is not None:
            d["vocab_size"] = vocab
        try:
            config = AutoConfig.for_model(model_type, **d)
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"--config {cfg.config}: transformers cannot build it ({exc})") from None
        torch.manual_seed(cfg.seed)
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        loaded = load_local_model(_checkpoint_folder(str(cfg.checkpoint)), dtype=dtype, apply_swap=False, quiet=True)
        model, tokenizer = loaded.model, loaded.tokenizer
    model.train()
    for name in ("attention_dropout", "attn_pdrop"):
        if getattr(model.config, name, 0):
            setattr(model.config, name, 0.0)  # attention dropout is not supported by the swap
    if cfg.gradient_checkpointing:
        kwargs = {"use_reentrant": False}  # non-reentrant: works with frozen inputs (LoRA) and DDP
        hf_model: Any = model  # a transformers PreTrainedModel: its methods are untyped here
        if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x
            hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # pragma: no cover - older transformers
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if cfg.finetune == "lora":
        try:
            import peft
        except ImportError as exc:
            raise ImportError("finetune='lora' needs peft: pip install 'positional-lsh[peft]'") from exc
        torch.manual_seed(cfg.seed)
        lcfg = peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                               target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")  # fmt: skip
        try:
            model = peft.get_peft_model(model, lcfg)
        except ValueError as exc:
            msg = " ".join(str(exc).split())[:200]
            raise UserError(f"--lora-targets {','.join(cfg.lora_targets)}: {msg}") from None
        model.peft_config["default"].base_model_name_or_path = str(_checkpoint_folder(str(cfg.checkpoint)).resolve())
    seed = cfg.seed if cfg.partition_seed is None else cfg.partition_seed
    if cfg.position == "plsh":
        use_positional_lsh(model, num_samples=cfg.num_samples, scheme=cfg.scheme, seed=seed, slopes=cfg.slopes_arg(),
                           backend=cfg.attn_backend, method=cfg.plsh_method)  # fmt: skip
    elif cfg.position in ("alibi", "window-alibi"):
        use_alibi(model, window=cfg.window, slopes=cfg.slopes_arg(), backend=cfg.attn_backend)
    return model, tokenizer


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _optimizer(model: nn.Module, cfg: HFTrainConfig, device: torch.device) -> torch.optim.AdamW:
    params = _trainable(model)
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **extra)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    cfg: HFTrainConfig
    out: Path
    info: Dist
    device: torch.device
    command: str
    tok: _Tokenizer
    model: nn.Module
    ddp_model: nn.Module
    opt: torch.optim.AdamW
    data_gen: torch.Generator
    amp: torch.dtype | None
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    tokens_per_step: int
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    val_loss: float | None = None
    last_loss: float = float("nan")


def resolve_settings(cfg: HFTrainConfig, resume: bool, overwrite: bool, changes: dict[str, Any]) -> tuple[
    HFTrainConfig, dict[str, Any] | None
]:  # fmt: skip
    """The settings the run uses (on resume: the saved ones, with the per-job fields of ``cfg`` and ``changes``)
    and the saved trainer state (``None`` for a new run, whose ``out_dir`` is checked or cleared)."""
    out = Path(cfg.out_dir)
    if not resume:
        cfg.validate()
        if cfg.config is not None:  # the model's source exists and reads, before anything on disk changes
            _config_dict(cfg.config)
        else:
            _checkpoint_folder(str(cfg.checkpoint))
        cfg = dataclasses.replace(cfg, threads=cfg.threads or torch.get_num_threads())
        if not overwrite or int(os.environ.get("RANK", "0")) == 0:
            R.prepare_new_run(out, overwrite=overwrite)
        return cfg, None
    saved = R.read_train_config(out)
    if saved.get("kind") != "transformers":
        raise UserError(f"--resume: {out} is a plsh train run, not a plsh train-hf run; resume it with plsh train")
    keep = {k: getattr(cfg, k) for k in ("out_dir", "stop_after", "progress", "device")}
    keep["threads"] = cfg.threads or saved["train"].get("threads")
    try:
        train = dict(saved["train"])
        for key in ("lora_targets", "slopes"):
            if isinstance(train.get(key), list):
                train[key] = tuple(train[key])
        cfg = dataclasses.replace(HFTrainConfig(**train), **keep, **R.check_changes(changes))
        cfg.validate()
    except (TypeError, ValueError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(f"{out / R.TRAIN_CONFIG_FILE}: bad settings ({exc}); the run cannot be resumed") from None
    ckpt = checkpoint_dir(out)
    file = ckpt / R.STATE_FILE
    if not file.is_file():
        raise UserError(f"--resume: {out} holds no checkpoint with a {R.STATE_FILE} to resume from")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a damaged pickle/zip
        msg = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{file} is corrupt or truncated ({msg}); the run cannot be resumed") from None
    need = ("step", "tokens", "elapsed", "val_loss", "trainable", "optimizer", "data_generator", "torch_rng",
            "swap_step", "world_size", "tokenizer_fingerprint")  # fmt: skip
    if not isinstance(state, dict) or any(k not in state for k in need):
        raise UserError(f"{file} is not a trainer state of plsh train-hf (missing fields); the run cannot be resumed")
    if cfg.steps < state["step"]:
        raise UserError(f"--resume: --steps {cfg.steps} is below the checkpoint's step {state['step']}")
    return cfg, state


def train_hf(
    cfg: HFTrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    changes: dict[str, Any] | None = None,
    command: str | None = None,
) -> TrainResult:
    """Train a transformers model; see the module docstring.

    Args:
        cfg: the settings (``cfg.out_dir`` receives the run).
        resume: continue the run in ``cfg.out_dir`` from its latest checkpoint, with its saved settings (of ``cfg``
            only ``stop_after``, ``progress``, ``threads`` and ``device`` apply).
        overwrite: a new run may replace a previous run in ``cfg.out_dir``.
        changes: on resume, saved settings to change (:data:`~positional_lsh.lm.run_dir.RESUME_MAY_CHANGE`).
        command: the command line to record (default ``sys.argv``).

    Returns:
        :class:`~positional_lsh.lm.train.TrainResult`; under ``torchrun`` every process returns it and rank 0 writes.
    """
    if not isinstance(cfg, HFTrainConfig):
        raise TypeError(f"cfg must be an HFTrainConfig, got {type(cfg).__name__}")
    check_device(cfg.device)
    cfg, state = resolve_settings(cfg, resume, overwrite, changes or {})
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    command = command if command is not None else shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    info, device = init_distributed(cfg.device)
    try:
        run = _setup(cfg, state, info, device, command)
        return _loop(run)
    finally:
        if info.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _tokenizer_for(cfg: HFTrainConfig, out: Path, info: Dist, splits: dict[str, list[D.Document]],
                   checkpoint_tok: Any) -> _Tokenizer:  # fmt: skip
    if cfg.tokenizer:
        return _load_tokenizer_arg(cfg.tokenizer)
    if checkpoint_tok is not None:
        return _Tokenizer(None, checkpoint_tok)
    if cfg.checkpoint is not None:
        raise UserError(f"--checkpoint {cfg.checkpoint} has no tokenizer files; pass --tokenizer")
    saved = out / "tokenizer.json"
    if info.main and not saved.is_file():
        D.train_tokenizer(splits["train"], vocab_size=cfg.vocab_size).save(saved)
    info.barrier()
    return _Tokenizer(D.BPETokenizer.load(saved), None)


def _streams(tok: _Tokenizer, splits: dict[str, list[D.Document]], cfg: HFTrainConfig) -> dict[str, torch.Tensor]:
    parts = {"train": splits["train"], "validation": splits["validation"]}
    if tok.bpe is not None:
        cache = None if cfg.cache_dir == "" else Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        return D.encode_splits(tok.bpe, parts, cache_dir=cache)
    return {k: encode_with_hf_tokenizer(tok.hf, v) for k, v in parts.items()}


def _setup(cfg: HFTrainConfig, state: dict[str, Any] | None, info: Dist, device: torch.device, command: str) -> _Run:
    out = Path(cfg.out_dir)
    splits = load_training_splits(cfg.data)
    if info.main:
        out.mkdir(parents=True, exist_ok=True)
    info.barrier()
    checkpoint_tok = None
    if cfg.checkpoint is not None and not cfg.tokenizer:
        folder = _checkpoint_folder(cfg.checkpoint)
        tok_dirs = [folder] + ([Path(json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])]
                               if (folder / ADAPTER_CONFIG).is_file() else [])  # fmt: skip
        for d in tok_dirs:
            if (d / "tokenizer_config.json").is_file() or (d / "tokenizer.json").is_file():
                from transformers import AutoTokenizer

                checkpoint_tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
                break
    tok = _tokenizer_for(cfg, out, info, splits, checkpoint_tok)
    if state is not None and state["tokenizer_fingerprint"] != tok.fingerprint():
        raise UserError(f"--resume: the tokenizer ({cfg.tokenizer or cfg.checkpoint or out / 'tokenizer.json'}) "
                        "differs from the one the run was trained with; restore it")  # fmt: skip
    streams = _streams(tok, splits, cfg)
    for name, s in streams.items():
        if s.numel() < cfg.seq_len + 2:
            raise UserError(f"--data {cfg.data or 'default'}: the {name} split has {s.numel()} tokens, fewer than "
                            f"--seq-len {cfg.seq_len} + 2; pass more text or a smaller --seq-len")  # fmt: skip
    model, _ = build_model(cfg, tok.size if cfg.config is not None else None)
    inner = unwrap_model(model)
    if tok.size > inner.config.vocab_size:
        raise UserError(f"the tokenizer has {tok.size} ids but the model's vocabulary only {inner.config.vocab_size}")
    model.to(device)
    opt = _optimizer(model, cfg, device)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    counters: dict[str, Any] = {}
    if state is not None:
        counters = _restore_state(state, model, opt, data_gen, info.world)
    elif info.main:
        R.write_train_config(out, {"kind": "transformers", "train": dataclasses.asdict(cfg),
                                   "model": inner.config.to_dict(), "command": command})  # fmt: skip
        (out / R.LOG_FILE).write_text("", encoding="utf-8")
    if state is not None and info.main:
        R.truncate_log(out, state["step"])
        R.clean_stale(out)
    model.train()
    ddp_model: nn.Module = model
    if info.enabled:
        device_ids = [device.index] if device.type == "cuda" else None
        ddp_model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    val_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    run = _Run(
        cfg, out, info, device, command, tok, model, ddp_model, opt, data_gen,
        amp=resolve_autocast_dtype(cfg.autocast, device),
        batches=_train_batches(streams["train"], cfg.seq_len, cfg.batch_size, info, data_gen),
        val_batches=[D.random_batch(streams["validation"], cfg.seq_len, cfg.batch_size * info.world,
                                    generator=val_gen) for _ in range(cfg.eval_batches)],
        tokens_per_step=cfg.batch_size * cfg.grad_accum * info.world * cfg.seq_len,
        **counters,
    )  # fmt: skip
    if info.main:
        n_train = sum(p.numel() for p in _trainable(model).values())
        n_all = sum(p.numel() for p in model.parameters())
        swap = current_swap(model)
        attn = "native" if swap is None else f"{cfg.position}" + (f" T={cfg.num_samples}" if cfg.position == "plsh"
                                                                    else "")  # fmt: skip
        print(f"plsh train-hf: {inner.config.model_type} {n_all:,} params ({n_train:,} trained, "
              f"{cfg.finetune}) | attention {attn} | seq_len {cfg.seq_len} | {run.tokens_per_step} tokens/step x "
              f"{cfg.steps} steps | device {device} x {info.world} | autocast {run.amp or 'off'} | train "
              f"{streams['train'].numel():,} tokens", flush=True)  # fmt: skip
    return run


def _train_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, info: Dist,
                   generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Endless micro-batches: every process draws the same global batch and keeps its own rows."""
    while True:
        x, y = D.random_batch(tokens, seq_len, batch_size * info.world, generator=generator)
        rows = slice(info.rank * batch_size, (info.rank + 1) * batch_size)
        yield x[rows], y[rows]


def _restore_state(state: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer, data_gen: torch.Generator,
                   world: int) -> dict[str, Any]:  # fmt: skip
    if state["world_size"] != world:
        raise UserError(f"--resume: the run was saved with {state['world_size']} processes; resume it with the same "
                        f"number (got {world}) so that the batches stay the same")  # fmt: skip
    params = _trainable(model)
    if set(params) != set(state["trainable"]):
        raise UserError(f"{R.STATE_FILE} does not fit the run's model (other trained parameters)")
    try:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["trainable"][name])
        opt.load_state_dict(state["optimizer"])
        data_gen.set_state(state["data_generator"])
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{R.STATE_FILE} does not fit the run's model ({' '.join(str(exc).split())[:160]})") from None
    swap = current_swap(model)
    if swap is not None:
        swap.set_step(int(state["swap_step"]))
    return {k: state[k] for k in ("step", "tokens", "elapsed", "val_loss")}


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def _validate(run: _Run) -> float:
    model, info = run.model, run.info
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=run.device)
    for x, y in run.val_batches:
        rows = slice(info.rank * x.shape[0] // info.world, (info.rank + 1) * x.shape[0] // info.world)
        x, y = x[rows].to(run.device), y[rows].to(run.device)
        with _autocast(run.device, run.amp):
            loss = _loss(model, x, y)
        total[0] += float(loss) * y.numel()
        total[1] += y.numel()
    if info.enabled:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def _save(run: _Run) -> None:
    """One checkpoint set: the model (or adapter) with its swap and tokenizer, and the exact resume state."""
    cfg, model = run.cfg, run.model
    swap = current_swap(model)
    state = {
        "step": run.step, "tokens": run.tokens, "elapsed": run.elapsed, "val_loss": run.val_loss,
        "trainable": {n: p.detach().cpu().clone() for n, p in _trainable(model).items()},
        "optimizer": run.opt.state_dict(), "data_generator": run.data_gen.get_state(),
        "torch_rng": torch.get_rng_state(), "swap_step": swap.step if swap is not None else 0,
        "world_size": run.info.world, "tokenizer_fingerprint": run.tok.fingerprint(),
    }  # fmt: skip
    meta = {"step": run.step, "tokens": run.tokens, "train_loss": run.last_loss, "val_loss": run.val_loss,
            "finished": run.step >= cfg.steps, "command": run.command}  # fmt: skip

    def write(folder: Path) -> None:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar at every checkpoint
        try:
            saved: Any = model  # a transformers (or peft) model: save_pretrained is untyped here
            saved.save_pretrained(str(folder))
            run.tok.as_transformers().save_pretrained(str(folder))
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        if swap is not None:
            write_swap_settings(swap, folder, train_len=cfg.seq_len)
        (folder / "plsh_train_hf.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    R.write_checkpoint_set(run.out, state, write)


def _stop_requested(stopper: StopOnSignal, info: Dist, device: torch.device) -> bool:
    if not info.enabled:
        return stopper.signal is not None
    flag = torch.tensor([1.0 if stopper.signal is not None else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _step(run: _Run) -> float:
    cfg, info = run.cfg, run.info
    lr = lr_at(run.step, cfg)  # type: ignore[arg-type]  # the schedule reads steps, warmup, lr, min_lr
    for group in run.opt.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        x, y = next(run.batches)
        x, y = x.to(run.device), y.to(run.device)
        sync = not info.enabled or micro == cfg.grad_accum - 1
        ctx = contextlib.nullcontext() if sync else run.ddp_model.no_sync()  # type: ignore[operator]
        with ctx:
            with _autocast(run.device, run.amp):
                loss = _loss(run.ddp_model, x, y)
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(list(_trainable(run.model).values()), cfg.grad_clip)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    run.tokens += run.tokens_per_step
    loss_t = loss_sum / cfg.grad_accum
    if info.enabled:
        dist.all_reduce(loss_t)
        loss_t /= info.world
    run.last_loss = float(loss_t)
    if not math.isfinite(run.last_loss):
        raise FloatingPointError(f"training loss is {run.last_loss} at step {run.step}; lower --lr or check the data")
    return lr


def _loop(run: _Run) -> TrainResult:
    cfg, info = run.cfg, run.info
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    bar = tqdm(total=cfg.steps, initial=run.step, desc="train-hf", disable=not (cfg.progress and info.main),
               dynamic_ncols=True)  # fmt: skip
    t_start = time.perf_counter() - run.elapsed
    window_t, window_tokens = time.perf_counter(), 0
    with StopOnSignal("plsh train-hf") as stopper:
        while run.step < stop:
            lr = _step(run)
            window_tokens += run.tokens_per_step
            now = time.perf_counter()
            tps = window_tokens / max(1e-9, now - window_t)
            if now - window_t > 30:
                window_t, window_tokens = now, 0
            bar.update(1)
            bar.set_postfix(loss=f"{run.last_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
            if info.main:
                R.append_log(run.out, {"step": run.step, "loss": run.last_loss, "lr": lr, "tokens": run.tokens,
                                       "tok_s": round(tps, 1), "elapsed": round(now - t_start, 2)})  # fmt: skip
            if run.step % cfg.eval_interval == 0 or run.step == cfg.steps:
                run.val_loss = _validate(run)
                if info.main:
                    R.append_log(run.out, {"step": run.step, "val_loss": run.val_loss,
                                           "val_ppl": math.exp(min(run.val_loss, 700))})  # fmt: skip
                    bar.write(f"step {run.step}: train loss {run.last_loss:.4f}, val loss {run.val_loss:.4f}")
            interrupted = _stop_requested(stopper, info, run.device)
            if run.step % cfg.ckpt_interval == 0 or run.step == stop or interrupted:
                run.elapsed = time.perf_counter() - t_start
                if info.main:
                    _save(run)
                info.barrier()
            if interrupted:
                break
    bar.close()
    seconds = time.perf_counter() - t_start
    if info.main:
        status = "finished" if run.step >= cfg.steps else f"stopped at step {run.step} (resume with --resume)"
        if stopper.signal is not None:
            status = f"interrupted by {stopper.signal} at step {run.step}; checkpoint saved (resume with --resume)"
        print(f"plsh train-hf: {status}; {run.tokens:,} tokens in {seconds:.0f} s; checkpoint in {run.out}",
              file=sys.stderr if stopper.signal else sys.stdout, flush=True)  # fmt: skip
    return TrainResult(run.out, run.step, run.tokens, run.last_loss, run.val_loss, seconds, run.step >= cfg.steps,
                       stopper.signal)  # fmt: skip
