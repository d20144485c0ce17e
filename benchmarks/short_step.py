"""A short training step (issue 31, item 2): positional LSH's forward + backward against torch's fused SDPA.

    nice python benchmarks/short_step.py                        # n = 128, 256, 1024; 1 thread
    nice python benchmarks/short_step.py --lengths 256 --repeats 41

Causal, fp32, batch 1 (``--batch``), H = 8 standard slopes, d = 64, T = 8, one torch thread (``--threads``). In one
process and interleaved (each call once per round, medians over the rounds, after one warm-up call each), forward
and backward (``torch.autograd.grad`` of ``q, k, v``) of:

* ``sdpa-mask``: ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)`` with the causal ALiBi
  bias ``(1, H, n, n)`` float built once, outside the timing;
* ``plsh``: a ``PositionalLSHAttention(8, num_samples=8, seed=0)`` module in training mode, which draws fresh
  partitions at every call (``layer_seed(seed, c)``) and runs ``plsh_attention`` (``method="auto"``), as the
  language model's layers do.

Before the lengths it measures this machine's matmul peak on the same threads (:func:`gemm_peak`: the median
GFLOP/s of ``512 x 512 @ 512 x 512`` fp32 products), and each row gives the time the step's causal attention
matmuls would take at that peak (``gemm-peak``: ``14 d`` flops per kept (query, key) pair and head, forward 4,
backward 10, as flash-attention counts them): a floor no kernel beats, against which both times read.

Prints every median, then a markdown table with both times, the GEMM-peak time and the ratio ``plsh / sdpa-mask``,
and the target line (``<= 1.5x`` at ``n = 256``). Results: docs/benchmarks.md, "A short training step".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from positional_lsh import PositionalLSHAttention, alibi_bias, alibi_slopes

TARGET = (1.5, 256)
"""``plsh`` at most this many times ``sdpa-mask`` at this ``n``."""


@dataclass
class Row:
    n: int
    sdpa: float  # median seconds of a forward + backward
    plsh: float
    gemm: float = 0.0  # seconds of the causal attention's matmuls at the measured matmul peak (0: not measured)

    @property
    def ratio(self) -> float:
        return self.plsh / self.sdpa


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 256, 1024])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="T of positional LSH")
    ap.add_argument("--repeats", type=int, default=0, help="rounds per length (0: 31 up to n = 256, 11 above)")
    ap.add_argument("--threads", type=int, default=1)
    return ap


def calls(n: int, batch: int, heads: int, dim: int, samples: int) -> dict[str, Callable[[], object]]:
    """The timed forward + backward calls ``{name: fn}`` at length ``n``."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=g).requires_grad_() for _ in range(3))
    up = torch.randn(q.shape, generator=g)
    bias = alibi_bias(n, n, alibi_slopes(heads), causal=True)[None]  # (1, H, n, n): torch's fused CPU kernel
    module = PositionalLSHAttention(heads, num_samples=samples, seed=0).train()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(fn(), (q, k, v), up)

    return {"sdpa-mask": step(lambda: sdpa(q, k, v, attn_mask=bias)), "plsh": step(lambda: module(q, k, v))}


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """One warm-up call each, then ``repeats`` rounds of one call each in turn: the median seconds of each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


def gemm_peak(repeats: int = 21, size: int = 512) -> float:
    """This machine's fp32 matmul rate on the current threads, FLOP/s: the median over ``repeats`` products of two
    ``size x size`` matrices (after one warm-up)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g) for _ in range(2))
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


def attention_flops(n: int, batch: int, heads: int, dim: int) -> float:
    """The flops of a causal attention forward + backward's matmuls over its kept pairs: ``14 d`` per (query, key)
    pair and head (forward ``q k^T`` and ``p v``, 4 d; backward five products, 10 d)."""
    return 14.0 * dim * batch * heads * n * (n + 1) / 2.0


def table(rows: Sequence[Row]) -> str:
    head = "| n | sdpa-mask fwd+bwd (ms) | plsh fwd+bwd (ms) | gemm-peak fwd+bwd (ms) | plsh / sdpa-mask |"
    lines = [head, "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.n} | {r.sdpa * 1e3:.2f} | {r.plsh * 1e3:.2f} | {r.gemm * 1e3:.2f} | {r.ratio:.2f}x |")
    return "\n".join(lines)


def target(rows: Sequence[Row]) -> str | None:
    bound, at = TARGET
    hit = [r for r in rows if r.n == at]
    if not hit:
        return None
    verdict = "met" if hit[0].ratio <= bound else "NOT met"
    return f"- plsh <= {bound}x sdpa-mask at n = {at}: {hit[0].ratio:.2f}x -- {verdict}"


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()} batch={args.batch} H={args.heads} d={args.dim} T={args.samples} "
          "causal fp32, forward + backward", flush=True)  # fmt: skip
    peak = gemm_peak()
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (fp32, 512^3, median of 21)", flush=True)
    rows = []
    for n in args.lengths:
        repeats = args.repeats or (31 if n <= 256 else 11)
        med = interleaved_medians(calls(n, args.batch, args.heads, args.dim, args.samples), repeats)
        rows.append(Row(n, med["sdpa-mask"], med["plsh"], attention_flops(n, args.batch, args.heads, args.dim) / peak))
        print(f"n={n}: sdpa-mask {med['sdpa-mask'] * 1e3:.2f} ms, plsh {med['plsh'] * 1e3:.2f} ms "
              f"({rows[-1].ratio:.2f}x; gemm-peak {rows[-1].gemm * 1e3:.2f} ms)", flush=True)  # fmt: skip
    print()
    print(table(rows))
    line = target(rows)
    if line is not None:
        print()
        print(line)
    return rows


if __name__ == "__main__":
    main()
