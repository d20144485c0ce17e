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

import dataclasses
import hashlib
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from positional_lsh.integrations.hf.loading import ADAPTER_CONFIG, load_local_model
from positional_lsh.integrations.hf.saved import write_swap_settings
from positional_lsh.integrations.hf.swap import current_swap, unwrap_model, use_alibi, use_positional_lsh
from positional_lsh.integrations.hf_train_config import BUILTIN_CONFIGS, PRESETS, HFTrainConfig
from positional_lsh.lm import data as D
from positional_lsh.lm import run_dir as R
from positional_lsh.lm import train_loop as L
from positional_lsh.lm.checkpoint import checkpoint_dir
from positional_lsh.lm.eval_models import encode_with_hf_tokenizer
from positional_lsh.lm.train_config import default_cache_dir, resolve_autocast_dtype
from positional_lsh.lm.train_dist import Dist, check_device, init_distributed
from positional_lsh.lm.train_loop import TrainResult
from positional_lsh.ops.errors import UserError

__all__ = ["PRESETS", "HFTrainConfig", "dry_run", "train_hf"]

# --------------------------------------------------------------------------------------------------
# Data and tokenizers
# --------------------------------------------------------------------------------------------------


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
    check_config_sizes(cfg, f"--config {file}")
    return cfg


_SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
                "d_model", "n_heads", "n_layers", "max_seq_len", "seq_length", "ffn_hidden_size")  # fmt: skip


def check_config_sizes(cfg: dict[str, Any], where: str) -> None:
    """``UserError`` naming ``where`` and the field if a size of a model config is not an int >= 1: the fields of
    :data:`_SIZE_FIELDS` (where not ``None``), and any other integer ``*_size``, ``num_*`` or ``n_*`` below 0."""
    for key, value in cfg.items():
        if key in _SIZE_FIELDS:
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        elif (key.endswith("_size") or key.startswith(("num_", "n_"))) and isinstance(value, int) \
                and not isinstance(value, bool) and value < 0:  # fmt: skip
            raise UserError(f"{where}: {key} must be >= 0, got {value!r}")


def disable_attention_dropout(model: nn.Module) -> float:
    """Set the attention dropout of ``model`` to 0, in its config and in every attention module (which copy it
    when built: Llama-family ``attention_dropout`` floats, BLOOM/Falcon ``nn.Dropout`` modules, MPT's
    ``attn_dropout_p``, GPT-2's ``attn_dropout``); returns the largest probability found (0.0: there was none)."""
    found = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "attn_pdrop"):
        value = getattr(config, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value:
            found = max(found, float(value))
            setattr(config, name, 0.0)
    for module in model.modules():
        for name in ("attention_dropout", "attn_dropout", "attn_dropout_p"):
            value = getattr(module, name, None)
            if isinstance(value, nn.Dropout):
                found, value.p = max(found, float(value.p)), 0.0
            elif isinstance(value, int | float) and not isinstance(value, bool) and value:
                found = max(found, float(value))
                setattr(module, name, 0.0)
    return found


def _checkpoint_folder(source: str) -> Path:
    p = Path(source).expanduser()
    if not p.is_dir():
        raise UserError(f"--checkpoint {source} is not a directory (a local transformers checkpoint is needed)")
    return checkpoint_dir(p)  # a plsh train-hf run directory: its latest checkpoint


def config_from_file(config: str, vocab: int | None) -> Any:
    """The transformers config of ``--config`` (a built-in name or a ``config.json``), its ``vocab_size`` set to
    ``vocab`` when given; what transformers cannot build is one line naming the file. Shared by
    :func:`build_model` and the dry run."""
    from transformers import AutoConfig

    d = _config_dict(config)
    model_type = d.pop("model_type")
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        d.pop(key, None)
    if vocab is not None:
        d["vocab_size"] = vocab
    try:
        return AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--config {config}: transformers cannot build it ({exc})") from None


def build_model(cfg: HFTrainConfig, vocab: int | None) -> tuple[nn.Module, Any]:
    """The model to train (swapped, with LoRA adapters for ``finetune="lora"``) and the checkpoint's tokenizer.

    From a config: random weights from ``torch.manual_seed(cfg.seed)``, ``vocab_size`` set to ``vocab`` (the
    tokenizer's). From a checkpoint: its weights (an adapter folder is merged into its base). Deterministic: the
    same settings give the same model, which is how a resumed run rebuilds it before loading its state.
    """
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, cfg.dtype)
    tokenizer = None
    if cfg.config is not None:
        config = config_from_file(cfg.config, vocab)
        torch.manual_seed(cfg.seed)
        try:
            model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except (ValueError, KeyError, TypeError, RuntimeError, ZeroDivisionError) as exc:
            msg = " ".join(str(exc).split())[:200]
            raise UserError(f"--config {cfg.config}: transformers cannot build a model from it ({msg})") from None
    else:
        loaded = load_local_model(_checkpoint_folder(str(cfg.checkpoint)), dtype=dtype, apply_swap=False, quiet=True)
        model, tokenizer = loaded.model, loaded.tokenizer
    model.train()
    p = disable_attention_dropout(model)  # the swap has no attention dropout: every position trains without it
    if p:
        print(f"plsh train-hf: the model's attention dropout {p:g} is set to 0 (positional-LSH and ALiBi attention "
              "have none; a native run does the same, so that runs compare)", flush=True)  # fmt: skip
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


def probe_attention(model: nn.Module, cfg: HFTrainConfig, device: torch.device, amp: torch.dtype | None) -> None:
    """One forward of one window of zeros (no gradients), before anything is written in ``--out``: a refusal that
    only the attention call can make (e.g. ``--attn-backend triton`` on CPU, key/value heads that do not divide
    the query heads) comes before the run starts. The swap's step and the random-number states are restored, so
    the run is the same as without the probe."""
    swap = current_swap(model)
    step = swap.step if swap is not None else 0
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    x = torch.zeros(1, cfg.seq_len, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), L.autocast(device, amp):
            model(input_ids=x, use_cache=False)
    finally:
        if swap is not None:
            swap.set_step(step)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _dims(config: Any) -> tuple[int, int, int, int]:
    """Hidden size, layers, MLP width and vocabulary of a transformers config (the families' attribute names)."""

    def first(*names: str, default: int = 0) -> int:
        return next((int(v) for v in (getattr(config, n, None) for n in names) if v), default)

    hidden = first("hidden_size", "d_model")
    return (hidden, first("num_hidden_layers", "n_layer", "n_layers"),
            first("intermediate_size", "ffn_hidden_size", default=4 * hidden), int(config.vocab_size))  # fmt: skip


def estimate_memory(cfg: HFTrainConfig, config: Any, n_params: int, n_trained: int) -> dict[str, float]:
    """A rough estimate of one process's training memory (bytes): ``params`` (the weights in ``cfg.dtype``),
    ``grads`` and ``optimizer`` (AdamW's two moments) of the trained parameters, and ``activations`` of one
    micro-batch kept for the backward (per layer: the MLP and ``num_samples`` attention outputs of ``plsh``, or
    only each layer's input under gradient checkpointing; plus the logits). A lower bound, not a promise."""
    hidden, layers, ffn, vocab = _dims(config)
    wbytes = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    abytes = 2 if cfg.autocast in ("bfloat16", "float16") else 4
    tokens = cfg.batch_size * cfg.seq_len
    samples = cfg.num_samples if cfg.position == "plsh" else 1
    per_layer = tokens * (hidden * (2 * samples + 6) + 3 * ffn)
    if cfg.gradient_checkpointing:
        kept = layers * tokens * hidden + per_layer
    else:
        kept = layers * per_layer
    return {"params": float(n_params * wbytes), "grads": float(n_trained * wbytes),
            "optimizer": float(2 * n_trained * wbytes),
            "activations": float(kept * abytes + tokens * vocab * 4 * 2)}  # fmt: skip


def memory_estimate_line(cfg: HFTrainConfig, config: Any, *, n_params: int, n_trained: int) -> str:
    """``plsh train-hf: memory estimate ...``: :func:`estimate_memory` as one line (GiB)."""
    m = estimate_memory(cfg, config, n_params, n_trained)
    attn = f"T={cfg.num_samples}" if cfg.position == "plsh" else cfg.position
    return (f"plsh train-hf: memory estimate per process: parameters {n_params:,} ({n_trained:,} trained) "
            f"{_bytes(m['params'])} + gradients {_bytes(m['grads'])} + optimizer state {_bytes(m['optimizer'])} + "
            f"activations {_bytes(m['activations'])} (seq_len {cfg.seq_len}, {attn}, batch {cfg.batch_size}"
            f"{', gradient checkpointing' if cfg.gradient_checkpointing else ''}) = about "
            f"{_bytes(sum(m.values()))}")  # fmt: skip


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2.0**10:.1f} KiB"


def _dry_run_config(cfg: HFTrainConfig) -> Any:
    """The transformers config of the run's model, from ``--config`` (vocabulary: ``--tokenizer``'s size, or
    ``--vocab-size``) or from the checkpoint's ``config.json``; no weights are read."""
    from transformers import AutoConfig

    if cfg.config is not None:
        vocab = _load_tokenizer_arg(cfg.tokenizer).size if cfg.tokenizer else cfg.vocab_size
        return config_from_file(cfg.config, vocab)
    folder = _checkpoint_folder(str(cfg.checkpoint))
    if (folder / ADAPTER_CONFIG).is_file():
        folder = Path(json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        why = str(exc).splitlines()[0]
        raise UserError(f"--checkpoint {cfg.checkpoint}: no readable config.json ({why})") from None


def dry_run(cfg: HFTrainConfig) -> str:
    """``plsh train-hf --dry-run``: the memory estimate line of the run ``cfg`` describes, from its model config
    alone (the model is built on the ``meta`` device: no weights are loaded or allocated, nothing is written)."""
    from transformers import AutoModelForCausalLM

    config = _dry_run_config(cfg)
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.dtype))
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = n_params
    if cfg.finetune == "lora":
        try:
            import peft
        except ImportError as exc:
            raise ImportError("finetune='lora' needs peft: pip install 'positional-lsh[peft]'") from exc
        lcfg = peft.LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                               target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")  # fmt: skip
        with torch.device("meta"):
            try:
                lora = peft.get_peft_model(model, lcfg)
            except ValueError as exc:
                msg = " ".join(str(exc).split())[:200]
                raise UserError(f"--lora-targets {','.join(cfg.lora_targets)}: {msg}") from None
        n_params = sum(p.numel() for p in lora.parameters())
        n_trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    return memory_estimate_line(cfg, config, n_params=n_params, n_trained=n_trained)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _optimizer(model: nn.Module, cfg: HFTrainConfig, device: torch.device) -> torch.optim.AdamW:
    return L.adamw(_trainable(model).values(), cfg, device)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Run(L.RunState):
    cfg: HFTrainConfig
    tok: _Tokenizer


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
    keep = R.per_job_settings(cfg, saved["train"])
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
    need = ("step", "tokens", "elapsed", "val_loss", "trainable", "optimizer", "data_generator", "torch_rng",
            "swap_step", "world_size", "tokenizer_fingerprint")  # fmt: skip
    state, _ = R.read_state_file(out, need, "plsh train-hf")
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
    command = L.default_command(command)
    info, device = init_distributed(cfg.device)
    try:
        run = _setup(cfg, state, info, device, command)
        return _loop(run)
    finally:
        L.end_distributed(info)


def _tokenizer_for(cfg: HFTrainConfig, out: Path, info: Dist, splits: dict[str, list[D.Document]],
                   checkpoint_tok: Any, *, resume: bool) -> tuple[_Tokenizer, bool]:  # fmt: skip
    """The run's tokenizer and whether it is new (to be saved as ``--out``'s ``tokenizer.json`` once every check
    has passed: nothing is written here). A ``tokenizer.json`` already in ``--out`` is reused on resume; in a new
    run it is reused when its size is ``vocab_size`` and refused otherwise (a stale one, not the one asked for)."""
    if cfg.tokenizer:
        return _load_tokenizer_arg(cfg.tokenizer), False
    if checkpoint_tok is not None:
        return _Tokenizer(None, checkpoint_tok), False
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
        return _Tokenizer(bpe, None), False
    text: list[str | None] = [None]
    if info.main:
        text[0] = D.train_tokenizer(splits["train"], vocab_size=cfg.vocab_size).to_str()
    if info.enabled:  # every process uses rank 0's tokenizer (nothing is on disk yet)
        import torch.distributed as dist

        dist.broadcast_object_list(text, src=0)
    assert text[0] is not None
    return _Tokenizer(D.BPETokenizer.from_str(text[0]), None), True


def check_prepared_tokenizer(path: Path, size: int, vocab_size: int) -> None:
    """Refuse a ``tokenizer.json`` found in a new run's ``--out`` whose size is not the ``--vocab-size`` asked for
    (e.g. left by an earlier attempt): one line naming the file and both sizes."""
    if size != vocab_size:
        raise UserError(f"{path} holds a {size}-token tokenizer but --vocab-size is {vocab_size}; remove the file to "
                        f"train a new one, or pass --vocab-size {size} to use it")  # fmt: skip


def _streams(tok: _Tokenizer, splits: dict[str, list[D.Document]], cfg: HFTrainConfig) -> dict[str, torch.Tensor]:
    parts = {"train": splits["train"], "validation": splits["validation"]}
    if tok.bpe is not None:
        cache = None if cfg.cache_dir == "" else Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
        return D.encode_splits(tok.bpe, parts, cache_dir=cache)
    return {k: encode_with_hf_tokenizer(tok.hf, v) for k, v in parts.items()}


def _setup(cfg: HFTrainConfig, state: dict[str, Any] | None, info: Dist, device: torch.device, command: str) -> _Run:
    out = Path(cfg.out_dir)
    splits = load_training_splits(cfg.data)
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
    tok, new_tok = _tokenizer_for(cfg, out, info, splits, checkpoint_tok, resume=state is not None)
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
    if info.main:
        n_all, n_train = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in _trainable(model).values())
        print(memory_estimate_line(cfg, inner.config, n_params=n_all, n_trained=n_train), flush=True)
    model.to(device)
    opt = _optimizer(model, cfg, device)
    amp = resolve_autocast_dtype(cfg.autocast, device)
    probe_attention(model, cfg, device, amp)
    # Every check has passed: only now is anything written in --out.
    if info.main:
        out.mkdir(parents=True, exist_ok=True)
        if new_tok:
            assert tok.bpe is not None
            tok.bpe.save(out / "tokenizer.json")
    info.barrier()
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
        out, info, device, command, model, ddp_model, opt, data_gen, cfg=cfg, tok=tok,
        amp=amp,
        batches=L.train_batches(streams["train"], cfg.seq_len, cfg.batch_size, info, data_gen),
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
              f"{cfg.finetune}) | attention {attn} | seq_len {cfg.seq_len} | {run.tokens_per_step} tokens/optimizer "
              "step "
              f"({cfg.grad_accum} micro-batch{'es' if cfg.grad_accum > 1 else ''}) x {cfg.steps} optimizer steps "
              f"| device {device} x {info.world} | autocast {run.amp or 'off'} | train "
              f"{streams['train'].numel():,} tokens", flush=True)  # fmt: skip
    return run


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


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


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


def _loop(run: _Run) -> TrainResult:
    return L.run_loop(
        run,
        run.cfg,
        prog="plsh train-hf",
        step=lambda: L.optimizer_step(run, run.cfg, _loss, list(_trainable(run.model).values()), non_blocking=False,
                                      lr_flag="--lr"),
        validate=lambda: L.validation_loss(run.model, run.val_batches, run.info, run.device, run.amp, _loss),
        save=lambda: _save(run),
        val_ppl=lambda v: math.exp(min(v, 700)),
        show_ppl=False,
    )  # fmt: skip
