"""The work model of the Triton kernels' count at the issue-17 target: integer ops per computed score entry.

    python scripts/triton_work.py                       # n = 32768, H = 32 standard slopes, T = 8, 64, 256
    python scripts/triton_work.py --lengths 4096 --samples 64 --arch 80

For each (arch's block configuration for bf16, d = 128; causal / bidirectional; T) it builds the kernels' layout on the
CPU (``positional_lsh.ops._engine.triton.plan.build_layout``, scheme ``discrete``, seed 0) and prints
``positional_lsh.ops._tools.triton_work.count_work``: integer operations per computed score entry over all heads (total
/ total) for the forward (= the ``dq`` kernel) and the ``dk, dv`` kernel, the per-head mean and maximum, the share of
near (table) pairs and the layout's bytes. The kernels before issue 17 spent ``2T`` per entry (128 at T = 64).
"""

from __future__ import annotations

import argparse

import torch

from positional_lsh import alibi_slopes, sample_partitions
from positional_lsh.ops._engine.triton.plan import block_config, build_layout
from positional_lsh.ops._tools.triton_work import count_work


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    ap.add_argument("--lengths", type=ints, default=(32768,))
    ap.add_argument("--samples", type=ints, default=(8, 64, 256))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--arch", type=ints, default=(90, 80))
    ap.add_argument("--bidirectional", action="store_true", help="also the bidirectional kernels")
    args = ap.parse_args(argv)
    print("| arch | config (m x n, near) | causal | n | T | fwd ops/entry | dkdv ops/entry | per-head mean | "
          "per-head max | near pairs | layout MiB |")  # fmt: skip
    print("|" + " --- |" * 11)
    for arch in args.arch:
        cfg = block_config(torch.bfloat16, 128, arch)
        for causal in (True, False) if args.bidirectional else (True,):
            for n in args.lengths:
                for t in args.samples:
                    parts = sample_partitions(n, alibi_slopes(args.heads), t, generator=0)
                    layout = build_layout(parts, n, causal, cfg, torch.device("cpu"))
                    fwd, dkdv = count_work(layout, "fwd"), count_work(layout, "dkdv")
                    head = fwd.per_entry_by_head
                    near = float(fwd.near_pairs.sum()) / float(fwd.pairs.sum())
                    tile = f"{cfg.block_m} x {cfg.block_n}, {cfg.near}"
                    print(f"| sm_{arch} | {tile} | {'yes' if causal else 'no'} | {n} | {t} | {fwd.per_entry:.2f} "
                          f"| {dkdv.per_entry:.2f} | {float(head.mean()):.2f} | {float(head.max()):.2f} | {near:.2f} "
                          f"| {layout.nbytes() / 2**20:.0f} |", flush=True)  # fmt: skip
                    del layout, parts


if __name__ == "__main__":
    main()
