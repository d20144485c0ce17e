"""Capture per-layer queries, keys and values of a model, for validating the theory on real activations.

Q/K/V are taken by forward hooks on the attention *projections*, as the paper did (§5.2): the output
of ``q_proj``/``k_proj``/``v_proj`` (Llama family: Llama, Mistral, Qwen, ...), of the fused
``query_key_value`` (BLOOM, Falcon, GPT-NeoX), of ``Wqkv`` (MPT), ``c_attn`` (GPT-2) or ``qkv`` (the
project's own ``TransformerLM`` and other nanoGPT-style modules with ``n_head`` and ``head_dim``). For RoPE models
this is *before* the rotary embedding (ALiBi slopes are then applied synthetically). For Qwen3-style
models with a per-head ``q_norm``/``k_norm`` it is also before that norm, exactly like the paper's hooks.

Where each architecture's projections are, and its ALiBi slopes, come from the one table of model families,
:mod:`positional_lsh.integrations.families` (shared with the transformers swap, so capture and swap agree on
the slopes: those the stock model computes). That table is imported when a model is inspected, never at
``import positional_lsh.theory``, and needs transformers only for transformers models.

**How any other model opts in.** Implement one method on the model::

    def qkv_capture_points(self) -> list[positional_lsh.theory.qkv.CapturePoint]:
        return [
            CapturePoint(layer=i, module=block.attn.c_attn, role="qkv",
                         split=split_fused_blocks(num_heads, num_kv_heads, head_dim))
            for i, block in enumerate(self.blocks)
        ]

(see :mod:`positional_lsh.theory.qkv` for :class:`CapturePoint` and the ready-made splits). A model that uses
ALiBi can also expose ``alibi_slopes`` (a ``(H,)`` tensor attribute or method) so that
:func:`model_alibi_slopes` finds its slopes. Nothing else is needed: :func:`capture_qkv` runs the model's
ordinary ``forward(input_ids)`` and collects the hooked outputs.

Synthetic inputs: :func:`synthetic_qkv` draws Gaussian Q/K/V (scores ``q.k/sqrt(d)`` of unit variance).
Real text: :func:`load_model_for_capture` and :func:`tokenize_contexts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from positional_lsh.ops.checks import GeneratorLike, as_generator, positive_int
from positional_lsh.theory.qkv import (
    CapturePoint,
    LayerQKV,
    QKVCapturable,
)

__all__ = ["capture_qkv", "load_model_for_capture", "model_alibi_slopes", "synthetic_qkv"]


def capture_points(model: nn.Module) -> list[CapturePoint]:
    """Where to hook ``model``: its own :meth:`QKVCapturable.qkv_capture_points`, else the capture points of its
    family in :mod:`positional_lsh.integrations.families` (Llama family, BLOOM, Falcon, GPT-NeoX, MPT, GPT-2,
    the project's ``TransformerLM``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, QKVCapturable):
        points = list(model.qkv_capture_points())
    else:
        from positional_lsh.integrations.families import family_capture_points

        points = family_capture_points(model)
    if not points:
        raise ValueError(
            f"cannot find attention projections in {type(model).__name__}: implement "
            "qkv_capture_points() on the model (see positional_lsh.theory.capture)"
        )
    return points


class _StopForward(Exception):
    """Raised by a hook once every requested layer is captured, to skip the rest of the forward."""


def capture_qkv(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    layers: Sequence[int] | None = None,
    forward: Callable[[nn.Module, torch.Tensor], Any] | None = None,
    dtype: torch.dtype = torch.float32,
    stop_early: bool = True,
) -> list[LayerQKV]:
    """Run ``model`` on ``input_ids`` and return the Q/K/V of the requested layers.

    Args:
        model: any ``nn.Module`` supported by :func:`capture_points`.
        input_ids: ``(B, n)`` int64 token ids.
        layers: layer indices to capture (negative counts from the end); default all.
        forward: how to call the model, default ``model(input_ids)`` (transformers models get
            ``use_cache=False``).
        dtype: dtype of the returned tensors (copied to the CPU).
        stop_early: stop the forward pass once the last requested layer is captured.

    Returns:
        one :class:`LayerQKV` per requested layer, in layer order, ``q (B, Hq, n, d)``, ``k, v (B, Hkv, n, d)``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError("input_ids must be a (batch, seq_len) integer tensor")
    points = capture_points(model)
    wanted = _wanted_layers(sorted({p.layer for p in points}), layers)
    store: dict[int, dict[str, torch.Tensor]] = {li: {} for li in wanted}
    stop_at = max(wanted) if stop_early else None
    handles = [
        p.module.register_forward_hook(_capture_hook(p, store, dtype, stop_at)) for p in points if p.layer in wanted
    ]
    try:
        _run_forward(model, input_ids, forward)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return [_layer_qkv(li, store[li]) for li in sorted(wanted)]


def _capture_hook(
    point: CapturePoint, store: dict[int, dict[str, torch.Tensor]], dtype: torch.dtype, stop_at: int | None
) -> Callable[..., None]:
    """A forward hook storing ``point``'s split output as CPU ``dtype`` tensors in ``store[point.layer]``; raises
    :class:`_StopForward` once layer ``stop_at`` has its ``q``, ``k`` and ``v``."""

    def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
        x = out[0] if isinstance(out, (tuple, list)) else out
        parts = point.split(x.detach())
        got = store[point.layer]
        if point.role == "qkv":
            q, k, v = parts
            got.update(q=q, k=k, v=v)
        else:
            got[point.role] = parts
        for key in list(got):
            got[key] = got[key].to("cpu", dtype).contiguous()
        if point.layer == stop_at and len(got) == 3:
            raise _StopForward

    return hook


def _run_forward(
    model: nn.Module, input_ids: torch.Tensor, forward: Callable[[nn.Module, torch.Tensor], Any] | None
) -> None:
    """``forward(model, input_ids)``, else ``model(input_ids)`` (``use_cache=False`` for transformers models)."""
    with torch.no_grad():
        if forward is not None:
            forward(model, input_ids)
        elif _is_transformers_model(model):
            model(input_ids, use_cache=False)
        else:
            model(input_ids)


def _wanted_layers(all_layers: list[int], layers: Sequence[int] | None) -> set[int]:
    """The requested layer indices (negative ones count from the end), checked against ``all_layers``."""
    if layers is None:
        return set(all_layers)
    wanted = set()
    for li in layers:
        if isinstance(li, bool) or not isinstance(li, int):
            raise TypeError(f"layers must contain ints, got {li!r}")
        idx = all_layers[li] if li < 0 and -li <= len(all_layers) else li
        if idx not in all_layers:
            raise ValueError(f"layer {li} not in the model's layers {all_layers[0]}..{all_layers[-1]}")
        wanted.add(idx)
    return wanted


def _layer_qkv(layer: int, got: dict[str, torch.Tensor]) -> LayerQKV:
    """The captured ``q``, ``k``, ``v`` of one layer, checked."""
    missing = {"q", "k", "v"} - set(got)
    if missing:
        raise RuntimeError(f"layer {layer}: the forward pass did not produce {sorted(missing)}")
    q, k, v = got["q"], got["k"], got["v"]
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise RuntimeError(f"layer {layer}: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}")
    return LayerQKV(layer, q, k, v)


def _is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is optional
        return False
    return isinstance(model, PreTrainedModel)


def model_alibi_slopes(model: nn.Module) -> torch.Tensor | None:
    """The model's own ALiBi slopes as ``(Hq,)`` float64, in this library's convention (bias
    ``-m |i - j|`` added to the *scaled* score), or ``None`` when the model has no ALiBi.

    A model's own ``alibi_slopes`` (tensor attribute or method) wins; otherwise the slopes come from
    :func:`positional_lsh.integrations.families.native_slopes`, the function the transformers swap uses too:
    BLOOM, MPT and Falcon with ``alibi=True`` (read from the stock model's own ALiBi builders, so Falcon's are
    rounded to bfloat16 and divided by ``sqrt(d)``, and MPT's ignore ``attn_config.alibi_bias_max`` as
    transformers' MPT does), and the project's ``TransformerLM`` (``cfg.slopes()`` for its ALiBi modes).
    """
    own = getattr(model, "alibi_slopes", None)
    if callable(own):
        own = own()
    if isinstance(own, torch.Tensor):
        return own.detach().to("cpu", torch.float64).reshape(-1)
    from positional_lsh.integrations.families import native_slopes

    return native_slopes(model)


def synthetic_qkv(
    num_layers: int,
    num_heads: int,
    seq_len: int,
    head_dim: int = 64,
    *,
    batch: int = 1,
    num_kv_heads: int | None = None,
    generator: GeneratorLike = 0,
    dtype: torch.dtype = torch.float32,
) -> list[LayerQKV]:
    """Gaussian Q/K/V: i.i.d. standard normal entries (scores ``q.k / sqrt(d)`` have unit variance)."""
    num_layers = positive_int("num_layers", num_layers)
    num_heads = positive_int("num_heads", num_heads)
    seq_len = positive_int("seq_len", seq_len)
    head_dim = positive_int("head_dim", head_dim)
    batch = positive_int("batch", batch)
    hkv = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    if num_heads % hkv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({hkv})")
    g = as_generator(generator)
    out = []
    for layer in range(num_layers):
        q = torch.randn(batch, num_heads, seq_len, head_dim, generator=g, dtype=dtype)
        k = torch.randn(batch, hkv, seq_len, head_dim, generator=g, dtype=dtype)
        v = torch.randn(batch, hkv, seq_len, head_dim, generator=g, dtype=dtype)
        out.append(LayerQKV(layer, q, k, v))
    return out


def load_model_for_capture(path: str | Path, *, tokenizer: str | Path | None = None) -> tuple[nn.Module, Any]:
    """Load a local transformers causal LM and its tokenizer for :func:`capture_qkv` (never downloads).

    Float32 on the CPU, eval mode, ``local_files_only``. (Not the project's own checkpoints: those are
    :func:`positional_lsh.lm.load_checkpoint`.)

    Args:
        path: a directory holding ``config.json`` and weights.
        tokenizer: tokenizer directory (default ``path``).

    Returns:
        ``(model in eval mode, float32, on the CPU; tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a local transformers checkpoint (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=torch.float32)
    tok_path = Path(tokenizer) if tokenizer is not None else p
    try:
        tok = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(
            f"no tokenizer found in {tok_path}; pass one with --tokenizer ({exc.__class__.__name__}: {exc})"
        ) from None
    return model.eval(), tok


def tokenize_contexts(
    encode: Callable[[str], Sequence[int]], text: str, seq_len: int, num_inputs: int = 1
) -> torch.Tensor:
    """Cut ``text`` into ``num_inputs`` consecutive non-overlapping windows of ``seq_len`` tokens.

    Args:
        encode: ``str -> token ids`` (e.g. ``tokenizer.encode`` or a tokenizer object's ``encode``).
        text: the text.
        seq_len: tokens per context.
        num_inputs: number of contexts.

    Returns:
        ``(num_inputs, seq_len)`` int64.
    """
    seq_len = positive_int("seq_len", seq_len)
    num_inputs = positive_int("num_inputs", num_inputs)
    need = seq_len * num_inputs
    ids: list[int] = []
    # Tokenize a growing prefix so that a huge file is not tokenized in full.
    chars = max(4096, need * 8)
    while True:
        ids = list(encode(text[:chars]))
        if len(ids) >= need or chars >= len(text):
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens; {num_inputs} contexts of {seq_len} tokens need {need}")
    return torch.tensor(ids[:need], dtype=torch.long).reshape(num_inputs, seq_len)
