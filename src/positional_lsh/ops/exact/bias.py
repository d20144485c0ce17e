"""The additive ALiBi bias ``-m_h |i - j|`` with ``-inf`` outside the causal/window mask, as a dense tensor.

The convention that :func:`~positional_lsh.ops.exact.alibi.alibi_attention` (the ``O(n)`` exact/windowed op) and the
language model's SDPA path apply; production code (the dense oracles are in :mod:`positional_lsh.ops.exact.reference`).
"""

from __future__ import annotations

import torch

from positional_lsh.ops.checks import check_bool

__all__ = ["alibi_bias"]


def alibi_bias(
    q_len: int,
    k_len: int,
    slopes: torch.Tensor,
    *,
    causal: bool,
    window: torch.Tensor | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Additive ALiBi bias ``-m_h |i - j|`` with ``-inf`` outside the causal/window mask: ``(H, q_len, k_len)``.

    Query ``r`` sits at position ``q_offset + r`` and key ``c`` at ``k_offset + c``. ``window`` (``(H,)``)
    drops keys with ``|i - j| > window[h]``. A ``slopes`` tensor that requires grad (learned slopes) keeps its graph:
    the same values, from one vectorized product that autograd differentiates (``d bias / d m_h = -|i - j|``) and
    ``torch.compile`` traces.
    """
    check_bool("causal", causal)
    # Distances are exact integers in float32 up to 2^24; float64 output is computed in float64.
    arith = torch.float64 if dtype == torch.float64 else torch.float32
    qi = torch.arange(q_len, device=device, dtype=arith) + q_offset
    kj = torch.arange(k_len, device=device, dtype=arith) + k_offset
    dist = qi[:, None] - kj[None, :]
    after = dist < 0 if causal else None
    dist = dist.abs_()
    if slopes.requires_grad:
        learned = dist * -slopes.to(device=dist.device, dtype=arith).reshape(-1, 1, 1)
        dropped = None if after is None else after.expand_as(learned)
        if window is not None:
            outside = dist > window.to(device=dist.device, dtype=arith).reshape(-1, 1, 1)
            dropped = outside if dropped is None else dropped | outside
        if dropped is not None:
            learned = learned.masked_fill(dropped, float("-inf"))
        return learned.to(dtype)
    m = slopes.detach().to("cpu", torch.float64).reshape(-1)
    out = torch.empty((m.numel(), q_len, k_len), dtype=dtype, device=device)
    for h in range(m.numel()):  # one head at a time: memory is the output plus one head
        bias = dist * -float(m[h])
        drop = after
        if window is not None:
            outside = dist > float(window[h])
            drop = outside if drop is None else drop | outside
        if drop is not None:
            bias.masked_fill_(drop, float("-inf"))
        out[h] = bias
    return out
