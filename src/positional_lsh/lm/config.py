"""The language model's configuration: :class:`ModelConfig`, the position modes and the argument checks.

:class:`ModelConfig` holds every hyperparameter of :class:`~positional_lsh.lm.model.TransformerLM`,
including the attention position mode (one of :data:`POSITIONS`) and its settings. It validates itself on
construction, so a bad field fails here with a message that names it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from positional_lsh.ops.checks import check_bool, check_choice, nonnegative_int, positive_int
from positional_lsh.ops.options import ALIBI_BACKENDS, BACKENDS, DEFAULT_BACKEND, DEFAULT_METHOD, METHODS
from positional_lsh.ops.partitions.schemes import scheme_names
from positional_lsh.ops.partitions.slopes import alibi_slopes

POSITIONS = ("alibi", "plsh", "window-alibi", "rope", "nope")
"""The attention position modes."""

LEARNABLE_POSITIONS = ("alibi", "window-alibi", "plsh")
"""The position modes whose ALiBi slopes ``learn_slopes`` can learn."""

ALIBI_IMPLS = ("auto", "sdpa", "chunked")
"""How exact ALiBi is computed: chosen by length, torch SDPA with a prebuilt bias, or the chunked kernel."""


def check_float(name: str, value: object, *, positive: bool = True, allow_zero: bool = False) -> float:
    """``value`` as a finite float (positive, or non-negative with ``allow_zero``) naming ``name`` on error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or (positive and (v < 0 or (v == 0 and not allow_zero))):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number, got {value}")
    return v


@dataclass
class ModelConfig:
    """Model hyperparameters, including the attention position mode.

    Attributes:
        vocab_size: number of token ids (the tokenizer's ``vocab_size``).
        seq_len: the training context length. Not a hard limit: ALiBi, positional LSH and NoPE run at any
            length, RoPE too (its extrapolation is what it is). Evaluation reports lengths as multiples of it.
        n_layer, n_head, d_model: depth, heads, width (``d_model % n_head == 0``; head dim even for RoPE).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout: dropout on attention outputs, MLP outputs and embeddings (0 disables).
        position: ``"alibi"``, ``"plsh"``, ``"window-alibi"``, ``"rope"`` or ``"nope"``.
        sigma: ``None`` for the standard per-head ALiBi slopes ``2^{-8h/H}``; otherwise one length scale for
            every head (slope ``1/sigma``), as the paper used (``sigma = 256``). For alibi, plsh, window-alibi.
            ``math.inf`` means slope 0: no positional bias (positional LSH is then exact causal attention).
        num_samples: positional-LSH samples ``T`` per call (``plsh``).
        scheme: positional-LSH partition scheme: any registered name (``"discrete"``, ``"gamma"``, ``"fixed"``,
            the variance-reduced ones, or one added with
            :func:`~positional_lsh.ops.partitions.schemes.register_scheme`).
        seed: seed of the training-time partition generators (one per layer, derived from it).
        eval_seed: seed of the eval-mode partitions (one per layer, derived from it).
        window: ``window-alibi``'s largest kept distance ``|i - j|``: ``None`` for ``window_factor * sigma_h``
            per head, one number for every head, or a list with one number per head.
        window_factor: per-head window in units of ``sigma_h = 1 / m_h`` when ``window`` is ``None``.
        rope_base: RoPE frequency base.
        alibi_impl: ``"auto"``, ``"sdpa"`` (torch SDPA with a ``(H, n, n)`` bias from ``alibi_bias``) or
            ``"chunked"`` (``alibi_attention``, ``O(n)`` memory). Also used by ``window-alibi``.
        attn_backend: kernel backend of ``plsh_attention``/``alibi_attention``, one of
            :data:`~positional_lsh.ops.options.BACKENDS` (``"auto"``, ``"flash"``, ``"math"``, ``"triton"``).
            ``"triton"`` is positional LSH's only: with ``alibi``/``window-alibi`` it is refused unless
            ``alibi_impl="sdpa"`` (``alibi_attention`` has no Triton path).
        attn_fp32: compute attention in float32 even under bf16/fp16 autocast (the projections and MLP stay
            in low precision). Keeps the ALiBi bias unrounded, and on CPU torch's float32 flash kernel is faster
            than its bf16 one on the many small blocks of positional LSH (docs/experiments.md).
        plsh_method: how ``plsh_attention`` computes the estimator (``method=``), one of
            :data:`~positional_lsh.ops.options.METHODS`: ``"auto"`` (decided once per call by the cost model),
            ``"samples"`` or ``"multiplicity"``. Same partitions, same result up to float rounding; only the
            speed differs (docs/implementation.md).
        learn_slopes: learn the ALiBi slopes: each layer gets a parameter ``log_slopes (n_head,)`` (float32,
            initialised to ``log`` of :meth:`slopes`; the slopes used are its ``exp``, so they stay positive).
            For ``alibi`` (exact gradient through both ``alibi_impl``), ``window-alibi`` (the window
            ``window_factor / m_h`` follows the current slopes, detached; a fixed ``window`` stays fixed) and
            ``plsh`` (partitions drawn from the current detached slopes, surrogate gradient). Refused for ``rope``
            and ``nope`` (no slopes) and for ``sigma=inf`` (slope 0 has no logarithm). ``False``: no parameter.
            All three compile with ``torch.compile(fullgraph=True)``. ``plsh train --context-parallel``
            refuses it (the sharded attention carries no slope gradient).
    """

    vocab_size: int = 8192
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 8
    d_model: int = 256
    mlp_ratio: int = 4
    dropout: float = 0.0
    position: str = "alibi"
    sigma: float | None = None
    num_samples: int = 1
    scheme: str = "discrete"
    seed: int = 0
    eval_seed: int = 0
    window: float | list[float] | None = None
    window_factor: float = 12.0
    rope_base: float = 10000.0
    alibi_impl: str = "auto"
    attn_backend: str = DEFAULT_BACKEND
    attn_fp32: bool = True
    plsh_method: str = DEFAULT_METHOD
    learn_slopes: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first bad field."""
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio", "num_samples"):
            positive_int(name, getattr(self, name))
        for name in ("seed", "eval_seed"):
            nonnegative_int(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        check_float("dropout", self.dropout, allow_zero=True)
        if self.dropout >= 1:
            raise ValueError(f"dropout must be < 1, got {self.dropout}")
        check_choice("position", self.position, POSITIONS)
        if self.sigma is not None and not (isinstance(self.sigma, float) and self.sigma == math.inf):
            check_float("sigma", self.sigma)
        check_choice("scheme", self.scheme, scheme_names())
        if self.window is not None:
            values = self.window if isinstance(self.window, list | tuple) else [self.window]
            for w in values:
                check_float("window", w, allow_zero=True)
            if isinstance(self.window, list | tuple) and len(self.window) != self.n_head:
                raise ValueError(f"window must have one entry per head ({self.n_head}), got {len(self.window)}")
        check_float("window_factor", self.window_factor)
        check_float("rope_base", self.rope_base)
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got d_model/n_head = {self.head_dim}")
        check_choice("alibi_impl", self.alibi_impl, ALIBI_IMPLS)
        check_bool("attn_fp32", self.attn_fp32)
        self._check_backend()
        check_choice("plsh_method", self.plsh_method, METHODS)
        self._check_learn_slopes()

    def _check_learn_slopes(self) -> None:
        """``learn_slopes`` is a bool, and ``True`` only where there are positive slopes to learn."""
        check_bool("learn_slopes", self.learn_slopes)
        if not self.learn_slopes:
            return
        if self.position not in LEARNABLE_POSITIONS:
            raise ValueError(
                f"learn_slopes=True needs position in {LEARNABLE_POSITIONS} (the modes with ALiBi slopes), "
                f"got position={self.position!r}"
            )
        if self.sigma is not None and float(self.sigma) == math.inf:
            raise ValueError(
                "learn_slopes=True cannot start from sigma=inf: slope 0 has no logarithm to learn (log-slopes keep "
                "the slopes positive); give a finite sigma"
            )

    def _check_backend(self) -> None:
        """``attn_backend`` is one of ``BACKENDS``, and one that the position mode's attention op accepts."""
        check_choice("attn_backend", self.attn_backend, BACKENDS)
        exact = self.position in ("alibi", "window-alibi") and self.alibi_impl != "sdpa"
        if exact and self.attn_backend not in ALIBI_BACKENDS:
            raise ValueError(
                f"attn_backend={self.attn_backend!r} is not available for position={self.position!r}: exact and "
                f"windowed ALiBi (alibi_attention) have no Triton path. Use attn_backend in {ALIBI_BACKENDS}, "
                "or alibi_impl='sdpa'"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def slopes(self) -> torch.Tensor:
        """``(n_head,)`` float64 CPU ALiBi slopes: the standard schedule, or ``1/sigma`` for every head."""
        if self.sigma is None:
            return alibi_slopes(self.n_head).double()
        return torch.full((self.n_head,), 1.0 / float(self.sigma), dtype=torch.float64)

    def windows(self) -> torch.Tensor:
        """``(n_head,)`` float64 window (largest kept ``|i - j|``) of ``window-alibi``."""
        if self.window is None:
            return (self.window_factor / self.slopes()).clamp(max=2.0**40)  # slope 0: no window
        if isinstance(self.window, list | tuple):
            return torch.tensor([float(w) for w in self.window], dtype=torch.float64)
        return torch.full((self.n_head,), float(self.window), dtype=torch.float64)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a dict (unknown keys are an error, so typos do not pass silently)."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {unknown}")
        return cls(**d)

    def describe(self) -> str:
        """A short label such as ``plsh T=4 discrete``, ``alibi`` or ``alibi, learned slopes``."""
        return self._describe_position() + (", learned slopes" if self.learn_slopes else "")

    def _describe_position(self) -> str:
        sig = "" if self.sigma is None else f" sigma={self.sigma:g}"
        if self.position == "plsh":
            return f"plsh T={self.num_samples} {self.scheme}{sig}"
        if self.position == "window-alibi":
            w = f"{self.window_factor:g}σ" if self.window is None else "custom"
            return f"window-alibi ({w}){sig}"
        if self.position == "alibi":
            return f"alibi{sig}"
        return self.position
