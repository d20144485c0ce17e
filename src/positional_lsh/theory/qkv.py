"""Where a layer's queries, keys and values are: capture points and the splits of projection outputs.

A :class:`CapturePoint` names a submodule whose forward *output* holds the projections, what it holds
(``"q"``, ``"k"``, ``"v"`` or ``"qkv"``), and a ``split`` function from that output (``(B, n, features)``)
to ``(B, H, n, d)`` tensors (one, or a ``(q, k, v)`` triple for ``"qkv"``). Ready-made splits:
:func:`split_heads` (one projection), :func:`split_fused_blocks` (``[q | k | v]`` concatenated, as
nanoGPT, GPT-2 and MPT do), :func:`split_fused_interleaved` (per-head ``[q, k, v]``, BLOOM/Falcon),
:func:`split_neox` (GPT-NeoX), :func:`split_falcon_grouped` and :func:`split_falcon_multiquery` (Falcon's
grouped and multi-query layouts). :class:`LayerQKV` holds what was captured for one layer.

The capture points of the supported architectures are listed in :mod:`positional_lsh.integrations.families`;
:mod:`positional_lsh.theory.capture` runs the hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "CapturePoint",
    "LayerQKV",
    "QKVCapturable",
    "Split",
    "split_fused_blocks",
    "split_fused_interleaved",
    "split_heads",
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
    """A model that says where its projections are (see :mod:`positional_lsh.theory.capture`)."""

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


def split_neox(num_heads: int, head_dim: int) -> Split:
    """GPT-NeoX: ``(B, n, H, 3d)``, each head holding ``[q | k | v]``."""

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        f = x.reshape(b, n, num_heads, 3 * head_dim).transpose(1, 2)
        return f.chunk(3, dim=-1)  # type: ignore[return-value]

    return split


def split_falcon_grouped(num_heads: int, num_kv_heads: int, head_dim: int) -> Split:
    """Falcon ``new_decoder_architecture``: ``(B, n, Hkv, H/Hkv + 2, d)``: the group's queries, then k, v."""
    group = num_heads // num_kv_heads

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        f = x.reshape(b, n, num_kv_heads, group + 2, head_dim)
        q = f[:, :, :, :group].reshape(b, n, num_heads, head_dim).transpose(1, 2)
        return q, f[:, :, :, group].transpose(1, 2), f[:, :, :, group + 1].transpose(1, 2)

    return split


def split_falcon_multiquery(num_heads: int, head_dim: int) -> Split:
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
