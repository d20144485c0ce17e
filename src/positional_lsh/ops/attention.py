"""The public entry points of the estimator: :func:`plsh_attention` and :class:`PositionalLSHAttention`.

The estimator (docs/design.md). For head ``h`` with sampled block masks ``M_1..M_T`` and their mean ``Mbar``::

    out_i = sum_j Mbar[i,j] e^{s[i,j]} v_j / sum_j Mbar[i,j] e^{s[i,j]} = softmax_j(s[i,j] + log Mbar[i,j]) v

with ``s[i,j] = scale * q_i . k_j`` (plus the causal mask). This is a ratio of averaged numerators and
denominators, *not* the mean of the ``T`` per-sample attention outputs. Its exact gradients are the standard
attention backward run against the merged output and log-sum-exp.

This module only checks arguments, draws partitions and hands the call to the estimator's one custom operator
(:mod:`positional_lsh.ops._engine.op`, eager and compiled alike), which runs the engine
(:mod:`positional_lsh.ops._engine.engine`: the backends behind one interface, chosen in one place,
:mod:`positional_lsh.ops._engine.routing`).
"""

from __future__ import annotations

import torch

from positional_lsh.ops._engine import routing
from positional_lsh.ops._engine.cost import AutoEstimate, call_estimate, exact_seconds
from positional_lsh.ops._engine.kinds import Method
from positional_lsh.ops._engine.op import run
from positional_lsh.ops.checks import (
    GeneratorLike,
    QKVShape,
    SlopesLike,
    as_scale,
    as_slopes,
    check_meta_slopes,
    check_qkv,
    grad_slopes,
    is_meta_tensor,
    meta_output,
    positive_int,
)
from positional_lsh.ops.errors import check_memory, check_seconds, format_seconds
from positional_lsh.ops.options import (
    DEFAULT_BACKEND,
    DEFAULT_METHOD,
    DEFAULT_SLOPE_GRAD,
    check_slope_grad,
)
from positional_lsh.ops.padding import check_cu_seqlens, check_key_padding_mask, routed_like, segment_ids
from positional_lsh.ops.partitions.partition import Partitions, check_partitions, check_slopes_match, sample_partitions
from positional_lsh.ops.partitions.sampling import sample_op

__all__ = ["plsh_attention"]

MAX_SECONDS = 60.0
"""A call is refused up front when its estimated time exceeds both this (seconds) ..."""
MAX_OVER_EXACT = 10.0
"""... and this many times exact attention over the same call: then positional LSH cannot be the point."""


def check_call_size(
    num_samples: int,
    num_heads: int,
    q_len: int,
    k_len: int,
    head_dim: int,
    causal: bool,
    method: str,
    *,
    what: str | None = None,
) -> None:
    """Refuse a call, before anything is drawn, whose estimated host memory exceeds this machine's
    (:func:`~positional_lsh.ops.errors.check_memory`) or whose estimated time exceeds both :data:`MAX_SECONDS` and
    :data:`MAX_OVER_EXACT` times exact attention over the same call (lower bounds from the cost model,
    :func:`~positional_lsh.ops._engine.cost.call_estimate`; e.g. ``num_samples=10**6`` at ``n = 4096``). One
    line with
    the estimate: :class:`~positional_lsh.ops.errors.UserError` (a ``ValueError``) naming ``what`` (default: the
    call's sizes). Every eager :func:`plsh_attention` call runs it; commands check their flags with it up front."""
    asked = Method(method)
    need, seconds = call_estimate(AutoEstimate.of(num_samples, num_heads, q_len), asked)
    what = what or (f"plsh_attention with num_samples={num_samples}, {num_heads} heads and {q_len} queries "
                    f"(method='{asked}')")  # fmt: skip
    check_memory(need, what)
    exact = exact_seconds(num_heads, q_len, k_len, head_dim, causal)
    why = f"exact attention over the same call takes about {format_seconds(exact)}; see alibi_attention"
    check_seconds(seconds, max(MAX_SECONDS, MAX_OVER_EXACT * exact), what, why)


def _check_size(shape: QKVShape, num_samples: int, route: routing.Route, checked: bool) -> None:
    """:func:`check_call_size` of an eager call (not under ``torch.compile``, where shapes may be symbolic), unless
    the caller ran it already (``checked``: :class:`~positional_lsh.PositionalLSHAttention`, before its draw)."""
    if not route.compiled and not checked:
        method = route.method if route.samples is not None else Method.MULTIPLICITY
        check_call_size(num_samples, shape.q_heads, shape.q_len, shape.k_len, shape.head_dim, route.causal, method)


def _grad_slopes(slopes: object, slope_grad: str, num_heads: int) -> torch.Tensor | None:
    """The slopes tensor that gets the surrogate gradient (:func:`~positional_lsh.ops.checks.grad_slopes`), or
    ``None``: also when ``slope_grad="none"`` (nothing changes, no extra work)."""
    return grad_slopes(slopes, num_heads) if slope_grad == "surrogate" else None


def _compiled_draw(
    slopes: SlopesLike, num_heads: int, seq_len: int, num_samples: int, scheme: object, generator: object
) -> Partitions:
    """The draw of ``plsh_attention`` without ``partitions=`` under ``torch.compile``: the custom op, from an int
    seed (the same partitions as eager mode)."""
    if isinstance(generator, bool) or not isinstance(generator, int):
        raise ValueError(
            "under torch.compile, plsh_attention needs partitions= or an int seed as generator= (a torch.Generator "
            f"or torch's global RNG cannot be traced), got generator={generator!r}"
        )
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__}")
    slopes_t = as_slopes(slopes, num_heads, read=False)
    pitch, shift = sample_op(None, generator, slopes_t, positive_int("num_samples", num_samples), scheme)
    return Partitions(seq_len, slopes_t, pitch, shift, scheme)


def plsh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: SlopesLike = None,
    *,
    num_samples: int = 8,
    causal: bool = True,
    partitions: Partitions | None = None,
    scheme: str = "discrete",
    generator: GeneratorLike = None,
    scale: float | None = None,
    backend: str = DEFAULT_BACKEND,
    method: str = DEFAULT_METHOD,
    slope_grad: str = DEFAULT_SLOPE_GRAD,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positional-LSH attention: the ALiBi estimator ``softmax(s + log Mbar) v`` in near-linear time.

    Args:
        q: ``(B, Hq, Lq, d)`` queries; float32, bfloat16, float16 or float64.
        k: ``(B, Hkv, Lk, d)`` keys with ``Hq % Hkv == 0`` (grouped-query attention) and ``Lq <= Lk``;
            queries are aligned to the last ``Lq`` keys (``Lq < Lk`` for decoding with a KV cache).
        v: ``(B, Hkv, Lk, d)`` values.
        slopes: ALiBi slopes, ``(Hq,)`` (a tensor, a numpy array or a sequence) or one float for every head;
            default ``alibi_slopes(Hq)``.
            The bias being approximated is ``-slopes[h] * |i - j|`` added after scaling. A tensor requiring grad
            (``(Hq,)`` or 0-dim, any float dtype and device) is learnable: the partitions are drawn from its
            detached values and, with ``slope_grad="surrogate"``, the backward gives it the surrogate gradient.
        num_samples: number ``T`` of sampled partitions per head (ignored when ``partitions`` is given).
        causal: restrict query ``i`` to keys ``j <= i``.
        partitions: pre-sampled :class:`~positional_lsh.Partitions` (``seq_len == Lk``, ``num_heads == Hq``);
            if given, ``slopes``, ``num_samples``, ``scheme`` and ``generator`` are not used for sampling
            (``slopes``, if given, must equal ``partitions.slopes``).
        scheme: partition scheme when sampling: ``"discrete"`` (default, exactly unbiased and fastest),
            ``"gamma"`` (the paper's), ``"fixed"`` (biased ablation), a variance-reduced scheme, or one added
            with :func:`~positional_lsh.register_scheme` (see
            :func:`~positional_lsh.ops.partitions.schemes.scheme_names`).
        generator: CPU ``torch.Generator``, ``int`` seed, or ``None`` (torch's global RNG).
        scale: score scale, default ``1/sqrt(d)``.
        backend: ``"auto"`` (the first backend, in a fixed priority, that takes the inputs: on CUDA the Triton
            kernels for the multiplicity form when triton is installed, torch's fused flash SDPA op of the device
            where it takes the calls, else the math backend), ``"flash"`` (torch's fused flash SDPA op, a private ATen
            op, on the CPU as on CUDA), ``"math"`` (batched matmuls, any device), or ``"triton"`` (the Triton
            kernels of the multiplicity form, for ``method="multiplicity"`` or ``"auto"``; float32/bfloat16/float16
            on CUDA; docs/implementation.md, "The Triton kernels"). Decided once per call, from the inputs, before
            anything is drawn (``ops._engine.routing.dispatch``): a forced ``backend`` that cannot run the inputs
            (e.g. ``"flash"`` on CUDA for float32, or for the multiplicity form, whose calls carry a mask the CUDA
            op does not take) raises one ``ValueError`` listing every backend's reason; nothing falls back later.
        method: ``"samples"`` (one kernel call per block group of every sample, merged by log-sum-exp),
            ``"multiplicity"`` (query tiles attending to the union of their blocks with the additive mask
            ``log c``, ``c[i,j]`` the number of samples in which ``i`` and ``j`` share a block), or ``"auto"``
            (decided once per call, for all heads, by a cost model). All three compute the same estimator from the
            same partitions (docs/implementation.md). Default ``"auto"``: one sample never takes the multiplicity
            form; at large ``T`` the call does. The choice changes the speed, not the result (beyond float rounding).
            How a call is routed: :func:`positional_lsh.ops._engine.routing.dispatch`.
        slope_grad: the gradient of a ``slopes`` tensor requiring grad (``ops.options.SLOPE_GRADS``):
            ``"surrogate"`` (default): ``slopes.grad[h] = -sum over batch, i, j of dS[b, h, i, j] |i - j|`` with the
            estimator's own ``dS = dL/d(score incl. log Mbar)`` — the exact ALiBi slope gradient's formula on the
            estimator, i.e. the gradient of ``softmax(s + log Mbar - (m - m.detach()) |i - j|) v`` for the same
            partitions: biased at finite ``T``, consistent as ``T -> inf`` (docs/implementation.md, "Learning the
            slopes"); accumulated in float32 (float64 for float64 inputs), returned in the slopes' dtype. Costs one
            more math pass over every kernel call's scores in the backward, only when the slopes require grad.
            ``"none"``: the slopes get no gradient from this call. Checked on every call; without a slopes tensor
            requiring grad it changes nothing (same outputs, same ``q, k, v`` gradients, no extra work).
        key_padding_mask: ``None`` (every key valid) or a ``(B, Lk)`` bool tensor on ``q``'s device, ``True`` for a
            valid key, any pattern (left or right padding, holes). A masked key leaves the softmax; positions (and
            so the blocks of the partitions, which must still be for ``Lk`` keys) are counted from the row's first
            valid key, masked keys after it included, queries stay aligned to the last ``Lq`` keys, and query rows
            at masked positions (or in a row without valid keys) return zeros and get zero gradients
            (:mod:`positional_lsh.ops.padding`). A mask of all ``True`` computes what no mask computes.
        cu_seqlens: ``None``, or packed sequences: a 1-D integer tensor ``[0, n_1, n_1 + n_2, ..., Lk]`` (strictly
            increasing; ``ValueError`` naming ``cu_seqlens`` otherwise) that splits every batch row into documents.
            Each document is its own sequence: positions restart at its start, no attention crosses documents, and
            the partitions apply to it as ``partitions.with_seq_len(its length)``, so the output equals running the
            documents one by one (:mod:`positional_lsh.ops.padding`). Combines with ``key_padding_mask``.

    Returns:
        ``(B, Hq, Lq, d)`` tensor in ``q``'s dtype. Differentiable w.r.t. ``q``, ``k``, ``v`` (exact gradients
        of the estimator for the sampled partitions), and w.r.t. ``slopes`` by the surrogate (see ``slope_grad``).
        NaN in the inputs propagates to NaN in the rows it reaches (and to the slope gradient); it never raises.
        On ``meta`` tensors: a ``meta`` tensor of that shape (shape propagation).

    Raises:
        TypeError, ValueError: naming the bad argument; :class:`~positional_lsh.ops.errors.UserError` (a
            ``ValueError``) with the estimate for a call too large to run (:func:`check_call_size`).

    Example:
        >>> import torch
        >>> import positional_lsh as plsh
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 4, 256, 16, generator=g) for _ in range(3))
        >>> out = plsh.plsh_attention(q, k, v, num_samples=8, generator=0)
        >>> out.shape
        torch.Size([1, 4, 256, 16])
        >>> torch.equal(out, plsh.plsh_attention(q, k, v, num_samples=8, generator=0))  # same seed, same output
        True

        More samples, closer to exact ALiBi; a slope of 0 is one block per head, i.e. plain causal attention:

        >>> exact = plsh.alibi_attention(q, k, v)
        >>> def error(t):
        ...     return ((plsh.plsh_attention(q, k, v, num_samples=t, generator=0) - exact).norm() / exact.norm()).item()
        >>> error(256) < error(4)
        True
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(plsh.plsh_attention(q, k, v, slopes=0.0), sdpa, atol=1e-6)
        True
    """
    return run_plsh_attention(
        q, k, v, slopes, num_samples=num_samples, causal=causal, partitions=partitions, scheme=scheme,
        generator=generator, scale=scale, backend=backend, method=method, slope_grad=slope_grad,
        key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, size_checked=False,
    )  # fmt: skip


def run_plsh_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: SlopesLike, *, num_samples: int, causal: bool,
    partitions: Partitions | None, scheme: str, generator: GeneratorLike, scale: float | None, backend: str,
    method: str, slope_grad: str, key_padding_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
    size_checked: bool,
) -> torch.Tensor:  # fmt: skip
    """:func:`plsh_attention`, whose arguments it takes, for a caller that ran :func:`check_call_size` for the call
    already when ``size_checked`` (:class:`~positional_lsh.PositionalLSHAttention`, before its draw): then the call
    does not run it again. Internal to the package (not in ``__all__``)."""
    shape = check_qkv(q, k, v)
    mask = check_key_padding_mask(key_padding_mask, q, shape.k_len)
    cu = check_cu_seqlens(cu_seqlens, shape.k_len)
    route = routing.dispatch(routed_like(q, mask), causal=causal, scale=as_scale(scale, shape.head_dim),
                             backend=backend, method=method, k_len=shape.k_len,
                             padded=mask is not None or cu is not None)  # fmt: skip
    mask = segment_ids(mask, cu, shape.batch, shape.k_len, q.device)
    grad_slopes = _grad_slopes(slopes, check_slope_grad(slope_grad), shape.q_heads)
    expected = None
    if q.device.type == "meta" and is_meta_tensor(slopes) and not route.compiled:
        # Meta slopes hold no values to draw from or compare: shapes only (connected to the slopes for autograd).
        assert isinstance(slopes, torch.Tensor)
        check_meta_slopes(slopes, shape.q_heads)
        if partitions is None:
            positive_int("num_samples", num_samples)
        else:
            check_partitions(partitions, shape.q_heads, shape.k_len)
        return meta_output(q, k, v, slopes)
    if partitions is None:
        _check_size(shape, positive_int("num_samples", num_samples), route, size_checked)
    elif isinstance(partitions, Partitions):
        _check_size(shape, partitions.num_samples, route, size_checked)
    if partitions is None and route.compiled:
        partitions = _compiled_draw(slopes, shape.q_heads, shape.k_len, num_samples, scheme, generator)
    elif partitions is None:
        slopes_t = as_slopes(slopes, shape.q_heads)
        t = positive_int("num_samples", num_samples)
        partitions = sample_partitions(shape.k_len, slopes_t, t, scheme=scheme, generator=generator)
    else:
        expected = check_slopes_match(slopes, partitions, shape.q_heads)  # under torch.compile: compared in the op
    check_partitions(partitions, shape.q_heads, shape.k_len)
    if q.device.type == "meta" and not route.compiled:
        return meta_output(q, k, v)
    return run(q, k, v, partitions, route, grad_slopes, expected, mask)
