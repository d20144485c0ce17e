"""How close each method runs to the machine: useful GFLOP/s as a percentage of the same run's GEMM peak.

    nice -n -10 python benchmarks/efficiency.py --threads 1,2      # ~6 min on 2 cores; docs/benchmarks.md

One process, CPU, causal, batch 1, H = 8 standard ALiBi slopes, d = 64, n = 32768 (``--n``). For each thread count:
``torch.matmul`` fp32 and bf16 GFLOP/s (1024^2, best of 5, measured between the repeats of the methods), then

* ``plsh_attention`` T = 8 per-sample (``method="samples"``), T = 8, 64, 256 with ``method="auto"`` (it takes the
  multiplicity form), T = 8 ``auto`` in bf16;
* windowed exact ALiBi, keys within 12 sigma (``alibi_attention(window=12 / slope)``),

in turns (``--repeats`` rounds, every method once per round, medians; fixed partitions drawn once, seed 0).
Useful GFLOP/s is ``4 d pairs / seconds``, ``pairs`` the score entries the method needs (``plsh bench``'s count:
the union of each query's T blocks for the multiplicity form, the sum of the blocks' causal pairs per sample for
the per-sample path, the band for windowed ALiBi). Prints a markdown table per thread count and the issue-26
targets with their measured values. Compare percentages within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from positional_lsh import alibi_attention, alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.cli.bench_peers import band_pairs, sample_pairs, union_pairs


def gemm_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best-of-``repeats`` ``torch.matmul`` GFLOP/s of ``size x size`` matrices (the current threads)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def methods(n: int, heads: int, dim: int, samples: list[int]) -> list[tuple[str, Callable[[], object], int, str]]:
    """``(name, call, pairs, dtype)`` of every measured method on fixed inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g) for _ in range(3))
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    slopes = alibi_slopes(heads)
    out: list[tuple[str, Callable[[], object], int, str]] = []
    for t in samples:
        parts = sample_partitions(n, slopes, t, generator=0)
        if t == samples[0]:
            out.append((f"T = {t}, per-sample", lambda p=parts: plsh_attention(q, k, v, partitions=p, method="samples"),
                        sample_pairs(parts, causal=True), "fp32"))  # fmt: skip
        union = union_pairs(parts, causal=True)
        out.append((f"T = {t}, auto", lambda p=parts: plsh_attention(q, k, v, partitions=p), union, "fp32"))
        if t == samples[0]:
            bf16 = lambda p=parts: plsh_attention(qb, kb, vb, partitions=p)  # noqa: E731
            out.append((f"T = {t}, auto, bf16", bf16, union, "bf16"))
    window = 12.0 / slopes.double()
    out.append(("windowed exact ALiBi, 12 sigma", lambda: alibi_attention(q, k, v, slopes, window=window),
                band_pairs(n, window, causal=True), "fp32"))  # fmt: skip
    return out


def run(threads: int, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(threads)
    ms = methods(args.n, args.heads, args.dim, [int(x) for x in args.samples.split(",")])
    for _, fn, _, _ in ms:
        fn()  # warm-up: plans, buffers
    times: dict[str, list[float]] = {name: [] for name, *_ in ms}
    peaks: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(args.repeats):
        peaks["fp32"].append(gemm_gflops(torch.float32))
        peaks["bf16"].append(gemm_gflops(torch.bfloat16))
        for name, fn, _, _ in ms:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    peak = {k: statistics.median(v) for k, v in peaks.items()}
    print(f"\n### {threads} thread{'s' if threads > 1 else ''}: torch.matmul fp32 {peak['fp32']:.1f} GFLOP/s, "
          f"bf16 {peak['bf16']:.1f} GFLOP/s ({peak['bf16'] / peak['fp32']:.2f}x)\n")  # fmt: skip
    print("| call | time (s) | useful GFLOP/s | % of the fp32 GEMM peak |")
    print("|---|---|---|---|")
    result: dict[str, float] = {"peak_fp32": peak["fp32"], "peak_bf16": peak["bf16"]}
    for name, _, pairs, _ in ms:
        sec = statistics.median(times[name])
        gf = 4.0 * args.dim * pairs / sec / 1e9
        result[name] = sec
        result[name + " %"] = 100 * gf / peak["fp32"]
        print(f"| {name} | {sec:.3f} | {gf:.1f} | {100 * gf / peak['fp32']:.1f} % |")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--samples", default="8,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.n < 1 or args.repeats < 1:
        raise SystemExit("--n and --repeats must be positive")
    for threads in (int(x) for x in args.threads.split(",")):
        r = run(threads, args)
        t = [int(x) for x in args.samples.split(",")]
        print(f"\nTargets ({threads} thread(s)):")
        for s, goal in zip(t, (30, 30, 20), strict=False):
            print(f"- T = {s} auto >= {goal} % of peak: {r[f'T = {s}, auto %']:.1f} %")
        win = r["windowed exact ALiBi, 12 sigma"]
        print(f"- T = {t[0]} auto faster than windowed ALiBi 12 sigma: {win / r[f'T = {t[0]}, auto']:.2f}x")
        ratio = r[f"T = {t[0]}, auto"] / r[f"T = {t[0]}, auto, bf16"]
        print(f"- bf16 T = {t[0]} speed vs fp32: {ratio:.2f}x (bf16 GEMM {r['peak_bf16'] / r['peak_fp32']:.2f}x fp32)")


if __name__ == "__main__":
    main()
