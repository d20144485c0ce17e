"""The public entry points of the estimator: :func:`plsh_attention` and :class:`PositionalLSHAttention`.

The estimator (docs/design.md). For head ``h`` with sampled block masks ``M_1..M_T`` and their mean ``Mbar``::

    out_i = sum_j Mbar[i,j] e^{s[i,j]} v_j / sum_j Mbar[i,j] e^{s[i,j]} = softmax_j(s[i,j] + log Mbar[i,j]) v

with ``s[i,j] = scale * q_i . k_j`` (plus the causal mask). This is a ratio of averaged numerators and
denominators, *not* the mean of the ``T`` per-sample attention outputs. Its exact gradients are the standard
attention backward run against the merged output and log-sum-exp.

This module only checks arguments, draws partitions and hands the call to the engine
(:mod:`positional_lsh.ops.engine`: one dispatch, the backends behind one interface, eager or compiled).
"""

from __future__ import annotations

import torch
from torch import nn

from positional_lsh.ops import compiled, engine
from positional_lsh.ops._checks import GeneratorLike, SlopesLike, as_slopes, check_qkv, positive_int
from positional_lsh.ops.options import DEFAULT_BACKEND, DEFAULT_METHOD, check_backend, check_method
from positional_lsh.ops.partitions import Partitions, check_partitions, check_slopes_match, sample_partitions
from positional_lsh.ops.sampling import PartitionSampler, sample_op, slopes_tensor

__all__ = ["PositionalLSHAttention", "plsh_attention"]


def _execute(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partitions: Partitions, route: engine.Route
) -> torch.Tensor:
    """Eager or compiled execution of a routed call (``route.compiled`` is decided by ``engine.dispatch``)."""
    return (compiled.run if route.compiled else engine.run)(q, k, v, partitions, route)


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
    slopes_t = slopes_tensor(slopes, num_heads)
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
) -> torch.Tensor:
    """Positional-LSH attention: the ALiBi estimator ``softmax(s + log Mbar) v`` in near-linear time.

    Args:
        q: ``(B, Hq, Lq, d)`` queries; float32, bfloat16, float16 or float64.
        k: ``(B, Hkv, Lk, d)`` keys with ``Hq % Hkv == 0`` (grouped-query attention) and ``Lq <= Lk``;
            queries are aligned to the last ``Lq`` keys (``Lq < Lk`` for decoding with a KV cache).
        v: ``(B, Hkv, Lk, d)`` values.
        slopes: ALiBi slopes, ``(Hq,)`` or one float for every head; default ``alibi_slopes(Hq)``.
            The bias being approximated is ``-slopes[h] * |i - j|`` added after scaling.
        num_samples: number ``T`` of sampled partitions per head (ignored when ``partitions`` is given).
        causal: restrict query ``i`` to keys ``j <= i``.
        partitions: pre-sampled :class:`~positional_lsh.Partitions` (``seq_len == Lk``, ``num_heads == Hq``);
            if given, ``slopes``, ``num_samples``, ``scheme`` and ``generator`` are not used for sampling
            (``slopes``, if given, must equal ``partitions.slopes``).
        scheme: partition scheme when sampling: ``"discrete"`` (default, exactly unbiased and fastest),
            ``"gamma"`` (the paper's), ``"fixed"`` (biased ablation), a variance-reduced scheme, or one added
            with :func:`~positional_lsh.register_scheme` (see :func:`~positional_lsh.ops.schemes.scheme_names`).
        generator: CPU ``torch.Generator``, ``int`` seed, or ``None`` (torch's global RNG).
        scale: score scale, default ``1/sqrt(d)``.
        backend: ``"auto"`` (CPU: torch's fused flash op; other devices: ``"math"``), ``"flash"``, ``"math"``,
            or ``"triton"`` (the Triton kernels of the multiplicity form, for ``method="multiplicity"`` or
            ``"auto"``; float32/bfloat16/float16 on CUDA). ``"auto"`` with ``method="multiplicity"`` on CUDA
            uses them when triton is installed (docs/implementation.md, "The Triton kernel").
        method: ``"samples"`` (one kernel call per block group of every sample, merged by log-sum-exp),
            ``"multiplicity"`` (query tiles attending to the union of their blocks with the additive mask
            ``log c``, ``c[i,j]`` the number of samples in which ``i`` and ``j`` share a block), or ``"auto"``
            (decided once per call, for all heads, by a cost model). All three compute the same estimator from the
            same partitions (docs/implementation.md). Default ``"auto"``: one sample never takes the multiplicity
            form; at large ``T`` the call does. The choice changes the speed, not the result (beyond float rounding).
            How a call is routed: :func:`positional_lsh.ops.engine.dispatch`.

    Returns:
        ``(B, Hq, Lq, d)`` tensor in ``q``'s dtype. Differentiable w.r.t. ``q``, ``k``, ``v`` (exact gradients
        of the estimator for the sampled partitions). NaN in the inputs propagates to NaN in the rows it
        reaches; it never raises.
    """
    shape = check_qkv(q, k, v)
    route = engine.dispatch(q, causal=causal, scale=scale, backend=backend, method=method)
    if partitions is None and route.compiled:
        partitions = _compiled_draw(slopes, shape.q_heads, shape.k_len, num_samples, scheme, generator)
    elif partitions is None:
        slopes_t = as_slopes(slopes, shape.q_heads)
        t = positive_int("num_samples", num_samples)
        partitions = sample_partitions(shape.k_len, slopes_t, t, scheme=scheme, generator=generator)
    else:
        check_slopes_match(slopes, partitions, shape.q_heads)
    check_partitions(partitions, shape.q_heads, shape.k_len)
    return _execute(q, k, v, partitions, route)


class PositionalLSHAttention(nn.Module):
    """Positional-LSH attention as a module holding slopes, sample count, scheme and a sampling policy.

    The sampling policy is the package's one (:class:`~positional_lsh.ops.sampling.PartitionSampler`): in eval
    mode every call uses the partitions drawn from ``eval_seed``, so evaluation is deterministic; training call
    ``c`` (``c = 0, 1, ...``, counted by the int64 buffer ``calls``, advanced by every training call and kept in
    the state dict, so a reloaded module continues the sequence) draws from ``layer_seed(seed, c)``: fresh
    partitions every call, the same sequence for the same ``seed``. ``seed=None`` draws from torch's global RNG.
    Call with ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)``; see :func:`plsh_attention`.

    Under ``torch.compile`` (``fullgraph=True`` included) the draw is the custom op
    ``positional_lsh::sample_partitions`` and the estimator the op ``positional_lsh::plsh_forward``
    (:mod:`positional_lsh.ops.compiled`); the module's Python generator is not used:

    * eval mode draws from ``eval_seed`` exactly as eager mode does: the same partitions, the same output;
    * training mode with an int ``seed``: compiled training call ``c`` (``c = 0, 1, ...``, counted by the int64
      buffer ``_calls``, advanced in place by each compiled training call, not saved in the state dict) draws
      from a generator seeded with ``layer_seed(seed, c)`` (:mod:`positional_lsh.ops.sampling`). Every call gets
      fresh partitions and a new module with the same ``seed`` repeats the sequence, but it is not the sequence
      of eager training calls (which draw from one generator stream);
    * training mode with ``seed=None`` draws from torch's global RNG inside the op, as eager training does.
    """

    def __init__(
        self,
        num_heads: int,
        slopes: SlopesLike = None,
        *,
        num_samples: int = 8,
        scheme: str = "discrete",
        causal: bool = True,
        seed: int | None = None,
        eval_seed: int = 0,
        scale: float | None = None,
        backend: str = DEFAULT_BACKEND,
        method: str = DEFAULT_METHOD,
    ) -> None:
        super().__init__()
        self.sampler = PartitionSampler(
            num_heads, slopes, num_samples=num_samples, scheme=scheme, seed=seed, eval_seed=eval_seed
        )
        self.causal = causal
        self.scale = scale
        self.backend = check_backend(backend)
        self.method = check_method(method)
        # Training calls so far: the key of their draws (see the class docstring).
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    @property
    def num_heads(self) -> int:
        return self.sampler.num_heads

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    @property
    def scheme(self) -> str:
        return self.sampler.scheme

    @property
    def slopes(self) -> torch.Tensor:
        """``(H,)`` float64 CPU slopes: they drive the sampler only, and are kept in the state dict as extra state
        so that casting the model (``.half()``, ``.to(bfloat16)``) never rounds them."""
        return self.sampler.slopes

    def get_extra_state(self) -> dict[str, list[float]]:
        return {"slopes": self.slopes.tolist()}

    def set_extra_state(self, state: dict[str, list[float]]) -> None:
        s = self.sampler
        self.sampler = PartitionSampler(
            s.num_heads, state["slopes"], num_samples=s.num_samples, scheme=s.scheme, seed=s.seed, eval_seed=s.eval_seed
        )

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_samples={self.num_samples}, scheme={self.scheme!r}"

    def sample(self, seq_len: int) -> Partitions:
        """The partitions the next call at ``seq_len`` keys will use (does not advance the step)."""
        return self.sampler.draw(seq_len, training=self.training, step=self.calls)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = check_qkv(q, k, v)
        route = engine.dispatch(q, causal=self.causal, scale=self.scale, backend=self.backend, method=self.method)
        partitions = self.sample(shape.k_len)
        if self.training:
            self.calls.add_(1)
        check_partitions(partitions, shape.q_heads, shape.k_len)
        return _execute(q, k, v, partitions, route)
