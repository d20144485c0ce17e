"""The peers ``plsh bench`` measures: FlexAttention and SDPA exact ALiBi, windowed ALiBi, positional LSH.

Also the float64 reference that every error of the benchmark is measured against on sampled query rows
(:func:`reference_rows`): exact ALiBi written out in plain torch, so that the exact peers' own errors are measured
too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from positional_lsh.ops import alibi_attention, alibi_bias, plsh_attention, sample_partitions

__all__ = [
    "ALL_METHODS",
    "DEFAULT_METHODS",
    "EXACT_METHODS",
    "Method",
    "band_block_mask",
    "methods_for_length",
    "reference_rows",
    "sampled_rows",
]

ALL_METHODS = ("flex-exact", "sdpa-mask", "flex-window", "alibi-chunked", "window-chunked", "plsh")
DEFAULT_METHODS = ("flex-exact", "sdpa-mask", "flex-window", "plsh")
EXACT_METHODS = ("flex-exact", "sdpa-mask", "alibi-chunked")
REFERENCE_ROWS = 256
"""Query rows of the float64 reference (evenly spaced, first and last included)."""


def flex() -> tuple[Callable[..., torch.Tensor], Callable[..., object]] | None:
    """``(compiled flex_attention, create_block_mask)``, or ``None`` where torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def band_block_mask(
    n: int, window: torch.Tensor | None, *, causal: bool, mask_mod: Callable[..., torch.Tensor], block: int = 128
) -> object:
    """FlexAttention ``BlockMask`` for keys with ``|i - j| <= window[h]`` (and ``j <= i`` when causal).

    Built from the band's geometry in ``O(H (n / block)^2)`` memory. torch's ``create_block_mask`` evaluates
    ``mask_mod`` on the whole ``n x n`` grid (with int64 intermediates: 16 GiB per head at n = 131072), which
    does not fit at the lengths this benchmark covers. ``window=None`` is the plain (causal) mask, one head.
    Blocks wholly inside the band are "full" (no ``mask_mod`` call); blocks that cut its edges are partial.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nb = -(-n // block)
    lo = torch.arange(nb, dtype=torch.float64) * block  # first position of each block
    hi = torch.clamp(lo + block - 1, max=n - 1)  # last position
    w = torch.full((1,), math.inf, dtype=torch.float64) if window is None else window.double().reshape(-1)
    w = w[:, None, None]
    qlo, qhi = lo[None, :, None], hi[None, :, None]
    klo, khi = lo[None, None, :], hi[None, None, :]
    if causal:  # 0 <= i - j <= w
        any_ = (qhi - klo >= 0) & (qlo - khi <= w)
        all_ = (qlo - khi >= 0) & (qhi - klo <= w)
    else:  # |i - j| <= w
        any_ = (qlo - khi <= w) & (klo - qhi <= w)
        all_ = (qhi - klo <= w) & (khi - qlo <= w)
    if n % block:  # a short last block is left to mask_mod (partial), never trusted as full
        all_[:, -1, :] = False
        all_[:, :, -1] = False
    partial = any_ & ~all_
    full = all_

    def pack(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = sel.sum(-1).to(torch.int32)
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return count[None], order[None]

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(n, n)
    )


def sampled_rows(n: int, count: int = REFERENCE_ROWS) -> torch.Tensor:
    """``count`` evenly spaced query positions of ``0 .. n - 1`` (all of them when ``n <= count``)."""
    return torch.linspace(0, n - 1, min(n, count), dtype=torch.float64).round().long().unique()


def reference_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, rows: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    """Exact ALiBi attention in float64 for the query positions ``rows``: ``(B, H, len(rows), d)``.

    Plain softmax over all keys (scale ``1/sqrt(d)``, bias ``-slopes[h] |i - j|``, keys ``j <= i`` when causal),
    a few rows at a time, so memory is ``O(H n)`` per row.
    """
    n, d = k.shape[-2], k.shape[-1]
    kk, vv = k.double(), v.double()
    m = slopes.double().reshape(-1, 1, 1)
    keys = torch.arange(n)
    outs = []
    for chunk in rows.split(16):
        scores = q[:, :, chunk].double() @ kk.transpose(-1, -2) / math.sqrt(d)
        dist = (chunk[:, None] - keys[None, :]).double()
        scores = scores - m * dist.abs()
        if causal:
            scores = scores.masked_fill(dist < 0, -math.inf)
        outs.append(torch.softmax(scores, dim=-1) @ vv)
    return torch.cat(outs, dim=-2)


AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Method:
    """One attention callable to measure."""

    name: str
    samples: int | None
    fn: AttnFn
    can_backward: bool
    note: str = ""


def methods_for_length(
    n: int,
    methods: tuple[str, ...],
    samples: tuple[int, ...],
    slopes: torch.Tensor,
    window: torch.Tensor,
    *,
    causal: bool,
    dtype: torch.dtype,
    scheme: str,
    seed: int,
    flex: tuple | None,
    sdpa_fits: bool,
    window_factor: float,
) -> list[Method]:
    """The attention callables to measure at length ``n``; exact peers first (they define the error)."""
    out: list[Method] = []
    sl = slopes.to(dtype)
    win = window.to(torch.int64)

    def alibi_mod(score, b, h, qi, ki):  # FlexAttention's signature
        return score - sl[h] * (qi - ki).abs()

    def causal_mask(b, h, qi, ki):
        return qi >= ki

    def window_mask(b, h, qi, ki):
        near = (qi - ki).abs() <= win[h]
        return near & (qi >= ki) if causal else near

    if "flex-exact" in methods and flex is not None:
        compiled, _ = flex
        bm = band_block_mask(n, None, causal=True, mask_mod=causal_mask) if causal else None
        out.append(
            Method("flex-exact", None, lambda a, b, c: compiled(a, b, c, score_mod=alibi_mod, block_mask=bm), False)
        )
    if "sdpa-mask" in methods and sdpa_fits:
        # (1, H, n, n): a 4-D mask lets SDPA use torch's fused CPU kernel (a 3-D one falls back to the math
        # path, which materializes the scores and is several times slower).
        mask = alibi_bias(n, n, slopes, causal=causal, dtype=dtype)[None]
        mib = mask.numel() * mask.element_size() / 2**20
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out.append(
            Method("sdpa-mask", None, lambda a, b, c: sdpa(a, b, c, attn_mask=mask), True, f"+{mib:.0f} MiB mask")
        )
    if "alibi-chunked" in methods:
        out.append(Method("alibi-chunked", None, lambda a, b, c: alibi_attention(a, b, c, slopes, causal=causal), True))
    if "flex-window" in methods and flex is not None:
        compiled, _ = flex
        wbm = band_block_mask(n, window, causal=causal, mask_mod=window_mask)
        out.append(
            Method(
                "flex-window",
                None,
                lambda a, b, c: compiled(a, b, c, score_mod=alibi_mod, block_mask=wbm),
                False,
                f"window {window_factor:g}*sigma",
            )
        )
    if "window-chunked" in methods:
        out.append(
            Method(
                "window-chunked",
                None,
                lambda a, b, c: alibi_attention(a, b, c, slopes, causal=causal, window=window),
                True,
                f"window {window_factor:g}*sigma",
            )
        )
    if "plsh" in methods:
        for t in samples:
            parts = sample_partitions(n, slopes, t, scheme=scheme, generator=seed)

            def plsh_fn(a, b, c, parts=parts):
                return plsh_attention(a, b, c, partitions=parts, causal=causal)

            out.append(Method("plsh", t, plsh_fn, True, scheme))
    return out
