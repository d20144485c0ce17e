"""Compile the Triton kernels for sm_80 and sm_90 without a GPU; print registers, spills, shared memory and SASS mix.

    python scripts/triton_resources.py                 # the block table's configurations, markdown table
    python scripts/triton_resources.py --json out.json --no-sass --jobs 2    # what the compile test runs
    python scripts/triton_resources.py --search --dims 64,128,256   # choose the configurations (BLOCK_TABLE rows)

For every (architecture, dtype, head dim, causal) it compiles the three kernels at the configuration of
``positional_lsh.ops._engine.triton.plan.BLOCK_TABLE`` (``scripts/triton_compile.py``: ``compile_report``),
and the ``dq`` kernel again with its slope-gradient switch on (``DIST_GRAD``; column "slope grad"), and prints one row
per kernel: registers, stack bytes, spill instructions (STL/LDL), dynamic shared memory, and the static
instruction mix of the kernel's main loop (the innermost loop with matrix instructions): ``mma`` (HMMA/HGMMA)
against ``int`` (integer, compare, select), ``float``, ``mufu`` (exp2/log2/rcp), ``conv``, ``mem``, ``uniform``
(per-warp scalar) and ``other``. Run it with TRITON_INTERPRET unset (the script sets it to 0 for itself).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: the kernels must be JIT functions
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse
import json
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MIX = ("mma", "int", "float", "mufu", "conv", "mem", "uniform", "other")


def _one(job: tuple[int, str, int, bool, bool]) -> list[dict[str, object]]:
    warnings.filterwarnings("ignore")
    from triton_compile import compile_report

    arch, dtype, dim, causal, sass = job
    reports = compile_report(arch, _DTYPES[dtype], dim, causal, dist_grad=True, sass=sass)
    return [r.as_dict() | {"spills": r.spills} for r in reports]


def _search(job: tuple[int, str, int]) -> tuple[tuple[int, str, int], dict[str, int], bool, list[str]]:
    warnings.filterwarnings("ignore")
    from triton_compile import search_config

    arch, dtype, dim = job
    lines: list[str] = []
    cfg, clean = search_config(arch, _DTYPES[dtype], dim, lines.append)
    return job, asdict(cfg), clean, lines


def table(rows: list[dict[str, object]], sass: bool = True) -> str:
    """The markdown table of the compile reports ``rows``."""
    head = ["kernel", "slope grad", "arch", "dtype", "d", "causal", "tile (m x n, near, warps, stages)", "registers",
            "stack B", "spill st/ld", "shared KiB"] + ([f"loop {m}" for m in _MIX] if sass else [])  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        c = r["config"]
        if r["kernel"] == "bwd_dkdv_kernel":
            tile = (f"{c['dkdv_m'] or c['block_m']} x {c['dkdv_n'] or c['block_n']}, {c['near']}, "
                    f"{c['dkdv_warps'] or c['num_warps']}, {c['dkdv_stages'] or c['num_stages']}")  # fmt: skip
        else:
            tile = f"{c['block_m']} x {c['block_n']}, {c['near']}, {c['num_warps']}, {c['num_stages']}"
        cells = [r["kernel"], "yes" if r.get("dist_grad") else "no", f"sm_{r['arch']}", r["dtype"], r["head_dim"],
                 "yes" if r["causal"] else "no", tile, r["registers"], r["stack"],
                 f"{r['spill_stores']}/{r['spill_loads']}", f"{r['shared'] / 1024:.0f}"]  # fmt: skip
        if sass:
            cells += [r["loop_mix"].get(m, 0) for m in _MIX]  # type: ignore[union-attr]
        out.append("| " + " | ".join(str(x) for x in cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    ap.add_argument("--archs", type=ints, default=(80, 90))
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--dims", type=ints, default=(64, 128))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="also write the reports to this file")
    ap.add_argument(
        "--no-sass",
        dest="sass",
        action="store_false",
        help="no instruction mix (and no disassembly of a kernel without stack or local memory: faster)",
    )
    ap.add_argument("--search", action="store_true", help="choose the configurations instead (slow: minutes)")
    args = ap.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        if args.search:
            jobs = [(a, d, m) for a in args.archs for d in dtypes for m in args.dims]
            for (arch, dtype, dim), cfg, clean, lines in pool.map(_search, jobs):
                print("\n".join(f"# {line}" for line in lines))
                vals = ", ".join(str(cfg[k]) for k in ("block_m", "block_n", "near", "num_warps", "num_stages",
                                                      "dkdv_m", "dkdv_n", "dkdv_warps", "dkdv_stages"))  # fmt: skip
                print(f'    ({arch}, "{dtype}", {dim}): BlockConfig({vals}),{"" if clean else "  # spills"}')
            return 0
        jobs = [(a, d, m, c, args.sass) for a in args.archs for d in dtypes for m in args.dims for c in (True, False)]
        rows = [r for part in pool.map(_one, jobs) for r in part]
    print(table(rows, args.sass))
    bad = [r for r in rows if r["spills"] and r["dtype"] != "float32"]
    shared = max(r["shared"] for r in rows) / 1024
    print(f"\n{len(rows)} kernels compiled in {time.perf_counter() - t0:.0f} s; "
          f"{len(bad)} half-precision kernels spill; max shared {shared:.0f} KiB")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
