"""The benchmark scripts run tiny on the CPU. benchmarks/gpu_check.py, the prepared device check: its correctness
section (every backend and method against the float64 oracle; the Triton rows in Triton's interpreter), its speed
section's logic, its files, and that it stops cleanly at its time budget. What it measures on a GPU is not
tested here (no GPU). benchmarks/short_context.py: its defaults, its table and target lines, its pair counts, and
that its timed exact calls compute the same attention. benchmarks/short_step.py: its defaults, a tiny run's table and
target line, and that both timed calls differentiate."""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

TINY = ["--device", "cpu", "--check-len", "24", "--check-dim", "16", "--check-samples", "2", "--lengths", "48",
        "--samples", "2", "--heads", "2", "--dim", "16", "--repeats", "1", "--no-compile"]  # fmt: skip


@pytest.fixture
def gpu_check(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_h200_check(gpu_check):
    args = gpu_check.parser().parse_args([])
    assert (args.heads, args.dim, args.dtype, args.device) == (32, 128, "bfloat16", "cuda")
    assert args.lengths[0] == 131072 and set(args.lengths) == {8192, 16384, 32768, 65536, 131072}
    assert args.samples == (8, 64)
    assert args.budget <= 480 and set(args.check_dtypes) == {"bfloat16", "float16", "float32"}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton rows need the interpreter on CPU")
def test_runs_tiny_on_cpu(gpu_check, tmp_path):
    pytest.importorskip("triton")
    rows = gpu_check.main([*TINY, "--check-dtypes", "float32,bfloat16", "--out", str(tmp_path)])
    checks = [r for r in rows if r.section == "correctness"]
    assert len(checks) == 4 * 2 * len(gpu_check.COMBOS)  # shapes x dtypes x (backend, method)
    assert all(r.status.startswith("ok") for r in checks), [r.status for r in checks if not r.status.startswith("ok")]
    assert {r.route for r in checks if r.backend == "triton"} == {"multiplicity/triton"}
    assert {r.case.split()[0] for r in checks} == {"prefill", "chunk", "decode"}
    slopes = [r for r in rows if r.section == "slope-grad"]  # the surrogate slope gradient, every route
    assert len(slopes) == 4 * 2 * len(gpu_check.COMBOS)
    assert all(r.status.startswith("ok") for r in slopes), [r.status for r in slopes if not r.status.startswith("ok")]
    assert {r.route for r in slopes if r.backend == "triton"} == {"multiplicity/triton"}
    speed = {(r.case, r.mode) for r in rows if r.section == "speed" and r.status == "ok"}
    assert {("plsh", "fwd+bwd"), ("plsh-triton", "fwd+bwd"), ("sdpa-flash", "fwd+bwd"), ("flex-exact", "fwd")} <= speed
    assert ("plsh-triton-slopes", "fwd+bwd") in speed and ("plsh-triton-slopes", "fwd") not in speed
    assert ("flex-exact", "fwd+bwd") not in speed  # torch has no CPU backward for FlexAttention
    md, table = tmp_path / "gpu_check.md", tmp_path / "gpu_check.csv"
    text = md.read_text()
    assert "## Correctness" in text and "## Slope gradient" in text and "## Speed" in text
    assert "- n=48 T=2: " in text  # the slope gradient's cost: with / without
    with table.open() as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)


def test_stops_cleanly_at_its_budget(gpu_check, tmp_path, monkeypatch):
    # Budget spent after the first correctness row: every later case is recorded as skipped, the files are written.
    left = iter([1.0] + [0.0] * 10_000)
    monkeypatch.setattr(gpu_check.Budget, "left", lambda self: next(left))
    rows = gpu_check.main([*TINY, "--check-dtypes", "float32", "--out", str(tmp_path)])
    assert rows[0].status.startswith("ok") and all(r.status == "skipped (budget)" for r in rows[1:])
    assert any(r.section == "speed" for r in rows)
    assert "skipped (budget)" in (tmp_path / "gpu_check.md").read_text() and (tmp_path / "gpu_check.csv").exists()


# ---- benchmarks/short_context.py: its pieces at a tiny size -------------------------------------------------------


@pytest.fixture
def short_context(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "short_context.py"
    spec = importlib.util.spec_from_file_location("short_context", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "short_context", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_context_defaults_are_the_issue_shape(short_context):
    args = short_context.parser().parse_args([])
    assert (args.batch, args.heads, args.dim, args.samples, args.threads) == (2, 8, 64, 8, 1)
    assert args.lengths == [512, 1024, 2048, 4096]


def test_short_context_runs_tiny(short_context, capsys):
    threads = torch.get_num_threads()
    try:
        rows = short_context.main(["--lengths", "16,24", "--batch", "1", "--heads", "2", "--dim", "8",
                                   "--samples", "2", "--repeats", "1", "--gemm-size", "32"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert len(rows) == 2 * len(short_context.METHODS) * len(short_context.PASSES)
    assert {(r.method, r.mode) for r in rows} == {(m, p) for m in short_context.METHODS for p in short_context.PASSES}
    for r in rows:
        assert r.seconds > 0 and r.gflops > 0 and r.peak_pct > 0
        if r.method == "sdpa-mask":
            assert r.ratio == 1.0
        exact = r.n * (r.n + 1) // 2 * 2  # n (n + 1) / 2 pairs per head, 2 heads, batch 1
        assert (r.pairs == exact) if r.method in ("sdpa-mask", "alibi_attention") else (0 < r.pairs <= exact)
    text = capsys.readouterr().out
    assert "| n | method | pass |" in text and "% of GEMM peak" in text
    assert "- alibi_attention <= 1.1x sdpa-mask at n <= 24" in text and "plsh T=8 fresh" in text


def test_short_context_calls_compute_the_same_attention(short_context):
    """The timed exact calls agree: the library's exact op is SDPA with the prebuilt mask."""
    fns, _ = short_context.calls(40, 1, 2, 8, 2)
    torch.testing.assert_close(fns[("alibi_attention", "fwd")](), fns[("sdpa-mask", "fwd")](), rtol=0, atol=2e-6)
    a, b = fns[("alibi_attention", "fwd+bwd")](), fns[("sdpa-mask", "fwd+bwd")]()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


# ---- benchmarks/short_step.py: its defaults and a tiny run ----------------------------------------------------------


@pytest.fixture
def short_step(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "short_step.py"
    spec = importlib.util.spec_from_file_location("short_step", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "short_step", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_short_step_defaults_are_the_issue_shape(short_step):
    args = short_step.parser().parse_args([])
    assert (args.batch, args.heads, args.dim, args.samples, args.threads) == (1, 8, 64, 8, 1)
    assert args.lengths == [128, 256, 1024] and short_step.TARGET == (1.5, 256)


def test_short_step_runs_tiny(short_step, capsys):
    threads = torch.get_num_threads()
    try:
        rows = short_step.main(["--lengths", "16,24", "--heads", "2", "--dim", "8", "--samples", "2", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    assert [r.n for r in rows] == [16, 24]
    for r in rows:
        assert r.sdpa > 0 and r.plsh > 0 and r.gemm > 0 and r.ratio == r.plsh / r.sdpa
    text = capsys.readouterr().out
    assert "| n | sdpa-mask fwd+bwd (ms) | plsh fwd+bwd (ms) | gemm-peak fwd+bwd (ms) | plsh / sdpa-mask |" in text
    assert "matmul peak:" in text
    # 14 d flops per kept pair and head: n = 2, d = 1, one head keeps 3 pairs
    assert short_step.attention_flops(2, 1, 1, 1) == 42.0
    assert short_step.target(rows) is None  # no n = 256 in this run
    assert "NOT met" in short_step.target([short_step.Row(256, 1.0, 2.0)])


def test_short_step_calls_differentiate_both(short_step):
    fns = short_step.calls(24, 1, 2, 8, 2)
    for fn in fns.values():
        grads = fn()
        assert len(grads) == 3 and all(bool(torch.isfinite(g).all()) for g in grads)


@pytest.fixture
def long_generate(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "long_generate.py"
    spec = importlib.util.spec_from_file_location("long_generate", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "long_generate", module)
    spec.loader.exec_module(module)
    return module


def test_long_generate_point_and_table(long_generate):
    # benchmarks/long_generate.py: one point in this process (a tiny prompt), the stock model's refusals, the table.
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    try:
        row = long_generate.run_point("bloom", "plsh", 96, 5, 16.0)
    finally:
        torch.set_num_threads(threads)
    assert row["generated"] == 5 and row["prompt"] == 96 and row["peak_rss_mib"] >= row["rss_before_mib"] > 0
    assert row["prefill_s"] > 0 and row["ms_per_token"] > 0 and row["cpu_ms_per_token"] > 0
    assert long_generate.stock_refusal("qwen3", 8192, 12.0, 262144) is None
    assert "quadratic prefill" in long_generate.stock_refusal("qwen3", 1 << 20, 12.0, 262144)
    assert "GiB" in long_generate.stock_refusal("bloom", 131072, 12.0, 262144)  # its (B H, chunk, n) scores
    table = long_generate._table([row, {"model": "bloom", "mode": "stock", "prompt": 96, "reason": "why"}])
    assert "| bloom | plsh T=8 | 96 |" in table and "not run: why" in table
