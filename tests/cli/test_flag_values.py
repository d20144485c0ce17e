"""Round three (issue 27), "values and messages": absurd flag values refused up front in one line (exit 2).

Seeds outside ``[0, 2^63)`` on every command that takes one, ``--sigma`` below its range, ``plsh eval
--num-samples 10^8`` (memory estimate) and ``plsh validate --adversarial --adversarial-samples 10^7`` (time estimate).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from positional_lsh import cli
from positional_lsh.cli.validate.settings import ValidateConfig


def _code(argv: list[str]) -> int:
    """``plsh ARGV``'s exit code (argparse refusals exit through ``SystemExit``)."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _command(name: str, tmp_path: Path) -> list[str]:
    return {"train": ["train", "--out", str(tmp_path / "t")], "train-hf": ["train-hf", "--out", str(tmp_path / "h")],
            "eval": ["eval"], "validate": ["validate", "--out", str(tmp_path / "v")], "bench": ["bench"],
            "demo": ["demo"]}[name]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "flag"),
    [("train", "--seed"), ("train", "--partition-seed"), ("train-hf", "--seed"), ("train-hf", "--partition-seed"),
     ("eval", "--eval-seed"), ("validate", "--seed"), ("bench", "--seed"), ("demo", "--seed")],
)  # fmt: skip
@pytest.mark.parametrize("seed", [str(2**64), str(2**63), "-1"])
def test_seeds_outside_int64_are_refused_naming_the_flag(command: str, flag: str, seed: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert _code([*_command(command, tmp_path), flag, seed]) == 2
    err = _one_line(capsys)
    assert f"argument {flag}: a seed must be an integer in [0, 2^63), got '{seed}'" in err, err
    assert not any(tmp_path.iterdir())  # nothing on disk


@pytest.mark.parametrize("command", ["train", "train-hf", "eval"])
@pytest.mark.parametrize("sigma", ["1e-320", "1e-31", "0", "-4"])
def test_sigma_below_its_range_names_sigma_and_the_range(command: str, sigma: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert _code([*_command(command, tmp_path), "--sigma", sigma]) == 2
    err = _one_line(capsys)
    assert "argument --sigma: --sigma must be a number in [1e-30, inf]" in err and repr(sigma) in err, err
    assert "slopes must be finite" not in err


def test_eval_num_samples_beyond_memory_is_refused_up_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import positional_lsh.ops.errors as errors

    monkeypatch.setattr(errors, "memory_bytes", lambda: 16 * 2**30)  # the estimate, on any machine
    t0 = time.perf_counter()
    argv = ["eval", str(tmp_path / "missing"), "--position", "plsh", "--num-samples", "100000000"]
    assert _code(argv) == 2
    err = _one_line(capsys)
    assert "--num-samples 100000000 needs about" in err and "GB of memory" in err, err
    assert time.perf_counter() - t0 < 30


def test_validate_adversarial_samples_beyond_the_time_limit_are_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.perf_counter()
    argv = ["validate", "--adversarial", "--adversarial-lengths", "64", "--adversarial-samples", "10000000",
            "--out", str(tmp_path / "v")]  # fmt: skip
    assert _code(argv) == 2
    err = _one_line(capsys)
    assert "--adversarial-lengths/--adversarial-samples" in err and "n=64, T=10000000" in err, err
    assert "would take about" in err and "refused above 10 min" in err
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "v").exists()


def test_validate_default_adversarial_studies_stay_within_the_time_limit(tmp_path: Path) -> None:
    from positional_lsh.cli.validate.settings import ADVERSARIAL_MAX_SECONDS

    for adversarial in (False, True):
        cfg = ValidateConfig(out_dir=str(tmp_path), adversarial=adversarial)
        seconds, _ = cfg.adversarial_seconds()
        assert 0 < seconds < ADVERSARIAL_MAX_SECONDS / 5
    ValidateConfig(out_dir=str(tmp_path), adversarial=True, adversarial_lengths=(64,), adversarial_samples=(10**6,))


def test_adversarial_estimate_has_each_cells_fixed_cost() -> None:
    """Issue 34, item 28: ``plsh validate --adversarial`` took about 3x its estimate plus 8-27 s per cell; the
    estimate counted only the samples (``T * (5e-5 s + 1e-8 s * n^2)``: 0.01 s for a cell at n = 1024, T = 1). Each
    cell now also costs what runs whatever its T, term by term, as the stages were profiled (docs/theory.md): at
    n = 1024 the row adversaries 0.49-0.58 s, the bound 0.10-0.11 s, the oracles 0.28-0.40 s, the full ascent
    6.3-7.2 s."""
    from positional_lsh.cli.validate import settings as S

    terms = S.adversarial_cell_seconds(1024, 1, rows=4, pgd_max_len=1024)
    assert set(terms) == {"samples", "rows", "bound", "remeasure", "pgd"}
    profiled = {"rows": (0.49, 0.58), "bound": (0.10, 0.11), "remeasure": (0.28, 0.40), "pgd": (6.3, 7.2)}
    for name, (lo, hi) in profiled.items():
        assert 0.75 * lo <= terms[name] <= 1.25 * hi, (name, terms[name])
    assert terms["samples"] == pytest.approx(S.ADVERSARIAL_SECONDS_PER_SAMPLE + S.ADVERSARIAL_SECONDS_PER_ENTRY * 2**20)
    # the full ascent runs only up to --adversarial-pgd-max-len; the rows attacked are at most 2 * rows, and n
    assert S.adversarial_cell_seconds(1024, 1, rows=4, pgd_max_len=1023)["pgd"] == 0.0
    assert S.adversarial_cell_seconds(4096, 1, rows=4, pgd_max_len=1024)["pgd"] == 0.0
    assert S.adversarial_cell_seconds(3, 1, rows=4, pgd_max_len=1024)["rows"] == pytest.approx(3 * 0.07)
    # the samples' term grows with T and n^2; the fixed terms do not grow with T
    big = S.adversarial_cell_seconds(4096, 64, rows=4, pgd_max_len=1024)
    assert big["samples"] == pytest.approx(
        64 * (S.ADVERSARIAL_SECONDS_PER_SAMPLE + S.ADVERSARIAL_SECONDS_PER_ENTRY * 4096**2)
    )
    small = S.adversarial_cell_seconds(4096, 1, rows=4, pgd_max_len=1024)
    assert {k: v for k, v in big.items() if k != "samples"} == {k: v for k, v in small.items() if k != "samples"}


def test_the_default_adversarial_study_estimate_sums_its_cells(tmp_path: Path) -> None:
    """The default study (n = 256, 1024, 4096 x T = 1, 4, 16, 64): the start-up once plus every cell's terms; about
    72 s (151 s measured on the shared 2-core machine with both cores busy; 15 s estimated before)."""
    from positional_lsh.cli.validate import settings as S

    cfg = ValidateConfig(out_dir=str(tmp_path), adversarial=True)
    seconds, what = cfg.adversarial_seconds()
    cells = [(n, t) for n in (256, 1024, 4096) for t in (1, 4, 16, 64)]
    total = S.ADVERSARIAL_SECONDS_STARTUP + sum(
        sum(S.adversarial_cell_seconds(n, t, 4, 1024).values()) for n, t in cells
    )
    assert seconds == pytest.approx(total)
    assert 60 < seconds < 90 and "12 cells" in what
