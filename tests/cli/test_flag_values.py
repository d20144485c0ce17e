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
        assert 0 < seconds < ADVERSARIAL_MAX_SECONDS / 10
    ValidateConfig(out_dir=str(tmp_path), adversarial=True, adversarial_lengths=(64,), adversarial_samples=(10**6,))
