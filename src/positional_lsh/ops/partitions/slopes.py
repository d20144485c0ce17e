"""ALiBi slope conventions (Press et al., 2022).

Bias sign convention used everywhere in this library: head ``h`` adds ``-slopes[h] * |i - j|``
to the *scaled* score ``scale * q_i . k_j`` (as BLOOM and FlashAttention do), so larger slopes mean
a stronger preference for nearby keys. ``sigma = 1 / slope`` is the length scale of the head.
"""

from __future__ import annotations

import math

import torch

__all__ = ["alibi_slopes"]


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard ALiBi slope for each head.

    For ``H`` a power of two, ``m_h = 2^(-8h/H)`` for ``h = 1..H``. Otherwise, with
    ``c = 2^floor(log2 H)``, the ``c`` slopes of the power-of-two schedule followed by every other
    slope of the ``2c`` schedule, the first ``H - c`` of them. This equals the slopes that BLOOM,
    MPT and Falcon build in ``transformers``.

    Args:
        num_heads: number of attention heads ``H >= 1``.

    Returns:
        ``(H,)`` float32 tensor of positive slopes.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be an int, got {type(num_heads).__name__}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_two_slopes(closest)
    if closest != num_heads:
        extra = _power_of_two_slopes(2 * closest)[0::2]
        slopes += extra[: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
