"""The cost of the slope gradients, in two parts (docs/implementation.md, "Gradients" and "Learning the slopes").

    python benchmarks/slope_grad_bench.py                             # both parts, their defaults
    python benchmarks/slope_grad_bench.py exact --repeats 9 --json out.json
    python benchmarks/slope_grad_bench.py surrogate --n 2048 --repeats 9 --json out.json

``exact`` — the exact slope / decay-parameter gradient: ``alibi_attention`` and ``decay_attention``'s backward with
and without a parameter that requires grad (exact n = 1024, 2048; window 128 at 4096; the power decay at 1024). For
each configuration two forwards are recorded, one with the slopes (parameters) requiring grad and one without; then
their backwards (``torch.autograd.grad`` of ``q, k, v`` and, for the first, the parameters, on the retained graph) are
timed alternately (interleaved, so that the machine's load affects both alike): the medians over the repeats and
their ratio, measured in the same run. The default backend (torch's CPU flash op for ``dq, dk, dv``; the parameter
pass is math).

``surrogate`` — positional LSH's surrogate slope gradient: the estimator's backward with and without ``dist_grad``
(default n = 1024, 4096; T = 8; both methods). One forward per configuration (``ops._engine.routing.plan`` /
``forward``),
then ``ops._engine.engine.backward`` on the same saved tensors, without and with ``dist_grad`` in adjacent pairs (the
order
alternating from pair to pair, so that the machine's load affects both alike): the medians over the repeats, and the
median of the pairs' ratios (with / without), measured in the same run; the ratios' quartiles show the spread.
``"discrete"`` partitions, torch's CPU flash op.

Both: batch 1, H = 4 query heads (the standard ALiBi slopes), d = 64, float32, causal, the default threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from positional_lsh import alibi_attention, alibi_slopes, decay_attention, sample_partitions
from positional_lsh.ops._engine import engine, routing

H, D = 4, 64
EXACT_CONFIGS = [("alibi", 1024, None), ("alibi", 2048, None), ("alibi", 4096, 128.0), ("power", 1024, None)]


def time_pairs(run: Callable[[bool], object], repeats: int, *, alternate: bool) -> dict[bool, list[float]]:
    """Seconds of ``run(False)`` and ``run(True)`` over ``repeats`` adjacent pairs: each pair in the order ``(False,
    True)``, or with ``alternate`` the order alternating from pair to pair. No warm-up (the caller's)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(repeats):
        for flag in (True, False) if alternate and r % 2 else (False, True):
            t0 = time.perf_counter()
            run(flag)
            times[flag].append(time.perf_counter() - t0)
    return times


def _call(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, param: torch.Tensor,
          window: float | None) -> torch.Tensor:  # fmt: skip
    if op == "alibi":
        return alibi_attention(q, k, v, param, window=window)
    return decay_attention(q, k, v, op, param)


def measure_exact(op: str, n: int, window: float | None, repeats: int) -> dict[str, float | int | str | None]:
    """One ``exact`` row: the backward of ``op`` (``"alibi"`` or a decay family) without and with the parameter."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_() for _ in range(3))
    values = alibi_slopes(H)[:, None] if op == "alibi" else torch.tensor([[0.5, 1.0]]).expand(H, 2)
    values = values.reshape(H) if op == "alibi" else values.contiguous()
    fixed, learned = values.clone(), values.clone().requires_grad_()
    outs = {False: _call(op, q, k, v, fixed, window), True: _call(op, q, k, v, learned, window)}
    assert torch.equal(outs[False], outs[True])
    dout = torch.randn(outs[False].shape, generator=g)
    inputs = {False: (q, k, v), True: (q, k, v, learned)}

    def run(flag: bool) -> object:
        return torch.autograd.grad(outs[flag], inputs[flag], dout, retain_graph=True)

    for flag in (False, True):  # warm-up
        run(flag)
    times = time_pairs(run, repeats, alternate=False)
    plain, with_param = statistics.median(times[False]), statistics.median(times[True])
    return {
        "op": op, "n": n, "window": window, "repeats": repeats, "backward_s": plain, "backward_param_s": with_param,
        "ratio": with_param / plain,
    }  # fmt: skip


def measure_surrogate(n: int, t: int, method: str, repeats: int) -> dict[str, float | int | str]:
    """One ``surrogate`` row: ``engine.backward`` without and with ``dist_grad`` for ``T = t`` samples."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for _ in range(3))
    parts = sample_partitions(n, alibi_slopes(H), t, generator=0)
    route = routing.dispatch(q, causal=True, scale=None, backend="auto", method=method)
    p = routing.plan(route, parts, H, n, q.device)
    out, lse, inputs = engine.forward(p, q, k, v)
    saved = (*inputs, out, lse)
    dout = torch.randn(out.shape, generator=g)

    def run(flag: bool) -> object:
        return engine.backward(p, saved, dout, dist_grad=flag)

    run(True)  # warm-up
    times = time_pairs(run, repeats, alternate=True)
    plain, with_dist = statistics.median(times[False]), statistics.median(times[True])
    ratios = [b / a for a, b in zip(times[False], times[True], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "n": n, "T": t, "method": p.method, "repeats": repeats, "backward_s": plain, "backward_dist_s": with_dist,
        "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
    }  # fmt: skip


def print_table(header: str, rule: str, rows: Iterable[dict[str, Any]], line: Callable[[dict[str, Any]], str]
                ) -> list[dict[str, Any]]:  # fmt: skip
    """Print a markdown table, ``header`` and ``rule`` then ``line(row)`` for each row as it is measured; the rows."""
    print(header)
    print(rule)
    out = []
    for row in rows:
        out.append(row)
        print(line(row), flush=True)
    return out


def run_exact(repeats: int, json_path: str | None) -> None:
    """The ``exact`` part: its table on stdout; ``json_path``: also the rows, as a list."""
    rows = print_table(
        "| op | n | window | backward (s) | backward + parameter grad (s) | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
        (measure_exact(op, n, window, repeats) for op, n, window in EXACT_CONFIGS),
        lambda r: f"| {r['op']} | {r['n']} | {r['window'] or '-'} | {r['backward_s']:.3f} | "
                  f"{r['backward_param_s']:.3f} | {r['ratio']:.2f} |",
    )  # fmt: skip
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


def run_surrogate(ns: list[int], ts: list[int], methods: list[str], repeats: int, json_path: str | None) -> None:
    """The ``surrogate`` part: its table on stdout; ``json_path``: also the rows, with the threads and torch version."""
    rows = print_table(
        "| n | T | method | backward (s) | backward + slope grad (s) | ratio (median of pairs) | ratio quartiles |",
        "|---:|---:|---|---:|---:|---:|---:|",
        (measure_surrogate(n, t, method, repeats) for n in ns for t in ts for method in methods),
        lambda r: f"| {r['n']} | {r['T']} | {r['method']} | {r['backward_s']:.3f} | {r['backward_dist_s']:.3f} | "
                  f"{r['ratio']:.2f}x | {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f} |",
    )  # fmt: skip
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", help="one part (default: both, with their defaults)")
    exact = sub.add_parser("exact", help="the exact slope / decay-parameter gradient")
    exact.add_argument("--repeats", type=int, default=7)
    exact.add_argument("--json", default=None, help="also write the rows to this file")
    sur = sub.add_parser("surrogate", help="positional LSH's surrogate slope gradient")
    sur.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    sur.add_argument("--T", type=int, nargs="+", default=[8])
    sur.add_argument("--methods", nargs="+", default=["samples", "multiplicity"])
    sur.add_argument("--repeats", type=int, default=15)
    sur.add_argument("--json", default=None, help="also write the rows to this file")
    args: Any = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for i, a in enumerate([args] if args.part else [parser.parse_args([part]) for part in ("exact", "surrogate")]):
        if i:
            print()
        if a.part == "exact":
            run_exact(a.repeats, a.json)
        else:
            run_surrogate(a.n, a.T, a.methods, a.repeats, a.json)


if __name__ == "__main__":
    main()
