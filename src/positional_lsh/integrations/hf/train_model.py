"""The model of ``plsh train-hf`` (:mod:`positional_lsh.integrations.hf.train`): its transformers config (a file,
a folder or a built-in name), building it from that config or loading a checkpoint to fine-tune (fully or with
LoRA) with the attention swap, the attention probe, the memory estimate and ``--dry-run``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.loading import ADAPTER_CONFIG, load_local_model
from positional_lsh.integrations.hf.swap import current_swap, use_alibi, use_positional_lsh
from positional_lsh.integrations.hf.train_data import load_tokenizer_arg
from positional_lsh.integrations.hf_train_config import BUILTIN_CONFIGS, HFTrainConfig
from positional_lsh.lm import train_loop as L
from positional_lsh.lm.checkpoint import checkpoint_dir
from positional_lsh.ops.errors import UserError


def config_dict(source: str) -> dict[str, Any]:
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


def checkpoint_folder(source: str) -> Path:
    p = Path(source).expanduser()
    if not p.is_dir():
        raise UserError(f"--checkpoint {source} is not a directory (a local transformers checkpoint is needed)")
    return checkpoint_dir(p)  # a plsh train-hf run directory: its latest checkpoint


def config_from_file(config: str, vocab: int | None) -> Any:
    """The transformers config of ``--config`` (a built-in name or a ``config.json``), its ``vocab_size`` set to
    ``vocab`` when given; what transformers cannot build is one line naming the file. Shared by
    :func:`build_model` and the dry run."""
    from transformers import AutoConfig

    d = config_dict(config)
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
        loaded = load_local_model(checkpoint_folder(str(cfg.checkpoint)), dtype=dtype, apply_swap=False, quiet=True)
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
        model.peft_config["default"].base_model_name_or_path = str(checkpoint_folder(str(cfg.checkpoint)).resolve())
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


def _dims(config: Any) -> dict[str, int]:
    """Hidden size, layers, MLP width, vocabulary, query and key/value widths (heads x head dim) of a transformers
    config (the families' attribute names; multi-query Falcon: one key/value head)."""

    def first(*names: str, default: int = 0) -> int:
        return next((int(v) for v in (getattr(config, n, None) for n in names) if v), default)

    hidden = first("hidden_size", "d_model", "n_embd")
    heads = first("num_attention_heads", "n_head", "n_heads", default=1)
    head_dim = first("head_dim", default=max(1, hidden // heads))
    kv_heads = 1 if getattr(config, "multi_query", False) else first("num_key_value_heads", "num_kv_heads",
                                                                        default=heads)  # fmt: skip
    return {"hidden": hidden, "layers": first("num_hidden_layers", "n_layer", "n_layers", default=1),
            "ffn": first("intermediate_size", "ffn_hidden_size", "n_inner", default=4 * hidden),
            "vocab": int(config.vocab_size), "q": heads * head_dim, "kv": kv_heads * head_dim}  # fmt: skip


FRAMEWORK_BYTES = 500 * 2**20
"""The process's own memory before the model: torch, transformers and the run's modules imported (466 MiB
measured on CPU), or about a CUDA context on a GPU."""

#: Bytes per token that one decoder layer keeps for the backward: per unit of the hidden width, the MLP width, the
#: query width and the key/value width (heads x head dim); counted with ``torch.autograd.graph.saved_tensors_hooks``
#: on Qwen3 (unique storages): in float32 the two RMSNorms keep their input, normalized and scaled copies (6 x
#: hidden), the MLP its gate, SiLU, up and product (4 x MLP), the attention its projections, q/k norms and rotary
#: outputs (4 x each width); under a 16-bit autocast the matmul outputs are 16-bit and the norms stay float32.
#: A swapped layer keeps one more query-width tensor (the op's ``out``; its ``lse`` is one float per head).
#: None of it grows with ``T``: the op keeps its merged ``out`` and ``lse``, not one output per sample.
LAYER_BYTES_PER_TOKEN = {"float32": (24.0, 16.0, 16.0, 16.0, 4.0), "16-bit": (30.0, 9.0, 10.0, 9.0, 2.0)}


def estimate_memory(cfg: HFTrainConfig, config: Any, n_params: int, n_trained: int, *, world: int = 1
                    ) -> dict[str, float]:  # fmt: skip
    """An estimate of one process's peak training memory (bytes), by term:

    * ``params``: the weights; ``finetune="full"`` trains float32 master weights, a LoRA base is in ``cfg.dtype``
      and its adapters float32 (as peft keeps them);
    * ``grads``, ``optimizer``: float32 gradients and AdamW's two moments of the trained parameters;
    * ``activations``: what one micro-batch keeps for the backward (:data:`LAYER_BYTES_PER_TOKEN` per layer and
      token at the autocast width; under gradient checkpointing each layer's float32 input and one layer
      recomputed), and the float32 log-probabilities of the loss;
    * ``working``: the backward's working set, the gradients of one layer's activations and of the logits;
    * ``framework``: :data:`FRAMEWORK_BYTES`.

    Under ``cfg.fsdp`` over ``world`` processes the weights, gradients and AdamW state are sharded (``1 / world``
    each), and the working set adds two layers' gathered float32 weights (the one computing and the one prefetched)
    and one layer's unsharded gradients. Checked against measured peaks on CPU within 25 %
    (``benchmarks/train_memory.py``); the data's token streams are not counted.
    """
    d = _dims(config)
    tokens = cfg.batch_size * cfg.seq_len
    wbytes = 4 if cfg.finetune == "full" else torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    swapped = cfg.position != "native"
    width = "16-bit" if cfg.autocast in ("bfloat16", "float16") else "float32"
    c_h, c_f, c_q, c_kv, c_swap = LAYER_BYTES_PER_TOKEN[width]
    layer = tokens * (c_h * d["hidden"] + c_f * d["ffn"] + (c_q + swapped * c_swap) * d["q"] + c_kv * d["kv"])
    logits = tokens * d["vocab"] * (4.5 if width == "16-bit" else 4.0)
    kept = d["layers"] * tokens * d["hidden"] * 4 + layer if cfg.gradient_checkpointing else d["layers"] * layer
    shards = world if cfg.fsdp else 1
    working = layer + 8.0 * tokens * d["vocab"]
    if cfg.fsdp:
        embeddings = d["vocab"] * d["hidden"] * (1 if getattr(config, "tie_word_embeddings", False) else 2)
        per_layer = max(0, n_params - embeddings) / d["layers"]
        working += 3 * 4 * per_layer
    return {"params": (n_trained * 4 + (n_params - n_trained) * wbytes) / shards, "grads": n_trained * 4 / shards,
            "optimizer": 2 * n_trained * 4 / shards, "activations": float(kept + logits), "working": float(working),
            "framework": float(FRAMEWORK_BYTES)}  # fmt: skip


def memory_estimate_line(cfg: HFTrainConfig, config: Any, *, n_params: int, n_trained: int, world: int = 1) -> str:
    """``plsh train-hf: memory estimate ...``: :func:`estimate_memory` as one line (GiB)."""
    m = estimate_memory(cfg, config, n_params, n_trained, world=world)
    attn = f"T={cfg.num_samples}" if cfg.position == "plsh" else cfg.position
    shard = f", FSDP over {world} process{'es' if world > 1 else ''}" if cfg.fsdp else ""
    return (f"plsh train-hf: memory estimate per process: parameters {n_params:,} ({n_trained:,} trained) "
            f"{_bytes(m['params'])} + gradients {_bytes(m['grads'])} + optimizer state {_bytes(m['optimizer'])} + "
            f"activations {_bytes(m['activations'])} + backward working set {_bytes(m['working'])} + framework "
            f"{_bytes(m['framework'])} (seq_len {cfg.seq_len}, {attn}, batch {cfg.batch_size}"
            f"{', gradient checkpointing' if cfg.gradient_checkpointing else ''}{shard}) = about "
            f"{_bytes(sum(m.values()))} (within 25 % of measured peaks; data not counted)")  # fmt: skip


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
        vocab = load_tokenizer_arg(cfg.tokenizer).size if cfg.tokenizer else cfg.vocab_size
        return config_from_file(cfg.config, vocab)
    folder = checkpoint_folder(str(cfg.checkpoint))
    if (folder / ADAPTER_CONFIG).is_file():
        folder = Path(json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        why = str(exc).splitlines()[0]
        raise UserError(f"--checkpoint {cfg.checkpoint}: no readable config.json ({why})") from None


def dry_run(cfg: HFTrainConfig, world: int = 1) -> str:
    """``plsh train-hf --dry-run``: the memory estimate line of the run ``cfg`` describes, from its model config
    alone (the model is built on the ``meta`` device: no weights are loaded or allocated, nothing is written); per
    process of ``world`` (the FSDP shards of ``cfg.fsdp``)."""
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
    return memory_estimate_line(cfg, config, n_params=n_params, n_trained=n_trained, world=world)
