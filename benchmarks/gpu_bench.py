"""GPU preset of the issue #8 comparison: positional LSH (both methods) against FlexAttention and SDPA.

    python benchmarks/gpu_bench.py                      # one H200: H=32, d=128, bf16, n = 8k ... 128k
    python benchmarks/gpu_bench.py --lengths 8192 --samples 8 --repeats 3 --no-backward   # a quick check

Per length, forward and forward + backward, on the same inputs:

* ``plsh`` / ``plsh-mult`` — :func:`~positional_lsh.plsh_attention`, ``method="samples"`` / ``"multiplicity"``,
  at each ``T`` of ``--samples`` (default 8 and 64), standard ALiBi slopes, scheme ``discrete``; on CUDA ``plsh``
  runs torch's fused CUDA flash op per block, with triton installed ``plsh-mult`` runs the Triton kernels, and
  ``plsh-mult-torch`` the torch tiles (``backend="math"``). ``benchmarks/gpu_check.py`` is the budgeted check with
  correctness first;
* ``flex-exact`` — exact causal ALiBi, FlexAttention with ``score_mod`` and the causal block mask;
* ``flex-window`` — windowed ALiBi (keys within ``--window-factor * sigma``), FlexAttention with a band block
  mask (:func:`~positional_lsh.cli.bench_peers.band_block_mask`);
* ``sdpa-flash`` — ``scaled_dot_product_attention(is_causal=True)`` restricted to the flash backend, no bias:
  the speed of light for exact causal attention.

Times are medians of ``--repeats`` calls after one warm-up (which compiles FlexAttention), with
``torch.cuda.synchronize``; peak memory is ``torch.cuda.max_memory_allocated`` beyond what was allocated before
the call. Useful GFLOP/s: ``4 d x pairs / seconds`` (x3.5 fwd+bwd) with the pair counts of ``plsh bench``.
Writes ``gpu_bench.md`` and ``gpu_bench.csv`` to ``--out``. Runs on CPU too (``--device cpu``, tiny sizes, for
the tests: no flash restriction, FlexAttention forward only and, with ``--no-compile``, eager).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from positional_lsh import alibi_slopes, plsh_attention, sample_partitions
from positional_lsh.cli.bench_peers import (
    PLSH_METHODS,
    band_block_mask,
    band_pairs,
    sample_pairs,
    union_pairs,
    useful_gflops,
)

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Row:
    method: str
    samples: int | None
    seq_len: int
    mode: str
    seconds: float
    peak_mib: float
    pairs: int
    useful_gflops: float | None


@dataclass
class Case:
    name: str
    samples: int | None
    fn: Fn
    pairs: int
    can_backward: bool = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _flash_only(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        yield


def cases(n: int, args: argparse.Namespace, device: torch.device) -> list[Case]:
    """The callables to time at length ``n`` (see the module docstring)."""
    slopes = alibi_slopes(args.heads)
    window = args.window_factor / slopes.double()
    sl, win = slopes.to(device), window.to(torch.int64).to(device)
    out: list[Case] = []
    for t in args.samples:
        parts = sample_partitions(n, slopes, t, generator=args.seed)
        for name, method in PLSH_METHODS.items():
            count = sample_pairs(parts, causal=True) if method == "samples" else union_pairs(parts, causal=True)
            fn = lambda a, b, c, p=parts, m=method: plsh_attention(a, b, c, partitions=p, method=m)  # noqa: E731
            out.append(Case(name, t, fn, count))
        if device.type == "cuda":  # plsh-mult is the Triton kernel there (when triton is installed); the torch path:
            fn = lambda a, b, c, p=parts: plsh_attention(a, b, c, partitions=p, method="multiplicity", backend="math")  # noqa: E731
            out.append(Case("plsh-mult-torch", t, fn, union_pairs(parts, causal=True)))
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False) if args.compile else flex_attention

    def alibi_mod(score, b, h, qi, ki):
        return score - sl[h] * (qi - ki).abs()

    def causal_mask(b, h, qi, ki):
        return qi >= ki

    def window_mask(b, h, qi, ki):
        return ((qi - ki).abs() <= win[h]) & (qi >= ki)

    cpu = device.type == "cpu"  # torch has no CPU backward for FlexAttention
    bm = band_block_mask(n, None, causal=True, mask_mod=causal_mask).to(device)
    wbm = band_block_mask(n, window, causal=True, mask_mod=window_mask).to(device)
    exact, band = band_pairs(n, None, causal=True, num_heads=args.heads), band_pairs(n, window, causal=True)
    for name, mask, pairs in (("flex-exact", bm, exact), ("flex-window", wbm, band)):
        fn = lambda a, b, c, m=mask: flex(a, b, c, score_mod=alibi_mod, block_mask=m)  # noqa: E731
        out.append(Case(name, None, fn, pairs, not cpu))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def flash(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        with _flash_only(device):
            return sdpa(a, b, c, is_causal=True)

    out.append(Case("sdpa-flash", None, flash, exact))
    return out


def _time(fn: Callable[[], object], repeats: int, device: torch.device, long_seconds: float) -> tuple[float, float]:
    """Median seconds over ``repeats`` (after one warm-up) and the peak extra memory (MiB; NaN on CPU)."""
    fn()
    _sync(device)
    times = []
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if times[-1] > long_seconds:
            break
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def _run_case(case: Case, x: tuple[torch.Tensor, ...], args: argparse.Namespace, device: torch.device) -> list[Row]:
    q, k, v, dout = x
    rows = []
    for mode in ["fwd"] + (["fwd+bwd"] if args.backward and case.can_backward else []):
        if mode == "fwd":
            with torch.no_grad():
                sec, peak = _time(lambda: case.fn(q, k, v), args.repeats, device, args.long_seconds)
        else:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))

            def fwd_bwd(qq: torch.Tensor = qq, kk: torch.Tensor = kk, vv: torch.Tensor = vv) -> object:
                return torch.autograd.grad(case.fn(qq, kk, vv), (qq, kk, vv), dout)

            sec, peak = _time(fwd_bwd, args.repeats, device, args.long_seconds)
        gf = useful_gflops(case.pairs, args.dim, sec, mode)
        rows.append(Row(case.name, case.samples, q.shape[-2], mode, sec, peak, case.pairs, gf))
        print(f"n={q.shape[-2]} {case.name} T={case.samples} {mode}: {sec:.4f} s, {gf:.1f} useful GFLOP/s", flush=True)
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    """Time every case at every length; print and return the rows."""
    device, dtype = torch.device(args.device), _DTYPES[args.dtype]
    rows: list[Row] = []
    for n in args.lengths:
        torch._dynamo.reset()  # static shapes: one compilation per length, never the recompile limit
        g = torch.Generator().manual_seed(args.seed + n)
        x = tuple(torch.randn(1, args.heads, n, args.dim, generator=g).to(device, dtype) for _ in range(4))
        for case in cases(n, args, device):
            rows += _run_case(case, x, args, device)
    return rows


def write(rows: list[Row], out: Path, meta: dict[str, object]) -> list[Path]:
    """``gpu_bench.md`` (the table and the settings) and ``gpu_bench.csv`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| method | T | n | pass | median s | peak MiB | pairs (M) | useful GFLOP/s |", "|" + " --- |" * 8]
    lines += [f"| {r.method} | {r.samples or ''} | {r.seq_len} | {r.mode} | {r.seconds:.4f} | {r.peak_mib:.0f} "
              f"| {r.pairs / 1e6:.1f} | {r.useful_gflops or 0:.1f} |" for r in rows]  # fmt: skip
    md, table = out / "gpu_bench.md", out / "gpu_bench.csv"
    md.write_text("# GPU bench\n\n" + "\n".join(lines) + "\n")
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    return [md, table]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    ap.add_argument("--lengths", type=ints, default=(8192, 16384, 32768, 65536, 131072))
    ap.add_argument("--samples", type=ints, default=(8, 64))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long-seconds", type=float, default=10.0, help="stop repeating past this many seconds")
    ap.add_argument("--window-factor", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-backward", dest="backward", action="store_false")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager FlexAttention (tests only)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_bench"))
    return ap


def main(argv: list[str] | None = None) -> list[Row]:
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "heads": args.heads, "head_dim": args.dim,
            "dtype": args.dtype, "causal": True, "scheme": "discrete", "samples": args.samples}  # fmt: skip
    rows = run(args)
    for path in write(rows, args.out, meta):
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
