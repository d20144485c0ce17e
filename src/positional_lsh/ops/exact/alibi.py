"""Exact and windowed ALiBi attention in ``O(n)`` memory: the entry points :func:`alibi_attention` and
:func:`decay_attention`.

``softmax_j(scale * q_i . k_j - m_h |i - j|) v_j``, the bias added after scaling, optionally restricted to
``|i - j| <= window[h]``. Chunked over queries, with a recomputing backward against the saved output and
log-sum-exp: never an ``n x n`` tensor. Two routes (``exact.fused.exact_route``): ``"fused"`` (``exact.fused``:
torch's fused CPU flash kernel, every head in one call per ``FUSED_ROWS`` query rows, the bias a strided view of one
``O(n)`` line per head against the keys in reverse order: no bias construction, and it skips the causal triangle)
whenever the kernel is that op and no window drops a key; ``"banks"`` otherwise (``exact.toeplitz``: per head, one
Toeplitz bias bank per head of which every chunk's bias is a view, each chunk on the keys its window keeps).
A ``slopes`` tensor that requires grad gets ``dL/dm_h = -sum_{b,i,j} dS_ij |i - j|`` from one more pass of score
recomputation per chunk in that backward (``ops._engine.torch_attention.attend_bias_grads`` with the weight
``d bias / dm = -|i - j|``, a view of a per-head Toeplitz distance bank). :func:`decay_attention` is the same op for
the built-in decay families (:data:`~positional_lsh.ops.partitions.decays.DECAY_FAMILIES`, bias
``log k_theta(|i - j|)``), with ``params.grad``. Both take a ``key_padding_mask`` (:mod:`positional_lsh.ops.padding`).

One custom-op registration (``exact.op``) serves both, eager and compiled: ``positional_lsh::exact_forward(q, k, v,
theta, window, kind, causal, scale, backend, check=False, key_padding_mask=None) -> (out, lse)`` (``theta``: the slopes
``(Hq,)``, or a decay family's parameters ``(Hq, P)``) and its backward ``positional_lsh::exact_backward``,
connected by ``torch.library.register_autograd``, which gives ``theta`` its exact gradient when autograd needs it.
``torch.compile(fullgraph=True)`` traces a call as that one opaque op; the values a trace cannot read (slopes,
window, parameters) are then checked inside it (``check``).

Runs torch's attention ops of ``ops._engine.torch_attention`` only (``backend`` in
:data:`~positional_lsh.ops.options.ALIBI_BACKENDS`, resolved by ``ops._engine.routing.exact_kernel``; exact ALiBi has
no Triton path). Used by the language model (``alibi`` and ``window-alibi``), the transformers swap, and every
benchmark and report as the exact/windowed peer. The dense conventions and oracles are in
:mod:`positional_lsh.ops.exact.reference`. """

from __future__ import annotations

from collections.abc import Sequence

import torch

from positional_lsh.ops._engine.routing import exact_kernel
from positional_lsh.ops.checks import (
    SlopesLike,
    as_scale,
    as_slopes,
    as_window,
    check_bool,
    check_meta_slopes,
    check_qkv,
    grad_slopes,
    is_meta_tensor,
    meta_output,
)
from positional_lsh.ops.exact.op import exact_forward
from positional_lsh.ops.padding import check_cu_seqlens, check_key_padding_mask, segment_ids
from positional_lsh.ops.partitions.decays import decay_family

__all__ = ["alibi_attention", "decay_attention"]


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
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact (optionally windowed) ALiBi attention with ``O(n)`` memory and a recomputing backward.

    Computes ``softmax_j(scale * q_i . k_j - slopes[h] * |i - j|) v`` over keys ``j <= i`` when ``causal``,
    dropping keys with ``|i - j| > window[h]`` when ``window`` is given (one number or one per head).

    Args:
        q: ``(B, Hq, Lq, d)``; float32, float64, bfloat16 or float16.
        k, v: ``(B, Hkv, Lk, d)``, ``Hq % Hkv == 0``, ``Lq <= Lk`` (queries aligned to the last keys).
        slopes: ``(Hq,)`` slopes ``>= 0`` (a tensor, a numpy array or a sequence) or one float; default
            ``alibi_slopes(Hq)``. A tensor (``(Hq,)`` or 0-d, any dtype and device) that requires grad gets
            ``dL/dm_h = -sum_{b,i,j} dS_bhij |i - j|`` (``dS`` the gradient of the loss with respect to the biased
            score), accumulated in float32 (float64 for float64 inputs) and returned in the slopes' dtype and device
            (a 0-d tensor gets the sum over heads). The window is a hard mask: no gradient flows through it. A float
            (or a tensor without grad) gets none, and then the backward does no extra work.
        causal: causal masking.
        window: ``None`` (exact), or the largest kept distance ``|i - j|``, one float or ``(Hq,)``.
        scale: score scale, default ``1/sqrt(d)``.
        backend: one of :data:`~positional_lsh.ops.options.ALIBI_BACKENDS`: ``"auto"`` (CPU: ``"flash"``, other
            devices: ``"math"``), ``"flash"`` (CPU fused op, float32/float64; on CUDA, which takes no bias, refused)
            or ``"math"``. ``"auto"`` uses ``"math"`` (float32 scores)
            for half types, so that the bias is not rounded to 8 bits; an explicit ``"flash"`` with a half type
            is refused (``ValueError``), and so is ``"triton"`` (no Triton path for exact ALiBi).
        key_padding_mask: ``None`` (every key valid) or a ``(B, Lk)`` bool tensor on ``q``'s device, ``True`` for a
            valid key, any pattern (left or right padding, holes). A masked key leaves the softmax; positions are
            counted from the row's first valid key, masked keys after it included (so the distances ``|i - j|``
            are those of the key indices), queries stay aligned to the last ``Lq`` keys, and query rows at masked
            positions (or in a row without valid keys) return zeros and get zero gradients
            (:mod:`positional_lsh.ops.padding`).
        cu_seqlens: ``None``, or packed sequences: a 1-D integer tensor ``[0, n_1, ..., Lk]`` (strictly
            increasing; ``ValueError`` naming ``cu_seqlens`` otherwise). Each document is its own sequence:
            distances within it, no attention across documents (as running the documents one by one).

    Returns:
        ``(B, Hq, Lq, d)`` in ``q``'s dtype; supports autograd (``q``, ``k``, ``v`` and a ``slopes`` tensor). A NaN
        or inf in a key or value makes exactly the rows that keep that key NaN, and the slope gradient of exactly
        the heads with such a row NaN (as dense autograd with a masked bias gives); masked (causal or
        out-of-window) keys never reach a row.

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
        >>> m = alibi_slopes(4).double().requires_grad_()  # learned slopes
        >>> alibi_attention(q, k, v, m).sum().backward()
        >>> m.grad.shape
        torch.Size([4])
    """
    b, hq, _, _, lk, d = check_qkv(q, k, v)
    sc = as_scale(scale, d)
    check_bool("causal", causal)
    backend = exact_kernel(backend, q, "alibi_attention")
    mask = segment_ids(check_key_padding_mask(key_padding_mask, q, lk), check_cu_seqlens(cu_seqlens, lk), b, lk,
                       q.device)  # fmt: skip
    compiling = torch.compiler.is_compiling()  # then the op checks the values (they cannot be read when tracing)
    if q.device.type == "meta" and is_meta_tensor(slopes) and not compiling:
        # Meta slopes hold no values: shapes only (connected to the slopes for autograd).
        assert isinstance(slopes, torch.Tensor)
        check_meta_slopes(slopes, hq)
        if not is_meta_tensor(window):
            as_window(window, hq)
        return meta_output(q, k, v, slopes)
    if compiling:
        theta, win = as_slopes(slopes, hq, read=False), None if window is None else as_slopes(window, hq, read=False)
    else:
        theta, win = as_slopes(slopes, hq), as_window(window, hq)  # detached float64 values, checked
    learnable = grad_slopes(slopes, hq)
    if learnable is not None:  # learnable: the tensor is the op's input
        theta = learnable
    out, _ = exact_forward(q, k, v, theta, win, "alibi", causal, sc, backend, check=compiling, key_padding_mask=mask)
    return out


def decay_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    family: str,
    params: torch.Tensor | Sequence[float],
    *,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention with a built-in positional decay, ``O(n)`` memory, and gradients for its parameters.

    Computes ``softmax_j(scale * q_i . k_j + log k_theta_h(|i - j|)) v`` (over ``j <= i`` when ``causal``): the
    bias is added after scaling, ``-inf`` where ``k = 0``. The families
    (:data:`~positional_lsh.ops.partitions.decays.DECAY_FAMILIES`) and their parameters, in this order:

    * ``"exponential"``: ``slope >= 0``, ``log k = -slope d`` (ALiBi's ``-m |i - j|``);
    * ``"power"``: ``r1 > 0, r2 > 0``, ``log k = -r1 log(1 + r2 d)`` (KERPLE's power/log decay);
    * ``"truncated-linear"``: ``width >= 1``, ``log k = log(1 - d / width)`` for ``d < width``, ``-inf`` beyond
      (a hard mask: no gradient through the support's edge).

    Chunked over queries like :func:`alibi_attention` (the same Toeplitz banks and recomputing backward; a
    truncated-linear head only visits keys within its width).

    Args:
        q: ``(B, Hq, Lq, d)``; float32, float64, bfloat16 or float16.
        k, v: ``(B, Hkv, Lk, d)``, ``Hq % Hkv == 0``, ``Lq <= Lk`` (queries aligned to the last keys).
        family: a family name (above); ``ValueError`` naming ``family`` otherwise.
        params: ``(Hq, P)`` (one row per query head) or ``(P,)`` (every head), a tensor (any float dtype and
            device) or numbers. A tensor that requires grad gets ``dL/dtheta_hp = sum_{b,i,j} dS_bhij d log
            k_theta_h(|i - j|) / d theta_p`` (``dS``: the gradient of the loss with respect to the biased score),
            accumulated in float32 (float64 for float64 inputs), in its own shape, dtype and device; each
            parameter costs one more math pass of score recomputation per chunk in the backward. ``ValueError``
            naming ``params`` for a wrong shape or a value outside the family's bounds.
        causal: causal masking.
        scale: score scale, default ``1/sqrt(d)``.
        backend: as :func:`alibi_attention`.
        key_padding_mask: as :func:`alibi_attention`.
        cu_seqlens: as :func:`alibi_attention`.

    Returns:
        ``(B, Hq, Lq, d)`` in ``q``'s dtype; supports autograd (``q``, ``k``, ``v``, ``params``). Non-finite keys
        poison exactly the rows that keep them, as in :func:`alibi_attention`.

    Example:
        >>> import torch
        >>> from positional_lsh import decay_attention
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 32, 8, dtype=torch.float64, generator=g) for _ in range(3))
        >>> theta = torch.tensor([[0.5, 1.0], [2.0, 0.3]], dtype=torch.float64, requires_grad=True)  # (r1, r2)
        >>> decay_attention(q, k, v, "power", theta).sum().backward()
        >>> theta.grad.shape
        torch.Size([2, 2])
    """
    b, hq, _, _, lk, d = check_qkv(q, k, v)
    sc = as_scale(scale, d)
    check_bool("causal", causal)
    fam = decay_family(family)
    backend = exact_kernel(backend, q, "decay_attention")
    mask = segment_ids(check_key_padding_mask(key_padding_mask, q, lk), check_cu_seqlens(cu_seqlens, lk), b, lk,
                       q.device)  # fmt: skip
    compiling = torch.compiler.is_compiling()  # then the op checks the parameters (shape and values)
    if q.device.type == "meta" and is_meta_tensor(params) and not compiling:
        # Meta parameters hold no values: shapes only (connected to the parameters for autograd).
        return meta_output(q, k, v, fam.check_param_shape(params, hq))
    if compiling:
        theta = params if isinstance(params, torch.Tensor) else torch.as_tensor(params, dtype=torch.float64)
        if theta.dim() == 1 and theta.shape[0] == fam.num_params:
            theta = theta[None].expand(hq, fam.num_params)
    else:
        theta, _ = fam.check_params(params, hq)
    out, _ = exact_forward(q, k, v, theta, None, fam.name, causal, sc, backend, check=compiling, key_padding_mask=mask)
    return out
