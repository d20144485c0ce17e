"""The positional-LSH attention module: :class:`PositionalLSHAttention` (slopes, sample count, scheme and a
sampling policy around :func:`~positional_lsh.ops.attention.plsh_attention`), the learned log-slopes parameter it
shares with the language model (:func:`log_slopes_parameter`), and :class:`ShardedAttention`, what a call over a
sequence split across ranks (context parallelism) is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from positional_lsh.ops._engine.routing import sized_method
from positional_lsh.ops.attention import check_call_size, run_plsh_attention
from positional_lsh.ops.checks import (
    SlopesLike,
    check_bool,
    check_qkv,
)
from positional_lsh.ops.options import (
    DEFAULT_BACKEND,
    DEFAULT_METHOD,
    DEFAULT_SLOPE_GRAD,
    check_backend,
    check_method,
    check_slope_grad,
)
from positional_lsh.ops.padding import check_cu_seqlens, check_key_padding_mask
from positional_lsh.ops.partitions.partition import Partitions
from positional_lsh.ops.partitions.sampling import PartitionSampler

__all__ = ["PositionalLSHAttention"]

_EXTRA_STATE = "_extra_state"  # torch's state-dict key of get_extra_state (nn.modules.module._EXTRA_STATE_KEY_SUFFIX)


@dataclass(frozen=True)
class ShardedCall:
    """What a :class:`PositionalLSHAttention` call hands its :class:`ShardedAttention`: the partitions of the whole
    sequence and the module's settings, the arguments of ``plsh_attention``."""

    partitions: Partitions
    causal: bool
    scale: float | None
    backend: str
    method: str


class ShardedAttention(Protocol):
    """How a :class:`PositionalLSHAttention` call runs when ``q, k, v`` are this rank's contiguous shard of a longer
    sequence (context parallelism): pass one as ``context=``. The module draws the partitions of the *whole*
    sequence (``seq_len``), with its own policy and step, and hands them to ``attend`` with its settings
    (:class:`ShardedCall`). :class:`positional_lsh.distributed.ContextShards` is the implementation over
    ``torch.distributed``.
    """

    def seq_len(self, local_len: int) -> int:
        """The whole sequence's length, given this rank's ``local_len`` keys."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: ShardedCall) -> torch.Tensor:
        """This rank's rows of ``plsh_attention`` on the whole sequence with ``call``'s partitions (of the whole
        sequence) and settings."""
        ...


def log_slopes_parameter(slopes: torch.Tensor) -> nn.Parameter:
    """The learned log-slopes of ``(H,)`` ``slopes``: a float32 parameter ``log(slopes)`` (the slopes used are its
    ``exp``, positive by construction). Every slope must be ``> 0`` (a slope of 0 has no log and cannot be learned).

    The one way both :class:`PositionalLSHAttention` (``learn_slopes=True``) and the language model's layers
    (:class:`~positional_lsh.lm.TransformerLM` with ``ModelConfig.learn_slopes``) make their parameter.
    """
    if not bool((slopes > 0).all()):
        raise ValueError(
            "learn_slopes=True learns log-slopes, so every slope must be > 0 (a slope of 0 cannot be "
            f"learned); got slopes={slopes.tolist()}"
        )
    return nn.Parameter(slopes.log().to(torch.float32))


class PositionalLSHAttention(nn.Module):
    """Positional-LSH attention as a module holding slopes, sample count, scheme and a sampling policy.

    The sampling policy is the package's one (:class:`~positional_lsh.ops.partitions.sampling.PartitionSampler`): in
    eval mode every call uses the partitions drawn from ``eval_seed``, so evaluation is deterministic; training call
    ``c`` (``c = 0, 1, ...``, counted by the int64 buffer ``calls``, advanced in place by every training call and kept
    in the state dict, so a reloaded module continues the sequence) draws from ``layer_seed(seed, c)``: fresh
    partitions every call, the same sequence for the same ``seed``. ``seed=None`` draws from torch's global RNG.
    Call with ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)``; see :func:`plsh_attention`.

    Under ``torch.compile`` (``fullgraph=True`` included) the draw is the custom op
    ``positional_lsh::sample_partitions``, which reads the step from ``calls`` inside the op, and the estimator is
    :func:`plsh_attention`'s compiled op. Compiled and eager calls draw the same partitions: eval mode from
    ``eval_seed``, training call ``c`` from ``layer_seed(seed, c)``, ``seed=None`` from torch's global RNG (the same
    numbers as an eager call after the same ``torch.manual_seed``); so they give the same outputs, up to float
    rounding of the estimator.

    Learned slopes (``learn_slopes=True``): the module holds the float32 parameter ``log_slopes (H,)``
    (:func:`log_slopes_parameter`: the log of ``slopes``, every slope ``> 0``) and uses ``slopes = log_slopes.exp()``:
    every call draws its partitions from the current detached slopes (same seeds as above) and passes the slopes
    tensor to :func:`plsh_attention`, whose backward gives it the surrogate gradient (``slope_grad="surrogate"``;
    ``"none"``: no gradient, the slopes only drive the draws). ``log_slopes`` is in the state dict (and follows the
    module's casts, like any parameter). Without ``learn_slopes`` (the default) there is no parameter: state dict
    and outputs are those of a fixed-slope module. An owner that keeps the slopes itself (the language model's
    layers) passes them per call instead: ``module(q, k, v, slopes)`` (see :meth:`forward`).

    ``persistent=False`` keeps the module's own state (the step ``calls`` and the slopes) out of the state dict, for
    an owner that records both elsewhere (:class:`~positional_lsh.lm.TransformerLM`: its config and
    :meth:`~positional_lsh.lm.TransformerLM.rng_state`); the module behaves the same.

    Context parallelism is an argument: ``module(q, k, v, context=shards)`` with a :class:`ShardedAttention`
    (``positional_lsh.distributed.ContextShards``), ``q, k, v`` this rank's shard.

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
        persistent: bool = True,
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
        self.persistent = check_bool("persistent", persistent)
        if self.learn_slopes:
            self.log_slopes = log_slopes_parameter(self.sampler.slopes)
        # Training calls so far: the key of their draws (see the class docstring).
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=self.persistent)

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

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.persistent:  # the slopes (extra state) stay out too, like the non-persistent buffer calls
            destination.pop(prefix + _EXTRA_STATE, None)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not self.persistent and prefix + _EXTRA_STATE in missing_keys:
            missing_keys.remove(prefix + _EXTRA_STATE)

    def extra_repr(self) -> str:
        learn = f", learn_slopes=True, slope_grad={self.slope_grad!r}" if self.learn_slopes else ""
        return f"num_heads={self.num_heads}, num_samples={self.num_samples}, scheme={self.scheme!r}{learn}"

    def sample(self, seq_len: int, slopes: torch.Tensor | None = None) -> Partitions:
        """The partitions the next call at ``seq_len`` keys will use (does not advance the step); with
        ``learn_slopes``, or ``slopes`` given as in :meth:`forward`, drawn from those slopes."""
        return self._draw(seq_len, self._call_slopes(slopes))

    def _call_slopes(self, slopes: torch.Tensor | None) -> torch.Tensor | None:
        """The slopes tensor of a call: the learned ones, the caller's, or ``None`` (the sampler's fixed slopes)."""
        if slopes is None:
            return self.learned_slopes()
        if self.learn_slopes:
            raise ValueError(
                "slopes= is for a module without learn_slopes (this one uses its own log_slopes parameter)"
            )
        if not isinstance(slopes, torch.Tensor):
            raise TypeError(f"slopes must be a (num_heads,) tensor or None, got {type(slopes).__name__}")
        return slopes

    def _draw(self, seq_len: int, slopes: torch.Tensor | None) -> Partitions:
        values = None if slopes is None else slopes.detach()
        return self.sampler.draw(seq_len, training=self.training, step=self.calls, slopes=values)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor | None = None,
        *,
        context: ShardedAttention | None = None,
        key_padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Positional-LSH attention of ``q (B, Hq, Lq, d)`` to ``k, v (B, Hkv, Lk, d)`` with this call's partitions.

        ``slopes``: ``None`` (the module's slopes), or an ``(H,)`` tensor of slopes that an owner keeps (a module
        without ``learn_slopes``): the partitions are drawn from their detached values and the tensor is passed to
        :func:`plsh_attention` (so learned slopes get its surrogate gradient). ``context``: a
        :class:`ShardedAttention` when ``q, k, v`` are this rank's shard of a longer sequence; the partitions are then
        those of the whole sequence, and the result is this rank's rows (no slope gradient: slopes that require grad
        are refused). ``key_padding_mask``: ``None`` or the ``(B, Lk)`` bool key validity of
        :func:`plsh_attention` (any pattern, holes included), and ``cu_seqlens``: ``None`` or its packed sequences
        (each document its own sequence, with this call's partitions); passed to it; not with ``context``.
        """
        shape = check_qkv(q, k, v)
        check_key_padding_mask(key_padding_mask, q, shape.k_len)  # before the step advances
        check_cu_seqlens(cu_seqlens, shape.k_len)
        values = self._call_slopes(slopes)
        seq_len = shape.k_len
        checked = False
        if context is not None:
            if not (callable(getattr(context, "seq_len", None)) and callable(getattr(context, "attend", None))):
                raise TypeError(
                    f"context must be a ShardedAttention (with seq_len and attend methods) or None, "
                    f"got {type(context).__name__}"
                )
            if values is not None and values.requires_grad:
                raise ValueError(
                    "slopes that require grad with context=: the sharded attention carries no gradient for the slopes"
                )
            if key_padding_mask is not None or cu_seqlens is not None:
                name = "key_padding_mask" if key_padding_mask is not None else "cu_seqlens"
                raise ValueError(f"{name} with context=: the sharded attention takes no padding mask or packing")
            seq_len = context.seq_len(shape.k_len)
        elif not torch.compiler.is_compiling():  # plsh_attention's up-front size check, before anything is drawn
            method = sized_method(self.backend, self.method)
            causal = check_bool("causal", self.causal)
            check_call_size(self.num_samples, shape.q_heads, shape.q_len, shape.k_len, shape.head_dim, causal, method)
            checked = True
        partitions = self._draw(seq_len, values)
        if self.training:
            self.calls.add_(1)
        if context is not None:
            return context.attend(q, k, v, ShardedCall(partitions, self.causal, self.scale, self.backend, self.method))
        return run_plsh_attention(
            q, k, v, values, num_samples=self.num_samples, causal=self.causal, partitions=partitions,
            scheme=self.scheme, generator=None, scale=self.scale, backend=self.backend, method=self.method,
            slope_grad=self.slope_grad, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
            size_checked=checked,
        )  # fmt: skip
