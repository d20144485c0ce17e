"""torch's attention ops as the engine calls them: the fused flash SDPA op of the device and the math kernel.

Both return the log-sum-exp, and both share one contract:

* :attr:`~positional_lsh.ops._engine.kinds.Kernel.FLASH` (public ``backend="flash"``) — torch's fused flash
  SDPA op of the device (a private ATen op: on the CPU too), with its log-sum-exp and a backward that takes an
  externally supplied ``out``/``lse``, which is exactly what the positional-LSH merge needs: on the CPU
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``..._backward``), which also takes a float mask; on
  CUDA ``aten._scaled_dot_product_flash_attention`` (and ``..._backward``, dropout 0), which takes no mask. What the
  CUDA op refuses (:func:`flash_refusal`: an additive mask, float32/float64, a head dim that is not a multiple of 8
  or above 256, a GPU older than sm_80; causal calls with ``Lq != Lk``) is decided once per call, up front, by the
  engine's routing (``ops._engine.routing.dispatch``: such calls run the math kernel). There is no fallback here:
  each call runs the kernel it is given.
* :attr:`~positional_lsh.ops._engine.kinds.Kernel.MATH` — plain batched matmuls with softmax, processed in chunks
  to bound memory. Runs on any device and dtype.

Contract: ``q (N, M, Lq, d)``, ``k, v (N, M, Lk, d)`` (any strides on the first two dims; the flash kernel
needs stride 1 in the last dim, see :func:`kernel_layout`),
``Lq <= Lk``; queries are aligned to the *last* ``Lq`` keys, so with ``causal=True`` query ``i`` sees keys
``j <= i + Lk - Lq``. ``bias`` is an optional additive float mask broadcastable to ``(N, M, Lq, Lk)``.
``attend`` returns ``out`` in the input dtype and ``lse`` in float32 (float64 for float64 input).
``attend_backward`` takes the upstream gradient with an arbitrary ``out``/``lse`` (one :class:`Grad`) — when these
are the *merged* output and log-sum-exp of several attention calls whose key sets are united in one softmax,
it returns this call's share of the gradient of the merged output (docs/design.md, the merged-lse backward).
The ``kernel`` arguments are :class:`~positional_lsh.ops._engine.kinds.Kernel` members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from positional_lsh.ops._engine.kinds import Kernel

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_cuda_flash = torch.ops.aten._scaled_dot_product_flash_attention
_cuda_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
FLASH_DEVICES = ("cpu", "cuda")
"""The devices whose fused flash op ``backend="flash"`` runs (``"meta"`` takes the CUDA op's shape functions)."""

# The math kernel materializes at most this many score entries at once.
_MATH_CHUNK_ELEMENTS = 2**24


def flash_refusal(device: torch.device, dtype: torch.dtype | None, head_dim: int | None, masked: bool) -> str | None:
    """Why torch's fused flash op of ``device`` refuses every kernel call of an op whose inputs are ``dtype`` with
    ``head_dim`` (with an additive mask when ``masked``; ``None``: not known, not checked); ``None`` where it takes
    them: what the engine's routing (``ops._engine.routing.refusal``) reads of the flash op.

    The CPU op takes every float dtype and a mask: never refused. The CUDA op (any other device: ``"meta"`` stands
    for CUDA in shape checks) takes no additive mask, half precision only, head dims that are multiples of 8 up to
    256 (torch's SDPA pads the others before calling it), sm_80 or newer.
    """
    if device.type == "cpu":
        return None
    if masked:
        return "an additive mask"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (float16 or bfloat16 only)"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"head dim {head_dim} (a multiple of 8, at most 256)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "a GPU older than sm_80"
    return None


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class Grad(NamedTuple):
    """What an attention backward takes: the upstream gradient ``dout`` and the call's ``q, k, v`` with its
    (possibly merged) ``out`` and ``lse`` (see the module docstring)."""

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def cuda_flash_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from torch's fused CUDA flash op (the routing checked that it takes the call)."""
    q, k, v = (_last_contiguous(x) for x in (q, k, v))
    out, lse = _cuda_flash(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse


def cuda_flash_attend_backward(g: Grad, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from torch's fused CUDA flash backward for an arbitrary (merged) ``out``/``lse``, dropout 0
    (its random-state inputs are unused then)."""
    dout, q, k, v, out = (_last_contiguous(x) for x in g[:5])
    lse = g.lse.to(torch.float32).contiguous()
    seed = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    lq, lk = q.shape[-2], k.shape[-2]
    return _cuda_flash_backward(
        dout, q, k, v, out, lse, None, None, lq, lk, 0.0, causal, seed, offset, scale=scale
    )  # fmt: skip


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float64 for float64, float32 otherwise (half types too)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def output_buffers(q: torch.Tensor, *, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for queries ``q (B, H, Lq, d)``: ``out`` in ``q``'s dtype, ``lse (B, H, Lq)`` in the
    accumulation dtype. Filled as rows no key reaches (``out = 0``, ``lse = -inf``: what a padded query row returns),
    or left uninitialised with ``empty=True`` (what an op's fake returns)."""
    lse_shape, acc = q.shape[:-1], acc_dtype(q.dtype)
    if empty:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(lse_shape, dtype=acc, device=q.device)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.full(lse_shape, float("-inf"), dtype=acc, device=q.device)


def kernel_layout(x: torch.Tensor, kernel: str) -> torch.Tensor:
    """``x (B, H, L, d)`` in a layout the kernels are correct and fast on; a copy only when needed.

    torch's CPU flash op reads the last dim as if its stride were 1 (any other stride gives wrong results)
    and is slow on rows that are far apart in memory (e.g. query heads interleaved with keys and values in
    a fused projection). So for ``"flash"`` every ``(L, d)`` slab must be row-major (``stride(-1) == 1`` and
    ``stride(-2) == d``); the batch and head strides may be anything (expanded tensors are kept as views).
    Called once per op call, so that the per-block kernel calls get views of it. ``"math"`` takes any layout.
    """
    if kernel != Kernel.FLASH:
        return x
    length, d = x.shape[-2], x.shape[-1]
    if (d == 1 or x.stride(-1) == 1) and (length == 1 or x.stride(-2) == d):
        return x
    return x.contiguous()


def nonfinite_keys(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``(B, H, Lk)`` bool: key positions whose key or value has a NaN or inf; ``None`` when there are none.

    A masked key must not reach any row, but the kernels add the ``-inf`` mask to the score (``NaN + -inf`` is
    NaN) and multiply zero probabilities by values (``0 * NaN`` is NaN). So the ops zero these keys, run, and
    set the rows that do keep one of them to NaN.
    """
    # Fast path: a NaN or inf anywhere makes the total non-finite (a finite overflow only costs the exact check).
    # bfloat16 has float32's range: its own sum (accumulated in float32 by torch) needs no float32 copy of k and v.
    acc = k.dtype if k.dtype == torch.bfloat16 else acc_dtype(k.dtype)
    if bool(torch.isfinite(k.sum(dtype=acc) + v.sum(dtype=acc))):
        return None
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    return bad if bool(bad.any()) else None


class Layout(NamedTuple):
    """``q, k, v`` as a kernel reads them (its layout, non-finite keys zeroed) and those keys (``(B, Hkv, Lk)`` bool,
    or ``None``): what :func:`kernel_inputs` makes once per forward, and its backward reuses."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bad: torch.Tensor | None


def kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> Layout:
    """``q, k, v`` in the kernel's layout with non-finite keys zeroed, and those keys (``nonfinite_keys``)."""
    if kernel == Kernel.TRITON:
        q, k, v = (x.contiguous() for x in (q, k, v))
    else:
        q, k, v = (kernel_layout(x, kernel) for x in (q, k, v))
    bad = nonfinite_keys(k, v)  # zeroed here; the rows that keep them are set to NaN by forward
    if bad is not None:
        k, v = k.masked_fill(bad[..., None], 0), v.masked_fill(bad[..., None], 0)
    return Layout(q, k, v, bad)


def rows_keeping(bad: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``(B, Hq, Lq)`` bool: the query rows whose kept keys, ``first[h, r]`` to ``last[h, r]`` (int64 ``(Hq, Lq)``,
    inclusive, within ``[0, Lk)``; none where ``last < first``), include a ``bad`` key (``(B, Hkv, Lk)`` bool, see
    :func:`nonfinite_keys`; query head ``h`` reads key head ``h // (Hq // Hkv)``): one prefix sum of the bad keys.
    The ops' one search of the rows to set to NaN (the estimator's and exact ALiBi's kept keys)."""
    b, hkv, _ = bad.shape
    before = torch.nn.functional.pad(bad.long().cumsum(-1), (1, 0))  # before[..., j]: bad keys among 0..j-1
    before = before.repeat_interleave(first.shape[0] // hkv, dim=1)  # (B, Hq, Lk + 1)
    count = before.gather(-1, (last + 1).expand(b, -1, -1)) - before.gather(-1, first.expand(b, -1, -1))
    return count > 0


def poison_rows(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to NaN, in place, the output ``(B, H, Lq, d)`` and lse ``(B, H, Lq)`` of the ``rows`` (bool
    ``(B, H, Lq)``) that keep a non-finite key (see :func:`nonfinite_keys`)."""
    out.masked_fill_(rows[..., None], float("nan"))
    lse.masked_fill_(rows, float("nan"))


def _causal_bias(lq: int, lk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``0`` where key ``j <= i + lk - lq``, ``-inf`` elsewhere: ``(lq, lk)``."""
    i = torch.arange(lq, device=device)[:, None] + (lk - lq)
    j = torch.arange(lk, device=device)[None, :]
    return torch.zeros((), dtype=dtype, device=device).masked_fill(j > i, float("-inf")).expand(lq, lk)


def _full_bias(
    q: torch.Tensor, lk: int, causal: bool, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    lq = q.shape[-2]
    out = bias.to(dtype) if bias is not None else None
    if causal and (lq != lk or out is not None):
        cb = _causal_bias(lq, lk, dtype, q.device)
        out = cb if out is None else out + cb
    return out


def _math_setup(
    q: torch.Tensor, lk: int, causal: bool, bias: torch.Tensor | None
) -> tuple[torch.dtype, torch.Tensor | None, list[slice]]:
    """Accumulation dtype, the full additive mask (causal included) and chunks of the ``M`` dimension."""
    acc = acc_dtype(q.dtype)
    lq = q.shape[-2]
    mask = bias.to(acc) if bias is not None else None
    if causal:
        cb = _causal_bias(lq, lk, acc, q.device)
        mask = cb if mask is None else mask + cb
    n, m = q.shape[0], q.shape[1]
    step = max(1, _MATH_CHUNK_ELEMENTS // max(1, n * lq * lk))
    return acc, mask, [slice(a, a + step) for a in range(0, m, step)]


def _add_mask(s: torch.Tensor, mask: torch.Tensor | None, sl: slice) -> torch.Tensor:
    if mask is None:
        return s
    per_m = mask.dim() == 4 and mask.shape[1] > 1  # a mask with its own M dimension is chunked with s
    return s + (mask[:, sl] if per_m else mask)


def _math_chunk_backward(
    g: Grad, acc: torch.dtype, mask: torch.Tensor | None, sl: slice, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The math backward's recomputation for the chunk ``sl`` of ``M``, in ``acc``: ``(qa, ka, doa, p, dP - D)``.

    ``p = exp(scale q k^T + mask - lse)``, ``dP = dout v^T``, ``D_i = dout_i . out_i``; ``dS = p * (dP - D)`` is
    the gradient with respect to the additive scores (shared by :func:`attend_backward` and
    :func:`attend_bias_grad`, so the two see the same ``p`` and ``dS`` to the bit).
    """
    doa, qa, ka, va, oa = (x[:, sl].to(acc) for x in g[:5])
    s = _add_mask(torch.matmul(qa, ka.transpose(-1, -2)) * scale, mask, sl)
    p = torch.exp(s - g.lse[:, sl].to(acc)[..., None])
    dp = torch.matmul(doa, va.transpose(-1, -2))
    delta = (doa * oa).sum(-1, keepdim=True)
    return qa, ka, doa, p, dp - delta


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kernel: str,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning ``(out, lse)`` with ``kernel`` (flash or math, decided by the caller: on CUDA
    the flash op must take the call, ``ops._engine.routing``); see the module docstring."""
    lk = k.shape[-2]
    if kernel == Kernel.FLASH and q.device.type != "cpu":
        return cuda_flash_attend(q, k, v, causal, scale)
    if kernel == Kernel.FLASH:
        mask = _full_bias(q, lk, causal, bias, q.dtype)
        plain_causal = causal and mask is None
        out, lse = _flash(q, k, v, 0.0, plain_causal, attn_mask=mask, scale=scale)
        return out, lse
    acc, mask, chunks = _math_setup(q, lk, causal, bias)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    for sl in chunks:
        s = torch.matmul(q[:, sl].to(acc), k[:, sl].to(acc).transpose(-1, -2)) * scale
        s = _add_mask(s, mask, sl)
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l[..., None])
        out[:, sl] = torch.matmul(p, v[:, sl].to(acc)).to(q.dtype)
        lse[:, sl] = l
    return out, lse


def attend_backward(
    g: Grad, *, causal: bool, scale: float, kernel: str, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one call with ``kernel``, given the (possibly merged) ``g.out`` and ``g.lse``."""
    q, k, v = g.q, g.k, g.v
    lk = k.shape[-2]
    if kernel == Kernel.FLASH and q.device.type != "cpu":
        return cuda_flash_attend_backward(g, causal, scale)
    if kernel == Kernel.FLASH:
        mask = _full_bias(q, lk, causal, bias, q.dtype)
        plain_causal = causal and mask is None
        return _flash_backward(*g, 0.0, plain_causal, attn_mask=mask, scale=scale)
    acc, mask, chunks = _math_setup(q, lk, causal, bias)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for sl in chunks:
        qa, ka, doa, p, dpd = _math_chunk_backward(g, acc, mask, sl, scale)
        dv[:, sl] = torch.matmul(p.transpose(-1, -2), doa).to(v.dtype)
        ds = p * dpd * scale
        dq[:, sl] = torch.matmul(ds, ka).to(q.dtype)
        dk[:, sl] = torch.matmul(ds.transpose(-1, -2), qa).to(k.dtype)
    return dq, dk, dv


def attend_bias_grad(
    g: Grad, weight: torch.Tensor, *, causal: bool, scale: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``(N, M)`` in the accumulation dtype: ``sum_{i,j} dS[n, m, i, j] * weight[n, m, i, j]`` for one call.

    ``dS = p * (dP - D)`` is the gradient of the loss with respect to the call's additive scores (after the scale,
    bias included), with ``p = exp(scale q k^T + bias - lse)``, ``dP = dout v^T`` and ``D_i = dout_i . out_i``; as
    in :func:`attend_backward`, ``out``/``lse`` may be the *merged* ones, and then this is the call's share.
    ``weight`` is broadcastable to ``(N, M, Lq, Lk)`` and finite (masked pairs have ``p = 0``). With ``weight =
    d bias / d theta`` this is the call's share of ``dL/d theta`` for a parameter ``theta`` of the bias (for ALiBi's
    ``bias = -m |i - j|``: ``dL/dm = -sum dS |i - j|``). Math only (one more pass over the scores, chunked over
    ``M``), for any kernel's call; no ``(Lq, Lk)`` tensor outlives a chunk. Several weights of one call:
    :func:`attend_bias_grads` (one pass for all of them).
    """
    return attend_bias_grads(g, (weight,), causal=causal, scale=scale, bias=bias)[..., 0]


def attend_bias_grads(
    g: Grad, weights: Sequence[torch.Tensor], *, causal: bool, scale: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``(N, M, P)``: :func:`attend_bias_grad` for each of the ``P`` weights, from one recomputation of the scores
    (a bias with ``P`` parameters, e.g. a decay family's, costs one pass, not ``P``)."""
    q = g.q
    acc, mask, chunks = _math_setup(q, g.k.shape[-2], causal, bias)
    total = torch.zeros((*q.shape[:2], len(weights)), dtype=acc, device=q.device)
    ws = [w.to(acc) for w in weights]
    for sl in chunks:
        p, dpd = _math_chunk_backward(g, acc, mask, sl, scale)[3:]
        ds = p * dpd
        for i, w in enumerate(ws):
            per_m = w.dim() == 4 and w.shape[1] > 1
            total[:, sl, i] = (ds * (w[:, sl] if per_m else w)).sum((-1, -2))
    return total
