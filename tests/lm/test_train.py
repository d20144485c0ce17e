"""Tests for positional_lsh.lm.train: schedule, determinism, exact resume, 2-process DDP, the CLI, bad input."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from positional_lsh.cli import train as cli_train
from positional_lsh.lm import ModelConfig, load_checkpoint
from positional_lsh.lm import train as T
from positional_lsh.lm.train_config import QUICK_PRESET, lr_at

from conftest import run_torchrun

# text_dir, tokenizer_file: tests/conftest.py


def tiny_configs(out: Path, data: Path, tok: Path, **train_kw: object) -> tuple[T.TrainConfig, ModelConfig]:
    kw: dict[str, object] = {
        "data": str(data),
        "tokenizer": str(tok),
        "cache_dir": "",
        "batch_size": 4,
        "steps": 6,
        "warmup": 2,
        "lr": 3e-3,
        "eval_interval": 3,
        "eval_batches": 2,
        "ckpt_interval": 100,
        "progress": False,
        "autocast": "float32",
    }
    kw.update(train_kw)
    cfg = T.TrainConfig(out_dir=str(out), **kw)  # type: ignore[arg-type]
    model = ModelConfig(seq_len=32, n_layer=2, n_head=2, d_model=32, position="plsh", num_samples=2)
    return cfg, model


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path).model.state_dict()


def log(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "log.jsonl").read_text().splitlines()]


def test_lr_schedule() -> None:
    cfg = T.TrainConfig(out_dir="x", steps=100, warmup=10, lr=1e-3, min_lr=1e-4)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))  # warm-up rises
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))  # cosine falls
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 45 / 90)))
    assert lr_at(100, cfg) == pytest.approx(1e-4)


def test_training_learns_and_writes_a_checkpoint(tmp_path: Path, text_dir: Path, tokenizer_file: Path) -> None:
    cfg, model_cfg = tiny_configs(tmp_path / "run", text_dir, tokenizer_file, steps=30, eval_interval=10)
    result = T.train(cfg, model_cfg)
    assert result.finished and result.step == 30 and result.tokens == 30 * 4 * 32
    records = log(tmp_path / "run")
    losses = [r["loss"] for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(losses) == 30 and len(vals) == 3
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3  # it learns
    ck = load_checkpoint(tmp_path / "run")
    assert ck.model.cfg.position == "plsh" and ck.model.cfg.vocab_size == ck.tokenizer.vocab_size
    assert ck.metadata["step"] == 30 and ck.metadata["finished"] is True
    assert ck.metadata["val_loss"] == pytest.approx(vals[-1])
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["model"]["num_samples"] == 2 and saved["train"]["steps"] == 30


def test_same_seed_same_weights(tmp_path: Path, text_dir: Path, tokenizer_file: Path) -> None:
    a = T.train(*tiny_configs(tmp_path / "a", text_dir, tokenizer_file))
    b = T.train(*tiny_configs(tmp_path / "b", text_dir, tokenizer_file))
    c = T.train(*tiny_configs(tmp_path / "c", text_dir, tokenizer_file, seed=1))
    wa, wb, wc = weights(a.out_dir), weights(b.out_dir), weights(c.out_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["embed.weight"], wc["embed.weight"])
    assert a.val_loss == b.val_loss


def test_resume_equals_uninterrupted(tmp_path: Path, text_dir: Path, tokenizer_file: Path) -> None:
    full = T.train(*tiny_configs(tmp_path / "full", text_dir, tokenizer_file, grad_accum=2))
    cfg, model_cfg = tiny_configs(tmp_path / "split", text_dir, tokenizer_file, grad_accum=2, stop_after=4)
    first = T.train(cfg, model_cfg)
    assert first.step == 4 and not first.finished
    assert load_checkpoint(tmp_path / "split").metadata["finished"] is False
    # resume: the saved settings are used (even if other ones are passed), stop_after is taken from the call
    other = dataclasses.replace(cfg, stop_after=None, lr=1.0)
    second = T.train(other, None, resume=True)
    assert second.finished and second.step == 6
    wf, ws = weights(full.out_dir), weights(second.out_dir)
    assert all(torch.equal(wf[k], ws[k]) for k in wf)
    assert [r["loss"] for r in log(tmp_path / "full") if "loss" in r] == [
        r["loss"] for r in log(tmp_path / "split") if "loss" in r
    ]


def test_resume_bad_input(tmp_path: Path, text_dir: Path, tokenizer_file: Path) -> None:
    cfg, model_cfg = tiny_configs(tmp_path / "nothing", text_dir, tokenizer_file)
    with pytest.raises(ValueError, match="resume"):
        T.train(cfg, model_cfg, resume=True)


def test_two_process_ddp_equals_one_process_with_double_batch(
    tmp_path: Path, text_dir: Path, tokenizer_file: Path
) -> None:
    """torchrun --nproc_per_node 2 with batch 2 per process == one process with batch 4 (gloo on CPU)."""
    args = ["--data", str(text_dir), "--tokenizer", str(tokenizer_file), "--cache-dir", "", "--seq-len", "32",
            "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--position", "plsh", "--num-samples", "2",
            "--steps", "4", "--warmup", "1", "--lr", "3e-3", "--eval-interval", "2", "--eval-batches", "2",
            "--autocast", "float32", "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "positional_lsh.cli", "train", "--out", str(tmp_path / "ddp"), "--batch-size", "2", *args]
    proc = run_torchrun(cmd, env, done="checkpoint in")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cpu x 2" in proc.stdout
    assert cli_train.main(["--out", str(tmp_path / "single"), "--batch-size", "4", *args]) == 0
    wd, ws = weights(tmp_path / "ddp"), weights(tmp_path / "single")
    # float32 all-reduce vs one batch sums in another order; Adam divides by sqrt(v) + eps, so a weight whose gradient
    # is near zero can move by a visible fraction of lr (3e-3) from that alone: allow ~lr/60 absolute.
    for k in wd:
        torch.testing.assert_close(wd[k], ws[k], rtol=1e-4, atol=5e-5)
    ld, ls = log(tmp_path / "ddp"), log(tmp_path / "single")
    assert [r["tokens"] for r in ld if "loss" in r] == [r["tokens"] for r in ls if "loss" in r]
    vd = [r["val_loss"] for r in ld if "val_loss" in r]
    vs = [r["val_loss"] for r in ls if "val_loss" in r]
    assert vd == pytest.approx(vs, rel=1e-4)
    meta = load_checkpoint(tmp_path / "ddp").metadata
    assert meta["world_size"] == 2


def test_cli_quick_preset_with_overrides(tmp_path: Path, text_dir: Path, tokenizer_file: Path) -> None:
    parser = __import__("argparse").ArgumentParser()
    cli_train.add_train_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "q"), "--quick", "--steps", "3", "--position", "rope"])
    cfg, model_cfg = cli_train.configs_from_args(args)
    assert cfg.steps == 3 and cfg.vocab_size == QUICK_PRESET["vocab_size"]  # flag beats preset
    assert model_cfg.n_layer == QUICK_PRESET["n_layer"] and model_cfg.position == "rope"
    argv = ["--out", str(tmp_path / "q"), "--quick", "--data", str(text_dir), "--tokenizer", str(tokenizer_file),
            "--cache-dir", "", "--steps", "4", "--eval-interval", "2", "--no-progress", "--save-dtype", "bfloat16",
            "--position", "window-alibi", "--window", "8"]  # fmt: skip
    assert cli_train.main(argv) == 0
    ck = load_checkpoint(tmp_path / "q")
    assert ck.model.cfg.position == "window-alibi" and ck.model.cfg.window == 8.0
    assert ck.metadata["weights_dtype"] == "bfloat16"
    assert "--quick" in ck.metadata["command"]


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"lr": -1.0}, ValueError, "lr"),
        ({"lr": 1e-4, "min_lr": 1e-3}, ValueError, "min_lr"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"steps": 2.5}, TypeError, "steps"),
        ({"beta2": 1.0}, ValueError, "beta2"),
        ({"autocast": "int8"}, ValueError, "autocast"),
        ({"save_dtype": "float64"}, ValueError, "save_dtype"),
        ({"stop_after": 0}, ValueError, "stop_after"),
    ],
)
def test_train_config_bad_input(kw: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        T.TrainConfig(out_dir="x", **kw).validate()


def test_cli_bad_input_returns_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_train.main(["--out", str(tmp_path / "bad"), "--lr", "-1"]) == 2
    assert "lr" in capsys.readouterr().err
    assert cli_train.main(["--out", str(tmp_path / "bad"), "--d-model", "30", "--n-head", "4"]) == 2


def test_autocast_resolution() -> None:
    cpu = torch.device("cpu")
    assert T.resolve_autocast_dtype("float32", cpu) is None
    assert T.resolve_autocast_dtype("bfloat16", cpu) is torch.bfloat16
    assert T.resolve_autocast_dtype("auto", cpu) in (None, torch.bfloat16)


def test_memory_estimate_counts_a_ranks_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --context-parallel C a rank holds ceil(seq_len / C) positions: a run that fits when split is not
    refused, the same run unsplit is."""
    from positional_lsh.ops import errors

    model_cfg = ModelConfig(seq_len=4096, n_layer=4, n_head=4, d_model=256, position="plsh", num_samples=8)
    one = T.TrainConfig(out_dir=str(tmp_path / "one"), batch_size=8)
    split = dataclasses.replace(one, out_dir=str(tmp_path / "split"), context_parallel=4)
    whole, quarter = T.estimate_step_bytes(one, model_cfg), T.estimate_step_bytes(split, model_cfg)
    assert quarter == pytest.approx(whole / 4)
    odd = dataclasses.replace(model_cfg, seq_len=4095)  # unequal shards: the largest one (1024 positions) counts
    assert T.estimate_step_bytes(split, odd) == quarter
    monkeypatch.setattr(errors, "memory_bytes", lambda: int(whole / 2))
    with pytest.raises(errors.UserError, match="of memory"):
        T.resolve_run_configs(one, model_cfg, resume=False, overwrite=False, changes={})
    cfg, _, _ = T.resolve_run_configs(split, model_cfg, resume=False, overwrite=False, changes={})
    assert cfg.context_parallel == 4
