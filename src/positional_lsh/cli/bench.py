"""``plsh bench``: time, peak memory and error of positional LSH against exact and windowed ALiBi.

Peers, measured in the same run on the same inputs:

* ``flex-exact`` — exact ALiBi with FlexAttention (``score_mod``, causal block mask), ``torch.compile``-d.
  Forward only on CPU (torch has no CPU backward for it).
* ``sdpa-mask`` — exact ALiBi with ``torch.nn.functional.scaled_dot_product_attention`` and a prebuilt
  ``(H, n, n)`` float mask: the only exact CPU path with a backward. Run only where it fits in memory.
* ``flex-window`` — windowed ALiBi (keys within ``window_factor * sigma`` of the query, per head) with
  FlexAttention, compiled, forward only.
* ``alibi-chunked`` / ``window-chunked`` — this library's :func:`~positional_lsh.alibi_attention` (``O(n)``
  memory, with a backward); opt in with ``--methods``.
* ``plsh`` / ``plsh-mult`` — :func:`~positional_lsh.plsh_attention` with ``T`` samples (default scheme
  ``discrete``), ``method="samples"`` (per sampled block) / ``method="multiplicity"`` (query tiles; on the CPU the
  package's CPU kernel where it builds); ``plsh-mult-torch`` the multiplicity form on the torch path
  (``PLSH_CPU_KERNEL=0``), so that one run reports both paths.

Useful GFLOP/s is ``4 d x pairs / seconds`` (x3.5 for fwd+bwd), where ``pairs`` are the score entries the
method needs, not what it computes: exact attention ``H n(n+1)/2`` (causal), windowed the band, the per-sample
path the sum over samples of each block's causal pairs, the multiplicity form the union of each query's ``T``
blocks (:mod:`~positional_lsh.cli.bench_peers`). The run measures ``torch.matmul``'s fp32 and bf16 GFLOP/s
(1024², the run's threads) and prints them next to it.

Times are medians over repeats (one run when a single call exceeds ``--long-seconds``), excluding compilation
and mask construction. Peak memory is the growth of the process's peak resident set (``VmHWM``, reset before
each call) beyond what was resident before it: the inputs are excluded, outputs and workspace included.
Relative error is ``||out - exact||_F / ||exact||_F``: for the approximate methods against the first exact peer
of the same run (``flex-exact``, else ``sdpa-mask``, else ``alibi-chunked``; without one, as for the exact peers);
for the exact peers against exact ALiBi in float64 on the same inputs, computed on 256 evenly spaced query rows
(:func:`~positional_lsh.cli.bench_peers.reference_rows`), so their rounding error is measured, not assumed 0.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import dataclasses
import gc
import itertools
import math
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from positional_lsh.cli.bench_peers import (
    ALL_METHODS,
    DEFAULT_METHODS,
    EXACT_METHODS,
    PLSH_METHODS,
    Method,
    band_block_mask,
    flex,
    methods_for_length,
    reference_rows,
    sampled_rows,
    useful_gflops,
)
from positional_lsh.cli.parsers import add_command, comma_list, option, positive_int_text
from positional_lsh.lm.run_dir import check_output_dir
from positional_lsh.ops import alibi_slopes
from positional_lsh.ops.attention import check_call_size
from positional_lsh.ops.checks import check_choice, nonnegative_int, positive_int
from positional_lsh.ops.errors import check_memory
from positional_lsh.ops.partitions.schemes import get_scheme

__all__ = [
    "ALL_METHODS",
    "DEFAULT_METHODS",
    "BenchConfig",
    "BenchRow",
    "band_block_mask",
    "format_table",
    "gemm_peak",
    "growth_exponents",
    "peak_rss_growth_mib",
    "register_cli",
    "reset_peak_rss",
    "run_bench_command",
    "run_benchmark",
    "write_outputs",
]


@dataclass
class BenchRow:
    """One measurement: a method (and ``T``) at one length, forward or forward + backward."""

    method: str
    seq_len: int
    samples: int | None
    mode: str  # "fwd" or "fwd+bwd"
    seconds: float
    repeats: int
    peak_mib: float
    rel_error: float | None = None
    note: str = ""
    times: list[float] = field(default_factory=list)
    pairs: int | None = None  # score entries the method needs (bench_peers.Method.pairs)
    useful_gflops: float | None = None  # 4 d pairs (x3.5 for fwd+bwd) / seconds


# --------------------------------------------------------------------------------------------- memory


def _status_kib(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"{key}:\s+(\d+)", text)
    return int(m.group(1)) if m else None


def reset_peak_rss() -> int | None:
    """Release freed heap memory, reset this process's peak resident set and return the current one (KiB).

    Linux only (``/proc/self/clear_refs``, glibc's ``malloc_trim``); ``None`` where that is not possible. Pass
    the result to :func:`peak_rss_growth_mib` after the work to measure.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kib("VmRSS")


def peak_rss_growth_mib(base: int | None) -> float:
    """How far the peak resident set (``VmHWM``) has risen above ``base`` (KiB, from :func:`reset_peak_rss`),
    in MiB (at least 0); ``nan`` where either is unknown."""
    peak = _status_kib("VmHWM")
    if base is None or peak is None:
        return float("nan")
    return max(0.0, (peak - base) / 1024)


def _measure(
    fn: Callable[[], torch.Tensor | None], repeats: int, long_seconds: float
) -> tuple[list[float], float, torch.Tensor | None]:
    """Run ``fn`` up to ``repeats`` times; return the times, the peak extra memory (MiB) and the last output."""
    times: list[float] = []
    peak = 0.0
    out: torch.Tensor | None = None
    for _ in range(repeats):
        out = None
        base = reset_peak_rss()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        peak = max(peak, peak_rss_growth_mib(base))
        if times[-1] > long_seconds:
            break
    return times, peak, out


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact.double()).norm() / exact.double().norm())


@dataclass
class _Inputs:
    """One length's inputs, the float64 reference rows and the first exact output (the error's reference)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor
    rows_ref: torch.Tensor
    ref: torch.Tensor
    exact: torch.Tensor | None = None


def _inputs(n: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int, causal: bool) -> _Inputs:
    g = torch.Generator().manual_seed(seed + n)
    q, k, v, grad = (torch.randn(1, num_heads, n, head_dim, generator=g).to(dtype) for _ in range(4))
    rows_ref = sampled_rows(n)
    return _Inputs(q, k, v, grad, rows_ref, reference_rows(q, k, v, alibi_slopes(num_heads), rows_ref, causal=causal))


def _measure_method(m: Method, x: _Inputs, *, backward: bool, repeats: int, long_seconds: float) -> list[BenchRow]:
    """The forward (and forward + backward) rows of one method on one length's inputs."""
    d, n = x.q.shape[-1], x.q.shape[-2]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*flex_attention called without torch.compile")
        if m.name.startswith("flex"):
            m.fn(x.q, x.k, x.v)  # compile for this shape, outside the timing
        times, peak, out = _measure(lambda: m.fn(x.q, x.k, x.v), repeats, long_seconds)
    assert out is not None
    if m.name in EXACT_METHODS or x.exact is None:
        err = _rel_err(out[:, :, x.rows_ref], x.ref)
    else:
        err = _rel_err(out, x.exact)
    if m.name in EXACT_METHODS and x.exact is None:
        x.exact = out
    sec = statistics.median(times)
    rows = [BenchRow(m.name, n, m.samples, "fwd", sec, len(times), peak, err, m.note, times, m.pairs,
                     useful_gflops(m.pairs, d, sec, "fwd"))]  # fmt: skip
    del out
    if backward and m.can_backward:
        qq, kk, vv = (t.clone().requires_grad_() for t in (x.q, x.k, x.v))

        def fwd_bwd() -> None:
            qq.grad = kk.grad = vv.grad = None
            torch.autograd.backward(m.fn(qq, kk, vv), x.grad)

        times, peak, _ = _measure(fwd_bwd, repeats, long_seconds)
        sec = statistics.median(times)
        rows.append(BenchRow(m.name, n, m.samples, "fwd+bwd", sec, len(times), peak, None, m.note, times, m.pairs,
                             useful_gflops(m.pairs, d, sec, "fwd+bwd")))  # fmt: skip
    return rows


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class BenchConfig:
    """Settings of ``plsh bench`` and of :func:`run_benchmark` (see the module docstring for what is measured).

    Every field but the last two is a flag of ``plsh bench``; ``window_factor`` (the windowed peers keep keys
    within ``window_factor * sigma_h`` of the query) and ``progress`` (a progress bar) are set from code only.
    """

    lengths: tuple[int, ...] = option(
        (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
        "sequence lengths n, comma-separated",
        parse=comma_list(positive_int_text),
    )
    samples: tuple[int, ...] = option(
        (1, 4, 8, 16), "T values for plsh, plsh-mult(-torch), e.g. 1,8,64,256", parse=comma_list(positive_int_text)
    )
    methods: tuple[str, ...] = option(DEFAULT_METHODS, f"comma-separated, from {ALL_METHODS}", choices=ALL_METHODS)
    heads: int = option(8, "attention heads H (standard ALiBi slopes)")
    head_dim: int = option(64, "head dimension d")
    dtype: str = option("float32", "dtype of q, k, v and the computation", choices=tuple(_DTYPES))
    scheme: str = option("discrete", "positional-LSH sampling scheme")
    causal: bool = option(True, "non-causal attention", name="--bidirectional")
    backward: bool = option(True, "forward only", name="--no-backward")
    backward_max_len: int = option(1 << 17, "longest n timed with a backward")
    repeats: int = option(3, "timed calls per measurement (median reported)")
    long_seconds: float = option(20.0, "run once when a call takes longer")
    sdpa_max_gib: float = option(
        20.0, "skip sdpa-mask where its (H, n, n) float mask (plus 25%) would exceed this many GiB"
    )
    threads: int = option(0, "torch threads (0: torch's default)")
    seed: int = option(0, "seed of the inputs and the partitions")
    out: str = option("runs/bench", "output directory (bench.csv, bench.md, bench.png)")
    window_factor: float = 12.0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "repeats", "backward_max_len"):
            positive_int(name, getattr(self, name))
        for name in ("threads", "seed"):
            nonnegative_int(name, getattr(self, name))
        if not self.lengths:
            raise ValueError("lengths (--lengths) must name at least one sequence length")
        for n in self.lengths:
            positive_int("lengths", n)
        for t in self.samples:
            positive_int("samples", t)
        if not self.methods:
            raise ValueError(f"methods (--methods) must name at least one of {ALL_METHODS}")
        unknown = set(self.methods) - set(ALL_METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; expected some of {ALL_METHODS}")
        plsh = [m for m in self.methods if m in PLSH_METHODS]
        if plsh and not self.samples:
            raise ValueError(f"samples (--samples) must name at least one T for the methods {plsh}")
        for name in ("long_seconds", "sdpa_max_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        check_choice("dtype", self.dtype, tuple(_DTYPES))
        get_scheme(self.scheme)
        if not isinstance(self.out, str) or not self.out.strip():
            raise ValueError(f"out (--out) must be a directory path, got {self.out!r}")
        # q, k, v, gradients and outputs in float32, O(n) kernels
        check_memory(64.0 * self.heads * self.head_dim * max(self.lengths), f"--lengths {max(self.lengths)}")
        for m in plsh:  # every positional-LSH call, as plsh_attention checks it (memory and time, with the estimate)
            for n in self.lengths:
                for t in self.samples:
                    check_call_size(t, self.heads, n, n, self.head_dim, self.causal, PLSH_METHODS[m],
                                    what=f"--samples {t} at --lengths {n} ({m})")  # fmt: skip

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a ``torch.dtype``."""
        return _DTYPES[self.dtype]


def run_benchmark(cfg: BenchConfig) -> list[BenchRow]:
    """Measure every method of ``cfg`` at every length of ``cfg``; see the module docstring.

    Reads the fields ``lengths``, ``samples``, ``methods``, ``heads``, ``head_dim``, ``causal``, ``dtype``,
    ``scheme``, ``window_factor``, ``backward``, ``backward_max_len``, ``repeats``, ``long_seconds``,
    ``sdpa_max_gib``, ``seed`` and ``progress`` (not ``threads`` or ``out``: :func:`run_bench_command` applies
    those). Returns one row per measurement.
    """
    if not isinstance(cfg, BenchConfig):
        raise TypeError(f"cfg must be a BenchConfig, got {type(cfg).__name__}")
    slopes = alibi_slopes(cfg.heads)
    window = cfg.window_factor / slopes.double()
    compiled_flex = flex() if {"flex-exact", "flex-window"} & set(cfg.methods) else None
    rows: list[BenchRow] = []
    per_length = len([m for m in cfg.methods if m not in PLSH_METHODS]) + len(cfg.samples) * len(
        [m for m in cfg.methods if m in PLSH_METHODS]
    )
    bar = tqdm(total=len(cfg.lengths) * per_length, desc="plsh bench", disable=not cfg.progress)
    for n in cfg.lengths:
        if compiled_flex is not None:
            # Each length compiles FlexAttention anew (static shapes); forget earlier lengths so that torch's
            # recompile limit is never hit (past it, flex_attention silently runs unfused and materializes n x n).
            torch._dynamo.reset()
        x = _inputs(n, cfg.heads, cfg.head_dim, cfg.torch_dtype, cfg.seed, cfg.causal)
        # The prebuilt mask dominates SDPA's memory (the fused kernel never materializes the scores).
        mask_gib = cfg.heads * n * n * x.q.element_size() / 2**30
        todo = methods_for_length(
            n, cfg.methods, cfg.samples, slopes, window, causal=cfg.causal, dtype=cfg.torch_dtype, scheme=cfg.scheme,
            seed=cfg.seed, flex=compiled_flex, sdpa_fits=mask_gib * 1.25 <= cfg.sdpa_max_gib,
            window_factor=cfg.window_factor,
        )  # fmt: skip
        bar.update(per_length - len(todo))  # methods that do not run at this length
        for m in todo:
            bar.set_postfix_str(f"n={n} {m.name}{'' if m.samples is None else f' T={m.samples}'}")
            bwd = cfg.backward and n <= cfg.backward_max_len
            rows += _measure_method(m, x, backward=bwd, repeats=cfg.repeats, long_seconds=cfg.long_seconds)
            bar.update(1)
        del todo, x
    bar.close()
    return rows


def gemm_peak(dtype: torch.dtype, size: int = 1024, repeats: int = 3) -> float:
    """``torch.matmul`` GFLOP/s of ``size x size`` matrices of ``dtype`` (torch's current intra-op threads)."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e9


# ------------------------------------------------------------------------------------------- reporting


def _ratio_rows(rows: list[BenchRow]) -> list[dict[str, Any]]:
    """Rows as dicts with speed-ups against the exact peers of the same length and mode."""
    peers: dict[tuple[int, str, str], float] = {
        (r.seq_len, r.mode, r.method): r.seconds for r in rows if r.method in ("flex-exact", "sdpa-mask")
    }
    out = []
    for r in rows:
        d = asdict(r)
        d["times"] = " ".join(f"{x:.4f}" for x in r.times)
        for peer in ("flex-exact", "sdpa-mask"):
            base = peers.get((r.seq_len, "fwd" if peer == "flex-exact" else r.mode, peer))
            d[f"speedup_vs_{peer}"] = None if base is None else base / r.seconds
        out.append(d)
    return out


def format_table(rows: list[BenchRow], peak: float | None = None) -> str:
    """The rows as a Markdown table; with ``peak`` (the run's fp32 GEMM GFLOP/s) each row's useful GFLOP/s also as a
    percentage of it."""
    lines = [
        "| method | T | n | pass | median s | runs | peak MiB | rel. error | × vs flex-exact (fwd) | × vs sdpa-mask "
        "| pairs (M) | useful GFLOP/s | % of fp32 GEMM peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in _ratio_rows(rows):

        def f(x: object, spec: str) -> str:
            return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

        lines.append(
            f"| {d['method']} | {d['samples'] or ''} | {d['seq_len']} | {d['mode']} | {d['seconds']:.4f} "
            f"| {d['repeats']} | {f(d['peak_mib'], '.0f')} | {f(d['rel_error'], '.3g')} "
            f"| {f(d['speedup_vs_flex-exact'], '.1f')} | {f(d['speedup_vs_sdpa-mask'], '.1f')} "
            f"| {f(None if d['pairs'] is None else d['pairs'] / 1e6, '.1f')} | {f(d['useful_gflops'], '.2f')} "
            f"| {f(None if peak is None or d['useful_gflops'] is None else 100 * d['useful_gflops'] / peak, '.1f')} |"
        )
    return "\n".join(lines)


def growth_exponents(
    rows: list[BenchRow], method: str = "plsh", samples: int = 8, mode: str = "fwd"
) -> list[tuple[int, int, float]]:
    """Log-log slope of time vs n between consecutive lengths."""
    pts = sorted((r.seq_len, r.seconds) for r in rows if r.method == method and r.samples == samples and r.mode == mode)
    return [(a[0], b[0], math.log(b[1] / a[1]) / math.log(b[0] / a[0])) for a, b in itertools.pairwise(pts)]


def write_outputs(rows: list[BenchRow], out_dir: Path, meta: dict[str, object]) -> list[Path]:
    """Write ``bench.csv``, ``bench.md``, ``bench.png`` (time vs n) and ``bench_t.png`` (time vs T) into
    ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    csv_path = out_dir / "bench.csv"
    dicts = _ratio_rows(rows)
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dicts[0]))
        writer.writeheader()
        writer.writerows(dicts)
    written.append(csv_path)
    md = out_dir / "bench.md"
    header = "# plsh bench\n\n" + "".join(f"- {k}: {v}\n" for k, v in meta.items())
    md.write_text(header + "\n" + format_table(rows, _peak(meta)) + "\n")
    written.append(md)
    written.append(_plot(rows, out_dir / "bench.png", meta))
    if any(r.samples is not None for r in rows):
        written.append(_plot_samples(rows, out_dir / "bench_t.png", meta))
    return written


def _plot_samples(rows: list[BenchRow], png: Path, meta: dict[str, object]) -> Path:
    """``bench_t.png``: median time vs ``T`` of each positional-LSH method at each length, fwd and fwd+bwd."""
    return _plot_times(
        [r for r in rows if r.samples is not None],
        png,
        meta,
        point=lambda r: (f"{r.method} n={r.seq_len}", r.samples or 0),
        xlabel="samples T",
        solid=lambda label: label.startswith("plsh-mult"),
    )


def _plot(rows: list[BenchRow], png: Path, meta: dict[str, object]) -> Path:
    """``bench.png``: median time vs n, forward and forward + backward."""
    return _plot_times(
        rows,
        png,
        meta,
        point=lambda r: (r.method if r.samples is None else f"{r.method} T={r.samples}", r.seq_len),
        xlabel="sequence length n",
        solid=lambda label: "plsh" in label,
    )


def _plot_times(
    rows: list[BenchRow],
    png: Path,
    meta: dict[str, object],
    *,
    point: Callable[[BenchRow], tuple[str, int]],
    xlabel: str,
    solid: Callable[[str], bool],
) -> Path:
    """Median time (log-log) of each series, forward and forward + backward side by side.

    ``point(row)`` gives the row's series label and x value; ``solid(label)`` whether its line is solid.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd"), strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r.mode == mode:
                label, x = point(r)
                series.setdefault(label, []).append((x, r.seconds))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    linestyle="-" if solid(label) else "--")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"{mode}, H={meta.get('heads')}, d={meta.get('head_dim')}, {meta.get('dtype')}")
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# ------------------------------------------------------------------------------------------ command line

def _peak(meta: dict[str, object]) -> float | None:
    value = meta.get(_PEAK32)
    return float(value) if isinstance(value, (int, float)) else None


_PEAK32 = "GEMM peak fp32 (torch.matmul 1024², GFLOP/s)"
_PEAK16 = "GEMM peak bf16 (torch.matmul 1024², GFLOP/s)"


def run_bench_command(cfg: BenchConfig) -> list[BenchRow]:
    """Run the benchmark length by length, writing the outputs after each; print the table and return the rows.
    ``--out`` is checked first (a directory that can be written, not a file), before any measurement."""
    check_output_dir(Path(cfg.out), "--out")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    meta = {
        "command": " ".join(["plsh", *sys.argv[1:]]) if sys.argv[0].endswith("plsh") else "plsh bench (API)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "dtype": cfg.dtype,
        "causal": cfg.causal,
        "scheme": cfg.scheme,
        "seed": cfg.seed,
        _PEAK32: round(gemm_peak(torch.float32), 1),
        _PEAK16: round(gemm_peak(torch.bfloat16), 2),
    }
    rows: list[BenchRow] = []
    paths: list[Path] = []
    for n in cfg.lengths:  # one length at a time, writing the outputs after each: long runs keep partial results
        rows += run_benchmark(dataclasses.replace(cfg, lengths=(n,)))
        paths = write_outputs(rows, Path(cfg.out), meta)
    print(format_table(rows, _peak(meta)))
    print(f"GEMM peaks ({torch.get_num_threads()} threads): fp32 {meta[_PEAK32]} GFLOP/s, bf16 {meta[_PEAK16]} GFLOP/s")
    for a, b, e in growth_exponents(rows):
        print(f"plsh T=8 fwd time growth {a}->{b}: n^{e:.2f}")
    for path in paths:
        print(f"wrote {path}")
    return rows


def register_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``plsh bench`` to the ``plsh`` command line."""
    help = "time/memory/error of positional LSH vs exact and windowed ALiBi"
    add_command(sub, "bench", BenchConfig, run_bench_command, help=help)
