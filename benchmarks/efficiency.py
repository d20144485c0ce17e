"""How close each method runs to the machine: useful GFLOP/s as a percentage of the same run's GEMM peaks, on both
paths (the CPU kernel of ``ops/_engine/cpu`` and the torch path, ``PLSH_CPU_KERNEL=0``) in one run.

    nice -n -10 python benchmarks/efficiency.py --threads 1,2      # ~3 min on 2 cores; docs/benchmarks.md

One process, CPU, causal, batch 1, H = 8 standard ALiBi slopes, d = 64, n = 32768 (``--n``). For each thread count:
``torch.matmul`` fp32 and bf16 GFLOP/s (1024^2, best of 5, measured between the repeats of the methods), then on each
path

* ``plsh_attention`` T = 8 per-sample (``method="samples"``, torch's kernel on both paths), T = 8, 64, 256 with
  ``method="auto"`` (the multiplicity form), T = 8 ``auto`` in bf16;
* windowed exact ALiBi, keys within 12 sigma (``alibi_attention(window=12 / slope)``);
* a training step (forward + backward) at T = 8, n = ``--train-n`` (8192);
* ``alibi_attention``'s forward against SDPA with a float ALiBi mask at n = 1024 and 4096,

in turns (``--repeats`` rounds, every method once per round, medians; a call shorter than 0.1 s is timed as the mean
of as many back-to-back calls as last about 0.1 s, the same count in every round; fixed partitions drawn once, seed
0). Useful
GFLOP/s is ``4 d pairs / seconds`` (x 3.5 for a training step), ``pairs`` the score entries the method needs
(``plsh bench``'s count: the union of each query's T blocks for the multiplicity form, the sum of the blocks' causal
pairs for the per-sample path, the band for windowed ALiBi). bf16 rows also give the % of the bf16 peak. Prints a
markdown table per thread count and issue 32's targets with their measured values. Compare within one run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from positional_lsh import alibi_attention, alibi_bias, alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.cli.bench_peers import band_pairs, sample_pairs, union_pairs

ENV = "PLSH_CPU_KERNEL"
MIN_SECONDS = 0.1  # a shorter call is timed over back-to-back calls lasting about this long
PATHS = (("kernel", ""), ("torch", "0"))  # the value of PLSH_CPU_KERNEL on each path ("": the default)


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


def on_path(fn: Callable[[], object], value: str) -> Callable[[], object]:
    """``fn`` run with ``PLSH_CPU_KERNEL=value`` (``""``: unset, the default)."""

    def call() -> object:
        old = os.environ.pop(ENV, None)
        if value:
            os.environ[ENV] = value
        try:
            return fn()
        finally:
            os.environ.pop(ENV, None)
            if old is not None:
                os.environ[ENV] = old

    return call


Method = tuple[str, Callable[[], object], float, str]  # (name, call, useful flops, dtype)


def methods(args: argparse.Namespace) -> list[Method]:
    """Every measured call on fixed inputs, on both paths."""
    n, heads, dim = args.n, args.heads, args.dim
    samples = [int(x) for x in args.samples.split(",")]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g) for _ in range(3))
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    slopes = alibi_slopes(heads)
    flops = 4.0 * dim
    calls: list[tuple[str, Callable[[], object], float, str]] = []
    for t in samples:
        parts = sample_partitions(n, slopes, t, generator=0)
        union = flops * union_pairs(parts, causal=True)
        if t == samples[0]:
            per = lambda p=parts: plsh_attention(q, k, v, partitions=p, method="samples")  # noqa: E731
            calls.append((f"T = {t}, per-sample", per, flops * sample_pairs(parts, causal=True), "fp32"))
        calls.append((f"T = {t}, auto", lambda p=parts: plsh_attention(q, k, v, partitions=p), union, "fp32"))
        if t == samples[0]:
            bf16 = lambda p=parts: plsh_attention(qb, kb, vb, partitions=p)  # noqa: E731
            calls.append((f"T = {t}, auto, bf16", bf16, union, "bf16"))
    window = 12.0 / slopes.double()
    calls.append(("windowed exact ALiBi, 12 sigma", lambda: alibi_attention(q, k, v, slopes, window=window),
                  flops * band_pairs(n, window, causal=True), "fp32"))  # fmt: skip
    m = args.train_n
    qt, kt, vt = (torch.randn(1, heads, m, dim, generator=g).requires_grad_() for _ in range(3))
    tparts = sample_partitions(m, slopes, samples[0], generator=0)

    def step() -> None:
        plsh_attention(qt, kt, vt, partitions=tparts).sum().backward()

    calls.append((f"train step T = {samples[0]}, n = {m}", step, 3.5 * flops * union_pairs(tparts, causal=True),
                  "fp32"))  # fmt: skip
    for length in (1024, 4096):
        qs, ks, vs = (torch.randn(1, heads, length, dim, generator=g) for _ in range(3))
        calls.append((f"alibi_attention n = {length}", lambda a=(qs, ks, vs): alibi_attention(*a, slopes),
                      flops * heads * length * (length + 1) / 2, "fp32"))  # fmt: skip
    out: list[Method] = []
    for name, fn, work, dtype in calls:
        for path, value in PATHS:
            if name.endswith("per-sample") and path == "kernel":
                continue  # the per-sample path runs torch's kernel on both paths
            out.append((f"{name} [{path}]", on_path(fn, value), work, dtype))
    for length in (1024, 4096):
        qs, ks, vs = (torch.randn(1, heads, length, dim, generator=g) for _ in range(3))
        mask = alibi_bias(length, length, slopes, causal=True)[None]
        sdpa = lambda a=(qs, ks, vs), b=mask: torch.nn.functional.scaled_dot_product_attention(*a, attn_mask=b)  # noqa: E731
        out.append((f"SDPA float mask n = {length}", sdpa, flops * heads * length * (length + 1) / 2, "fp32"))
    return out


def run(threads: int, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(threads)
    ms = methods(args)
    calls: dict[str, int] = {}
    for name, fn, _, _ in ms:
        fn()  # warm-up: plans, buffers, the kernel's build
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, math.ceil(MIN_SECONDS / max(time.perf_counter() - t0, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name, *_ in ms}
    peaks: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(args.repeats):
        peaks["fp32"].append(gemm_gflops(torch.float32))
        peaks["bf16"].append(gemm_gflops(torch.bfloat16))
        for name, fn, _, _ in ms:
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            times[name].append((time.perf_counter() - t0) / calls[name])
    peak = {k: statistics.median(v) for k, v in peaks.items()}
    print(f"\n### {threads} thread{'s' if threads > 1 else ''}: torch.matmul fp32 {peak['fp32']:.1f} GFLOP/s, "
          f"bf16 {peak['bf16']:.1f} GFLOP/s ({peak['bf16'] / peak['fp32']:.2f}x)\n")  # fmt: skip
    print("| call | time (s) | useful GFLOP/s | % of the fp32 peak | % of the bf16 peak |")
    print("|---|---|---|---|---|")
    result: dict[str, float] = {"peak_fp32": peak["fp32"], "peak_bf16": peak["bf16"]}
    for name, _, work, dtype in ms:
        sec = statistics.median(times[name])
        gf = work / sec / 1e9
        result[name] = sec
        result[name + " %"] = 100 * gf / peak["fp32"]
        bf = f"{100 * gf / peak['bf16']:.1f} %" if dtype == "bf16" else ""
        print(f"| {name} | {sec:.3f} | {gf:.1f} | {100 * gf / peak['fp32']:.1f} % | {bf} |")
    return result


def targets(r: dict[str, float], args: argparse.Namespace) -> None:
    """Issue 32's targets with this run's values."""
    t = [int(x) for x in args.samples.split(",")]
    for s in t:
        kernel, torch_path = r[f"T = {s}, auto [kernel] %"], r[f"T = {s}, auto [torch] %"]
        print(f"- multiplicity form T = {s}, kernel: {kernel:.1f} % of the fp32 peak (torch path {torch_path:.1f} %; "
              "target >= 45 % at 1 thread, >= 40 % at 2)")  # fmt: skip
    print(f"- windowed exact ALiBi, kernel: {r['windowed exact ALiBi, 12 sigma [kernel] %']:.1f} % (target >= 55 %)")
    gemm = r["peak_bf16"] / r["peak_fp32"]
    speed = r[f"T = {t[0]}, auto [kernel]"] / r[f"T = {t[0]}, auto, bf16 [kernel]"]
    print(f"- bf16 T = {t[0]}, kernel: {speed:.2f}x the fp32 speed (bf16 GEMM {gemm:.2f}x fp32; target >= 1.5x "
          "where the GEMM is >= 2x)")  # fmt: skip
    name = f"train step T = {t[0]}, n = {args.train_n}"
    print(f"- {name}: kernel {r[name + ' [torch]'] / r[name + ' [kernel]']:.2f}x faster than the torch path "
          "(target >= 2x at 1 thread)")  # fmt: skip
    for length in (1024, 4096):
        ratio = r[f"alibi_attention n = {length} [kernel]"] / r[f"SDPA float mask n = {length}"]
        print(f"- alibi_attention forward n = {length}, kernel: {ratio:.2f}x SDPA with a float mask (target <= 0.5x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--train-n", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--samples", default="8,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.n < 1 or args.train_n < 1 or args.repeats < 1:
        raise SystemExit("--n, --train-n and --repeats must be positive")
    for threads in (int(x) for x in args.threads.split(",")):
        r = run(threads, args)
        print(f"\nTargets ({threads} thread(s)):")
        targets(r, args)


if __name__ == "__main__":
    main()
