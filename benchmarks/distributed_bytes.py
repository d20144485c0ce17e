"""Bytes per rank of the halo exchange versus ring attention and all-gather (docs/distributed.md).

    python benchmarks/distributed_bytes.py                  # planned table + measured bytes for P = 2, 4
    python benchmarks/distributed_bytes.py --no-measure     # planned table only (no processes)

Planned bytes are exact for the sampled partitions (positional_lsh.distributed.halo_plan): H = 8 heads with the
standard ALiBi slopes, T = 8 samples ("discrete"), d = 64, fp32, batch 1, keys and values of every halo position.
Measured bytes are what went through ``isend`` in one forward + backward on P gloo processes on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from positional_lsh import alibi_slopes, sample_partitions
from positional_lsh.distributed import (
    bytes_per_rank,
    comm_stats,
    context_parallel_plsh_attention,
    exchange_bytes,
    halo_plan,
    reset_comm_stats,
)

H, T, D = 8, 8, 64
SEED = 0


def _fmt(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return str(b)


def planned_table(lengths: list[int], worlds: list[int], causal: bool) -> list[str]:
    kw = {"kv_heads": H, "head_dim": D, "dtype": torch.float32}
    rows = [
        "| n | P | halo positions/rank (mean / max) | halo bytes/rank (max) | ring bytes/rank | "
        "all-gather bytes/rank | halo / ring (max rank) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        parts = sample_partitions(n, alibi_slopes(H), T, generator=SEED)
        for p in worlds:
            plan = halo_plan(parts, [n // p] * p, causal=causal)
            recv = bytes_per_rank(plan, **kw)["received"]
            halo = [plan.halo_positions(r) for r in range(p)]
            ring = exchange_bytes(n, p, **kw)
            rows.append(
                f"| {n:,} | {p} | {sum(halo) / p:,.0f} / {max(halo):,} | {_fmt(max(recv))} | {_fmt(ring)} | "
                f"{_fmt(exchange_bytes(n, p, exchange='allgather', **kw))} | {100 * max(recv) / ring:.3f} % |"
            )
    return rows


def _worker(rank: int, world: int, store: str, n: int, causal: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    g = torch.Generator().manual_seed(rank)
    shard = n // world
    q, k, v = (torch.randn(1, H, shard, D, generator=g).requires_grad_() for _ in range(3))
    reset_comm_stats()
    o = context_parallel_plsh_attention(q, k, v, num_samples=T, generator=SEED, causal=causal)
    o.square().sum().backward()
    Path(out, f"{rank}.json").write_text(json.dumps(comm_stats()))
    dist.barrier()
    dist.destroy_process_group()


def measured(n: int, world: int, causal: bool) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), n, causal, tmp), nprocs=world)
        stats = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
    parts = sample_partitions(n, alibi_slopes(H), T, generator=SEED)
    plan = halo_plan(parts, [n // world] * world, causal=causal)
    planned = bytes_per_rank(plan, kv_heads=H, head_dim=D, dtype=torch.float32)
    ring = exchange_bytes(n, world, kv_heads=H, head_dim=D, dtype=torch.float32)
    rows = []
    for r, s in enumerate(stats):
        rows.append(
            f"| {n:,} | {world} | {'causal' if causal else 'bidirectional'} | {r} | {s['forward_bytes']:,} | "
            f"{planned['sent'][r]:,} | {s['backward_bytes']:,} | {planned['received'][r]:,} | "
            f"{s['forward_messages'] + s['backward_messages']} | {100 * s['forward_bytes'] / ring:.3f} % |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-measure", action="store_true")
    ap.add_argument("--measure-n", type=int, default=32768)
    args = ap.parse_args()
    lengths = [2**k for k in range(15, 21)]
    worlds = [2, 4, 8, 16, 32, 64]
    for causal in (True, False):
        print(f"\n### Planned, {'causal' if causal else 'bidirectional'} (H={H}, T={T}, d={D}, fp32, batch 1)\n")
        print("\n".join(planned_table(lengths, worlds, causal)))
    if args.no_measure:
        return
    print(f"\n### Measured on this machine (gloo), one forward + backward, n = {args.measure_n:,}\n")
    print(
        "| n | P | attention | rank | fwd bytes sent (measured) | planned | bwd bytes sent (measured) | planned | "
        "messages | fwd sent / ring |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for world in (2, 4):
        for causal in (True, False):
            print("\n".join(measured(args.measure_n, world, causal)))


if __name__ == "__main__":
    main()
