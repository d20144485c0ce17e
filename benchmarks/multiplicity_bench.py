"""Issue #8 targets in one run: the multiplicity form vs the per-sample path on the same partitions.

    nice python benchmarks/multiplicity_bench.py --n 32768 --samples 8,64,256 --repeats 3 --slow-repeats 1
    nice python benchmarks/multiplicity_bench.py --sweep 1024,4096,16384 --repeats 3   # auto vs samples

Prints each timing with the peak memory beyond the inputs (growth of the peak RSS, in units of q), then a
markdown table of medians and ratios (CPU, torch intra-op threads as set by torch). Compare ratios within one
run, not absolute times across runs. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from positional_lsh import alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.cli.bench import gemm_peak, peak_rss_growth_mib, reset_peak_rss


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    if repeats > 1:
        fn()  # warm-up (plans, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--samples", default="8,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slow-repeats", type=int, default=1, help="repeats of the per-sample path at T >= 64")
    ap.add_argument("--bf16-n", type=int, default=4096, help="length of the bf16 error check (vs float64)")
    ap.add_argument("--sweep", default=None, help="instead: auto vs samples at these n (e.g. 1024,4096,16384)")
    ap.add_argument("--sweep-samples", default="1,4,8,16,64", help="T values of --sweep")
    args = ap.parse_args()
    if args.sweep:
        sweep(args)
        return
    n, h, d = args.n, args.heads, args.dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for _ in range(3))
    slopes = alibi_slopes(h)
    rows = []

    q_mib = q.numel() * q.element_size() / 2**20

    def run(label: str, fn: Callable[[], object], repeats: int) -> float:
        t = _median_time(fn, repeats)
        base = reset_peak_rss()
        if repeats > 1:  # one more call for the peak memory (outputs included, inputs excluded)
            fn()
        peak = peak_rss_growth_mib(base) if repeats > 1 else float("nan")
        rows.append((label, t))
        print(f"{label}: {t:.3f} s, peak +{peak:.0f} MiB ({peak / q_mib:.2f}x q)", flush=True)
        return t

    print(f"threads={torch.get_num_threads()} n={n} H={h} d={d} causal", flush=True)
    print(f"GEMM peak fp32: {gemm_peak(torch.float32):.1f} GFLOP/s; bf16: {gemm_peak(torch.bfloat16, 256):.2f} GFLOP/s")
    res: dict[tuple[str, int], float] = {}
    for t_ in [int(x) for x in args.samples.split(",")]:
        parts = sample_partitions(n, slopes, t_, generator=0)
        for method in ("samples", "multiplicity", "auto"):
            if method == "samples" and t_ > 64:
                continue  # minutes per call; time(T) of the per-sample path grows linearly in T
            reps = args.slow_repeats if (method == "samples" and t_ >= 64) else args.repeats
            res[(method, t_)] = run(
                f"fwd T={t_} {method}", lambda p=parts, m=method: plsh_attention(q, k, v, partitions=p, method=m), reps
            )
        a = plsh_attention(q, k, v, partitions=parts, method="multiplicity")
        if t_ <= 64:
            b = plsh_attention(q, k, v, partitions=parts, method="samples")
            print(f"  T={t_}: max |multiplicity - samples| = {(a - b).abs().max():.2e}")

    parts64 = sample_partitions(n, slopes, 64, generator=0)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def fwd_bwd(method: str) -> None:
        out = plsh_attention(qg, kg, vg, partitions=parts64, method=method)
        torch.autograd.grad(out, (qg, kg, vg), torch.ones_like(out))

    res[("fb samples", 64)] = run("fwd+bwd T=64 samples", lambda: fwd_bwd("samples"), args.slow_repeats)
    res[("fb multiplicity", 64)] = run("fwd+bwd T=64 multiplicity", lambda: fwd_bwd("multiplicity"), args.repeats)

    parts8 = sample_partitions(n, slopes, 8, generator=0)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    res[("bf16", 8)] = run("fwd T=8 auto bf16", lambda: plsh_attention(qb, kb, vb, partitions=parts8), args.repeats)
    m = args.bf16_n
    p_small = sample_partitions(m, slopes, 8, generator=0)
    ref = plsh_attention(*(x[:, :, :m].double() for x in (q, k, v)), partitions=p_small, method="multiplicity")
    low = plsh_attention(*(x[:, :, :m].bfloat16() for x in (q, k, v)), partitions=p_small).double()
    print(f"  bf16 relative error vs float64 (n={m}): {((low - ref).norm() / ref.norm()):.2e}")

    print("\n| quantity | value | target |\n| --- | --- | --- |")

    def ratio(a: tuple[str, int], b: tuple[str, int]) -> str:
        return f"{res[a] / res[b]:.2f}" if a in res and b in res else "n/a"

    print(f"| T=64 samples / multiplicity (fwd) | {ratio(('samples', 64), ('multiplicity', 64))} | >= 6 |")
    print(f"| T=64 samples / auto (fwd) | {ratio(('samples', 64), ('auto', 64))} | >= 6 |")
    print(f"| T=8 samples / auto (fwd) | {ratio(('samples', 8), ('auto', 8))} | >= 1.3 |")
    print(f"| T=8 samples / multiplicity (fwd) | {ratio(('samples', 8), ('multiplicity', 8))} | |")
    print(f"| auto time(T=256) / time(T=8) | {ratio(('auto', 256), ('auto', 8))} | <= 4 |")
    print(f"| T=64 fwd+bwd samples / multiplicity | {ratio(('fb samples', 64), ('fb multiplicity', 64))} | >= 4 |")
    print(f"| T=8 fp32 auto / bf16 auto | {ratio(('auto', 8), ('bf16', 8))} | >= 2.5 |")


def sweep(args: argparse.Namespace) -> None:
    """``method="auto"`` against the per-sample path (and the multiplicity form), forward and forward + backward."""
    h, d = args.heads, args.dim
    slopes = alibi_slopes(h)
    print(f"threads={torch.get_num_threads()} H={h} d={d} causal fp32; medians of {args.repeats} after a warm-up\n")
    print("| n | T | pass | samples | multiplicity | auto | samples / auto | best / auto |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in [int(x) for x in args.sweep.split(",")]:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, n, d, generator=g, requires_grad=True) for _ in range(3))
        for t_ in [int(x) for x in args.sweep_samples.split(",")]:
            parts = sample_partitions(n, slopes, t_, generator=0)
            for label, backward in (("fwd", False), ("fwd+bwd", True)):

                def call(method: str, p=parts, b=backward, x=(q, k, v)) -> None:
                    out = plsh_attention(*x, partitions=p, method=method)
                    if b:
                        torch.autograd.grad(out, x, torch.ones_like(out))

                t = {m: _median_time(lambda m=m: call(m), args.repeats) for m in ("samples", "multiplicity", "auto")}
                best = min(t["samples"], t["multiplicity"])
                print(
                    f"| {n} | {t_} | {label} | {t['samples']:.3f} | {t['multiplicity']:.3f} | {t['auto']:.3f} | "
                    f"{t['samples'] / t['auto']:.2f} | {best / t['auto']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
