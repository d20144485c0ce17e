"""Argument validation shared by the public entry points.

Every public function checks its input here first, so that bad input fails with a ``ValueError`` or
``TypeError`` naming the argument instead of a shape error from deep inside torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from positional_lsh.ops.partitions.slopes import alibi_slopes

SlopesLike = torch.Tensor | np.ndarray | Sequence[float] | float | None
GeneratorLike = torch.Generator | int | None


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as an ``int``: ``TypeError`` unless an integer (``bool`` refused), ``ValueError`` below ``minimum``.

    The one integer validator of the package; errors name the argument ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def positive_int(name: str, value: object) -> int:
    """``check_int(name, value, minimum=1)``."""
    return check_int(name, value, minimum=1)


def nonnegative_int(name: str, value: object) -> int:
    """``check_int(name, value, minimum=0)``."""
    return check_int(name, value, minimum=0)


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a ``bool``, else ``TypeError`` (``"{name} must be a bool, got ..."``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """``ValueError`` (``"{name} must be one of {choices}, got {value!r}"``) unless ``value`` is one of ``choices``."""
    if value not in tuple(choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


class QKVShape(NamedTuple):
    """The sizes of a checked ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)`` call."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int


def check_qkv(q: object, k: object, v: object) -> QKVShape:
    """Validate ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)``.

    Returns their sizes, ``QKVShape(batch, q_heads, kv_heads, q_len, k_len, head_dim)`` (a tuple).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have rank 4 (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hq, lq, d = q.shape
    bk, hkv, lk, dk = k.shape
    if min(b, hq, lq, d, hkv, lk) < 1:
        raise ValueError(f"q and k must have non-empty dimensions, got {tuple(q.shape)} and {tuple(k.shape)}")
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hkv})"
        )
    if lq > lk:
        raise ValueError(
            f"q has more positions ({lq}) than k ({lk}); queries are aligned to the last keys, "
            "so q's seq_len must be <= k's"
        )
    return QKVShape(b, hq, hkv, lq, lk, d)


def as_slopes(slopes: SlopesLike, num_heads: int, name: str = "slopes", *, read: bool = True) -> torch.Tensor:
    """Validate slopes and return them as a ``(H,)`` float64 CPU tensor: the one slope coercion of the package.

    ``None`` gives the standard ALiBi schedule; a single number is used for every head; a tensor is detached and
    copied; a numpy array is taken as the tensor of its values (:func:`numpy_slopes`). ``read=False`` (inside a
    ``torch.compile`` trace, where values cannot be read): the same coercion and structural checks, without reading the
    values (finite, ``>= 0``: the draw op checks them when it runs).
    """
    if slopes is None:
        return alibi_slopes(num_heads).double()
    if isinstance(slopes, bool):
        raise TypeError(f"{name} must be a tensor, a sequence of floats or a float, got bool")
    slopes = numpy_slopes(slopes, name)
    if isinstance(slopes, numbers.Real):
        out = torch.full((num_heads,), float(slopes), dtype=torch.float64)
    elif isinstance(slopes, torch.Tensor):
        if slopes.is_complex() or slopes.dtype == torch.bool:
            raise TypeError(f"{name} must be a real tensor, got dtype {slopes.dtype}")
        if slopes.device.type == "meta":
            raise ValueError(
                f"{name} is a meta tensor, which holds no values; meta {name} are taken with meta q, k and v only "
                "(shape propagation)"
            )
        if slopes.dim() == 0:
            out = slopes.detach().to("cpu", torch.float64).expand(num_heads).clone()
        elif slopes.dim() == 1:
            out = slopes.detach().to("cpu", torch.float64).clone()
        else:
            raise ValueError(f"{name} must be a 1-D tensor of shape ({num_heads},), got {tuple(slopes.shape)}")
    elif isinstance(slopes, Sequence):
        try:
            out = torch.tensor([float(s) for s in slopes], dtype=torch.float64)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must contain numbers: {exc}") from None
    else:
        raise TypeError(f"{name} must be a tensor, a sequence of floats or a float, got {type(slopes).__name__}")
    if out.numel() != num_heads:
        raise ValueError(f"{name} must have one entry per head ({num_heads}), got {out.numel()}")
    if not read:
        return out
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{name} must be finite, got {out.tolist()}")
    if bool((out < 0).any()):
        raise ValueError(f"{name} must be >= 0 (the bias is -slope*|i-j|), got {out.tolist()}")
    return out


def grad_slopes(slopes: object, num_heads: int) -> torch.Tensor | None:
    """The slopes tensor that carries a gradient, as ``(H,)`` (a 0-dim one expanded: its gradient is the sum over
    heads), or ``None`` when ``slopes`` is not a tensor requiring grad (a float, a sequence, ``None``, a tensor without
    ``requires_grad``)."""
    if not isinstance(slopes, torch.Tensor) or not slopes.requires_grad:
        return None
    return slopes.expand(num_heads) if slopes.dim() == 0 else slopes


def numpy_slopes(slopes: SlopesLike, name: str = "slopes") -> torch.Tensor | Sequence[float] | float | None:
    """A numpy array of slopes (real numbers, as :class:`~positional_lsh.Partitions` takes them) as a float64 tensor
    of its shape, for the tensor rules of :func:`as_slopes` (0-D or 1-D); anything else unchanged. ``TypeError``
    naming ``name`` for a bool, complex or non-numeric array."""
    if not isinstance(slopes, np.ndarray):
        return slopes
    try:
        out = torch.as_tensor(slopes)  # (not slopes.dtype: torch.compile traces an array as a tensor)
    except TypeError:
        out = None
    if out is None or out.is_complex() or out.dtype == torch.bool:
        raise TypeError(f"{name} must be a real array, got numpy dtype {slopes.dtype}")
    return out.to(torch.float64)


def is_meta_tensor(x: object) -> bool:
    """Whether ``x`` is a tensor on the ``meta`` device (shapes, no values)."""
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def check_meta_slopes(slopes: torch.Tensor, num_heads: int, name: str = "slopes") -> None:
    """Check the shape and dtype of ``slopes`` on the meta device (no values to check): a real tensor of one or
    ``num_heads`` entries, 0-D or 1-D; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if slopes.is_complex() or slopes.dtype == torch.bool:
        raise TypeError(f"{name} must be a real tensor, got dtype {slopes.dtype}")
    if slopes.dim() > 1 or (slopes.dim() == 1 and slopes.shape[0] != num_heads):
        raise ValueError(f"{name} must be a 1-D tensor of shape ({num_heads},) or 0-D, got {tuple(slopes.shape)}")


def meta_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra: object) -> torch.Tensor:
    """The output of an attention call on ``meta`` tensors: ``q``'s shape and dtype, connected to ``q, k, v`` and
    the ``extra`` tensors (e.g. learnable slopes) for autograd (zero gradients): shape propagation, as torch's own
    ops do on the meta device. Non-tensors in ``extra`` are ignored."""
    zero = (k.sum() + v.sum()) * 0
    for x in extra:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            zero = zero + x.sum().to(q.dtype) * 0
    return q * 0 + zero


def as_generator(generator: GeneratorLike, name: str = "generator") -> torch.Generator | None:
    """``int`` seeds a new CPU generator; ``None`` means torch's global CPU generator."""
    if generator is None:
        return None
    if isinstance(generator, bool):
        raise TypeError(f"{name} must be a torch.Generator, an int seed or None, got bool")
    if isinstance(generator, torch.Generator):
        if generator.device.type != "cpu":
            raise ValueError(
                f"{name} must be a CPU torch.Generator (random draws are made on the CPU so that a seed "
                f"gives the same result on every device), got one on {generator.device}"
            )
        return generator
    if isinstance(generator, numbers.Integral):
        if not 0 <= generator < 2**64:
            raise ValueError(f"{name} seed must be in [0, 2**64) (a torch.Generator seed), got {generator}")
        return torch.Generator(device="cpu").manual_seed(int(generator))
    raise TypeError(f"{name} must be a torch.Generator, an int seed or None, got {type(generator).__name__}")


def as_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if torch.compiler.is_compiling():  # under dynamic=True a symbolic float, whose value cannot be read while tracing
        torch._check(scale > 0, lambda: "scale must be a positive finite float")
        torch._check(scale < math.inf, lambda: "scale must be a positive finite float")
        return scale
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    return float(scale)


def as_window(window: SlopesLike, num_heads: int) -> torch.Tensor | None:
    """``None`` (no window), one number for all heads, or one per head; returns float64 (H,)."""
    if window is None:
        return None
    try:
        out = as_slopes(window, num_heads, name="window")  # same rules: finite, >= 0, one per head
    except TypeError as exc:
        raise TypeError(str(exc)) from None
    return out
