"""Exact and windowed ALiBi attention in ``O(n)`` memory: the production op :func:`alibi_attention`.

``softmax_j(scale * q_i . k_j - m_h |i - j|) v_j``, the bias added after scaling, optionally restricted to
``|i - j| <= window[h]``. Chunked over queries, with one Toeplitz bias bank per head (every chunk's bias is a
view of it) and a recomputing backward against the saved output and log-sum-exp: never an ``n x n`` tensor.
Runs the torch kernels of ``ops._kernels`` only (``backend`` in :data:`ALIBI_BACKENDS`; exact ALiBi has no
Triton path). Used by the language model (``alibi`` and ``window-alibi``), the transformers swap, and every benchmark
and report as the exact/windowed peer. The dense conventions and oracles are in :mod:`positional_lsh.ops.reference`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from positional_lsh.ops._checks import SlopesLike, as_scale, as_slopes, as_window, check_bool, check_qkv
from positional_lsh.ops._kernels import (
    acc_dtype,
    attend,
    attend_backward,
    kernel_layout,
    nonfinite_keys,
    poison_rows,
    resolve_backend,
)
from positional_lsh.ops._parallel import pool_size, run_all, work_items, workers_for
from positional_lsh.ops.options import ALIBI_BACKENDS, check_backend
from positional_lsh.ops.reference import alibi_bias

__all__ = ["alibi_attention"]
"""``backend=`` of :func:`alibi_attention`: the torch kernels only (exact ALiBi has no Triton path)."""

# Each kernel call materializes at most about CHUNK_ELEMENTS bias/score entries.
_MIN_WINDOW_ROWS = 64  # query rows per chunk for windowed ALiBi (at least)
CHUNK_ELEMENTS = 2**22


@dataclass(frozen=True)
class _Chunk:
    a: int  # query rows [a, b)
    b: int
    lo: int  # key rows [lo, hi)
    hi: int


class _HeadPlan:
    """Query chunks of one head and a bias bank from which every chunk's bias is a view.

    The ALiBi bias is Toeplitz: chunk queries at positions ``p + r`` and keys ``lo + c`` see
    ``f(p - lo + r - c)``. One ``(rows, width)`` bank ``bank[r, x] = f(r - x + off)`` holds every chunk's
    bias as the column slice starting at ``off - (p - lo)``, so it is computed once per head.
    """

    def __init__(
        self,
        q_len: int,
        k_len: int,
        slope: float,
        win: float | None,
        causal: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        q0 = k_len - q_len  # position of the first query
        reach = None if win is None else int(win)
        span = k_len if reach is None else min(k_len, 2 * reach + 1)
        rows = max(1, min(q_len, CHUNK_ELEMENTS // max(1, span)))
        if reach is not None:  # a chunk of r rows spans r + reach keys: keep r near reach, not the whole input
            rows = min(rows, max(_MIN_WINDOW_ROWS, reach))
        chunks = []
        for a in range(0, q_len, rows):
            b = min(q_len, a + rows)
            first, last = q0 + a, q0 + b - 1
            lo = 0 if reach is None else max(0, first - reach)
            hi = last + 1 if causal else (k_len if reach is None else min(k_len, last + reach + 1))
            chunks.append(_Chunk(a, b, lo, hi))
        self.chunks = chunks
        deltas = [q0 + c.a - c.lo for c in chunks]
        self.off = max(deltas)
        width = max(self.off - d + (c.hi - c.lo) for d, c in zip(deltas, chunks, strict=True))
        window = None if win is None else torch.tensor([win], dtype=torch.float64)
        self.bank = alibi_bias(
            rows,
            width,
            torch.tensor([slope], dtype=torch.float64),
            causal=causal,
            window=window,
            q_offset=self.off,
            dtype=dtype,
            device=device,
        )[0]
        self.q0 = q0

    def bias(self, c: _Chunk) -> torch.Tensor:
        start = self.off - (self.q0 + c.a - c.lo)
        return self.bank[: c.b - c.a, start : start + c.hi - c.lo]


def _head_items(q: torch.Tensor, k: torch.Tensor, window: torch.Tensor | None) -> list[tuple[list[int], slice]]:
    """Independent (heads, batch slice) pieces; a head's cost is its key span."""
    group = q.shape[1] // k.shape[1]
    lk = k.shape[2]
    spans = [lk if window is None else min(lk, 2 * float(window[h]) + 1) for h in range(q.shape[1])]
    return work_items([(h, h // group, spans[h]) for h in range(q.shape[1])], q.shape[0], workers_for(q.device))


def _alibi_rows_with_bad_keys(
    bad: torch.Tensor, num_heads: int, q_len: int, window: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """``(B, Hq, Lq)`` bool: query rows whose kept keys (causal and window mask) include a ``bad`` (non-finite) key.

    ``bad`` is ``(B, Hkv, Lk)`` bool; these are the rows :func:`alibi_attention` sets to NaN.
    """
    b, hkv, lk = bad.shape
    before = torch.nn.functional.pad(bad.long().cumsum(-1), (1, 0))  # before[..., j]: bad keys among 0..j-1
    before = before.repeat_interleave(num_heads // hkv, dim=1)  # (B, Hq, Lk + 1)
    pos = torch.arange(q_len, device=bad.device, dtype=torch.float64) + (lk - q_len)
    reach = torch.full((num_heads, 1), float(lk), dtype=torch.float64, device=bad.device)
    if window is not None:
        reach = torch.floor(window.to(bad.device, torch.float64)).clamp_max(lk)[:, None]
    lo = (pos - reach).clamp_min(0).long()  # (Hq, Lq): first kept key
    hi = (pos if causal else (pos + reach).clamp_max(lk - 1)).long().expand(num_heads, q_len)  # last kept key
    count = before.gather(-1, (hi + 1).expand(b, -1, -1)) - before.gather(-1, lo.expand(b, -1, -1))
    return count > 0


def _head_chunks(
    heads: list[int],
    q: torch.Tensor,
    k: torch.Tensor,
    slopes: torch.Tensor,
    window: torch.Tensor | None,
    causal: bool,
    backend: str,
) -> Iterator[tuple[int, int, _Chunk, torch.Tensor]]:
    """``(query head, key head, chunk, its bias (1, 1, rows, keys))`` for every query chunk of ``heads``, in order.

    The forward and the recomputing backward walk the same chunks with the same bias (one plan per head).
    """
    group = q.shape[1] // k.shape[1]
    bias_dtype = q.dtype if backend == "flash" else acc_dtype(q.dtype)
    for h in heads:
        win = None if window is None else float(window[h])
        plan = _HeadPlan(q.shape[2], k.shape[2], float(slopes[h]), win, causal, bias_dtype, q.device)
        for c in plan.chunks:
            yield h, h // group, c, plan.bias(c)[None, None]


def _alibi_forward_item(
    item: tuple[list[int], slice],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    slopes: torch.Tensor,
    window: torch.Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
) -> None:
    """Exact ALiBi for one work item's heads and batch rows, chunk by chunk, into ``out`` and ``lse``."""
    heads, b = item
    for h, hk, c, bias in _head_chunks(heads, q, k, slopes, window, causal, backend):
        o, l = attend(
            q[b, h : h + 1, c.a : c.b],
            k[b, hk : hk + 1, c.lo : c.hi],
            v[b, hk : hk + 1, c.lo : c.hi],
            causal=False,
            scale=scale,
            backend=backend,
            bias=bias,
        )
        out[b, h, c.a : c.b] = o[:, 0]
        lse[b, h, c.a : c.b] = l[:, 0]


def _alibi_backward_item(
    item: tuple[list[int], slice],
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    window: torch.Tensor | None,
    causal: bool,
    scale: float,
    backend: str,
) -> None:
    """Accumulate one work item's ``(dq, dk, dv)``, recomputing each chunk against the saved out/lse."""
    q, k, v, out, lse, slopes = saved[:6]
    dq, dk, dv = grads
    heads, b = item
    for h, hk, c, bias in _head_chunks(heads, q, k, slopes, window, causal, backend):
        qs, ks = slice(c.a, c.b), slice(c.lo, c.hi)
        gq, gk, gv = attend_backward(
            dout[b, h : h + 1, qs],
            q[b, h : h + 1, qs],
            k[b, hk : hk + 1, ks],
            v[b, hk : hk + 1, ks],
            out[b, h : h + 1, qs],
            lse[b, h : h + 1, qs],
            causal=False,
            scale=scale,
            backend=backend,
            bias=bias,
        )
        dq[b, h, qs] += gq[:, 0]
        dk[b, hk, ks] += gk[:, 0]
        dv[b, hk, ks] += gv[:, 0]


class _AlibiFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx, with this function's attributes set on it
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        window: torch.Tensor | None,
        causal: bool,
        scale: float,
        backend: str,
    ) -> torch.Tensor:
        q, k, v = (kernel_layout(x, backend) for x in (q, k, v))  # once per call; chunks are views
        bad = nonfinite_keys(k, v)  # zeroed here, and the rows that keep them set to NaN below
        if bad is not None:
            k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)
        items = _head_items(q, k, window)
        run = partial(
            _alibi_forward_item,
            q=q,
            k=k,
            v=v,
            out=out,
            lse=lse,
            slopes=slopes,
            window=window,
            causal=causal,
            scale=scale,
            backend=backend,
        )
        run_all(run, items, pool_size(len(items), q.device))
        if bad is not None:
            poison_rows(out, lse, _alibi_rows_with_bad_keys(bad, q.shape[1], q.shape[2], window, causal))
        ctx.save_for_backward(q, k, v, out, lse, slopes, window if window is not None else torch.empty(0))
        ctx.has_window, ctx.causal, ctx.scale, ctx.backend = window is not None, causal, scale, backend
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        acc = acc_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
        grads = (dq, dk, dv)
        window = saved[6] if ctx.has_window else None
        items = _head_items(q, k, window)
        run = partial(
            _alibi_backward_item,
            saved=saved,
            dout=dout.contiguous(),
            grads=grads,
            window=window,
            causal=ctx.causal,
            scale=ctx.scale,
            backend=ctx.backend,
        )
        run_all(run, items, pool_size(len(items), q.device))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: SlopesLike = None,
    *,
    causal: bool = True,
    window: torch.Tensor | float | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Exact (optionally windowed) ALiBi attention with ``O(n)`` memory and a recomputing backward.

    Computes ``softmax_j(scale * q_i . k_j - slopes[h] * |i - j|) v`` over keys ``j <= i`` when ``causal``,
    dropping keys with ``|i - j| > window[h]`` when ``window`` is given (one number or one per head).

    Args:
        q: ``(B, Hq, Lq, d)``; float32, float64, bfloat16 or float16.
        k, v: ``(B, Hkv, Lk, d)``, ``Hq % Hkv == 0``, ``Lq <= Lk`` (queries aligned to the last keys).
        slopes: ``(Hq,)`` slopes ``>= 0`` or one float; default ``alibi_slopes(Hq)``.
        causal: causal masking.
        window: ``None`` (exact), or the largest kept distance ``|i - j|``, one float or ``(Hq,)``.
        scale: score scale, default ``1/sqrt(d)``.
        backend: one of :data:`ALIBI_BACKENDS`: ``"auto"`` (CPU: ``"flash"``, other devices: ``"math"``),
            ``"flash"`` (CPU fused op, float32/float64) or ``"math"``. ``"auto"`` uses ``"math"`` (float32 scores)
            for half types, so that the bias is not rounded to 8 bits; an explicit ``"flash"`` with a half type
            is refused (``ValueError``), and so is ``"triton"`` (no Triton path for exact ALiBi).

    Returns:
        ``(B, Hq, Lq, d)`` in ``q``'s dtype; supports autograd. A NaN or inf in a key or value makes exactly
        the rows that keep that key NaN; masked (causal or out-of-window) keys never reach a row.

    Example:
        >>> import torch
        >>> from positional_lsh import alibi_attention, alibi_bias, alibi_slopes
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 4, 64, 16, dtype=torch.float64, generator=g) for _ in range(3))
        >>> bias = alibi_bias(64, 64, alibi_slopes(4), causal=True, dtype=torch.float64)  # -m |i - j|, -inf if j > i
        >>> dense = torch.softmax(q @ k.transpose(-1, -2) / 16**0.5 + bias, dim=-1) @ v
        >>> torch.allclose(alibi_attention(q, k, v), dense)
        True
        >>> windowed = alibi_attention(q, k, v, window=8.0)  # keys with |i - j| <= 8 only
        >>> torch.allclose(windowed[..., :9, :], dense[..., :9, :])  # rows 0..8 have no farther key
        True
    """
    _, hq, _, _, _, d = check_qkv(q, k, v)
    sc = as_scale(scale, d)
    check_bool("causal", causal)
    if backend == "triton":
        raise ValueError(
            "backend='triton' is not available for alibi_attention: exact ALiBi has no Triton path "
            f"(the Triton kernels are positional LSH's); backend must be one of {ALIBI_BACKENDS}"
        )
    check_backend(backend, ALIBI_BACKENDS)
    m = as_slopes(slopes, hq)
    win = as_window(window, hq)
    requested = backend
    backend = resolve_backend(backend, q.device)
    if q.dtype in (torch.float16, torch.bfloat16):
        if requested == "flash":
            raise ValueError(
                f"backend='flash' is not supported for {q.dtype} in alibi_attention: the fused op would round the "
                "ALiBi bias to the input precision. Use backend='math' or 'auto' (float32 scores)"
            )
        backend = "math"
    return _AlibiFunction.apply(q, k, v, m, win, causal, sc, backend)
