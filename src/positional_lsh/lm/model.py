"""A compact decoder-only transformer language model whose attention position mode is one argument.

Pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> GELU MLP -> residual), tied
input/output embeddings, no biases, nanoGPT-style initialization. The only thing that changes between
position modes is how the attention turns ``q, k, v`` into an output; every mode calls the core library
or torch's own attention, never a second implementation:

* ``"alibi"`` — exact ALiBi (bias ``-m_h |i - j|`` after scaling). Short sequences use torch's
  ``scaled_dot_product_attention`` with the bias built by :func:`~positional_lsh.alibi_bias` (fastest for
  training at short lengths); long ones use :func:`~positional_lsh.alibi_attention` (``O(n)`` memory).
  ``alibi_impl`` forces one or the other; both compute the same function.
* ``"plsh"`` — positional-LSH attention (:func:`~positional_lsh.plsh_attention`) with ``num_samples``
  partitions of a ``scheme``, for the standard per-head ALiBi slopes or one constant ``sigma`` for every head
  (as the paper did). Training mode draws fresh partitions at every call from each layer's own generator
  (seeded by ``seed`` and the layer index); eval mode uses partitions seeded by ``eval_seed`` and the layer
  index, the same at every call and every length (the law of a partition does not depend on the length), so
  evaluation is deterministic and decoding with a KV cache equals a full recomputation.
* ``"window-alibi"`` — exact ALiBi restricted to keys with ``|i - j| <= window_h``: ``window`` tokens for
  every head, or ``window_factor * sigma_h`` per head.
* ``"rope"`` — rotary position embedding (GPT-NeoX half-split layout) and causal attention.
* ``"nope"`` — no position information: causal attention only.

The mode can be changed after training without touching the weights (:meth:`TransformerLM.set_position`),
e.g. to evaluate an ALiBi-trained model with positional-LSH attention at several ``T``.

Checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`) are directories holding ``config.json``
(the :class:`ModelConfig` and metadata), ``model.safetensors`` (float32, or float16/bfloat16 storage that
loads back as float32) and ``tokenizer.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from positional_lsh.lm.data import BPETokenizer
from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.reference import alibi_attention, alibi_bias
from positional_lsh.ops.sampling import SCHEMES, sample_partitions
from positional_lsh.ops.slopes import alibi_slopes

__all__ = [
    "CHECKPOINT_FORMAT",
    "POSITIONS",
    "Checkpoint",
    "ModelConfig",
    "TransformerLM",
    "is_checkpoint",
    "load_checkpoint",
    "load_shipped_model",
    "save_checkpoint",
    "shipped_checkpoint_path",
]

POSITIONS = ("alibi", "plsh", "window-alibi", "rope", "nope")
"""The attention position modes."""

ALIBI_IMPLS = ("auto", "sdpa", "chunked")

CHECKPOINT_FORMAT = "positional-lsh-lm"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"

# alibi_impl="auto" uses SDPA with a prebuilt (H, Lq, Lk) bias up to this many bias entries.
_SDPA_MAX_BIAS_ENTRIES = 2**22

_SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(name: str, value: object, *, positive: bool = True, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or (positive and (v < 0 or (v == 0 and not allow_zero))):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number, got {value}")
    return v


def _layer_seed(seed: int, layer: int) -> int:
    """Independent-looking seeds per layer from one base seed (a fixed odd multiplier, kept below 2**63)."""
    return (seed * 1_000_003 + layer * 7_919 + 1) % (2**62)


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Model hyperparameters, including the attention position mode.

    Attributes:
        vocab_size: number of token ids (the tokenizer's ``vocab_size``).
        seq_len: the training context length. Not a hard limit: ALiBi, positional LSH and NoPE run at any
            length, RoPE too (its extrapolation is what it is). Evaluation reports lengths as multiples of it.
        n_layer, n_head, d_model: depth, heads, width (``d_model % n_head == 0``; head dim even for RoPE).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout: dropout on attention outputs, MLP outputs and embeddings (0 disables).
        position: ``"alibi"``, ``"plsh"``, ``"window-alibi"``, ``"rope"`` or ``"nope"``.
        sigma: ``None`` for the standard per-head ALiBi slopes ``2^{-8h/H}``; otherwise one length scale for
            every head (slope ``1/sigma``), as the paper used (``sigma = 256``). For alibi, plsh, window-alibi.
            ``math.inf`` means slope 0: no positional bias (positional LSH is then exact causal attention).
        num_samples: positional-LSH samples ``T`` per call (``plsh``).
        scheme: positional-LSH partition scheme (``"discrete"``, ``"gamma"``, ``"fixed"``).
        seed: seed of the training-time partition generators (one per layer, derived from it).
        eval_seed: seed of the eval-mode partitions (one per layer, derived from it).
        window: ``window-alibi``'s largest kept distance ``|i - j|``: ``None`` for ``window_factor * sigma_h``
            per head, one number for every head, or a list with one number per head.
        window_factor: per-head window in units of ``sigma_h = 1 / m_h`` when ``window`` is ``None``.
        rope_base: RoPE frequency base.
        alibi_impl: ``"auto"``, ``"sdpa"`` (torch SDPA with a ``(H, n, n)`` bias from ``alibi_bias``) or
            ``"chunked"`` (``alibi_attention``, ``O(n)`` memory). Also used by ``window-alibi``.
        attn_backend: kernel backend of ``plsh_attention``/``alibi_attention`` (``"auto"``, ``"flash"``,
            ``"math"``).
        attn_fp32: compute attention in float32 even under bf16/fp16 autocast (the projections and MLP stay
            in low precision). Keeps the ALiBi bias unrounded, and on CPU torch's float32 flash kernel is faster
            than its bf16 one on the many small blocks of positional LSH (docs/experiments.md).
    """

    vocab_size: int = 8192
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 8
    d_model: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    position: str = "alibi"
    sigma: float | None = None
    num_samples: int = 1
    scheme: str = "discrete"
    seed: int = 0
    eval_seed: int = 0
    window: float | list[float] | None = None
    window_factor: float = 12.0
    rope_base: float = 10000.0
    alibi_impl: str = "auto"
    attn_backend: str = "auto"
    attn_fp32: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first bad field."""
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio", "num_samples"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "eval_seed"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        _check_float("dropout", self.dropout, allow_zero=True)
        if self.dropout >= 1:
            raise ValueError(f"dropout must be < 1, got {self.dropout}")
        if not isinstance(self.position, str) or self.position not in POSITIONS:
            raise ValueError(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.sigma is not None and not (isinstance(self.sigma, float) and self.sigma == math.inf):
            _check_float("sigma", self.sigma)
        if not isinstance(self.scheme, str) or self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.window is not None:
            values = self.window if isinstance(self.window, list | tuple) else [self.window]
            for w in values:
                _check_float("window", w, allow_zero=True)
            if isinstance(self.window, list | tuple) and len(self.window) != self.n_head:
                raise ValueError(f"window must have one entry per head ({self.n_head}), got {len(self.window)}")
        _check_float("window_factor", self.window_factor)
        _check_float("rope_base", self.rope_base)
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got d_model/n_head = {self.head_dim}")
        if self.alibi_impl not in ALIBI_IMPLS:
            raise ValueError(f"alibi_impl must be one of {ALIBI_IMPLS}, got {self.alibi_impl!r}")
        if not isinstance(self.attn_fp32, bool):
            raise TypeError(f"attn_fp32 must be a bool, got {type(self.attn_fp32).__name__}")
        if self.attn_backend not in ("auto", "flash", "math"):
            raise ValueError(f"attn_backend must be 'auto', 'flash' or 'math', got {self.attn_backend!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def slopes(self) -> torch.Tensor:
        """``(n_head,)`` float64 CPU ALiBi slopes: the standard schedule, or ``1/sigma`` for every head."""
        if self.sigma is None:
            return alibi_slopes(self.n_head).double()
        return torch.full((self.n_head,), 1.0 / float(self.sigma), dtype=torch.float64)

    def windows(self) -> torch.Tensor:
        """``(n_head,)`` float64 window (largest kept ``|i - j|``) of ``window-alibi``."""
        if self.window is None:
            return (self.window_factor / self.slopes()).clamp(max=2.0**40)  # slope 0: no window
        if isinstance(self.window, list | tuple):
            return torch.tensor([float(w) for w in self.window], dtype=torch.float64)
        return torch.full((self.n_head,), float(self.window), dtype=torch.float64)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a dict (unknown keys are an error, so typos do not pass silently)."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        return cls(**d)

    def describe(self) -> str:
        """A short label such as ``plsh T=4 discrete`` or ``alibi``."""
        sig = "" if self.sigma is None else f" sigma={self.sigma:g}"
        if self.position == "plsh":
            return f"plsh T={self.num_samples} {self.scheme}{sig}"
        if self.position == "window-alibi":
            w = f"{self.window_factor:g}σ" if self.window is None else "custom"
            return f"window-alibi ({w}){sig}"
        if self.position == "alibi":
            return f"alibi{sig}"
        return self.position


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``(L, head_dim // 2)`` for integer ``positions (L,)``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, H, L, d)`` by position: pairs ``(x[..., i], x[..., i + d/2])`` (GPT-NeoX layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


KVCache = list["tuple[torch.Tensor, torch.Tensor] | None"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the position mode is set by :meth:`configure` (no parameters)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout
        self.configure(cfg)

    def configure(self, cfg: ModelConfig) -> None:
        """Set the position mode and its settings from ``cfg`` (weights untouched)."""
        self.cfg = cfg
        self.position = cfg.position
        self.slopes = cfg.slopes()
        self.window = cfg.windows() if cfg.position == "window-alibi" else None
        # Training-time partitions: a generator per layer, advanced at every training call.
        self.generator = torch.Generator().manual_seed(_layer_seed(cfg.seed, self.layer_idx))
        self._bias_cache: tuple[tuple[Any, ...], torch.Tensor] | None = None

    def extra_repr(self) -> str:
        return f"position={self.cfg.describe()!r}"

    def partitions(self, seq_len: int) -> Any:
        """The positional-LSH partitions of the next call (advances the training generator in training)."""
        gen = self.generator if self.training else _layer_seed(self.cfg.eval_seed, self.layer_idx)
        return sample_partitions(seq_len, self.slopes, self.cfg.num_samples, scheme=self.cfg.scheme, generator=gen)

    def _sdpa_bias(self, lq: int, lk: int, window: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        key = (lq, lk, q.dtype, q.device, None if window is None else tuple(window.tolist()))
        if self._bias_cache is None or self._bias_cache[0] != key:
            bias = alibi_bias(
                lq, lk, self.slopes, causal=True, window=window, q_offset=lk - lq, dtype=q.dtype, device=q.device
            )
            self._bias_cache = (key, bias)
        return self._bias_cache[1]

    def _alibi(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
        lq, lk = q.shape[2], k.shape[2]
        impl = self.cfg.alibi_impl
        if impl == "auto":
            impl = "sdpa" if self.n_head * lq * lk <= _SDPA_MAX_BIAS_ENTRIES else "chunked"
        if impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._sdpa_bias(lq, lk, window, q))
        return alibi_attention(q, k, v, self.slopes, causal=True, window=window, backend=self.cfg.attn_backend)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of ``q (B, H, Lq, d)`` to ``k, v (B, H, Lk, d)``; queries are the last ``Lq`` positions."""
        lq, lk = q.shape[2], k.shape[2]
        if self.position == "alibi":
            return self._alibi(q, k, v, None)
        if self.position == "window-alibi":
            return self._alibi(q, k, v, self.window)
        if self.position == "plsh":
            parts = self.partitions(lk)
            return plsh_attention(q, k, v, partitions=parts, causal=True, backend=self.cfg.attn_backend)
        # rope / nope: plain causal attention (rotation already applied for rope).
        if lq == lk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if lq == 1:
            return F.scaled_dot_product_attention(q, k, v)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x (B, L, d_model)`` -> ``(y (B, L, d_model), (k, v))``; ``cache`` holds earlier keys/values."""
        b, l, c = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        past = 0 if cache is None else cache[0].shape[2]
        if self.position == "rope":
            pos = torch.arange(past, past + l, device=x.device)
            cos, sin = rope_cos_sin(pos, self.head_dim, self.cfg.rope_base)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        if self.cfg.attn_fp32 and q.dtype in (torch.float16, torch.bfloat16):
            with torch.autocast(x.device.type, enabled=False):
                y = self.attend(q.float(), k.float(), v.float()).to(q.dtype)
        else:
            y = self.attend(q, k, v)
        y = y.transpose(1, 2).reshape(b, l, c)
        y = F.dropout(self.proj(y), self.dropout, self.training)
        return y, (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        a, kv = self.attn(self.norm1(x), cache)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return x, kv


class TransformerLM(nn.Module):
    """Decoder-only transformer language model; see the module docstring.

    ``model(idx)`` takes ``idx (B, L)`` int64 token ids and returns float32 logits ``(B, L, vocab_size)``;
    ``model(idx, targets)`` also returns the mean cross-entropy over targets that are not ``-100``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nanoGPT initialization: N(0, 0.02), residual projections scaled by ``1/sqrt(2 n_layer)``."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            else:
                nn.init.ones_(p)

    def num_params(self) -> int:
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def set_position(self, position: str | None = None, **settings: Any) -> ModelConfig:
        """Change the attention position mode or its settings in place, keeping the weights.

        ``settings`` are :class:`ModelConfig` fields (``num_samples``, ``scheme``, ``sigma``, ``window``,
        ``window_factor``, ``eval_seed``, ``seed``, ``alibi_impl``, ``attn_backend``). Returns the new config.
        Example: ``model.set_position("plsh", num_samples=16, scheme="gamma")``.
        """
        allowed = {"num_samples", "scheme", "sigma", "window", "window_factor", "eval_seed", "seed", "alibi_impl"}
        allowed |= {"attn_backend", "attn_fp32", "rope_base"}
        bad = sorted(set(settings) - allowed)
        if bad:
            raise ValueError(f"set_position got settings that are not position settings: {bad}")
        changes = dict(settings)
        if position is not None:
            changes["position"] = position
        cfg = dataclasses.replace(self.cfg, **changes)  # validates
        self.cfg = cfg
        for block in self.blocks:
            block.attn.configure(cfg)
        return cfg

    def rng_state(self) -> list[torch.Tensor]:
        """States of the per-layer training partition generators (for exact resume)."""
        return [block.attn.generator.get_state() for block in self.blocks]

    def set_rng_state(self, states: list[torch.Tensor]) -> None:
        if len(states) != len(self.blocks):
            raise ValueError(f"states must have one entry per layer ({len(self.blocks)}), got {len(states)}")
        for block, s in zip(self.blocks, states, strict=True):
            block.attn.generator.set_state(s)

    def _check_idx(self, idx: object, name: str = "idx") -> torch.Tensor:
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dtype not in (torch.long, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"{name} must be an integer tensor, got dtype {idx.dtype}")
        if idx.dim() != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
            raise ValueError(f"{name} must have shape (batch, seq_len) with both >= 1, got {tuple(idx.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.cfg.vocab_size):
            raise ValueError(f"{name} holds ids outside [0, {self.cfg.vocab_size})")
        return idx.long()

    def forward_with_cache(
        self, idx: torch.Tensor, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits ``(B, L, V)`` float32 of ``idx (B, L)`` that follow the cached positions, and the new cache."""
        idx = self._check_idx(idx)
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"cache must have one entry per layer ({len(self.blocks)}), got {len(cache)}")
        x = F.dropout(self.embed(idx), self.cfg.dropout, self.training)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if cache is None else cache[i])
            new_cache.append(kv)
        logits = self.head(self.norm(x)).float()
        return logits, new_cache

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``idx (B, L)`` -> logits ``(B, L, V)``; with ``targets (B, L)`` -> ``(logits, loss)``."""
        idx = self._check_idx(idx)
        x = F.dropout(self.embed(idx), self.cfg.dropout, self.training)
        for block in self.blocks:
            x, _ = block(x)
        logits = self.head(self.norm(x)).float()
        if targets is None:
            return logits
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
            shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets must be a tensor of shape {tuple(idx.shape)}, got {shape}")
        loss = F.cross_entropy(logits.flatten(0, 1), targets.long().flatten(), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | int | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
    ) -> torch.Tensor:
        """Continue ``idx (B, L)`` by ``max_new_tokens`` sampled tokens; returns ``(B, L + new)`` int64.

        ``temperature = 0`` is greedy decoding. ``top_k`` keeps the ``k`` most likely tokens. ``generator``
        (CPU ``torch.Generator`` or int seed) makes sampling reproducible. With ``use_cache`` keys and values
        are cached (one forward per new token); without it every step recomputes the whole sequence — both
        give the same tokens (for ``plsh``, eval-mode partitions are fixed, so this holds exactly). Generation
        stops early when every row has produced ``stop_token``. The model is put in eval mode.
        """
        idx = self._check_idx(idx)
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, minimum=0)
        temperature = _check_float("temperature", temperature, allow_zero=True)
        if top_k is not None:
            top_k = _check_int("top_k", top_k)
        if isinstance(generator, bool):
            raise TypeError("generator must be a torch.Generator, an int seed or None")
        if isinstance(generator, numbers.Integral):
            generator = torch.Generator().manual_seed(int(generator))
        elif generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator)}")
        self.eval()
        out = idx.to(self.device)
        done = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        for _ in range(max_new_tokens):
            if use_cache:
                logits, cache = self.forward_with_cache(out if cache is None else out[:, -1:], cache)
            else:
                logits = self.forward(out)
            logits = logits[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(out.device)
            out = torch.cat((out, nxt), dim=1)
            if stop_token is not None:
                done |= nxt[:, 0] == stop_token
                if bool(done.all()):
                    break
        return out


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


class Checkpoint(NamedTuple):
    """A loaded checkpoint: the model (eval mode), its tokenizer (``None`` if absent) and the metadata."""

    model: TransformerLM
    tokenizer: BPETokenizer | None
    metadata: dict[str, Any]


def _as_dir(name: str, value: object) -> Path:
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name} must be a str or os.PathLike path, got {type(value).__name__}")
    return Path(value)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: TransformerLM,
    tokenizer: BPETokenizer | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and (if given) ``tokenizer.json`` into directory ``path``.

    ``dtype``: storage dtype of the weights, ``"float32"``, ``"float16"`` or ``"bfloat16"`` (loading always
    restores float32). ``metadata`` (JSON-serializable) is stored in ``config.json`` under ``"metadata"``.
    Files are written to temporary names and renamed, so an interrupted save never leaves a torn checkpoint.
    """
    from safetensors.torch import save_file

    p = _as_dir("path", path)
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if tokenizer is not None and not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"tokenizer must be a BPETokenizer or None, got {type(tokenizer).__name__}")
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in _SAVE_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype}")
        dtype = names[dtype]
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
    if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.cfg.vocab_size}")
    p.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", _SAVE_DTYPES[dtype]).contiguous()
        for k, v in model.state_dict().items()
        if k != "head.weight"  # tied to embed.weight
    }
    tmp = p / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": CHECKPOINT_FORMAT, "dtype": dtype})
    os.replace(tmp, p / WEIGHTS_FILE)
    config = {
        "format": CHECKPOINT_FORMAT,
        "version": 1,
        "model": model.cfg.to_dict(),
        "weights_dtype": dtype,
        "num_params": model.num_params(),
        "tokenizer_fingerprint": None if tokenizer is None else tokenizer.fingerprint,
        "metadata": metadata or {},
    }
    tmp = p / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, p / CONFIG_FILE)
    if tokenizer is not None:
        tmp = p / (TOKENIZER_FILE + ".tmp")
        tmp.write_text(tokenizer.to_str(), encoding="utf-8")
        os.replace(tmp, p / TOKENIZER_FILE)
    return p


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding one of this library's checkpoints."""
    p = Path(path)
    cfg = p / CONFIG_FILE
    if not (cfg.is_file() and (p / WEIGHTS_FILE).is_file()):
        return False
    try:
        return json.loads(cfg.read_text(encoding="utf-8")).get("format") == CHECKPOINT_FORMAT
    except (OSError, ValueError):
        return False


def load_checkpoint(
    path: str | os.PathLike[str], *, device: torch.device | str | None = None, **overrides: Any
) -> Checkpoint:
    """Load a checkpoint written by :func:`save_checkpoint`: float32 model in eval mode, tokenizer, metadata.

    ``overrides`` replace :class:`ModelConfig` fields (e.g. ``position="plsh", num_samples=16`` to evaluate
    an ALiBi-trained model with positional LSH; only settings without weights can change).
    """
    from safetensors.torch import load_file

    p = _as_dir("path", path)
    if not p.is_dir():
        raise ValueError(f"path {p} is not a directory")
    if not (p / CONFIG_FILE).is_file() or not (p / WEIGHTS_FILE).is_file():
        raise ValueError(f"path {p} is not a checkpoint directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads((p / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"path {p}: {CONFIG_FILE} is not a {CHECKPOINT_FORMAT} config (format={config.get('format')})")
    model_cfg = dict(config["model"])
    model_cfg.update(overrides)
    cfg = ModelConfig.from_dict(model_cfg)
    model = TransformerLM(cfg)
    state = {k: v.float() for k, v in load_file(str(p / WEIGHTS_FILE)).items()}
    state["head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True)
    if device is not None:
        model.to(device)
    model.eval()
    tokenizer = BPETokenizer.load(p / TOKENIZER_FILE) if (p / TOKENIZER_FILE).is_file() else None
    meta = dict(config.get("metadata") or {})
    meta.update({"weights_dtype": config.get("weights_dtype"), "num_params": config.get("num_params")})
    return Checkpoint(model, tokenizer, meta)


def shipped_checkpoint_path() -> Path:
    """Directory of the small ALiBi language model shipped inside the package (``checkpoints/alibi-lm``).

    Trained by ``plsh train`` on the shipped corpus; its recipe is ``checkpoints/alibi-lm/RECIPE.md``.
    """
    return Path(__file__).resolve().parent / "checkpoints" / "alibi-lm"


def load_shipped_model(*, device: torch.device | str | None = None, **overrides: Any) -> Checkpoint:
    """Load the shipped model (float32, eval mode) with its tokenizer; ``overrides`` as in :func:`load_checkpoint`
    (e.g. ``position="plsh", num_samples=16``)."""
    path = shipped_checkpoint_path()
    if not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"the shipped model is missing from {path} (a broken installation?)")
    return load_checkpoint(path, device=device, **overrides)
