from __future__ import annotations

import csv
import math

import pytest

from positional_lsh.bench import growth_exponents, run_benchmark, write_outputs
from positional_lsh.cli import main
from positional_lsh.demo import attention_table, mask_convergence_table


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "bench", "train", "eval", "validate"):
        assert command in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_mask_convergence_error_falls_with_t():
    rows = mask_convergence_table(seq_len=96, num_heads=4, samples=(1, 16, 256), progress=False)
    errs = [r["rel_spectral"] for r in rows]
    assert errs[0] > errs[1] > errs[2]
    # 1/sqrt(T): 256x more samples divide the error by about 16
    assert 6 < errs[0] / errs[2] < 40


def test_attention_table_exact_row_and_errors():
    rows = attention_table(lengths=(128,), samples=(1, 64), num_heads=2, head_dim=8, progress=False)
    by = {r["method"]: r for r in rows}
    assert by["exact ALiBi"]["rel_error"] == 0.0
    assert by["windowed ALiBi (12σ)"]["rel_error"] < 1e-4
    assert by["positional LSH T=64"]["rel_error"] < by["positional LSH T=1"]["rel_error"]


def test_demo_command_runs(capsys):
    assert main(["demo", "--mask-len", "64", "--lengths", "64", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "positional LSH T=16" in out and "exact ALiBi" in out
    # part 3: the shipped model, with exact ALiBi first and a continuation
    part3 = out.split("3. Shipped model", 1)[1]
    assert "exact ALiBi" in part3 and "positional LSH, T=16" in part3 and "continuation:" in part3


def test_demo_can_skip_the_model(capsys):
    assert main(["demo", "--mask-len", "64", "--lengths", "64", "--quiet", "--skip-model"]) == 0
    assert "Shipped model" not in capsys.readouterr().out


def test_validate_defaults_to_the_shipped_model():
    from positional_lsh.cli import build_parser

    args = build_parser().parse_args(["validate", "--out", "x"])
    assert args.source == "shipped"


def test_bench_rows_and_outputs(tmp_path):
    rows = run_benchmark(
        [256, 512], samples=(1, 4), methods=("sdpa-mask", "alibi-chunked", "plsh"), num_heads=2, head_dim=8,
        repeats=1, progress=False,
    )
    kinds = {(r.method, r.samples, r.mode, r.seq_len) for r in rows}
    assert ("plsh", 4, "fwd+bwd", 512) in kinds and ("sdpa-mask", None, "fwd", 256) in kinds
    plsh = [r for r in rows if r.method == "plsh" and r.mode == "fwd"]
    assert all(r.rel_error is not None and 0 < r.rel_error < 2 for r in plsh)
    chunked = [r for r in rows if r.method == "alibi-chunked" and r.mode == "fwd"]
    assert all(r.rel_error is None for r in chunked)  # an exact peer, not compared with itself
    assert all(r.seconds > 0 and r.repeats == 1 for r in rows)
    paths = write_outputs(rows, tmp_path, {"heads": 2, "head_dim": 8, "dtype": "float32"})
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "bench.md").exists()
    with (tmp_path / "bench.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(rows)
    assert all(float(r["speedup_vs_sdpa-mask"]) > 0 for r in table)
    assert len(paths) >= 2
    exps = growth_exponents(rows, samples=4)
    assert len(exps) == 1 and math.isfinite(exps[0][2])


def test_bench_bad_input():
    with pytest.raises(ValueError, match="unknown methods"):
        run_benchmark([128], methods=("cuda-magic",), progress=False)
    with pytest.raises(ValueError, match="lengths"):
        run_benchmark([0], methods=("plsh",), progress=False)


def test_cli_rejects_bad_lengths(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--lengths", "ten"])
    assert "comma-separated" in capsys.readouterr().err
