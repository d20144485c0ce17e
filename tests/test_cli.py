from __future__ import annotations

import csv
import math

import pytest
import torch

from positional_lsh.cli import main
from positional_lsh.cli.bench import growth_exponents, run_benchmark, write_outputs
from positional_lsh.cli.demo import attention_table, mask_convergence_table


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


@pytest.mark.parametrize("n", [700, 1024])
@pytest.mark.parametrize(("causal", "windowed"), [(True, True), (False, True), (True, False)])
def test_band_block_mask_equals_torch_create_block_mask(n, causal, windowed):
    # The benchmark builds FlexAttention block masks from the band's geometry (torch's create_block_mask
    # materializes n x n); both must select the same partial and full blocks.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    from positional_lsh.cli.bench import band_block_mask

    win = torch.tensor([40.0, 130.0, 300.0, 1e9]) if windowed else None
    wi = None if win is None else win.long()

    def mask_mod(b, h, qi, ki):
        ok = (qi - ki).abs() <= wi[h] if wi is not None else qi >= ki
        return ok & (qi >= ki) if causal else ok

    ours = band_block_mask(n, win, causal=causal, mask_mod=mask_mod)
    ref = create_block_mask(mask_mod, None, 4 if windowed else None, n, n, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())

    def full(bm):
        return BlockMask.from_kv_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, seq_lengths=(n, n)).to_dense()

    assert torch.equal(full(ours), full(ref))
