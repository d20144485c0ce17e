"""Capture per-layer queries, keys and values of a model, for validating the theory on real activations.

Q/K/V are taken by forward hooks on the attention *projections*, as the paper did (§5.2): the output
of ``q_proj``/``k_proj``/``v_proj`` (Llama family: Llama, Mistral, Qwen, ...), of the fused
``query_key_value`` (BLOOM, Falcon, GPT-NeoX), of ``Wqkv`` (MPT), ``c_attn`` (GPT-2) or ``qkv`` (the
project's own ``TransformerLM`` and other nanoGPT-style modules with ``n_head`` and ``head_dim``). For RoPE models
this is *before* the rotary embedding (ALiBi slopes are then applied synthetically). For Qwen3-style
models with a per-head ``q_norm``/``k_norm`` it is also before that norm, exactly like the paper's hooks.

The project's own decoder (``positional_lsh.lm.model.TransformerLM``) is recognized as it is: its attention
modules hold a fused ``qkv`` projection with ``n_head`` and ``head_dim`` attributes, and its ``cfg.slopes()``
gives the ALiBi slopes of the ``alibi``/``plsh``/``window-alibi`` position modes.

**How any other model opts in.** Implement one method on the model::

    def qkv_capture_points(self) -> list[positional_lsh.theory.capture.CapturePoint]:
        return [
            CapturePoint(layer=i, module=block.attn.c_attn, role="qkv",
                         split=split_fused_blocks(num_heads, num_kv_heads, head_dim))
            for i, block in enumerate(self.blocks)
        ]

A :class:`CapturePoint` names a submodule whose forward *output* holds the projections, what it holds
(``"q"``, ``"k"``, ``"v"`` or ``"qkv"``), and a ``split`` function from that output (``(B, n, features)``)
to ``(B, H, n, d)`` tensors (one, or a ``(q, k, v)`` triple for ``"qkv"``). Ready-made splits:
:func:`split_heads` (one projection), :func:`split_fused_blocks` (``[q | k | v]`` concatenated, as
nanoGPT, GPT-2 and MPT do), :func:`split_fused_interleaved` (per-head ``[q, k, v]``, BLOOM/Falcon).
A model that uses ALiBi can also expose ``alibi_slopes`` (a ``(H,)`` tensor attribute or method) so that
:func:`model_alibi_slopes` finds its slopes. Nothing else is needed: :func:`capture_qkv` runs the model's
ordinary ``forward(input_ids)`` and collects the hooked outputs.

Synthetic inputs: :func:`synthetic_qkv` draws Gaussian Q/K/V (scores ``q.k/sqrt(d)`` of unit variance).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from positional_lsh.ops._checks import GeneratorLike, as_generator, positive_int
from positional_lsh.ops.slopes import alibi_slopes

__all__ = [
    "CapturePoint",
    "LayerQKV",
    "QKVCapturable",
    "capture_points",
    "capture_qkv",
    "load_checkpoint",
    "model_alibi_slopes",
    "split_fused_blocks",
    "split_fused_interleaved",
    "split_heads",
    "synthetic_qkv",
    "tokenize_contexts",
]

Split = Callable[[torch.Tensor], Any]


@dataclass(frozen=True)
class LayerQKV:
    """Queries, keys and values of one attention layer.

    Attributes:
        layer: layer index.
        q: ``(B, Hq, n, d)`` float tensor (CPU).
        k: ``(B, Hkv, n, d)``; ``Hq % Hkv == 0`` (grouped-query attention: query head ``h`` uses key head
            ``h // (Hq // Hkv)``).
        v: ``(B, Hkv, n, d)``.
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def seq_len(self) -> int:
        return int(self.q.shape[2])

    def head(self, h: int, batch: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` of query head ``h`` as ``(n, d)`` tensors (keys/values of its key head)."""
        group = self.q.shape[1] // self.k.shape[1]
        return self.q[batch, h], self.k[batch, h // group], self.v[batch, h // group]


@dataclass(frozen=True)
class CapturePoint:
    """A submodule whose forward output holds a layer's projections.

    Attributes:
        layer: the layer index the captured tensors belong to.
        module: the submodule to hook (its output is captured; a tuple output uses its first element).
        role: ``"q"``, ``"k"``, ``"v"`` (one projection) or ``"qkv"`` (all three, fused).
        split: maps the output ``(B, n, features)`` to ``(B, H, n, d)`` (role q/k/v) or to a
            ``(q, k, v)`` triple of such tensors (role qkv).
    """

    layer: int
    module: nn.Module
    role: str
    split: Split

    def __post_init__(self) -> None:
        if self.role not in ("q", "k", "v", "qkv"):
            raise ValueError(f"role must be 'q', 'k', 'v' or 'qkv', got {self.role!r}")
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(self.module).__name__}")


@runtime_checkable
class QKVCapturable(Protocol):
    """A model that says where its projections are (see the module docstring)."""

    def qkv_capture_points(self) -> Sequence[CapturePoint]: ...


def split_heads(num_heads: int, head_dim: int) -> Split:
    """Split for one projection: ``(B, n, H*d) -> (B, H, n, d)``."""

    def split(x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.reshape(b, n, num_heads, head_dim).transpose(1, 2)

    return split


def split_fused_blocks(num_heads: int, num_kv_heads: int, head_dim: int) -> Split:
    """Split for ``[q (H*d) | k (Hkv*d) | v (Hkv*d)]`` concatenated features (nanoGPT/GPT-2 ``c_attn``, MPT)."""
    sq, skv = num_heads * head_dim, num_kv_heads * head_dim

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = x.split([sq, skv, skv], dim=-1)
        return (
            split_heads(num_heads, head_dim)(q),
            split_heads(num_kv_heads, head_dim)(k),
            split_heads(num_kv_heads, head_dim)(v),
        )

    return split


def split_fused_interleaved(num_heads: int, head_dim: int) -> Split:
    """Split for per-head interleaved ``(B, n, H, 3, d)`` features (BLOOM, Falcon without multi-query)."""

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        f = x.reshape(b, n, num_heads, 3, head_dim)
        return tuple(f[..., i, :].transpose(1, 2) for i in range(3))  # type: ignore[return-value]

    return split


def _split_neox(num_heads: int, head_dim: int) -> Split:
    """GPT-NeoX: ``(B, n, H, 3d)``, each head holding ``[q | k | v]``."""

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        f = x.reshape(b, n, num_heads, 3 * head_dim).transpose(1, 2)
        return f.chunk(3, dim=-1)  # type: ignore[return-value]

    return split


def _split_falcon_grouped(num_heads: int, num_kv_heads: int, head_dim: int) -> Split:
    """Falcon ``new_decoder_architecture``: ``(B, n, Hkv, H/Hkv + 2, d)``: the group's queries, then k, v."""
    group = num_heads // num_kv_heads

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        f = x.reshape(b, n, num_kv_heads, group + 2, head_dim)
        q = f[:, :, :, :group].reshape(b, n, num_heads, head_dim).transpose(1, 2)
        return q, f[:, :, :, group].transpose(1, 2), f[:, :, :, group + 1].transpose(1, 2)

    return split


def _split_falcon_multiquery(num_heads: int, head_dim: int) -> Split:
    """Falcon ``multi_query``: ``(B, n, H + 2, d)``: H queries, one key, one value."""

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        f = x.reshape(b, n, num_heads + 2, head_dim)
        return (
            f[:, :, :num_heads].transpose(1, 2),
            f[:, :, num_heads : num_heads + 1].transpose(1, 2),
            f[:, :, num_heads + 1 :].transpose(1, 2),
        )

    return split


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _cfg(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _auto_points(model: nn.Module) -> list[CapturePoint]:
    """Capture points of the transformers architectures listed in the module docstring."""
    config = _config(model)
    hidden = _cfg(config, "hidden_size", "d_model", "n_embd")
    heads = _cfg(config, "num_attention_heads", "n_head", "n_heads")
    points: list[CapturePoint] = []
    layer = 0
    for _name, mod in model.named_modules():
        cls = type(mod).__name__
        if all(isinstance(getattr(mod, p, None), nn.Module) for p in ("q_proj", "k_proj", "v_proj")):
            q_out = _out_features(mod.q_proj)
            k_out = _out_features(mod.k_proj)
            d = getattr(mod, "head_dim", None) or _cfg(config, "head_dim") or (hidden // heads)
            hq, hkv = q_out // d, k_out // d
            li = getattr(mod, "layer_idx", None)
            li = layer if li is None else int(li)
            points += [
                CapturePoint(li, mod.q_proj, "q", split_heads(hq, d)),
                CapturePoint(li, mod.k_proj, "k", split_heads(hkv, d)),
                CapturePoint(li, mod.v_proj, "v", split_heads(hkv, d)),
            ]
            layer += 1
        elif (
            isinstance(getattr(mod, "qkv", None), nn.Linear)
            and isinstance(getattr(mod, "n_head", None), int)
            and isinstance(getattr(mod, "head_dim", None), int)
        ):
            # nanoGPT-style fused projection [q | k | v], as the project's TransformerLM
            # (``qkv(x).view(b, l, 3, n_head, head_dim)``); RoPE, when configured, comes after it.
            h, d = mod.n_head, mod.head_dim
            li = getattr(mod, "layer_idx", None)
            li = layer if li is None else int(li)
            points.append(CapturePoint(li, mod.qkv, "qkv", split_fused_blocks(h, h, d)))
            layer += 1
        elif isinstance(getattr(mod, "query_key_value", None), nn.Module) and "Falcon" in cls:
            d = mod.head_dim
            h = mod.num_heads
            if getattr(mod, "new_decoder_architecture", False):
                split = _split_falcon_grouped(h, mod.num_kv_heads, d)
            elif getattr(mod, "multi_query", False):
                split = _split_falcon_multiquery(h, d)
            else:
                split = split_fused_interleaved(h, d)
            points.append(CapturePoint(layer, mod.query_key_value, "qkv", split))
            layer += 1
        elif isinstance(getattr(mod, "query_key_value", None), nn.Module) and "NeoX" in cls:
            d = getattr(mod, "head_size", None) or getattr(mod, "head_dim", None) or hidden // heads
            points.append(CapturePoint(layer, mod.query_key_value, "qkv", _split_neox(heads, d)))
            layer += 1
        elif isinstance(getattr(mod, "query_key_value", None), nn.Module):  # BLOOM
            h = getattr(mod, "num_heads", heads)
            d = getattr(mod, "head_dim", hidden // h)
            points.append(CapturePoint(layer, mod.query_key_value, "qkv", split_fused_interleaved(h, d)))
            layer += 1
        elif isinstance(getattr(mod, "Wqkv", None), nn.Module):  # MPT
            h = getattr(mod, "n_heads", heads)
            d = getattr(mod, "head_dim", hidden // h)
            points.append(CapturePoint(layer, mod.Wqkv, "qkv", split_fused_blocks(h, h, d)))
            layer += 1
        elif isinstance(getattr(mod, "c_attn", None), nn.Module) and hasattr(mod, "split_size"):  # GPT-2
            h = getattr(mod, "num_heads", heads)
            d = getattr(mod, "head_dim", hidden // h)
            points.append(CapturePoint(layer, mod.c_attn, "qkv", split_fused_blocks(h, h, d)))
            layer += 1
    return points


def _out_features(mod: nn.Module) -> int:
    out = getattr(mod, "out_features", None)
    if out is None:
        weight = getattr(mod, "weight", None)
        if weight is None:
            raise ValueError(f"cannot tell the output size of {type(mod).__name__}")
        out = weight.shape[0]
    return int(out)


def capture_points(model: nn.Module) -> list[CapturePoint]:
    """Where to hook ``model``: its own :meth:`QKVCapturable.qkv_capture_points`, else auto-detection of the
    supported transformers architectures (Llama family, BLOOM, Falcon, GPT-NeoX, MPT, GPT-2)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, QKVCapturable):
        points = list(model.qkv_capture_points())
    else:
        points = _auto_points(model)
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
    all_layers = sorted({p.layer for p in points})
    if layers is None:
        wanted = set(all_layers)
    else:
        wanted = set()
        for li in layers:
            if isinstance(li, bool) or not isinstance(li, int):
                raise TypeError(f"layers must contain ints, got {li!r}")
            idx = all_layers[li] if li < 0 and -li <= len(all_layers) else li
            if idx not in all_layers:
                raise ValueError(f"layer {li} not in the model's layers {all_layers[0]}..{all_layers[-1]}")
            wanted.add(idx)
    store: dict[int, dict[str, torch.Tensor]] = {li: {} for li in wanted}
    last = max(wanted)
    handles = []

    def make_hook(point: CapturePoint) -> Callable[..., None]:
        def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
            x = out[0] if isinstance(out, (tuple, list)) else out
            parts = point.split(x.detach())
            if point.role == "qkv":
                q, k, v = parts
                store[point.layer].update(q=q, k=k, v=v)
            else:
                store[point.layer][point.role] = parts
            for key in list(store[point.layer]):
                store[point.layer][key] = store[point.layer][key].to("cpu", dtype).contiguous()
            if stop_early and point.layer == last and len(store[last]) == 3:
                raise _StopForward

        return hook

    for point in points:
        if point.layer in wanted:
            handles.append(point.module.register_forward_hook(make_hook(point)))
    try:
        with torch.no_grad():
            if forward is not None:
                forward(model, input_ids)
            elif _is_transformers_model(model):
                model(input_ids, use_cache=False)
            else:
                model(input_ids)
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    out = []
    for li in sorted(wanted):
        got = store[li]
        missing = {"q", "k", "v"} - set(got)
        if missing:
            raise RuntimeError(f"layer {li}: the forward pass did not produce {sorted(missing)}")
        q, k, v = got["q"], got["k"], got["v"]
        if q.shape[1] % k.shape[1] or k.shape != v.shape:
            raise RuntimeError(f"layer {li}: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}")
        out.append(LayerQKV(li, q, k, v))
    return out


def _is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is optional
        return False
    return isinstance(model, PreTrainedModel)


def model_alibi_slopes(model: nn.Module) -> torch.Tensor | None:
    """The model's own ALiBi slopes as ``(Hq,)`` float64, in this library's convention (bias
    ``-m |i - j|`` added to the *scaled* score), or ``None`` when the model has no ALiBi.

    Knows BLOOM and MPT (``attn_config.alibi``), Falcon with ``alibi=True`` (whose bias is added before
    the ``1/sqrt(d)`` scaling, so its effective slope is ``m / sqrt(d)``), and any model exposing an
    ``alibi_slopes`` tensor attribute or method.
    """
    own = getattr(model, "alibi_slopes", None)
    if callable(own):
        own = own()
    if isinstance(own, torch.Tensor):
        return own.detach().to("cpu", torch.float64).reshape(-1)
    cfg = getattr(model, "cfg", None)  # the project's TransformerLM: ModelConfig.position and .slopes()
    if getattr(cfg, "position", None) in ("alibi", "plsh", "window-alibi") and callable(getattr(cfg, "slopes", None)):
        return cfg.slopes().detach().to("cpu", torch.float64).reshape(-1)
    config = _config(model)
    if config is None:
        return None
    mtype = getattr(config, "model_type", "")
    heads = _cfg(config, "num_attention_heads", "n_head", "n_heads")
    if mtype == "bloom":
        return alibi_slopes(int(heads)).double()
    if mtype == "mpt":
        attn = getattr(config, "attn_config", None)
        if attn is None or not getattr(attn, "alibi", False):
            return None
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        bias = build_mpt_alibi_tensor(int(heads), 2, getattr(attn, "alibi_bias_max", 8))
        return (-bias[:, 0, 0]).to(torch.float64)
    if mtype == "falcon":
        if not getattr(config, "alibi", False):
            return None
        d = _cfg(config, "head_dim") or config.hidden_size // heads
        return alibi_slopes(int(heads)).double() / math.sqrt(d)
    return None


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


def load_checkpoint(path: str | Path, *, tokenizer: str | Path | None = None) -> tuple[nn.Module, Any]:
    """Load a local transformers causal LM and its tokenizer (never downloads: ``local_files_only``).

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
