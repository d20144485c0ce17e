"""The peers ``plsh bench`` measures: FlexAttention and SDPA exact ALiBi, windowed ALiBi, positional LSH.

Also the float64 reference that every error of the benchmark is measured against on sampled query rows
(:func:`reference_rows`): exact ALiBi written out in plain torch, so that the exact peers' own errors are measured
too.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from positional_lsh.ops import alibi_attention, alibi_bias, plsh_attention, sample_partitions
from positional_lsh.ops.partitions.bounds import block_bounds
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "ALL_METHODS",
    "DEFAULT_METHODS",
    "EXACT_METHODS",
    "PLSH_METHODS",
    "TORCH_PATH_METHODS",
    "Method",
    "band_block_mask",
    "band_pairs",
    "methods_for_length",
    "reference_rows",
    "sample_pairs",
    "sampled_rows",
    "torch_path",
    "union_pairs",
    "useful_gflops",
]

PLSH_METHODS = {"plsh": "samples", "plsh-mult": "multiplicity", "plsh-mult-torch": "multiplicity"}
"""Positional-LSH entries of the benchmark and the ``method=`` of :func:`~positional_lsh.plsh_attention` each uses;
``plsh-mult-torch`` runs the multiplicity form on the torch path (``PLSH_CPU_KERNEL=0``, :func:`torch_path`), so
that one run reports both paths (on the CPU ``plsh-mult`` takes the CPU kernel where it builds)."""
TORCH_PATH_METHODS = ("plsh-mult-torch",)


@contextlib.contextmanager
def torch_path(on: bool = True) -> Iterator[None]:
    """``PLSH_CPU_KERNEL=0`` inside the block when ``on`` (the torch path; the variable restored after it)."""
    if not on:
        yield
        return
    old = os.environ.get("PLSH_CPU_KERNEL")
    os.environ["PLSH_CPU_KERNEL"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["PLSH_CPU_KERNEL"]
        else:
            os.environ["PLSH_CPU_KERNEL"] = old
ALL_METHODS = ("flex-exact", "sdpa-mask", "flex-window", "alibi-chunked", "window-chunked", *PLSH_METHODS)
DEFAULT_METHODS = ("flex-exact", "sdpa-mask", "flex-window", *PLSH_METHODS)
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
    """One attention callable to measure; ``pairs``: the (query, key) score entries it needs (per batch element,
    all heads), the numerator of its useful GFLOP/s (:func:`useful_gflops`)."""

    name: str
    samples: int | None
    fn: AttnFn
    can_backward: bool
    note: str = ""
    pairs: int | None = None


# ------------------------------------------------------------------------------------------ pair counts


def _bound_rows(partitions: Partitions, head: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` of the blocks holding ``rows`` in every sample of ``head``: int64 ``(T, len(rows))``."""
    pitch, shift = partitions.pitch[:, head, None], partitions.shift[:, head, None]
    return block_bounds(pitch, shift, partitions.seq_len, rows[None, :])


def sample_pairs(partitions: Partitions, *, causal: bool, chunk: int = 4096) -> int:
    """Score entries of the per-sample path: the sum over samples and heads of the pairs of each block
    (``j <= i`` when causal), i.e. ``sum_t sum_i (i - start_t(i) + 1)`` (causal) or ``end_t(i) - start_t(i)``."""
    total = 0
    for h in range(partitions.num_heads):
        for rows in torch.arange(partitions.seq_len).split(chunk):
            start, end = _bound_rows(partitions, h, rows)
            total += int(((rows + 1 - start) if causal else (end - start)).sum())
    return total


def union_pairs(partitions: Partitions, *, causal: bool, chunk: int = 4096) -> int:
    """Score entries of the multiplicity form: per query the union of its ``T`` blocks (an interval, since all
    contain ``i``): ``i - min_t start_t(i) + 1`` causal, ``max_t end_t(i) - min_t start_t(i)`` bidirectional."""
    total = 0
    for h in range(partitions.num_heads):
        for rows in torch.arange(partitions.seq_len).split(chunk):
            start, end = _bound_rows(partitions, h, rows)
            lo = start.amin(0)
            total += int(((rows + 1 - lo) if causal else (end.amax(0) - lo)).sum())
    return total


def band_pairs(n: int, window: torch.Tensor | None, *, causal: bool, num_heads: int = 1) -> int:
    """Score entries of exact (``window=None``, ``num_heads`` heads) or windowed attention (one per window)."""
    i = torch.arange(n, dtype=torch.float64)
    ws = [math.inf] * num_heads if window is None else [float(w) for w in window.reshape(-1)]
    total = 0.0
    for w in ws:
        left = torch.minimum(i, torch.tensor(w).floor()) + 1
        right = 0 if causal else torch.minimum(n - 1 - i, torch.tensor(w).floor())
        total += float((left + right).sum())
    return int(total)


def useful_gflops(pairs: int | None, head_dim: int, seconds: float, mode: str) -> float | None:
    """``4 d pairs / seconds`` (forward: ``q.k`` and ``p.v``, 2 flops each); fwd+bwd counts 3.5x that (the
    backward's 5 matmuls of the same size, FlashAttention's convention)."""
    if pairs is None or seconds <= 0:
        return None
    return 4.0 * head_dim * pairs * (3.5 if mode == "fwd+bwd" else 1.0) / seconds / 1e9


# ------------------------------------------------------------------------------------------ methods


def _exact_methods(n: int, methods: tuple[str, ...], slopes: torch.Tensor, ctx: dict[str, Any]) -> list[Method]:
    out: list[Method] = []
    causal, dtype, flex_ = ctx["causal"], ctx["dtype"], ctx["flex"]
    pairs = band_pairs(n, None, causal=causal, num_heads=slopes.numel())
    if "flex-exact" in methods and flex_ is not None:
        compiled, _ = flex_
        bm = band_block_mask(n, None, causal=True, mask_mod=ctx["causal_mask"]) if causal else None
        alibi_mod = ctx["alibi_mod"]
        out.append(
            Method(
                "flex-exact",
                None,
                lambda a, b, c: compiled(a, b, c, score_mod=alibi_mod, block_mask=bm),
                False,
                pairs=pairs,
            )
        )
    if "sdpa-mask" in methods and ctx["sdpa_fits"]:
        # (1, H, n, n): a 4-D mask lets SDPA use torch's fused CPU kernel (a 3-D one falls back to the math
        # path, which materializes the scores and is several times slower).
        mask = alibi_bias(n, n, slopes, causal=causal, dtype=dtype)[None]
        mib = mask.numel() * mask.element_size() / 2**20
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out.append(
            Method(
                "sdpa-mask", None, lambda a, b, c: sdpa(a, b, c, attn_mask=mask), True, f"+{mib:.0f} MiB mask", pairs
            )
        )
    if "alibi-chunked" in methods:
        fn = lambda a, b, c: alibi_attention(a, b, c, slopes, causal=causal)  # noqa: E731
        out.append(Method("alibi-chunked", None, fn, True, pairs=pairs))
    return out


def _window_methods(
    n: int, methods: tuple[str, ...], slopes: torch.Tensor, window: torch.Tensor, ctx: dict[str, Any]
) -> list[Method]:
    out: list[Method] = []
    causal, note = ctx["causal"], f"window {ctx['window_factor']:g}*sigma"
    pairs = band_pairs(n, window, causal=causal)
    if "flex-window" in methods and ctx["flex"] is not None:
        compiled, _ = ctx["flex"]
        wbm = band_block_mask(n, window, causal=causal, mask_mod=ctx["window_mask"])
        alibi_mod = ctx["alibi_mod"]
        fn = lambda a, b, c: compiled(a, b, c, score_mod=alibi_mod, block_mask=wbm)  # noqa: E731
        out.append(Method("flex-window", None, fn, False, note, pairs))
    if "window-chunked" in methods:
        fn = lambda a, b, c: alibi_attention(a, b, c, slopes, causal=causal, window=window)  # noqa: E731
        out.append(Method("window-chunked", None, fn, True, note, pairs))
    return out


def _plsh_methods(
    n: int, methods: tuple[str, ...], samples: tuple[int, ...], slopes: torch.Tensor, ctx: dict[str, Any]
) -> list[Method]:
    out: list[Method] = []
    causal = ctx["causal"]
    for t in samples:
        parts = sample_partitions(n, slopes, t, scheme=ctx["scheme"], generator=ctx["seed"])
        for name, method in PLSH_METHODS.items():
            if name not in methods:
                continue
            count = sample_pairs if method == "samples" else union_pairs

            def plsh_fn(
                a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, parts: Partitions = parts, method: str = method,
                torch_only: bool = name in TORCH_PATH_METHODS,
            ) -> torch.Tensor:  # fmt: skip
                with torch_path(torch_only):
                    return plsh_attention(a, b, c, partitions=parts, causal=causal, method=method)

            out.append(Method(name, t, plsh_fn, True, ctx["scheme"], count(parts, causal=causal)))
    return out


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
    sl = slopes.to(dtype)
    win = window.to(torch.int64)

    # FlexAttention's score_mod and mask_mod signatures: int32 index tensors (b, h, q_idx, kv_idx).
    def alibi_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        return score - sl[h] * (qi - ki).abs()

    def causal_mask(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return qi >= ki

    def window_mask(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        near = (qi - ki).abs() <= win[h]
        return near & (qi >= ki) if causal else near

    ctx = dict(causal=causal, dtype=dtype, scheme=scheme, seed=seed, flex=flex, sdpa_fits=sdpa_fits,
               window_factor=window_factor, alibi_mod=alibi_mod, causal_mask=causal_mask,
               window_mask=window_mask)  # fmt: skip
    return (
        _exact_methods(n, methods, slopes, ctx)
        + _window_methods(n, methods, slopes, window, ctx)
        + _plsh_methods(n, methods, samples, slopes, ctx)
    )
