"""transformers integration: positional-LSH or exact/windowed ALiBi attention inside Hugging Face models.

Two kinds of models are supported (transformers >= 5; tested with 5.24):

* **Native ALiBi models** — BLOOM, MPT and Falcon with ``alibi=True``. Their attention modules get a new
  ``forward`` (an instance attribute; the class is untouched) that runs the model's own projections and
  KV cache, then :func:`~positional_lsh.plsh_attention` or :func:`~positional_lsh.alibi_attention` instead
  of the eager ``n x n`` score matrix. The model's own slopes and convention are kept exactly:
  BLOOM and MPT add ``slope * j`` per key after scaling (equal to ``-slope |i - j|`` up to a per-row
  constant); Falcon adds ``slope * j`` *before* dividing by ``sqrt(d)``, i.e. an effective slope of
  ``slope / sqrt(d)`` in this library's convention. (transformers 5.24's Falcon *eager* path adds the bias
  a second time, ``2 slope / sqrt(d)``; we match its ``sdpa`` path and the original Falcon code.)
* **Llama-family models** (Llama, Mistral, Qwen2, Qwen3) — the paper's setup: the rotary embedding is
  neutralized (it returns ``cos = 1, sin = 0``, so ``apply_rotary_pos_emb`` is the identity) and attention is
  dispatched through transformers' registry: an attention function and a mask function are registered
  under the name ``"positional_lsh"`` (:class:`transformers.AttentionInterface`,
  :class:`transformers.masking_utils.AttentionMaskInterface`) and selected with
  ``model.set_attn_implementation``. Default slopes are the standard ALiBi schedule for the number of
  query heads; the paper used one constant ``sigma = 256`` (``slopes=1/256``).

For every family the registered mask function replaces the ``(B, 1, n, n)`` causal mask by a
``(B, n)`` boolean key-validity mask, so no ``n x n`` tensor is built anywhere.

Partitions. Positional-LSH partitions are drawn per layer, **independently across layers**, by one
:class:`~positional_lsh.ops.partitions.sampling.PartitionSampler` per layer (the package's one sampling policy) seeded
with
``layer_seed(seed, layer_idx)`` (:func:`positional_lsh.ops.partitions.sampling.layer_seed`, the formula the project's
model uses); the law of a partition does not depend on the length, so one draw per layer serves every length
(:meth:`Partitions.with_seq_len`). In eval mode the partitions are therefore
fixed: decoding with a KV cache (each new query attends within its own block in every sample) gives
exactly the same attention as recomputing the whole sequence, and one seed reproduces every result. In
training mode (``resample_in_training=True``) every forward pass of the model draws fresh partitions from
``layer_seed(layer_seed(seed, layer_idx), step)``; the step counter advances once per model call, so
recomputation by gradient checkpointing within a step reuses the step's partitions.
``swap.partitions(layer_idx, seq_len, training=...)`` returns them.

Options. ``backend`` is checked against :data:`positional_lsh.ops.options.BACKENDS` and ``method`` (positional LSH
only) against :data:`~positional_lsh.ops.options.METHODS`; both are passed to :func:`~positional_lsh.plsh_attention`.
:func:`use_alibi` refuses ``backend="triton"`` (``ValueError``): exact and windowed ALiBi have no Triton kernels.

Padding and packing. A 2-D mask may have any pattern (left or right padding, holes): positions are counted from
each row's first valid token, holes included, and a masked token leaves the softmax — a left-padded row gives
exactly what the same row gives without padding. Packed sequences (position ids that restart,
``DataCollatorWithFlattening``) run each document as its own sequence (the RoPE family and Falcon; eager). 4-D or
custom masks, sliding windows, transformers' own static cache and attention dropout in training raise ``ValueError``;
``generate(cache_implementation="static")`` builds the swap's fixed-capacity cache
(:mod:`~positional_lsh.integrations.hf.static_cache`).

Attention weights. ``output_attentions=True`` returns, per layer, the ``(B, Hq, Lq, Lk)`` weights the call used
(:meth:`AttentionSwap.attention_weights`): positional LSH's ``softmax(s + log Mbar)`` with the call's partitions,
or exact / windowed ALiBi's ``softmax(s - m |i - j|)``; computed only when asked, dense (refused up front above
the dense oracles' size). The layer's output is then computed from them (``weights @ v``:
:meth:`AttentionSwap.attend_with_weights`), so they are on its path, as in eager attention.

Modules, each importing only those listed before it (no import cycle, no private names across modules):

* :mod:`~positional_lsh.integrations.hf.masks` — the mask side: the registered mask function and the ``(B, n)``
  key-validity mask;
* :mod:`~positional_lsh.integrations.hf.cache` — :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`, a
  KV cache that drops the keys no later query can reach (``swap.new_cache()``);
* :mod:`~positional_lsh.integrations.hf.static_cache` —
  :class:`~positional_lsh.integrations.hf.static_cache.LiveKeyStaticCache`, the fixed-capacity cache of
  ``generate(cache_implementation="static")``;
* :mod:`~positional_lsh.integrations.hf.attention_swap` — :class:`AttentionSwap`, the installed replacement: its
  settings, per-layer partition samplers and attention call (autocast, the decoding path, padding; its custom ops
  under ``torch.compile``);
* :mod:`~positional_lsh.integrations.hf.forward` — what the replacement forwards share: finding a module's swap,
  the attention call with merged heads and its weights (``output_attentions``), the refusals (dropout, masks),
  installing an instance attribute;
* one module per family's replacement attention: :mod:`~positional_lsh.integrations.hf.bloom`, ``mpt``, ``falcon``
  (each a ``forward``) and :mod:`~positional_lsh.integrations.hf.rope` (the registered attention function and the
  rotary neutralization);
* :mod:`~positional_lsh.integrations.hf.saved` — the swap's settings saved next to the weights
  (``positional_lsh_swap.json``): writing, reading and checking them;
* :mod:`~positional_lsh.integrations.hf.configs` — a model's own config object before its first swap
  (transformers shares one between the models built from it; a swap changes its own model only);
* :mod:`~positional_lsh.integrations.hf.swap` — the API: :func:`use_positional_lsh`, :func:`use_alibi`,
  :func:`restore`, ... (installing, stacking and undoing; peft models; re-applying saved settings);
* :mod:`~positional_lsh.integrations.hf.autoload` — ``attn_implementation="positional_lsh"`` on its own: the
  registered mask function installs the swap saved with the model's config at its first call (and a plain load of a
  swapped checkpoint warns once);
* :mod:`~positional_lsh.integrations.hf.loading` — loading a local checkpoint (or a peft adapter folder),
  re-applying its saved swap;
* :mod:`~positional_lsh.integrations.hf.trainer` — :class:`SwapStepCallback`, the swap's training step in
  transformers ``Trainer`` checkpoints (exact resume; imported on first use: it needs accelerate);
* :mod:`~positional_lsh.integrations.hf.train` — the training loop of ``plsh train-hf`` (from a config or a local
  checkpoint, full or LoRA, the run directory of ``plsh train``).

The model families themselves (attention modules, heads, slopes, Q/K/V) are one table,
:mod:`positional_lsh.integrations.families`, which names each replacement forward by its import path.

Usage::

    from positional_lsh.integrations import hf
    swap = hf.use_positional_lsh(model, num_samples=16, seed=0)   # or hf.use_alibi(model, window=None)
    out = model.generate(ids, max_new_tokens=20)
    model.save_pretrained("ckpt")                               # also writes ckpt/positional_lsh_swap.json
    hf.restore(model)                                           # or: with hf.use_alibi(model): ...
    model, tok = hf.load_local_model("ckpt")                    # re-applies the saved swap (one line on stderr)
"""

from __future__ import annotations

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"positional_lsh.integrations.hf needs transformers >= 5 (pip install 'transformers>=5'); import failed: {exc}"
    ) from exc

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(f"positional_lsh.integrations.hf needs transformers >= 5, found {transformers.__version__}")

from positional_lsh.integrations.hf.autoload import mask_function
from positional_lsh.integrations.hf.loading import LoadedModel, load_local_model
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION
from positional_lsh.integrations.hf.rope import attention_function
from positional_lsh.integrations.hf.saved import SWAP_FILE, read_swap_settings, swap_settings, write_swap_settings
from positional_lsh.integrations.hf.swap import (
    AttentionSwap,
    apply_saved_swap,
    apply_swap_settings,
    current_swap,
    model_family,
    restore,
    unwrap_model,
    use_alibi,
    use_positional_lsh,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SWAP_FILE",
    "AttentionSwap",
    "LoadedModel",
    "SwapStepCallback",
    "apply_saved_swap",
    "apply_swap_settings",
    "current_swap",
    "load_local_model",
    "model_family",
    "read_swap_settings",
    "restore",
    "swap_settings",
    "unwrap_model",
    "use_alibi",
    "use_positional_lsh",
    "write_swap_settings",
]

AttentionInterface.register(ATTN_IMPLEMENTATION, attention_function)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, mask_function)


def _register_falcon() -> None:
    """Falcon picks its attention class by name in its own table (``FALCON_ATTENTION_CLASSES``), not through the
    registry: the registered name builds its stock ``FalconAttention`` (the swap replaces its forward)."""
    try:
        from transformers.models.falcon import modeling_falcon
    except ImportError:  # pragma: no cover - a transformers without Falcon
        return
    table = getattr(modeling_falcon, "FALCON_ATTENTION_CLASSES", None)
    if isinstance(table, dict) and "eager" in table:
        table.setdefault(ATTN_IMPLEMENTATION, table["eager"])


_register_falcon()


def _accept_config_output_attentions() -> None:
    """transformers refuses ``config.output_attentions = True`` (and a config made with it) unless the attention
    implementation is ``"eager"``, the only built-in one that returns weights. The registered name returns the
    weights each call used (``output_attentions``), so it is accepted like ``"eager"``; every other name keeps
    transformers' refusal."""
    from transformers.configuration_utils import PreTrainedConfig

    prop = PreTrainedConfig.__dict__.get("output_attentions")
    validate = PreTrainedConfig.__dict__.get("validate_output_attentions")
    if not isinstance(prop, property) or prop.fset is None or getattr(prop.fset, "positional_lsh", False):
        return  # another transformers layout, or done already
    stock_set = prop.fset

    def fset(self: PreTrainedConfig, value: bool) -> None:
        if value and self._attn_implementation == ATTN_IMPLEMENTATION:
            self._output_attentions = value  # what the stock setter stores once it accepts
            return
        stock_set(self, value)

    fset.positional_lsh = True  # type: ignore[attr-defined]
    PreTrainedConfig.output_attentions = property(prop.fget, fset, prop.fdel, prop.__doc__)  # type: ignore[method-assign,assignment]
    if callable(validate):
        stock_validate = validate

        def validate_output_attentions(self: PreTrainedConfig) -> None:
            if self._attn_implementation != ATTN_IMPLEMENTATION:
                stock_validate(self)

        PreTrainedConfig.validate_output_attentions = validate_output_attentions  # type: ignore[method-assign]
        # config classes made (by huggingface_hub's strict dataclasses) before this ran listed the stock validator
        pending: list[type] = [PreTrainedConfig]
        while pending:
            cls = pending.pop()
            pending += cls.__subclasses__()
            validators = cls.__dict__.get("__class_validators__")
            if isinstance(validators, list):
                validators[:] = [validate_output_attentions if v is stock_validate else v for v in validators]


_accept_config_output_attentions()


def __getattr__(name: str) -> object:
    """``SwapStepCallback`` is imported on first access: transformers' ``TrainerCallback`` needs accelerate."""
    if name == "SwapStepCallback":
        from positional_lsh.integrations.hf.trainer import SwapStepCallback

        return SwapStepCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
