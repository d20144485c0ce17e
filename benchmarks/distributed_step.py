"""Time per forward + backward and peak memory per process of context-parallel positional-LSH attention.

    python benchmarks/distributed_step.py [--n 16384] [--worlds 1 2 4] [--repeats 3]

P processes (gloo, CPU) each hold n/P positions of q, k, v (batch 1, H = 8 standard ALiBi slopes, T = 8, d = 64,
fp32, causal) and run ``context_parallel_plsh_attention`` forward + backward. P = 1 runs the same function
without a process group (it is ``plsh_attention``). Each process uses max(1, cores // P) threads.

Peak memory: the kernel's peak resident set (VmHWM) during one step, reset with /proc/self/clear_refs
before the inputs are made, minus the resident set just before (imports, torch, gloo, and the libraries and
workspaces that a tiny warm-up step loaded): the bytes that the step itself added, inputs included.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from positional_lsh.distributed import context_parallel_plsh_attention

H, T, D = 8, 8, 64


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _step(n_local: int, seed: int, head_chunk: int | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, n_local, D, generator=g).requires_grad_() for _ in range(3))
    out = context_parallel_plsh_attention(q, k, v, num_samples=T, generator=0, causal=True, head_chunk=head_chunk)
    out.square().sum().backward()


def _worker(
    rank: int, world: int, store: str, n: int, repeats: int, threads: int, out: str, head_chunk: int | None
) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
        )
    n_local = n // world
    # One tiny warm-up step loads the kernels' libraries and workspaces (a fixed ~50 MiB, whatever n is),
    # then the peak of one full step.
    _step(256, rank, head_chunk)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kib("VmRSS")
    _step(n_local, rank, head_chunk)
    peak = _status_kib("VmHWM") - base
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        _step(n_local, rank, head_chunk)
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    Path(out, f"{rank}.json").write_text(json.dumps({"peak_kib": peak, "times": times}))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--head-chunk",
        type=int,
        default=None,
        help="P > 1: key/value heads per chunk, recomputed in the backward (context_parallel_plsh_attention's "
        "head_chunk; P = 1 is always plain plsh_attention)",
    )
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    print(f"n = {args.n:,}, H = {H}, T = {T}, d = {D}, fp32, causal, batch 1; {cores} cores; torch {torch.__version__}")
    print(f"head_chunk (P > 1): {args.head_chunk}")
    print("\n| P | threads/process | step time (median of repeats) | speed-up | peak MiB/process (max rank) | vs P=1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    base_t = base_m = None
    for world in args.worlds:
        threads = max(1, cores // world)
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _worker,
                args=(world, os.path.join(tmp, "store"), args.n, args.repeats, threads, tmp, args.head_chunk),
                nprocs=world,
            )
            res = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
        step = sorted(max(r["times"][i] for r in res) for i in range(args.repeats))[args.repeats // 2]
        peak = max(r["peak_kib"] for r in res) / 1024
        base_t = base_t or step
        base_m = base_m or peak
        print(f"| {world} | {threads} | {step:.2f} s | {base_t / step:.2f}x | {peak:.1f} | {peak / base_m:.2f}x |")


if __name__ == "__main__":
    main()
