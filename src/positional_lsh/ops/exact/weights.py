"""The attention weights of a call, materialized: what ``output_attentions=True`` returns.

* :func:`plsh_attention_weights` — positional LSH's dense weights ``softmax(s + log Mbar)`` (``Mbar`` the mean of the
  partitions' masks): the weights the estimator applies to the values (its oracle ``softmax(s + log Mbar) v``);
* :func:`alibi_attention_weights` — exact (optionally windowed) ALiBi's ``softmax(s - m_h |i - j|)``;
* :func:`weighted_values` — the output ``weights @ v`` of such weights (grouped key heads shared by their query
  heads), NaN kept to the rows that weigh it: what ``output_attentions=True`` computes the output from, so
  that the weights returned are on the output's path (their ``retain_grad()`` gets a gradient).

The estimator's output *is* ``softmax(s + log Mbar) v`` whichever way it is computed (the multiplicity form's
``softmax(s + log c)``, ``c = T Mbar``, and the per-sample form's merge by log-sum-exp are that ratio:
docs/design.md, "The estimator"), so ``weighted_values(plsh_attention_weights(...), v)`` equals the op's output and
its gradients with respect to ``q``, ``k`` and ``v`` up to float rounding, for every ``method``. Slopes that
require grad get the exact ALiBi gradient from :func:`alibi_attention_weights` and the op's surrogate gradient
(``slope_grad="surrogate"``) from :func:`plsh_attention_weights`'s ``slopes=``.

The two weights functions take the arguments of the ops' calls (``q (B, Hq, Lq, d)``, ``k (B, Hkv, Lk, d)`` with
queries aligned to the last keys, grouped key heads shared by their query heads; ``key_padding_mask`` and
``key_offset`` as :func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache`: any pattern of valid keys,
positions counted from each row's first valid key, masked keys after it included), and return ``(B, Hq, Lq, Lk)``
weights in ``q``'s dtype (computed in float32, float64 for float64 inputs). Masked keys (after the query, outside
the window, padded, or never in the query's block) get weight 0; query rows at padded positions are all zeros.
Dense: a call whose ``B Hq Lq Lk`` weights (or positional LSH's ``H n^2`` mean mask) exceed ``MAX_DENSE_ELEMENTS``
entries, or this machine's memory, is refused up front.
"""

from __future__ import annotations

import torch

from positional_lsh.ops.checks import (
    SlopesLike,
    as_scale,
    as_slopes,
    as_window,
    check_bool,
    check_int,
    check_qkv,
    grad_slopes,
)
from positional_lsh.ops.errors import check_memory
from positional_lsh.ops.padding import check_key_padding_mask, valid_runs
from positional_lsh.ops.partitions.partition import MAX_DENSE_ELEMENTS, Partitions, check_slopes_match

__all__ = ["alibi_attention_weights", "plsh_attention_weights", "weighted_values"]


def _check_size(what: str, elements: int, itemsize: int) -> None:
    if elements > MAX_DENSE_ELEMENTS:
        raise ValueError(
            f"{what} would materialize {elements:,} attention weights (more than {MAX_DENSE_ELEMENTS:,}); ask for "
            "attention weights (output_attentions=True) on shorter sequences or smaller batches"
        )
    check_memory(4.0 * elements * itemsize, f"{what} ({elements:,} attention weights)")


def _positions(
    q: torch.Tensor, k_len: int, mask: torch.Tensor | None, key_offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per batch row, the queries' and keys' positions counted from the row's first valid key, ``(B, Lq)`` and
    ``(B, Lk)``, and whether each is a valid position (masked ones, holes included, are not)."""
    b, lq = q.shape[0], q.shape[-2]
    n = key_offset + k_len
    dev = q.device
    if mask is None:
        first = torch.zeros(b, 1, dtype=torch.long, device=dev)
        end = torch.full((b, 1), n, dtype=torch.long, device=dev)
    else:
        runs = valid_runs(mask)
        first = torch.tensor([f for f, _ in runs], dtype=torch.long, device=dev)[:, None]
        end = torch.tensor([e for _, e in runs], dtype=torch.long, device=dev)[:, None]
    qa = torch.arange(n - lq, n, device=dev)[None, :]
    ka = torch.arange(key_offset, n, device=dev)[None, :]
    qok, kok = (qa >= first) & (qa < end), (ka >= first) & (ka < end)
    if mask is not None:  # holes: masked keys get weight 0, queries at masked positions are zero rows
        qok, kok = qok & mask[:, n - lq :], kok & mask[:, key_offset:]
    return qa - first, ka - first, qok, kok


def _softmax(s: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    w = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.where(keep.any(-1, keepdim=True), w, torch.zeros((), dtype=w.dtype, device=w.device)).to(dtype)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, acc: torch.dtype) -> torch.Tensor:
    kk = k.to(acc).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.matmul(q.to(acc), kk.transpose(-1, -2)) * scale


def plsh_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    partitions: Partitions,
    *,
    causal: bool = True,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    key_offset: int = 0,
    slopes: SlopesLike = None,
) -> torch.Tensor:
    """Positional LSH's attention weights ``softmax(scale q k^T + log Mbar)``: ``(B, Hq, Lq, Lk)``.

    ``partitions`` (for ``Hq`` heads and at least ``key_offset + Lk`` positions) are those of the call; ``Mbar`` is
    their :meth:`~positional_lsh.ops.partitions.partition.Partitions.mean_mask`, read at the positions counted
    from each row's first valid key. ``key_offset``: position of ``k``'s first key (a KV cache that dropped the
    keys before it); ``key_padding_mask``: ``None`` or the ``(B, key_offset + Lk)`` validity of every position.
    ``slopes``: ``None``, or the partitions' slopes (``ValueError`` when they differ, as
    :func:`~positional_lsh.plsh_attention`); a tensor that requires grad gets the op's surrogate gradient
    (``slope_grad="surrogate"``): the weights are ``softmax(s + log Mbar - (m - m.detach()) |i - j|)``, the same
    values.
    """
    b, hq, _, lq, lk, d = check_qkv(q, k, k)
    check_bool("causal", causal)
    key_offset = check_int("key_offset", key_offset, minimum=0)
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a Partitions, got {type(partitions).__name__}")
    n = key_offset + lk
    if partitions.num_heads != hq or partitions.seq_len < n:
        raise ValueError(
            f"partitions are for {partitions.num_heads} heads and seq_len={partitions.seq_len}; q has {hq} heads "
            f"and the keys cover positions {key_offset}..{n - 1} (at least seq_len={n})"
        )
    check_slopes_match(slopes, partitions, hq)
    learned = grad_slopes(slopes, hq)
    mask = check_key_padding_mask(key_padding_mask, q, n)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    item = torch.empty((), dtype=acc).element_size()
    _check_size("plsh_attention_weights", max(b * hq * lq * lk, hq * n * n), item)
    sc = as_scale(scale, d)
    qi, kj, qok, kok = _positions(q, lk, mask, key_offset)
    mbar = partitions.with_seq_len(n).mean_mask(device=q.device, dtype=acc)  # (H, n, n)
    rows, cols = qi.clamp(0, n - 1), kj.clamp(0, n - 1)
    mb = mbar[:, rows[:, :, None], cols[:, None, :]].permute(1, 0, 2, 3)  # (B, H, Lq, Lk)
    keep = (qok[:, :, None] & kok[:, None, :])[:, None] & (mb > 0)
    if causal:
        keep = keep & (kj[:, None, :] <= qi[:, :, None])[:, None]
    z = _scores(q, k, sc, acc) + torch.log(mb)
    if learned is not None:  # the surrogate: zero in value, -|i - j| per head in gradient
        m = learned.to(device=q.device, dtype=acc)
        z = z - (m - m.detach())[None, :, None, None] * (qi[:, :, None] - kj[:, None, :]).abs().to(acc)[:, None]
    return _softmax(z, keep, q.dtype)


def alibi_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    slopes: SlopesLike = None,
    *,
    causal: bool = True,
    window: torch.Tensor | float | None = None,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    key_offset: int = 0,
) -> torch.Tensor:
    """Exact (windowed) ALiBi's attention weights ``softmax(scale q k^T - m_h |i - j|)``: ``(B, Hq, Lq, Lk)``.

    ``slopes`` ``(Hq,)``, one number or ``None`` (the standard schedule); a tensor that requires grad gets the
    exact gradient through the bias (as :func:`~positional_lsh.alibi_attention`'s); ``window`` the largest kept
    distance ``|i - j|`` (one number or one per head: a hard mask, no gradient); ``key_offset`` and
    ``key_padding_mask`` as :func:`plsh_attention_weights`.
    """
    b, hq, _, lq, lk, d = check_qkv(q, k, k)
    check_bool("causal", causal)
    key_offset = check_int("key_offset", key_offset, minimum=0)
    m = as_slopes(slopes, hq)
    learned = grad_slopes(slopes, hq)
    win = as_window(window, hq)
    mask = check_key_padding_mask(key_padding_mask, q, key_offset + lk)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    _check_size("alibi_attention_weights", b * hq * lq * lk, torch.empty((), dtype=acc).element_size())
    sc = as_scale(scale, d)
    qi, kj, qok, kok = _positions(q, lk, mask, key_offset)
    rel = qi[:, :, None] - kj[:, None, :]  # (B, Lq, Lk)
    dist = rel.abs().to(acc)[:, None]
    keep = (qok[:, :, None] & kok[:, None, :])[:, None].expand(b, hq, lq, lk)
    if causal:
        keep = keep & (rel >= 0)[:, None]
    if win is not None:
        keep = keep & (dist <= win.to(device=q.device, dtype=acc)[None, :, None, None])
    bias = -(m if learned is None else learned).to(device=q.device, dtype=acc)[None, :, None, None] * dist
    return _softmax(_scores(q, k, sc, acc) + bias, keep, q.dtype)


def weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention output ``weights @ v``: ``(B, Hq, Lq, d)`` from ``weights (B, Hq, Lq, Lk)`` (those of
    :func:`plsh_attention_weights` or :func:`alibi_attention_weights`) and ``v (B, Hkv, Lk, d)`` (``Hq % Hkv == 0``:
    grouped value heads shared by their query heads), in the weights' dtype (``v`` is cast to it), differentiable
    with respect to both (the weights stay on the output's path).

    Non-finite values: a row that gives a NaN or infinite value a nonzero weight is NaN; the other rows are computed
    without them (``0 * inf`` does not leak into them), as the ops keep NaN to the rows that reach it.
    """
    if not isinstance(weights, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError("weights and v must be tensors")
    if weights.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"weights must be (B, Hq, Lq, Lk) and v (B, Hkv, Lk, d), got {tuple(weights.shape)} and {tuple(v.shape)}"
        )
    b, hq, _, lk = weights.shape
    if v.shape[0] != b or v.shape[2] != lk or v.shape[1] == 0 or hq % v.shape[1] != 0:
        raise ValueError(
            f"v {tuple(v.shape)} does not fit weights {tuple(weights.shape)}: v must be (B, Hkv, Lk, d) with the "
            "weights' B and Lk and Hq a multiple of Hkv"
        )
    vv = v.to(weights.dtype).repeat_interleave(hq // v.shape[1], dim=1)
    bad = ~torch.isfinite(vv).all(-1)  # (B, Hq, Lk)
    if not bool(bad.any()):
        return torch.matmul(weights, vv)
    out = torch.matmul(weights, vv.masked_fill(bad[..., None], 0))
    poisoned = ((weights != 0) & bad[:, :, None, :]).any(-1, keepdim=True)
    return out.masked_fill(poisoned, float("nan"))
