"""Round three (issue 27), "values and messages": corrupt learned slopes, absurd steps and seeds, diverging slopes.

Each case: one line and exit code 2 from the command (nothing trained or scored on the bad value), or a
``UserError``/``ValueError`` naming the file, layer or setting from the library.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from positional_lsh.cli import eval as cli_eval
from positional_lsh.cli import train as cli_train
from positional_lsh.lm.checkpoint import checkpoint_dir, load_checkpoint
from positional_lsh.lm.train import TrainConfig
from positional_lsh.ops.errors import UserError

# text_dir, tokenizer_file: tests/conftest.py


def train_args(out: Path, text_dir: Path, tok: Path, *more: str) -> list[str]:
    return ["--out", str(out), "--data", str(text_dir), "--tokenizer", str(tok), "--cache-dir", "", "--seq-len", "32",
            "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--position", "plsh", "--num-samples", "2",
            "--batch-size", "4", "--steps", "4", "--warmup", "1", "--lr", "3e-2", "--eval-interval", "2",
            "--eval-batches", "2", "--autocast", "float32", "--no-progress", "--learn-slopes", *more]  # fmt: skip


@pytest.fixture(scope="module")
def slopes_run(text_dir: Path, tokenizer_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A learned-slopes run stopped at step 2 of 4 (resumable)."""
    out = tmp_path_factory.mktemp("slopes") / "run"
    assert cli_train.main(train_args(out, text_dir, tokenizer_file, "--stop-after", "2")) == 0
    return out


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _corrupt_weights(run: Path, value: float) -> Path:
    """Set layer 1's log-slopes in the checkpoint's model.safetensors to ``value``; return the file."""
    from safetensors.torch import load_file, save_file

    file = checkpoint_dir(run) / "model.safetensors"
    state = load_file(str(file))
    state["blocks.1.attn.log_slopes"] = torch.full_like(state["blocks.1.attn.log_slopes"], value)
    save_file(state, str(file), metadata={"format": "positional-lsh-lm", "dtype": "float32"})
    return file


@pytest.mark.parametrize("value", [float("-inf"), float("nan"), float("inf"), 1e4])
def test_corrupt_learned_slopes_are_refused_at_load_and_by_eval(
    value: float, slopes_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(slopes_run, run)
    file = _corrupt_weights(run, value)  # 1e4: finite, but its slope exp(1e4) is not
    with pytest.raises(UserError, match=r"model\.safetensors: the learned slopes of layer 1 are not finite"):
        load_checkpoint(run)
    capsys.readouterr()
    argv = [str(run), "--factors", "1", "--samples", "none", "--max-tokens", "300", "--cache-dir", "", "--no-progress"]
    assert cli_eval.main(argv) == 2
    err = _one_line(capsys)
    assert str(file) in err and "layer 1" in err


def test_resume_refuses_corrupt_learned_slopes(slopes_run: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(slopes_run, run)
    file = checkpoint_dir(run) / "trainer_state.pt"
    state = torch.load(file, weights_only=True)
    state["model"]["blocks.0.attn.log_slopes"][:] = float("-inf")
    torch.save(state, file)
    before = (run / "log.jsonl").read_text()
    capsys.readouterr()
    assert cli_train.main(["--out", str(run), "--resume", "--no-progress"]) == 2
    err = _one_line(capsys)
    assert str(file) in err and "layer 0" in err and "not finite" in err
    assert (run / "log.jsonl").read_text() == before  # nothing trained


@pytest.mark.parametrize("step", [2**63, 2**64, -1])
def test_resume_refuses_a_step_outside_int64(step: int, slopes_run: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(slopes_run, run)
    file = checkpoint_dir(run) / "trainer_state.pt"
    state = torch.load(file, weights_only=True)
    state["step"] = step
    torch.save(state, file)
    # the checkpoint's config.json records the step too: keep them consistent, so only the value is wrong
    import json

    cfg_file = checkpoint_dir(run) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["metadata"]["step"] = step
    cfg_file.write_text(json.dumps(cfg))
    capsys.readouterr()
    assert cli_train.main(["--out", str(run), "--resume", "--no-progress", "--steps", str(2**65)]) == 2
    err = _one_line(capsys)
    assert "step" in err and "2^63" in err


def test_train_config_refuses_seeds_and_steps_outside_int64() -> None:
    for seed in (2**63, 2**64):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^63\)"):
            TrainConfig(out_dir="x", seed=seed).validate()
    TrainConfig(out_dir="x", seed=2**63 - 1).validate()
    with pytest.raises(ValueError, match=r"steps must be < 2\^63"):
        TrainConfig(out_dir="x", steps=2**63).validate()


def test_diverging_learned_slopes_say_lower_lr(text_dir: Path, tokenizer_file: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """``--lr 1e4`` sends the log-slopes to inf: the same kind of message as a nan loss (naming lr), not the op's
    "slopes must be finite"."""
    out = tmp_path / "div"
    assert cli_train.main(train_args(out, text_dir, tokenizer_file, "--lr", "1e4", "--min-lr", "1")) == 2
    err = _one_line(capsys)
    assert "diverged at step" in err and "lower lr" in err and "must be finite" not in err, err
