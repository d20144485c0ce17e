"""Short contexts (issue 26, item 2): exact ALiBi and positional LSH against torch's fused SDPA with a float mask.

    nice python benchmarks/short_context.py                     # n = 512, 1024, 2048, 4096; 1 thread
    nice python benchmarks/short_context.py --lengths 512 --repeats 9

Causal, fp32, batch 2, H = 8 standard slopes, d = 64, one torch thread (``--threads``). In one process and
interleaved (every method and pass once per round, medians over the rounds, after one warm-up call each):

* ``sdpa-mask``: ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)`` with the ALiBi bias
  ``(1, H, n, n)`` float (causal ``-inf`` included) built once, outside the timing (a 3-D ``(H, n, n)`` mask would
  send torch's CPU SDPA to its math path);
* ``alibi_attention``: the library's exact op (its bias built inside every call, as a user calls it);
* ``plsh T=8 fresh``: ``plsh_attention(q, k, v, alibi_slopes(8), num_samples=8)`` (``method="auto"``), partitions
  drawn inside every call, as a user runs it; ``plsh T=8 fixed``: the same with ``partitions=`` drawn once.

Forward (inputs without grad) and forward + backward (``torch.autograd.grad`` of ``q, k, v``). Prints every median,
then a markdown table with the ratio against ``sdpa-mask`` (< 1: faster) and each method's useful GFLOP/s as a
percentage of the fp32 ``torch.matmul`` peak measured in the same run (before, after and once per round of the
timings; the largest):
useful pairs are ``n (n + 1) / 2 * H * batch`` for the exact methods and the union of each query's ``T`` blocks
(``positional_lsh.cli.bench_peers.union_pairs``, on the fixed partitions) for positional LSH; a pass counts ``4 d``
flops per pair, fwd+bwd 3.5 times that (``useful_gflops``). Targets: ``alibi_attention <= 1.1x`` sdpa-mask at
every ``n <= 4096`` and ``plsh T=8 <= 1.2x`` at ``n = 512``, both passes. Results: docs/benchmarks.md, "Short
contexts".
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from positional_lsh import alibi_attention, alibi_bias, alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.cli.bench import gemm_peak
from positional_lsh.cli.bench_peers import band_pairs, union_pairs, useful_gflops

METHODS = ("sdpa-mask", "alibi_attention", "plsh T=8 fresh", "plsh T=8 fixed")
PASSES = ("fwd", "fwd+bwd")
GEMM = ("torch.matmul", "fp32")
TARGETS = {"alibi_attention": (1.1, None), "plsh T=8 fresh": (1.2, 512), "plsh T=8 fixed": (1.2, 512)}


@dataclass
class Row:
    n: int
    method: str
    mode: str
    seconds: float  # median
    ratio: float  # seconds / sdpa-mask's of the same n and pass
    pairs: int
    gflops: float  # useful GFLOP/s
    peak_pct: float  # gflops as % of the run's fp32 GEMM peak


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048, 4096])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="T of positional LSH")
    ap.add_argument("--repeats", type=int, default=0, help="rounds per length (0: 21 up to n = 1024, 7 above)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemm-size", type=int, default=1024)
    return ap


def calls(
    n: int, batch: int, heads: int, dim: int, samples: int
) -> tuple[dict[tuple[str, str], Callable[[], object]], dict[str, int]]:
    """The timed calls ``{(method, pass): fn}`` at length ``n`` and each method's useful pairs."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(batch, heads, n, dim, generator=g) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    up = torch.randn(q.shape, generator=g)
    slopes = alibi_slopes(heads)
    bias = alibi_bias(n, n, slopes, causal=True)[None]  # (1, H, n, n): torch's fused kernel (3-D: its math path)
    parts = sample_partitions(n, slopes, samples, generator=0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns: dict[str, Callable[..., torch.Tensor]] = {
        "sdpa-mask": lambda a, b, c: sdpa(a, b, c, attn_mask=bias),
        "alibi_attention": lambda a, b, c: alibi_attention(a, b, c, slopes),
        "plsh T=8 fresh": lambda a, b, c: plsh_attention(a, b, c, slopes, num_samples=samples),
        "plsh T=8 fixed": lambda a, b, c: plsh_attention(a, b, c, slopes, partitions=parts),
    }

    def backward(fn: Callable[..., torch.Tensor]) -> object:
        return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), up)

    out: dict[tuple[str, str], Callable[[], object]] = {}
    for method, fn in fns.items():
        out[(method, "fwd")] = partial(fn, q, k, v)
        out[(method, "fwd+bwd")] = partial(backward, fn)
    exact = band_pairs(n, None, causal=True, num_heads=heads) * batch
    plsh = union_pairs(parts, causal=True) * batch
    pairs = {"sdpa-mask": exact, "alibi_attention": exact, "plsh T=8 fresh": plsh, "plsh T=8 fixed": plsh}
    return out, pairs


def interleaved_medians(fns: dict[tuple[str, str], Callable[[], object]], repeats: int) -> dict[tuple[str, str], float]:
    """One warm-up call each, then ``repeats`` rounds of one call each in turn: the median seconds of each."""
    for fn in fns.values():
        fn()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(ts) for key, ts in times.items()}


def table(rows: Sequence[Row], peak: float, threads: int) -> str:
    """The markdown table of ``rows`` (with the run's GEMM peak and threads in its heading line)."""
    lines = [
        f"fp32 `torch.matmul` peak of this run: {peak:.1f} GFLOP/s ({threads} thread{'s' if threads > 1 else ''})",
        "",
        "| n | method | pass | median (ms) | vs sdpa-mask | useful GFLOP/s | % of GEMM peak |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.n} | {r.method} | {r.mode} | {r.seconds * 1e3:.1f} | {r.ratio:.2f}x | {r.gflops:.1f} | "
            f"{r.peak_pct:.1f} % |"
        )
    return "\n".join(lines)


def targets(rows: Sequence[Row]) -> list[str]:
    """One line per target: the worst measured ratio where it applies, and whether it is met."""
    out = []
    for method, (bound, at) in TARGETS.items():
        hits = [r for r in rows if r.method == method and (at is None or r.n == at)]
        if hits:
            worst = max(hits, key=lambda r: r.ratio)
            where = f"n = {at}" if at is not None else f"n <= {max(r.n for r in hits)}"
            verdict = "met" if worst.ratio <= bound else "NOT met"
            out.append(
                f"- {method} <= {bound}x sdpa-mask at {where}: worst {worst.ratio:.2f}x ({worst.mode}, n = {worst.n}) "
                f"-- {verdict}"
            )
    return out


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    peak = gemm_peak(torch.float32, args.gemm_size)
    print(
        f"threads={torch.get_num_threads()} batch={args.batch} H={args.heads} d={args.dim} causal fp32; "
        f"GEMM peak fp32 {peak:.1f} GFLOP/s",
        flush=True,
    )
    rows: list[Row] = []
    a, b = torch.randn(args.gemm_size, args.gemm_size), torch.randn(args.gemm_size, args.gemm_size)
    for n in args.lengths:
        repeats = args.repeats or (21 if n <= 1024 else 7)
        fns, pairs = calls(n, args.batch, args.heads, args.dim, args.samples)
        fns[GEMM] = lambda: a @ b  # the peak once per round too: a busy machine's peak varies
        med = interleaved_medians(fns, repeats)
        peak = max(peak, 2 * args.gemm_size**3 / med[GEMM] / 1e9)
        for mode in PASSES:
            base = med[("sdpa-mask", mode)]
            for method in METHODS:
                t = med[(method, mode)]
                gf = useful_gflops(pairs[method], args.dim, t, mode) or 0.0
                rows.append(Row(n, method, mode, t, t / base, pairs[method], gf, 0.0))
                print(f"n={n} {method} {mode}: {t * 1e3:.1f} ms ({t / base:.2f}x sdpa-mask)", flush=True)
    peak = max(peak, gemm_peak(torch.float32, args.gemm_size))
    for r in rows:
        r.peak_pct = 100.0 * r.gflops / peak
    print()
    print(table(rows, peak, torch.get_num_threads()))
    print()
    print("\n".join(targets(rows)))
    return rows


if __name__ == "__main__":
    main()
