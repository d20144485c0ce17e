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
* ``plsh`` — :func:`~positional_lsh.plsh_attention` with ``T`` samples (default scheme ``discrete``).

Times are medians over repeats (one run when a single call exceeds ``--long-seconds``), excluding compilation
and mask construction. Peak memory is the growth of the process's peak resident set (``VmHWM``, reset before
each call) beyond what was resident before it: the inputs are excluded, outputs and workspace included.
Relative error is ``||out - exact||_F / ||exact||_F`` against ``flex-exact`` (or ``sdpa-mask``) of the same run.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
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

import torch
from tqdm.auto import tqdm

from positional_lsh.ops.attention import plsh_attention
from positional_lsh.ops.reference import alibi_attention, alibi_bias
from positional_lsh.ops.sampling import sample_partitions
from positional_lsh.ops.slopes import alibi_slopes

__all__ = ["BenchRow", "register_cli", "run_benchmark"]

ALL_METHODS = ("flex-exact", "sdpa-mask", "flex-window", "alibi-chunked", "window-chunked", "plsh")
DEFAULT_METHODS = ("flex-exact", "sdpa-mask", "flex-window", "plsh")


@dataclass
class BenchRow:
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


# --------------------------------------------------------------------------------------------- memory


def _status_kib(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"{key}:\s+(\d+)", text)
    return int(m.group(1)) if m else None


def _reset_peak() -> int | None:
    """Release freed heap memory, reset the peak RSS and return the current RSS (KiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kib("VmRSS")


def _peak_since(base: int | None) -> float:
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
        base = _reset_peak()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        peak = max(peak, _peak_since(base))
        if times[-1] > long_seconds:
            break
    return times, peak, out


# -------------------------------------------------------------------------------------------- methods


def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def band_block_mask(
    n: int, window: torch.Tensor | None, *, causal: bool, mask_mod: Callable[..., torch.Tensor], block: int = 128
) -> object:
    """FlexAttention ``BlockMask`` for keys with ``|i - j| <= window[h]`` (and ``j <= i`` when causal).

    Built from the band's geometry in ``O(H (n / block)^2)`` memory. torch's ``create_block_mask`` evaluates
    ``mask_mod`` on the whole ``n x n`` grid (with int64 intermediates: 16 GiB per head at n = 131072), which
    does not fit at the lengths this benchmark covers. ``window=None`` is the plain (causal) mask, one head.
    Blocks wholly inside the band are "full" (no ``mask_mod`` call); blocks that cut its edges are partial.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nb = -(-n // block)
    lo = torch.arange(nb, dtype=torch.float64) * block  # first position of each block
    hi = torch.clamp(lo + block - 1, max=n - 1)  # last position
    w = torch.full((1,), math.inf, dtype=torch.float64) if window is None else window.double().reshape(-1)
    w = w[:, None, None]
    qlo, qhi = lo[None, :, None], hi[None, :, None]
    klo, khi = lo[None, None, :], hi[None, None, :]
    if causal:  # 0 <= i - j <= w
        any_ = (qhi - klo >= 0) & (qlo - khi <= w)
        all_ = (qlo - khi >= 0) & (qhi - klo <= w)
    else:  # |i - j| <= w
        any_ = (qlo - khi <= w) & (klo - qhi <= w)
        all_ = (qhi - klo <= w) & (khi - qlo <= w)
    if n % block:  # a short last block is left to mask_mod (partial), never trusted as full
        all_[:, -1, :] = False
        all_[:, :, -1] = False
    partial = any_ & ~all_
    full = all_

    def pack(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = sel.sum(-1).to(torch.int32)
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return count[None], order[None]

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(n, n)
    )


def _rel_err(out: torch.Tensor, exact: torch.Tensor | None) -> float | None:
    if exact is None:
        return None
    return float((out.double() - exact.double()).norm() / exact.double().norm())


AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Method:
    name: str
    samples: int | None
    fn: AttnFn
    can_backward: bool
    note: str = ""


def _methods_for_length(
    n: int,
    methods: tuple[str, ...],
    samples: tuple[int, ...],
    slopes: torch.Tensor,
    window: torch.Tensor,
    *,
    causal: bool,
    dtype: torch.dtype,
    scheme: str,
    seed: int,
    flex: tuple | None,
    sdpa_fits: bool,
    window_factor: float,
) -> list[_Method]:
    """The attention callables to measure at length ``n``; exact peers first (they define the error)."""
    out: list[_Method] = []
    sl = slopes.to(dtype)
    win = window.to(torch.int64)

    def alibi_mod(score, b, h, qi, ki):  # FlexAttention's signature
        return score - sl[h] * (qi - ki).abs()

    def causal_mask(b, h, qi, ki):
        return qi >= ki

    def window_mask(b, h, qi, ki):
        near = (qi - ki).abs() <= win[h]
        return near & (qi >= ki) if causal else near

    if "flex-exact" in methods and flex is not None:
        compiled, _ = flex
        bm = band_block_mask(n, None, causal=True, mask_mod=causal_mask) if causal else None
        out.append(
            _Method("flex-exact", None, lambda a, b, c: compiled(a, b, c, score_mod=alibi_mod, block_mask=bm), False)
        )
    if "sdpa-mask" in methods and sdpa_fits:
        # (1, H, n, n): a 4-D mask lets SDPA use torch's fused CPU kernel (a 3-D one falls back to the math
        # path, which materializes the scores and is several times slower).
        mask = alibi_bias(n, n, slopes, causal=causal, dtype=dtype)[None]
        mib = mask.numel() * mask.element_size() / 2**20
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out.append(
            _Method("sdpa-mask", None, lambda a, b, c: sdpa(a, b, c, attn_mask=mask), True, f"+{mib:.0f} MiB mask")
        )
    if "alibi-chunked" in methods:
        out.append(
            _Method("alibi-chunked", None, lambda a, b, c: alibi_attention(a, b, c, slopes, causal=causal), True)
        )
    if "flex-window" in methods and flex is not None:
        compiled, _ = flex
        wbm = band_block_mask(n, window, causal=causal, mask_mod=window_mask)
        out.append(
            _Method(
                "flex-window",
                None,
                lambda a, b, c: compiled(a, b, c, score_mod=alibi_mod, block_mask=wbm),
                False,
                f"window {window_factor:g}*sigma",
            )
        )
    if "window-chunked" in methods:
        out.append(
            _Method(
                "window-chunked",
                None,
                lambda a, b, c: alibi_attention(a, b, c, slopes, causal=causal, window=window),
                True,
                f"window {window_factor:g}*sigma",
            )
        )
    if "plsh" in methods:
        for t in samples:
            parts = sample_partitions(n, slopes, t, scheme=scheme, generator=seed)

            def plsh_fn(a, b, c, parts=parts):
                return plsh_attention(a, b, c, partitions=parts, causal=causal)

            out.append(_Method("plsh", t, plsh_fn, True, scheme))
    return out


EXACT_METHODS = ("flex-exact", "sdpa-mask", "alibi-chunked")


def run_benchmark(
    lengths: list[int],
    *,
    samples: tuple[int, ...] = (1, 4, 8, 16),
    methods: tuple[str, ...] = DEFAULT_METHODS,
    num_heads: int = 8,
    head_dim: int = 64,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
    scheme: str = "discrete",
    window_factor: float = 12.0,
    backward: bool = True,
    repeats: int = 3,
    long_seconds: float = 20.0,
    sdpa_max_gib: float = 20.0,
    backward_max_len: int = 1 << 17,
    seed: int = 0,
    progress: bool = True,
) -> list[BenchRow]:
    """Measure every method at every length; see the module docstring. Returns one row per measurement."""
    unknown = set(methods) - set(ALL_METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; expected some of {ALL_METHODS}")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive integers, got {lengths}")
    slopes = alibi_slopes(num_heads)
    window = window_factor / slopes.double()
    flex = _flex() if {"flex-exact", "flex-window"} & set(methods) else None
    rows: list[BenchRow] = []
    per_length = len([m for m in methods if m != "plsh"]) + len(samples) * ("plsh" in methods)
    bar = tqdm(total=len(lengths) * per_length, desc="plsh bench", disable=not progress)
    for n in lengths:
        if flex is not None:
            # Each length compiles FlexAttention anew (static shapes); forget earlier lengths so that torch's
            # recompile limit is never hit (past it, flex_attention silently runs unfused and materializes n x n).
            torch._dynamo.reset()
        g = torch.Generator().manual_seed(seed + n)
        q, k, v, grad = (torch.randn(1, num_heads, n, head_dim, generator=g).to(dtype) for _ in range(4))
        mask_gib = num_heads * n * n * q.element_size() / 2**30
        # The prebuilt mask dominates SDPA's memory (the fused kernel never materializes the scores).
        sdpa_fits = mask_gib * 1.25 <= sdpa_max_gib
        exact: torch.Tensor | None = None
        todo = _methods_for_length(
            n,
            methods,
            samples,
            slopes,
            window,
            causal=causal,
            dtype=dtype,
            scheme=scheme,
            seed=seed,
            flex=flex,
            sdpa_fits=sdpa_fits,
            window_factor=window_factor,
        )
        bar.update(per_length - len(todo))  # methods that do not run at this length
        for m in todo:
            bar.set_postfix_str(f"n={n} {m.name}{'' if m.samples is None else f' T={m.samples}'}")
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*flex_attention called without torch.compile")
                if m.name.startswith("flex"):
                    m.fn(q, k, v)  # compile for this shape, outside the timing
                times, peak, out = _measure(lambda m=m, q=q, k=k, v=v: m.fn(q, k, v), repeats, long_seconds)
            assert out is not None
            if m.name in EXACT_METHODS and exact is None:
                exact = out
            err = None if m.name in EXACT_METHODS else _rel_err(out, exact)
            rows.append(
                BenchRow(m.name, n, m.samples, "fwd", statistics.median(times), len(times), peak, err, m.note, times)
            )
            del out
            if backward and m.can_backward and n <= backward_max_len:
                qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))

                def fwd_bwd(m: _Method = m, qq=qq, kk=kk, vv=vv, grad=grad) -> None:
                    qq.grad = kk.grad = vv.grad = None
                    torch.autograd.backward(m.fn(qq, kk, vv), grad)

                times, peak, _ = _measure(fwd_bwd, repeats, long_seconds)
                rows.append(
                    BenchRow(
                        m.name, n, m.samples, "fwd+bwd", statistics.median(times), len(times), peak, None, m.note, times
                    )
                )
                del qq, kk, vv
            bar.update(1)
        del todo, exact
    bar.close()
    return rows


# ------------------------------------------------------------------------------------------- reporting


def _ratio_rows(rows: list[BenchRow]) -> list[dict[str, object]]:
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


def format_table(rows: list[BenchRow]) -> str:
    lines = [
        "| method | T | n | pass | median s | runs | peak MiB | rel. error | × vs flex-exact (fwd) | × vs sdpa-mask |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in _ratio_rows(rows):

        def f(x: object, spec: str) -> str:
            return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

        lines.append(
            f"| {d['method']} | {d['samples'] or ''} | {d['seq_len']} | {d['mode']} | {d['seconds']:.4f} "
            f"| {d['repeats']} | {f(d['peak_mib'], '.0f')} | {f(d['rel_error'], '.3g')} "
            f"| {f(d['speedup_vs_flex-exact'], '.1f')} | {f(d['speedup_vs_sdpa-mask'], '.1f')} |"
        )
    return "\n".join(lines)


def growth_exponents(
    rows: list[BenchRow], method: str = "plsh", samples: int = 8, mode: str = "fwd"
) -> list[tuple[int, int, float]]:
    """Log-log slope of time vs n between consecutive lengths."""
    pts = sorted((r.seq_len, r.seconds) for r in rows if r.method == method and r.samples == samples and r.mode == mode)
    return [(a[0], b[0], math.log(b[1] / a[1]) / math.log(b[0] / a[0])) for a, b in itertools.pairwise(pts)]


def write_outputs(rows: list[BenchRow], out_dir: Path, meta: dict[str, object]) -> list[Path]:
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
    md.write_text(
        "# plsh bench\n\n" + "".join(f"- {k}: {v}\n" for k, v in meta.items()) + "\n" + format_table(rows) + "\n"
    )
    written.append(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd"), strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r.mode == mode:
                label = r.method if r.samples is None else f"{r.method} T={r.samples}"
                series.setdefault(label, []).append((r.seq_len, r.seconds))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=label,
                linestyle="--" if "plsh" not in label else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"{mode}, H={meta.get('heads')}, d={meta.get('head_dim')}, {meta.get('dtype')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = out_dir / "bench.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    written.append(png)
    return written


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = tuple(args.methods.split(","))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
    meta = {
        "command": " ".join(["plsh", *sys.argv[1:]]) if sys.argv[0].endswith("plsh") else "plsh bench (API)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "causal": not args.bidirectional,
        "scheme": args.scheme,
        "seed": args.seed,
    }
    rows: list[BenchRow] = []
    for n in args.lengths:  # one length at a time, writing the outputs after each: long runs keep partial results
        rows += run_benchmark(
            [n],
            samples=tuple(args.samples),
            methods=methods,
            num_heads=args.heads,
            head_dim=args.head_dim,
            causal=not args.bidirectional,
            dtype=dtype,
            scheme=args.scheme,
            backward=not args.no_backward,
            repeats=args.repeats,
            long_seconds=args.long_seconds,
            sdpa_max_gib=args.sdpa_max_gib,
            seed=args.seed,
            backward_max_len=args.backward_max_len,
        )
        paths = write_outputs(rows, Path(args.out), meta)
    print(format_table(rows))
    for a, b, e in growth_exponents(rows):
        print(f"plsh T=8 fwd time growth {a}->{b}: n^{e:.2f}")
    for path in paths:
        print(f"wrote {path}")
    return 0


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time/memory/error of positional LSH vs exact and windowed ALiBi")
    p.add_argument(
        "--lengths",
        type=_int_list,
        default=[1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072],
        help="sequence lengths n, comma-separated (default 1k ... 128k)",
    )
    p.add_argument("--samples", type=_int_list, default=[1, 4, 8, 16], help="T values for plsh")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, from {ALL_METHODS}")
    p.add_argument("--heads", type=int, default=8, help="attention heads H (standard ALiBi slopes)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension d")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--scheme", default="discrete", help="positional-LSH sampling scheme")
    p.add_argument("--bidirectional", action="store_true", help="non-causal attention")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--backward-max-len", type=int, default=1 << 17, help="longest n timed with a backward")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median reported)")
    p.add_argument("--long-seconds", type=float, default=20.0, help="run once when a call takes longer")
    p.add_argument(
        "--sdpa-max-gib",
        type=float,
        default=20.0,
        help="skip sdpa-mask where its (H, n, n) float mask (plus 25%%) would exceed this many GiB",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and the partitions")
    p.add_argument("--out", default="runs/bench", help="output directory (bench.csv, bench.md, bench.png)")
    p.set_defaults(func=_main)
