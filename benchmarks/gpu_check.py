"""One prepared device check for one H200: correctness on the GPU against the float64 CPU oracle, then speed.

    python benchmarks/gpu_check.py                  # the whole check, inside --budget seconds (default 420)
    python benchmarks/gpu_check.py --budget 120 --lengths 8192,16384 --samples 8    # a shorter one

1. **Correctness** (small n): every backend and method of :func:`~positional_lsh.plsh_attention` (``auto``,
   ``flash``, ``math``, ``triton`` × ``auto``, ``samples``, ``multiplicity``, where the backend takes the method),
   forward and the gradients of ``q, k, v``, in bfloat16, float16 and float32, with GQA (4 query heads over 2),
   causal and bidirectional, chunked prefill (``Lq < Lk``) and one decoding step (``Lq = 1``), against
   :func:`~positional_lsh.dense_plsh_attention` in float64 on the CPU on the same inputs. The error is
   ``max |got - want| / max(1, max |want|)``; each row also records how the call was routed (the engine's
   ``dispatch`` and ``plan``: method and kernel).
2. **Slope gradient** (same shapes and dtypes): the surrogate gradient of learned slopes (``plsh_attention(...,
   slopes=<tensor requiring grad>)``, ``slopes.grad = -sum dS |i - j|``) through every backend and method, the
   Triton route's computed inside its ``dq`` kernel, against the torch multiplicity backend (``backend="math",
   method="multiplicity"``) in float64 on the CPU on the same inputs and partitions; same normalized error, the
   gradient tolerance of the dtype.
3. **Speed**: H = 32, d = 128, bf16, causal, n = 8k ... 128k, T in {8, 64}, forward and forward + backward:
   positional LSH (``plsh``: the defaults, ``backend="auto", method="auto"``; ``plsh-triton``: ``backend="triton"``;
   ``plsh-triton-slopes``: the same with learned slopes, forward + backward only: the backward's cost of the slope
   gradient is its time over ``plsh-triton``'s, the ratio in ``gpu_check.md``)
   against FlexAttention exact causal ALiBi (``score_mod``), FlexAttention windowed ALiBi (band block mask,
   ``12 sigma``) and SDPA restricted to the flash backend (``is_causal``, no bias: exact causal attention's speed of
   light). Medians of ``--repeats`` calls after a warm-up, ``torch.cuda.synchronize``; TFLOP/s on the useful pairs
   (``4 d`` flops per pair forward, ``x 3.5`` forward + backward; the pair counts of ``plsh bench``: the union of a
   row's blocks for positional LSH, the band for windowed ALiBi, the causal triangle for exact attention).

Writes ``gpu_check.md`` (the tables and the settings) and ``gpu_check.csv`` to ``--out``. Stops cleanly at its time
budget: a case that would not finish in the time left (estimated from the same case at the previous length) is
recorded as ``skipped (budget)``, and the files are written either way; the lengths run in the order given (by
default n = 131072, where the targets are, then 8k ... 64k). Runs on the CPU too (``--device cpu``, tiny
sizes: what ``tests/test_benchmarks.py`` runs; FlexAttention there is forward-only and, with
``--no-compile``, eager; the Triton rows need ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from positional_lsh import alibi_slopes, dense_plsh_attention, plsh_attention, sample_partitions
from positional_lsh.cli.bench_peers import band_block_mask, band_pairs, union_pairs, useful_gflops
from positional_lsh.ops._engine import routing

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Correctness tolerances on the normalized error, per input dtype: forward, gradients.
TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.float16: (5e-3, 2e-2), torch.bfloat16: (4e-2, 1e-1)}
COMBOS = (
    ("auto", "auto"), ("auto", "samples"), ("auto", "multiplicity"), ("flash", "samples"), ("flash", "multiplicity"),
    ("math", "samples"), ("math", "multiplicity"), ("triton", "multiplicity"),
)  # fmt: skip
"""``(backend, method)`` pairs of the correctness section (``triton`` takes the multiplicity form only)."""


@dataclass
class Row:
    """One line of the CSV (both sections)."""

    section: str
    case: str
    dtype: str
    backend: str = ""
    method: str = ""
    route: str = ""
    causal: bool = True
    shape: str = ""
    samples: int | None = None
    seq_len: int | None = None
    mode: str = ""
    seconds: float | None = None
    tflops: float | None = None
    error: float | None = None
    tolerance: float | None = None
    status: str = ""


@dataclass
class Budget:
    """Seconds from the start; ``left()`` is what remains."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _triton_ok(device: torch.device) -> bool:
    from positional_lsh.ops._engine.triton.host import triton_refusal

    return triton_refusal(torch.empty(1, 1, 1, 64, device=device, dtype=torch.bfloat16)) is None


def _route(q: torch.Tensor, k: torch.Tensor, parts: object, causal: bool, backend: str, method: str) -> str:
    """How the engine runs this call: ``method/kernel`` after the plan (``method="auto"`` resolved)."""
    route = routing.dispatch(q, causal=causal, scale=None, backend=backend, method=method)
    plan = routing.plan(route, parts, k.shape[1], q.shape[2], q.device)
    return f"{plan.method}/{plan.kernel}"


def _normalized(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).abs().max()) / max(1.0, float(want.abs().max()))


CHECK_HQ, CHECK_HKV = 4, 2  # the correctness sections' query and key/value heads


def _check_inputs(
    args: argparse.Namespace, seed: int
) -> Iterator[tuple[str, int, int, bool, tuple[torch.Tensor, ...]]]:
    """The correctness sections' cases ``(name, Lq, Lk, causal, (q, k, v, dout))``, float64 on the CPU, batch 2: a
    causal and a bidirectional prefill of ``--check-len``, a causal chunk of a quarter of it and one decoded query,
    their tensors drawn in that order from one generator seeded ``seed``."""
    n, d, hq, hkv = args.check_len, args.check_dim, CHECK_HQ, CHECK_HKV
    g = torch.Generator().manual_seed(seed)
    for name, lq, lk, causal in (("prefill", n, n, True), ("prefill", n, n, False), ("chunk", n // 4, n, True),
                                 ("decode", 1, n, True)):  # fmt: skip
        base = tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in
                     ((2, hq, lq, d), (2, hkv, lk, d), (2, hkv, lk, d), (2, hq, lq, d)))  # fmt: skip
        yield name, lq, lk, causal, base


def _unrunnable(budget: Budget, backend: str, triton_ok: bool) -> str | None:
    """Why a correctness row is skipped (the budget is spent, or Triton cannot run here), or ``None``."""
    if budget.left() <= 0:
        return "skipped (budget)"
    if backend == "triton" and not triton_ok:
        return "skipped (triton cannot run here)"
    return None


def correctness(args: argparse.Namespace, device: torch.device, budget: Budget) -> list[Row]:
    """The correctness section (see the module docstring)."""
    rows: list[Row] = []
    d, hq, hkv = args.check_dim, CHECK_HQ, CHECK_HKV
    triton_ok = _triton_ok(device)
    for name, lq, lk, causal, (q64, k64, v64, dout) in _check_inputs(args, seed=0):
        parts = sample_partitions(lk, alibi_slopes(hq), args.check_samples, generator=1)
        ref_in = tuple(x.clone().requires_grad_() for x in (q64, k64, v64))
        want = dense_plsh_attention(*ref_in, parts, causal=causal)
        want_grads = torch.autograd.grad(want, ref_in, dout)
        want = want.detach()
        for dtype_name in args.check_dtypes:
            dtype = _DTYPES[dtype_name]
            tol_out, tol_grad = TOLERANCE[dtype]
            for backend, method in COMBOS:
                case = f"{name} {lq}x{lk}"
                row = Row("correctness", case, dtype_name, backend, method, causal=causal,
                          shape=f"B=2 Hq={hq} Hkv={hkv} d={d}", samples=args.check_samples, seq_len=lk)  # fmt: skip
                reason = _unrunnable(budget, backend, triton_ok)
                if reason is None and backend == "flash" and device.type not in ("cpu", "cuda"):
                    reason = "skipped (no flash op on this device)"
                if reason:
                    rows.append(_skip(row, reason))
                    continue
                x = [t.to(device, dtype).requires_grad_() for t in (q64, k64, v64)]
                try:
                    row.route = _route(x[0], x[1], parts, causal, backend, method)
                except ValueError as exc:  # a forced backend the inputs refuse (e.g. flash on CUDA for float32)
                    rows.append(_skip(row, f"refused up front ({str(exc)[:80]})"))
                    continue
                try:
                    out = plsh_attention(*x, partitions=parts, causal=causal, backend=backend, method=method)
                    grads = torch.autograd.grad(out, x, dout.to(device, dtype))
                    _sync(device)
                except Exception as exc:  # a failure is a finding: record it and go on
                    rows.append(_skip(row, f"FAIL ({type(exc).__name__}: {str(exc)[:80]})"))
                    continue
                err_out = _normalized(out, want)
                err_grad = max(_normalized(a, b) for a, b in zip(grads, want_grads, strict=True))
                ok = err_out <= tol_out and err_grad <= tol_grad
                row.error, row.tolerance = max(err_out / tol_out, err_grad / tol_grad), 1.0
                row.status = (f"{'ok' if ok else 'FAIL'} (out {err_out:.1e} of {tol_out:g}, "
                              f"grad {err_grad:.1e} of {tol_grad:g})")  # fmt: skip
                rows.append(row)
                print(f"{row.case} {row.dtype} {backend}/{method} -> {row.route}: {row.status}", flush=True)
    return rows


def slope_correctness(args: argparse.Namespace, device: torch.device, budget: Budget) -> list[Row]:
    """The slope-gradient section (see the module docstring): one row per shape, dtype and (backend, method)."""
    rows: list[Row] = []
    d, hq, hkv = args.check_dim, CHECK_HQ, CHECK_HKV
    triton_ok = _triton_ok(device)
    slopes = alibi_slopes(hq)
    for name, lq, lk, causal, (q64, k64, v64, dout) in _check_inputs(args, seed=1):
        parts = sample_partitions(lk, slopes, args.check_samples, generator=1)
        want = _slope_grad(q64, k64, v64, dout, parts, slopes.double(), causal, "math", "multiplicity")
        for dtype_name in args.check_dtypes:
            dtype = _DTYPES[dtype_name]
            tol = TOLERANCE[dtype][1]
            for backend, method in COMBOS:
                row = Row("slope-grad", f"{name} {lq}x{lk}", dtype_name, backend, method, causal=causal,
                          shape=f"B=2 Hq={hq} Hkv={hkv} d={d}", samples=args.check_samples, seq_len=lk)  # fmt: skip
                reason = _unrunnable(budget, backend, triton_ok)
                if reason:
                    rows.append(_skip(row, reason))
                    continue
                x = [t.to(device, dtype) for t in (q64, k64, v64, dout)]
                try:
                    row.route = _route(x[0], x[1], parts, causal, backend, method)
                except ValueError as exc:  # a forced backend the inputs refuse (e.g. flash on CUDA for float32)
                    rows.append(_skip(row, f"refused up front ({str(exc)[:80]})"))
                    continue
                try:
                    got = _slope_grad(*x, parts, slopes.to(device), causal, backend, method)
                    _sync(device)
                except Exception as exc:  # a failure is a finding: record it and go on
                    rows.append(_skip(row, f"FAIL ({type(exc).__name__}: {str(exc)[:80]})"))
                    continue
                err = _normalized(got, want)
                row.error, row.tolerance = err, tol
                row.status = f"{'ok' if err <= tol else 'FAIL'} (slopes {err:.1e} of {tol:g})"
                rows.append(row)
                print(f"slopes {row.case} {row.dtype} {backend}/{method} -> {row.route}: {row.status}", flush=True)
    return rows


def _slope_grad(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, parts: object, slopes: torch.Tensor,
    causal: bool, backend: str, method: str,
) -> torch.Tensor:  # fmt: skip
    """``slopes.grad`` of one call (the surrogate), ``slopes`` a leaf requiring grad."""
    s = slopes.clone().requires_grad_()
    out = plsh_attention(q, k, v, slopes=s, partitions=parts, causal=causal, backend=backend, method=method)
    (grad,) = torch.autograd.grad(out, (s,), dout)
    return grad


def _skip(row: Row, status: str) -> Row:
    row.status = status
    return row


@contextlib.contextmanager
def _flash_only(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        yield


Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


Case = tuple[str, int | None, Fn, int, bool, tuple[torch.Tensor, ...]]
"""``(name, T, fn, useful pairs, has a backward here, further leaves the backward differentiates)``."""


def speed_cases(n: int, args: argparse.Namespace, device: torch.device) -> list[Case]:
    """The speed cases at length ``n`` (:data:`Case`)."""
    slopes = alibi_slopes(args.heads)
    window = args.window_factor / slopes.double()
    sl, win = slopes.to(device), window.to(torch.int64).to(device)
    out: list[Case] = []
    triton_ok = _triton_ok(device)
    for t in args.samples:
        parts = sample_partitions(n, slopes, t, generator=args.seed)
        pairs = union_pairs(parts, causal=True)
        out.append(("plsh", t, lambda a, b, c, p=parts: plsh_attention(a, b, c, partitions=p), pairs, True, ()))
        if triton_ok:
            fn = lambda a, b, c, p=parts: plsh_attention(a, b, c, partitions=p, backend="triton")  # noqa: E731
            out.append(("plsh-triton", t, fn, pairs, True, ()))
            learned = sl.clone().requires_grad_()  # the slopes' surrogate gradient in the dq kernel
            fn = lambda a, b, c, p=parts, s=learned: plsh_attention(  # noqa: E731
                a, b, c, slopes=s, partitions=p, backend="triton"
            )
            out.append(("plsh-triton-slopes", t, fn, pairs, True, (learned,)))
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
        out.append((name, None, fn, pairs, not cpu, ()))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def flash(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        with _flash_only(device):
            return sdpa(a, b, c, is_causal=True)

    out.append(("sdpa-flash", None, flash, exact, True, ()))
    return out


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device, cap: float) -> float:
    """Median of ``repeats`` calls after one warm-up; fewer repeats once the calls so far pass ``cap`` seconds."""
    fn()
    _sync(device)
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if sum(times) > cap:
            break
    return statistics.median(times)


def speed(args: argparse.Namespace, device: torch.device, budget: Budget) -> list[Row]:
    """The speed section (see the module docstring), in the order of ``--lengths``."""
    dtype = _DTYPES[args.dtype]
    rows: list[Row] = []
    last: dict[tuple[str, int | None, str], tuple[int, float]] = {}  # (case, T, mode) -> (n, seconds incl. warm-up)
    for n in args.lengths:
        torch._dynamo.reset()  # static shapes: one compilation per length, never the recompile limit
        g = torch.Generator().manual_seed(args.seed + n)
        if budget.left() <= 0:
            rows += [Row("speed", name, args.dtype, samples=t, seq_len=n, status="skipped (budget)")
                     for name, t in _names(args)]  # fmt: skip
            continue
        q, k, v, dout = (torch.randn(1, args.heads, n, args.dim, generator=g).to(device, dtype) for _ in range(4))
        for name, t, fn, pairs, can_backward, extra in speed_cases(n, args, device):
            for mode in ("fwd", "fwd+bwd"):
                row = Row("speed", name, args.dtype, causal=True, shape=f"H={args.heads} d={args.dim}", samples=t,
                          seq_len=n, mode=mode)  # fmt: skip
                if (mode == "fwd+bwd" and not can_backward) or (mode == "fwd" and extra):
                    continue  # no backward here; with learned slopes only the backward differs
                prev = last.get((name, t, mode))
                growth = 4.0 if name in ("flex-exact", "sdpa-flash") else 2.0
                estimate = 0.0 if prev is None else prev[1] * growth ** math.log2(n / prev[0])
                if budget.left() <= 0 or estimate > budget.left():
                    rows.append(_skip(row, "skipped (budget)"))
                    continue
                call = _forward_call(fn, q, k, v) if mode == "fwd" else _backward_call(fn, q, k, v, dout, extra)

                t0 = time.monotonic()
                try:
                    sec = _median_seconds(call, args.repeats, device, cap=max(0.0, budget.left() / 4))
                except Exception as exc:  # out of memory, a compiler refusal: recorded, not fatal
                    rows.append(_skip(row, f"FAIL ({type(exc).__name__}: {str(exc)[:80]})"))
                    continue
                last[(name, t, mode)] = (n, time.monotonic() - t0)
                gf = useful_gflops(pairs, args.dim, sec, mode)
                row.seconds, row.tflops, row.status = sec, None if gf is None else gf / 1000, "ok"
                rows.append(row)
                print(f"n={n} {name} T={t} {mode}: {sec:.4f} s, {row.tflops or 0:.1f} useful TFLOP/s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _forward_call(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], object]:
    def call() -> object:
        with torch.no_grad():
            return fn(q, k, v)

    return call


def _backward_call(
    fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, extra: tuple[torch.Tensor, ...] = ()
) -> Callable[[], object]:
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))

    def call() -> object:
        return torch.autograd.grad(fn(qq, kk, vv), (qq, kk, vv, *extra), dout)

    return call


def _names(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    names: list[tuple[str, int | None]] = [
        (p, t) for t in args.samples for p in ("plsh", "plsh-triton", "plsh-triton-slopes")
    ]
    return [*names, ("flex-exact", None), ("flex-window", None), ("sdpa-flash", None)]


def slope_overheads(rows: list[Row]) -> list[str]:
    """``n, T: seconds with / without = ratio`` for every (n, T) where both Triton forward + backward rows ran."""
    timed = {(r.case, r.seq_len, r.samples): r.seconds for r in rows
             if r.section == "speed" and r.mode == "fwd+bwd" and r.status == "ok"}  # fmt: skip
    out = []
    for (case, n, t), sec in timed.items():
        plain = timed.get(("plsh-triton", n, t))
        if case == "plsh-triton-slopes" and sec is not None and plain:
            out.append(f"n={n} T={t}: {sec:.4f} s / {plain:.4f} s = {sec / plain:.3f}")
    return out


def write(rows: list[Row], out: Path, meta: dict[str, object]) -> list[Path]:
    """``gpu_check.md`` (settings, the correctness table, the speed table) and ``gpu_check.csv`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# GPU check", "", *(f"- {k}: {v}" for k, v in meta.items()), "", "## Correctness", ""]
    lines += ["| case | causal | dtype | backend | method | routed to | status |", "|" + " --- |" * 7]
    lines += [f"| {r.case} | {'yes' if r.causal else 'no'} | {r.dtype} | {r.backend} | {r.method} | {r.route} "
              f"| {r.status} |" for r in rows if r.section == "correctness"]  # fmt: skip
    lines += ["", "## Slope gradient", "", "| case | causal | dtype | backend | method | routed to | status |",
              "|" + " --- |" * 7]  # fmt: skip
    lines += [f"| {r.case} | {'yes' if r.causal else 'no'} | {r.dtype} | {r.backend} | {r.method} | {r.route} "
              f"| {r.status} |" for r in rows if r.section == "slope-grad"]  # fmt: skip
    lines += ["", "## Speed", "", "| case | T | n | pass | median s | useful TFLOP/s | status |", "|" + " --- |" * 7]
    lines += [f"| {r.case} | {r.samples or ''} | {r.seq_len} | {r.mode} | "
              f"{'' if r.seconds is None else f'{r.seconds:.4f}'} | {'' if r.tflops is None else f'{r.tflops:.1f}'} "
              f"| {r.status} |" for r in rows if r.section == "speed"]  # fmt: skip
    lines += ["", "Triton forward + backward with learned slopes over without (the slope gradient's cost):", ""]
    lines += [f"- {line}" for line in slope_overheads(rows)] or ["- not measured"]
    md, table = out / "gpu_check.md", out / "gpu_check.csv"
    md.write_text("\n".join(lines) + "\n")
    with table.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[f for f in asdict(Row("", "", ""))])
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    return [md, table]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check (default 420)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--check-len", type=int, default=192, help="keys of the correctness section")
    ap.add_argument("--check-dim", type=int, default=64)
    ap.add_argument("--check-samples", type=int, default=8)
    ap.add_argument("--check-dtypes", type=lambda s: tuple(s.split(",")), default=tuple(_DTYPES))
    # The target length first (issue 17's targets are at n = 131072), then the others shortest first.
    ap.add_argument("--lengths", type=ints, default=(131072, 8192, 16384, 32768, 65536))
    ap.add_argument("--samples", type=ints, default=(8, 64))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=tuple(_DTYPES), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window-factor", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-speed", dest="speed", action="store_false")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager FlexAttention (tests only)")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    return ap


def main(argv: list[str] | None = None) -> list[Row]:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    budget = Budget(args.budget)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "budget_s": args.budget,
            "command": "python benchmarks/gpu_check.py " + " ".join(argv)}  # fmt: skip
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = "not installed"
    rows = correctness(args, device, budget)
    rows += slope_correctness(args, device, budget)
    if args.speed:
        rows += speed(args, device, budget)
    meta["elapsed_s"] = f"{args.budget - budget.left():.0f}"
    for path in write(rows, args.out, meta):
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
