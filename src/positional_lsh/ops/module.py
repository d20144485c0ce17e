"""The positional-LSH attention module: :class:`PositionalLSHAttention` (slopes, sample count, scheme and a
sampling policy around :func:`~positional_lsh.ops.attention.plsh_attention`)."""

from __future__ import annotations

import torch
from torch import nn

from positional_lsh.ops._checks import (
    SlopesLike,
    check_bool,
    check_qkv,
)
from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.options import (
    DEFAULT_BACKEND,
    DEFAULT_METHOD,
    DEFAULT_SLOPE_GRAD,
    check_backend,
    check_method,
    check_slope_grad,
)
from positional_lsh.ops.partitions.partition import Partitions
from positional_lsh.ops.partitions.sampling import PartitionSampler

__all__ = ["PositionalLSHAttention"]


class PositionalLSHAttention(nn.Module):
    """Positional-LSH attention as a module holding slopes, sample count, scheme and a sampling policy.

    The sampling policy is the package's one (:class:`~positional_lsh.ops.partitions.sampling.PartitionSampler`): in
    eval
    mode every call uses the partitions drawn from ``eval_seed``, so evaluation is deterministic; training call
    ``c`` (``c = 0, 1, ...``, counted by the int64 buffer ``calls``, advanced by every training call and kept in
    the state dict, so a reloaded module continues the sequence) draws from ``layer_seed(seed, c)``: fresh
    partitions every call, the same sequence for the same ``seed``. ``seed=None`` draws from torch's global RNG.
    Call with ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)``; see :func:`plsh_attention`.

    Under ``torch.compile`` (``fullgraph=True`` included) the draw is the custom op
    ``positional_lsh::sample_partitions`` and the estimator the op ``positional_lsh::plsh_forward``
    (:mod:`positional_lsh.ops._engine.op`); the module's Python generator is not used:

    * eval mode draws from ``eval_seed`` exactly as eager mode does: the same partitions, the same output;
    * training mode with an int ``seed``: compiled training call ``c`` (``c = 0, 1, ...``, counted by the int64
      buffer ``_calls``, advanced in place by each compiled training call, not saved in the state dict) draws
      from a generator seeded with ``layer_seed(seed, c)`` (:mod:`positional_lsh.ops.partitions.sampling`). Every call
      gets
      fresh partitions and a new module with the same ``seed`` repeats the sequence, but it is not the sequence
      of eager training calls (which draw from one generator stream);
    * training mode with ``seed=None`` draws from torch's global RNG inside the op, as eager training does.

    Learned slopes (``learn_slopes=True``): the module holds the float32 parameter ``log_slopes (H,)``, initialised to
    the log of ``slopes`` (every slope must be ``> 0``: a slope of 0 has no log and cannot be learned), and uses
    ``slopes = log_slopes.exp()`` (positive by construction): every call draws its partitions from the current
    detached slopes (same seeds as above) and passes the slopes tensor to :func:`plsh_attention`, whose backward
    gives it the surrogate gradient (``slope_grad="surrogate"``; ``"none"``: no gradient, the slopes only drive the
    draws). ``log_slopes`` is in the state dict (and follows the module's casts, like any parameter). Without
    ``learn_slopes`` (the default) there is no parameter: state dict and outputs are those of a fixed-slope module.

    Example:
        >>> import torch
        >>> from positional_lsh import PositionalLSHAttention
        >>> attn = PositionalLSHAttention(num_heads=4, num_samples=4, seed=0)
        >>> q, k, v = (torch.randn(2, 4, 128, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
        >>> y = attn(q, k, v)  # training mode: fresh partitions at every call
        >>> y.shape, int(attn.calls)
        (torch.Size([2, 4, 128, 16]), 1)
        >>> torch.equal(attn(q, k, v), y)
        False
        >>> _ = attn.eval()  # eval mode: the partitions drawn from eval_seed, at every call
        >>> torch.equal(attn(q, k, v), attn(q, k, v))
        True
    """

    calls: torch.Tensor  # the int64 buffer registered in __init__ (typed here for the checker)

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
        learn_slopes: bool = False,
        slope_grad: str = DEFAULT_SLOPE_GRAD,
    ) -> None:
        super().__init__()
        self.sampler = PartitionSampler(
            num_heads, slopes, num_samples=num_samples, scheme=scheme, seed=seed, eval_seed=eval_seed
        )
        self.causal = causal
        self.scale = scale
        self.backend = check_backend(backend)
        self.method = check_method(method)
        self.learn_slopes = check_bool("learn_slopes", learn_slopes)
        self.slope_grad = check_slope_grad(slope_grad)
        if self.learn_slopes:
            init = self.sampler.slopes
            if not bool((init > 0).all()):
                raise ValueError(
                    "learn_slopes=True learns log-slopes, so every slope must be > 0 (a slope of 0 cannot be "
                    f"learned); got slopes={init.tolist()}"
                )
            self.log_slopes = nn.Parameter(init.log().to(torch.float32))
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
        so that casting the model (``.half()``, ``.to(bfloat16)``) never rounds them. With ``learn_slopes``: the
        current learned slopes ``log_slopes.exp()``, detached (the extra state keeps the initial ones)."""
        if self.learn_slopes:
            return self.log_slopes.detach().exp().to("cpu", torch.float64)
        return self.sampler.slopes

    def learned_slopes(self) -> torch.Tensor | None:
        """``log_slopes.exp()`` (``(H,)``, differentiable, on the parameter's device and dtype) with
        ``learn_slopes``, else ``None``."""
        return self.log_slopes.exp() if self.learn_slopes else None

    def get_extra_state(self) -> dict[str, list[float]]:
        return {"slopes": self.sampler.slopes.tolist()}

    def set_extra_state(self, state: dict[str, list[float]]) -> None:
        s = self.sampler
        self.sampler = PartitionSampler(
            s.num_heads, state["slopes"], num_samples=s.num_samples, scheme=s.scheme, seed=s.seed, eval_seed=s.eval_seed
        )

    def extra_repr(self) -> str:
        learn = f", learn_slopes=True, slope_grad={self.slope_grad!r}" if self.learn_slopes else ""
        return f"num_heads={self.num_heads}, num_samples={self.num_samples}, scheme={self.scheme!r}{learn}"

    def sample(self, seq_len: int) -> Partitions:
        """The partitions the next call at ``seq_len`` keys will use (does not advance the step); with
        ``learn_slopes``, drawn from the current slopes."""
        return self._draw(seq_len, self.learned_slopes())

    def _draw(self, seq_len: int, slopes: torch.Tensor | None) -> Partitions:
        values = None if slopes is None else slopes.detach()
        return self.sampler.draw(seq_len, training=self.training, step=self.calls, slopes=values)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = check_qkv(q, k, v)
        slopes = self.learned_slopes()
        partitions = self._draw(shape.k_len, slopes)
        if self.training:
            self.calls.add_(1)
        return plsh_attention(
            q,
            k,
            v,
            slopes,
            partitions=partitions,
            causal=self.causal,
            scale=self.scale,
            backend=self.backend,
            method=self.method,
            slope_grad=self.slope_grad,
        )
