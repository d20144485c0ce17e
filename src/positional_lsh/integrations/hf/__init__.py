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
:class:`~positional_lsh.ops.sampling.PartitionSampler` per layer (the package's one sampling policy) seeded with
``layer_seed(seed, layer_idx)`` (:func:`positional_lsh.ops.sampling.layer_seed`, the formula the project's model
uses); the law of a partition does not depend on the length, so one draw per layer serves every length
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

Padding. Each batch row may be left- and/or right-padded (its valid tokens one contiguous run); the row
is then computed on its valid tokens only, with positions counted from its first valid token — exactly
what the same row would give without padding. Masks with holes, 4-D or custom masks, packed sequences,
sliding windows, static caches, attention dropout in training and ``output_attentions`` raise
``ValueError``.

Modules, each importing only those listed before it (no import cycle, no private names across modules):

* :mod:`~positional_lsh.integrations.hf.masks` — the mask side: the registered mask function and the ``(B, n)``
  key-validity mask;
* :mod:`~positional_lsh.integrations.hf.attention_swap` — :class:`AttentionSwap`, the installed replacement: its
  settings, per-layer partition samplers and attention call;
* :mod:`~positional_lsh.integrations.hf.forward` — what the replacement forwards share: finding a module's swap,
  the attention call with merged heads, the refusals (dropout, ``output_attentions``), installing an instance
  attribute;
* one module per family's replacement attention: :mod:`~positional_lsh.integrations.hf.bloom`, ``mpt``, ``falcon``
  (each a ``forward``) and :mod:`~positional_lsh.integrations.hf.rope` (the registered attention function and the
  rotary neutralization);
* :mod:`~positional_lsh.integrations.hf.swap` — the API: :func:`use_positional_lsh`, :func:`use_alibi`,
  :func:`restore`, ... (installing and undoing);
* :mod:`~positional_lsh.integrations.hf.loading` — loading a local checkpoint.

The model families themselves (attention modules, heads, slopes, Q/K/V) are one table,
:mod:`positional_lsh.integrations.families`, which names each replacement forward by its import path.

Usage::

    from positional_lsh.integrations import hf
    swap = hf.use_positional_lsh(model, num_samples=16, seed=0)   # or hf.use_alibi(model, window=None)
    out = model.generate(ids, max_new_tokens=20)
    hf.restore(model)                                           # or: with hf.use_alibi(model): ...
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

from positional_lsh.integrations.hf.loading import LoadedModel, load_local_model
from positional_lsh.integrations.hf.masks import ATTN_IMPLEMENTATION, padding_mask_interface
from positional_lsh.integrations.hf.rope import attention_function
from positional_lsh.integrations.hf.swap import (
    NATIVE_ALIBI_TYPES,
    ROPE_TYPES,
    AttentionSwap,
    current_swap,
    model_family,
    restore,
    use_alibi,
    use_positional_lsh,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "NATIVE_ALIBI_TYPES",
    "ROPE_TYPES",
    "AttentionSwap",
    "LoadedModel",
    "current_swap",
    "load_local_model",
    "model_family",
    "restore",
    "use_alibi",
    "use_positional_lsh",
]

AttentionInterface.register(ATTN_IMPLEMENTATION, attention_function)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_interface)
