from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import math
import re

import pytest
import torch

from positional_lsh.cli import main
from positional_lsh.cli.bench import BenchConfig, growth_exponents, run_benchmark, write_outputs
from positional_lsh.cli.demo import attention_table, mask_convergence_table
from positional_lsh.cli.parsers import (
    add_arguments,
    comma_list,
    config_from_args,
    option,
    positive_int_text,
    to_argv,
)


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
    # every error is measured against float64 exact ALiBi: the float32 exact row's is its rounding error
    assert 0 < by["exact ALiBi"]["rel_error"] < 1e-5
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
    cfg = BenchConfig(lengths=(256, 512), samples=(1, 4), methods=("sdpa-mask", "alibi-chunked", "plsh", "plsh-mult"),
                      heads=2, head_dim=8, repeats=1, progress=False)  # fmt: skip
    # Each measurement starts with gc.collect() (bench.reset_peak_rss): over this test process's heap, ~0.3 s each.
    # Frozen, the objects made before the benchmark are not traversed; the benchmark's own garbage still is.
    gc.freeze()
    try:
        rows = run_benchmark(cfg)
    finally:
        gc.unfreeze()
    kinds = {(r.method, r.samples, r.mode, r.seq_len) for r in rows}
    assert ("plsh", 4, "fwd+bwd", 512) in kinds and ("sdpa-mask", None, "fwd", 256) in kinds
    plsh = [r for r in rows if r.method == "plsh" and r.mode == "fwd"]
    assert all(r.rel_error is not None and 0 < r.rel_error < 2 for r in plsh)
    # the exact peers are measured against a float64 reference (on sampled query rows): float32 rounding
    exact = [r for r in rows if r.method in ("sdpa-mask", "alibi-chunked") and r.mode == "fwd"]
    assert len(exact) == 4 and all(r.rel_error is not None and 0 < r.rel_error < 1e-5 for r in exact)
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
    # the multiplicity form: same estimator, so the same error as the per-sample path on the same partitions
    mult = {(r.seq_len, r.samples): r for r in rows if r.method == "plsh-mult" and r.mode == "fwd"}
    for r in plsh:
        assert abs(mult[(r.seq_len, r.samples)].rel_error - r.rel_error) < 1e-4
        assert mult[(r.seq_len, r.samples)].pairs <= r.pairs  # union of the T blocks <= their sum
    assert all(r.useful_gflops is not None and r.useful_gflops > 0 and r.pairs > 0 for r in rows)
    exact_pairs = 2 * 512 * 513 // 2
    assert {r.pairs for r in rows if r.method == "sdpa-mask" and r.seq_len == 512} == {exact_pairs}
    assert "useful GFLOP/s" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench_t.png").exists()


@pytest.mark.parametrize("scheme", ["discrete", "gamma"])
@pytest.mark.parametrize("causal", [True, False])
def test_bench_pair_counts_match_brute_force(scheme, causal):
    from positional_lsh import sample_partitions
    from positional_lsh.cli.bench_peers import band_pairs, sample_pairs, union_pairs

    n = 37
    parts = sample_partitions(n, torch.tensor([0.5, 0.1, 0.0]), 5, scheme=scheme, generator=1)
    same = parts.labels()[..., :, None] == parts.labels()[..., None, :]  # (T, H, n, n)
    keep = torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
    assert sample_pairs(parts, causal=causal, chunk=8) == int((same & keep).sum())
    assert union_pairs(parts, causal=causal, chunk=8) == int((same.any(0) & keep).sum())
    i = torch.arange(n)
    window = torch.tensor([3.0, 100.0])
    band = ((i[:, None] - i[None, :]).abs()[None] <= window[:, None, None]) & keep
    assert band_pairs(n, window, causal=causal) == int(band.sum())
    assert band_pairs(n, None, causal=causal, num_heads=3) == 3 * int(keep.sum())


def test_bench_gemm_peak_and_useful_gflops():
    from positional_lsh.cli.bench import gemm_peak
    from positional_lsh.cli.bench_peers import useful_gflops

    assert gemm_peak(torch.float32, size=64, repeats=1) > 0
    assert useful_gflops(10**9, 64, 2.0, "fwd") == pytest.approx(128.0)
    assert useful_gflops(10**9, 64, 2.0, "fwd+bwd") == pytest.approx(448.0)
    assert useful_gflops(None, 64, 1.0, "fwd") is None


def test_bench_bad_input():
    with pytest.raises(ValueError, match="unknown methods"):
        BenchConfig(lengths=(128,), methods=("cuda-magic",))
    with pytest.raises(ValueError, match="lengths"):
        BenchConfig(lengths=(0,), methods=("plsh",))
    with pytest.raises(ValueError, match="dtype"):
        BenchConfig(lengths=(128,), dtype="float16")
    with pytest.raises(TypeError, match="BenchConfig"):
        run_benchmark({"lengths": (128,)})  # type: ignore[arg-type]


def test_cli_rejects_bad_lengths(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--lengths", "ten"])
    assert "comma-separated" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--lengths", "64,0"])
    assert ">= 1" in capsys.readouterr().err


def test_reference_rows_equal_float64_alibi_attention():
    from positional_lsh import alibi_attention, alibi_slopes
    from positional_lsh.cli.bench_peers import reference_rows, sampled_rows

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rows = sampled_rows(70, 9)
    assert rows[0] == 0 and rows[-1] == 69 and len(rows) == 9
    for causal in (True, False):
        ref = alibi_attention(q, k, v, alibi_slopes(4), causal=causal)
        got = reference_rows(q, k, v, alibi_slopes(4), rows, causal=causal)
        torch.testing.assert_close(got, ref[:, :, rows])


# ------------------------------------------------------------------------------ parsers from dataclasses


@dataclasses.dataclass
class _Toy:
    out_dir: str = option(help="output", name="--out")
    sizes: tuple[int, ...] = option((1, 2), "sizes", parse=comma_list(positive_int_text))
    layers: tuple[int, ...] | None = option(None, "layers", none="all")
    names: tuple[str, ...] = option(("a",), "names", choices=("a", "b"))
    rate: float | None = option(None, "rate")
    progress: bool = option(True, "no bar", name="--quiet")
    extra: int = 3  # not a flag


def _toy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    add_arguments(p, _Toy)
    return p


def test_parser_generated_from_a_dataclass():
    p = _toy_parser()
    args = p.parse_args(["--out", "x"])
    assert config_from_args(args, _Toy) == _Toy(out_dir="x")  # defaults come from the dataclass
    args = p.parse_args(["--out", "x", "--sizes", "3,4", "--layers", "0,-1", "--names", "b,a", "--rate", "0.5",
                         "--quiet"])  # fmt: skip
    cfg = config_from_args(args, _Toy, extra=7)
    assert cfg == _Toy("x", (3, 4), (0, -1), ("b", "a"), 0.5, False, 7)
    # to_argv writes what differs from the defaults; parsing it back gives the same config
    argv = to_argv(cfg)
    assert argv[:2] == ["--out", "x"] and "--quiet" in argv and "--extra" not in argv
    assert config_from_args(p.parse_args(argv), _Toy, extra=7) == cfg
    assert p.parse_args(["--out", "x", "--sizes", "none"]).sizes == ()
    assert "(default: 1,2)" in p.format_help() and "(default: all)" in p.format_help()


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "1,x"], "comma-separated positive integers"),
    (["--sizes", "0"], ">= 1"),
    (["--names", "c"], "expected comma-separated values from"),
    ([], "required"),
])  # fmt: skip
def test_generated_parser_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit):
        _toy_parser().parse_args(argv if not argv else ["--out", "x", *argv])
    assert message in capsys.readouterr().err


def test_every_command_keeps_its_flags(capsys):
    # the flags of every command before the parsers were generated from the settings dataclasses
    expected = {
        "demo": "--mask-len --lengths --skip-model --seed --quiet",
        "bench": "--lengths --samples --methods --heads --head-dim --dtype --scheme --bidirectional --no-backward "
        "--backward-max-len --repeats --long-seconds --sdpa-max-gib --threads --seed --out",
        "eval": "--labels --out --data --split --factors --stride --max-tokens --samples --schemes --sweep-factors "
        "--no-equal-cost --eval-seed --train-len --tokenizer --batch-tokens --cache-dir --device --threads "
        "--no-progress",
        "train": "--out --quick --resume --data --tokenizer --vocab-size --cache-dir --position --num-samples --scheme "
        "--sigma --window --window-factor --n-layer --n-head --d-model --mlp-ratio --dropout --seq-len --rope-base "
        "--alibi-impl --attn-backend --partition-seed --attn-low-precision --batch-size --grad-accum --steps --lr "
        "--min-lr --warmup --weight-decay --beta1 --beta2 --grad-clip --eval-interval --eval-batches "
        "--ckpt-interval --seed --autocast --device --threads --save-dtype --stop-after --no-progress",
        "validate": "--out --source --checkpoint --tokenizer --text --seq-lens --num-inputs --layers --heads --slopes "
        "--schemes --samples --repeats --bidirectional --seed --eps --delta --tol --max-output-len --max-work "
        "--compare-samples --compare-repeats --compare-schemes --lengths --length-samples "
        "--unbiasedness-replicates --synthetic-layers --synthetic-heads --synthetic-head-dim --no-plots --quiet "
        "--threads",
        "": "",  # the top-level parser (plsh --help)
    }
    # Flags added on purpose since then (an old flag must never disappear; a new one is listed here).
    added = {
        "train": "--overwrite --context-parallel --plsh-method --learn-slopes",
        "eval": "--position --num-samples --scheme --sigma --slopes --window",  # transformers checkpoints (issue 18)
        "validate": "--block-delta --adversarial --adversarial-lengths --adversarial-samples --adversarial-rows "
        "--adversarial-head-dim --adversarial-sigma --adversarial-score-bound --adversarial-pgd-max-len "
        "--report-adversarial-lengths --report-adversarial-samples --slope-grad-samples --slope-grad-len "
        "--slope-grad-replicates --slope-grad-scheme --slope-grad-fd-step --slope-grad-only",
        "": "--debug",
    }
    for command, flags in expected.items():
        with pytest.raises(SystemExit):
            main([command, "--help"] if command else ["--help"])
        words = re.findall(r"(?<![\w-])--[a-z0-9][\w-]*", capsys.readouterr().out)
        listed = {w for w in words if "_" not in w} - {"--help"}  # not torchrun's --nproc_per_node
        assert listed == set(flags.split()) | set(added.get(command, "").split()), command


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


# ------------------------------------------------------------------------------ one error path for every command

# Each command with the fewest arguments it runs with, and the function its ``func`` hands the settings to.
_COMMANDS = {
    "bench": (["--lengths", "64"], "positional_lsh.cli.bench", "run_bench_command"),
    "train": (["--out", "{tmp}/run"], "positional_lsh.cli.train", "train"),
    "eval": ([], "positional_lsh.cli.eval", "run_eval"),
    "validate": (["--out", "{tmp}/val"], "positional_lsh.cli.validate", "run_validation"),
}


def _argv(command: str, tmp_path, *extra: str) -> list[str]:
    return [command, *(a.format(tmp=tmp_path) for a in _COMMANDS[command][0]), *extra]


@pytest.mark.parametrize("command", list(_COMMANDS))
@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (ValueError, "seq_len must be >= 1,\n  got 0"),
        (TypeError, "steps must be an int, got float"),
        ("UserError", "--data nowhere: no such corpus"),
        (FileNotFoundError, None),
    ],
)
def test_every_command_reports_a_user_error_as_one_line_and_exit_2(command, exc, message, tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    import importlib

    from positional_lsh.ops.errors import UserError

    exc = UserError if exc == "UserError" else exc
    error = exc(2, "No such file or directory", "missing.txt") if exc is FileNotFoundError else exc(message)

    def refuse(*args, **kwargs):
        raise error

    _, module, worker = _COMMANDS[command]
    monkeypatch.setattr(importlib.import_module(module), worker, refuse)
    monkeypatch.delenv("PLSH_DEBUG", raising=False)
    assert main(_argv(command, tmp_path)) == 2
    captured = capsys.readouterr()
    expected = "missing.txt: No such file or directory" if message is None else " ".join(message.split())
    assert captured.err.splitlines() == [f"plsh {command}: error: {expected}"]
    with pytest.raises(exc):  # --debug: the exception itself, with its traceback
        main(["--debug", *_argv(command, tmp_path)])
    monkeypatch.setenv("PLSH_DEBUG", "1")
    with pytest.raises(exc):
        main(_argv(command, tmp_path))


@pytest.mark.parametrize(
    ("command", "flag", "name"),
    [
        ("bench", ["--heads", "0"], "heads"),
        ("train", ["--batch-size", "0"], "batch_size"),
        ("eval", ["--batch-tokens", "0"], "batch_tokens"),
        ("validate", ["--num-inputs", "0"], "num_inputs"),
    ],
)
def test_every_command_refuses_a_bad_setting_in_one_line(command, flag, name, tmp_path, monkeypatch, capsys):
    # A setting the parser accepts and the settings dataclass refuses: exit 2, one line naming it, no work done.
    import importlib

    _, module, worker = _COMMANDS[command]
    monkeypatch.setattr(importlib.import_module(module), worker, lambda *a, **k: pytest.fail("work started"))
    monkeypatch.delenv("PLSH_DEBUG", raising=False)
    assert main(_argv(command, tmp_path, *flag)) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"plsh {command}: error: ") and name in err[0], err


def test_command_functions_are_plsh_with_the_command_in_front(tmp_path, monkeypatch, capsys):
    from positional_lsh.cli import eval as cli_eval
    from positional_lsh.cli import train as cli_train

    monkeypatch.delenv("PLSH_DEBUG", raising=False)
    assert cli_train.main(["--out", str(tmp_path), "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.startswith("plsh train: error: ")
    assert cli_eval.main(["--batch-tokens", "0"]) == 2
    assert capsys.readouterr().err.startswith("plsh eval: error: ")


def test_shims_are_gone_and_lm_never_imports_cli():
    import ast
    import importlib.util
    from pathlib import Path

    import positional_lsh

    assert importlib.util.find_spec("positional_lsh.model") is None
    assert importlib.util.find_spec("positional_lsh.hf") is None
    root = Path(positional_lsh.__file__).parent
    found = []
    for path in sorted((root / "lm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions included
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.name}:{node.lineno}" for n in names if n.startswith("positional_lsh.cli")]
    assert found == []


def test_cli_and_benchmarks_import_no_private_names():
    # A name starting with "_" (not a dunder such as __version__) stays in its module: shared helpers are public.
    import ast
    from pathlib import Path

    import positional_lsh

    def private(name: str | None) -> bool:
        return name is not None and name.startswith("_") and not name.endswith("__")

    root = Path(positional_lsh.__file__).parent
    files = [*sorted((root / "cli").rglob("*.py")), *sorted((root.parents[1] / "benchmarks").glob("*.py"))]
    assert len(files) > 10
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("positional_lsh"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if private(a.name)]
                found += [f"{path.name}: as {a.asname}" for a in node.names if private(a.asname)]
    assert found == []


def test_backend_and_method_flags_take_the_op_layer_option_sets():
    from positional_lsh.cli.train import MODEL_FLAGS
    from positional_lsh.ops.options import BACKENDS, METHODS

    assert tuple(MODEL_FLAGS["attn_backend"].choices) == BACKENDS
    assert tuple(MODEL_FLAGS["plsh_method"].choices) == METHODS
