"""Exact attention with a positional decay ``k(|i - j|)``, dense, in float64: the references that positional LSH with
decay partitions converges to (:func:`decay_attention_reference`), with the dense decay matrix and biases
(:func:`decay_bias`, for a family's parameters differentiable in them: the dense reference of
:func:`~positional_lsh.ops.exact.alibi.decay_attention`).

The decays themselves — :class:`Decay`, the built-in families (:data:`DECAY_FAMILIES`), the exact pitch law
(:func:`pitch_law`, :func:`mean_pitch`) — are defined in :mod:`positional_lsh.ops.partitions.decay_families` and
imported from here (docs/theory.md §10).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from positional_lsh.ops.checks import as_scale, check_qkv, positive_int
from positional_lsh.ops.partitions.decay_families import (
    DECAY_FAMILIES,
    Decay,
    DecayFamily,
    DecayLike,
    decay_family,
    decay_list,
    exponential_decay,
    mean_pitch,
    pitch_law,
    power_decay,
    tabulated_decay,
    truncated_linear_decay,
)

# Imported from here by the partition draw (positional_lsh.ops.partitions.partition).
from positional_lsh.ops.partitions.decay_families import sample_decay_pitches as sample_decay_pitches

__all__ = [
    "DECAY_FAMILIES",
    "Decay",
    "DecayFamily",
    "DecayLike",
    "decay_attention_reference",
    "decay_bias",
    "exponential_decay",
    "mean_pitch",
    "pitch_law",
    "power_decay",
    "tabulated_decay",
    "truncated_linear_decay",
]


def decay_matrix(
    decays: DecayLike | Sequence[DecayLike],
    seq_len: int,
    *,
    num_heads: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``K[h, i, j] = k_h(|i - j|)``: ``(H, n, n)`` (float64 by default; small ``n`` only)."""
    n = positive_int("seq_len", seq_len)
    heads = decay_list(decays, num_heads)
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
    return torch.stack([dec.checked_values(n)[dist] for dec in heads]).to(dtype=dtype, device=device)


def _query_key_offsets(q_len: int, k_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``i - j`` for the last ``q_len`` of ``k_len`` positions as queries: ``(q_len, k_len)`` int64, after checking
    both lengths (positive, ``q_len <= k_len``)."""
    lq, lk = positive_int("q_len", q_len), positive_int("k_len", k_len)
    if lq > lk:
        raise ValueError(f"q_len={lq} exceeds k_len={lk}")
    return (torch.arange(lq, device=device)[:, None] + (lk - lq)) - torch.arange(lk, device=device)[None, :]


def decay_bias(
    decays: DecayLike | Sequence[DecayLike] | str,
    q_len: int,
    k_len: int,
    *,
    params: torch.Tensor | Sequence[float] | None = None,
    causal: bool,
    num_heads: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Additive bias ``log k_h(|i - j|)`` (``-inf`` where ``k = 0`` or, if causal, ``j > i``): ``(H, q_len, k_len)``;
    queries are the last ``q_len`` of the ``k_len`` positions.

    ``decays``: decays (one for every head, ``num_heads`` times, default 1, or one per head), or a built-in family's
    name (:data:`DECAY_FAMILIES`) with its ``params``, ``(H, P)`` (one row per head) or ``(P,)`` (every head;
    ``num_heads`` heads, default 1) in the order of the family's ``param_names``. A family's bias is computed in
    float64 with torch ops, so autograd gives ``d bias / d params`` (the dense reference of
    :func:`~positional_lsh.ops.exact.alibi.decay_attention`).
    """
    rel = _query_key_offsets(q_len, k_len)
    if isinstance(decays, str):
        if params is None:
            raise ValueError(f"params is required with a decay family name ({decays!r})")
        fam = decay_family(decays)
        if num_heads is None:
            num_heads = params.shape[0] if isinstance(params, torch.Tensor) and params.dim() == 2 else 1
        theta, _ = fam.check_params(params, num_heads)
        rel = rel if device is None else rel.to(device)
        bias = fam.log_k(rel.abs().double(), theta.to(device=rel.device, dtype=torch.float64)[:, None, None, :])
    else:
        if params is not None:
            raise ValueError("params is only for a decay family name (e.g. decays='power'), not with Decay objects")
        with torch.no_grad():
            values = [dec.checked_values(rel.shape[1]) for dec in decay_list(decays, num_heads)]
            bias = torch.stack([torch.log(k[rel.abs()]) for k in values])
    if causal:
        bias = bias.masked_fill(rel < 0, -math.inf)
    return bias.to(dtype=dtype, device=device)


def decay_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decays: DecayLike | Sequence[DecayLike] | str,
    params: torch.Tensor | Sequence[float] | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention with a positional decay, dense: ``softmax(scale q k^T + log k(|i - j|)) v``.

    Shapes as :func:`~positional_lsh.plsh_attention`: ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)``, queries
    aligned to the last keys, one decay per query head (or one for all). Computed in float64 (returned in
    ``q``'s dtype); the reference that ``plsh_attention`` with decay partitions converges to.

    With ``decays`` a family name (:data:`DECAY_FAMILIES`) and ``params`` its parameters (``(Hq, P)`` or ``(P,)``),
    the bias is :func:`decay_bias`'s and the result is differentiable in ``params`` too: the dense
    autograd reference of :func:`~positional_lsh.ops.exact.alibi.decay_attention`.
    """
    _, hq, hkv, lq, lk, d = check_qkv(q, k, v)
    sc = as_scale(scale, d)
    if not isinstance(decays, str) and params is None:  # decay objects: one for every head or one per head
        heads = decay_list(decays, None)
        if len(heads) not in (1, hq):
            raise ValueError(f"{len(heads)} decays for {hq} query heads")
        decays = heads * (hq // len(heads))
    bias = decay_bias(decays, lq, lk, params=params, causal=causal, num_heads=hq, device=q.device)
    group = hq // hkv
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.matmul(q.double(), kk.transpose(-1, -2)) * sc + bias
    return torch.matmul(torch.softmax(s, dim=-1), vv).to(q.dtype)
