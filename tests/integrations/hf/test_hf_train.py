"""plsh train-hf end to end at CI scale (issue 18, item 1): train a tiny Qwen3 from a config, fine-tune it with LoRA,
resume (bit for bit), evaluate; torchrun data parallel; SIGTERM; one-line refusals. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from positional_lsh.cli import eval as cli_eval  # noqa: E402
from positional_lsh.cli import train_hf as cli  # noqa: E402
from positional_lsh.integrations import hf  # noqa: E402
from positional_lsh.integrations.hf import train_data as TD  # noqa: E402
from positional_lsh.integrations.hf_train_config import HF_POSITIONS, PRESETS, HFTrainConfig  # noqa: E402
from positional_lsh.lm.checkpoint import checkpoint_dir  # noqa: E402

from conftest import run_torchrun  # noqa: E402


def flags(data: Path, tok: Path | None = None) -> list[str]:
    out = ["--preset", "tiny", "--data", str(data), "--cache-dir", "", "--seq-len", "32", "--steps", "4",
           "--eval-interval", "2", "--ckpt-interval", "2", "--no-progress", "--threads", "1"]  # fmt: skip
    return out + (["--tokenizer", str(tok)] if tok is not None else [])


def log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def trained(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint_dir(run) / "trainer_state.pt", weights_only=True)["trainable"]


@pytest.fixture(scope="module")
def base_run(hf_text_dir: Path, tok_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 trained from the built-in config with positional LSH (the tiny preset, 4 steps)."""
    out = tmp_path_factory.mktemp("runs") / "base"
    assert cli.main(["--out", str(out), *flags(hf_text_dir, tok_file)]) == 0
    return out


def test_train_from_config_writes_a_loadable_swapped_checkpoint(base_run: Path, capsys) -> None:
    records = log(base_run)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    saved = json.loads((base_run / "train_config.json").read_text())
    assert saved["kind"] == "transformers" and saved["train"]["num_samples"] == 4 and saved["train"]["sigma"] == 16
    step_dir = checkpoint_dir(base_run)
    swap_file = json.loads((step_dir / hf.SWAP_FILE).read_text())
    assert swap_file["position"] == "plsh" and swap_file["num_samples"] == 4 and swap_file["step"] == 4
    assert swap_file["slopes"] == [1 / 16] * 4 and swap_file["train_len"] == 32
    capsys.readouterr()
    model, tok = hf.load_local_model(step_dir)
    assert "re-applied" in capsys.readouterr().err
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tok)
    swap = hf.current_swap(model)
    assert swap is not None and swap.step == 4 and swap.num_samples == 4
    # the exported weights are the trained ones
    state = trained(base_run)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in state.items())


def test_resume_equals_uninterrupted_full_and_lora(base_run: Path, hf_text_dir: Path, tok_file: Path,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """Stopped at step 2 and resumed == 4 steps in one go, bit for bit: from a config and a LoRA fine-tune."""
    lora = ["--checkpoint", str(base_run), "--finetune", "lora", "--lora-r", "4", "--lr", "1e-2"]
    for name, extra, tok in (("full", [], True), ("lora", lora, False)):
        args = flags(hf_text_dir, tok_file if tok else None) + extra
        one, two = tmp_path / f"{name}-one", tmp_path / f"{name}-two"
        assert cli.main(["--out", str(one), *args]) == 0
        assert cli.main(["--out", str(two), *args, "--stop-after", "2"]) == 0
        assert json.loads((checkpoint_dir(two) / hf.SWAP_FILE).read_text())["step"] == 2
        assert cli.main(["--out", str(two), "--resume", "--no-progress"]) == 0
        a, b = trained(one), trained(two)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        assert [r["loss"] for r in log(one) if "loss" in r] == [r["loss"] for r in log(two) if "loss" in r]
        if name == "lora":
            assert all("lora_" in k for k in a)  # only the adapters train
            assert (checkpoint_dir(two) / "adapter_config.json").is_file()
            base = json.loads((checkpoint_dir(two) / "adapter_config.json").read_text())["base_model_name_or_path"]
            assert Path(base) == checkpoint_dir(base_run).resolve()


def test_eval_scores_the_lora_run_with_its_saved_swap(base_run: Path, hf_text_dir: Path, tmp_path: Path,
                                                      capsys) -> None:  # fmt: skip
    run = tmp_path / "lora"
    args = [*flags(hf_text_dir), "--checkpoint", str(base_run), "--finetune", "lora", "--lora-r", "4", "--steps", "2"]
    assert cli.main(["--out", str(run), *args]) == 0
    capsys.readouterr()
    common = ["--data", str(hf_text_dir), "--factors", "1,2", "--max-tokens", "300", "--samples", "2",
              "--schemes", "discrete", "--no-progress", "--cache-dir", ""]  # fmt: skip
    assert cli_eval.main([str(run), *common, "--out", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr()
    lines = [x for x in out.err.splitlines() if x.startswith("plsh eval:")]
    assert len(lines) == 1 and "plsh T=4 discrete" in lines[0] and "saved with the checkpoint" in lines[0]
    rows = (tmp_path / "ev" / "results.csv").read_text()
    assert "own: plsh T=4 discrete, sigma 16 (saved swap)" in rows and "exact ALiBi" in rows and "plsh T=2" in rows
    assert ",32," in rows and ",64," in rows  # the saved training length (32), not the config's 4096
    # any transformers checkpoint, scored as native / alibi / window-alibi / plsh at a chosen sigma
    assert cli_eval.main([str(run), *common, "--position", "native", "--samples", "none"]) == 0
    assert "own: native qwen3" in capsys.readouterr().out
    assert cli_eval.main([str(run), *common, "--position", "plsh", "--sigma", "4", "--num-samples", "3",
                          "--samples", "none"]) == 0  # fmt: skip
    got = capsys.readouterr()
    assert "own: plsh T=3 discrete, sigma 4" in got.out and "--position plsh" in got.err
    assert cli_eval.main([str(run), *common, "--position", "window-alibi", "--window", "8", "--samples", "none"]) == 0
    assert "own: window-alibi window 8" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--position", "native", "--sigma", "4"], "native"),
        (["--position", "window-alibi"], "window"),
        (["--position", "alibi", "--num-samples", "3"], "num-samples"),
        (["--sigma", "4", "--slopes", "1,2"], "sigma"),
        (["--position", "plsh", "--slopes", "0.5,0.25"], "slopes"),  # 2 slopes for 4 heads
    ],
)
def test_eval_refuses_what_cannot_apply(base_run: Path, hf_text_dir: Path, capsys, argv, match) -> None:
    capsys.readouterr()
    code = cli_eval.main([str(base_run), "--data", str(hf_text_dir), "--no-progress", "--cache-dir", "", *argv])
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert code == 2 and len(err) == 1 and match in err[0], err


def test_eval_refuses_a_swap_on_a_model_that_has_none(tmp_path: Path, hf_text_dir: Path, tok_file: Path,
                                                      capsys) -> None:  # fmt: skip
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    base = [str(tmp_path / "gpt2"), "--data", str(hf_text_dir), "--tokenizer", str(tok_file), "--no-progress",
            "--cache-dir", "", "--train-len", "16", "--max-tokens", "100", "--factors", "1"]  # fmt: skip
    capsys.readouterr()
    assert cli_eval.main([*base, "--position", "alibi"]) == 2
    assert "cannot apply" in capsys.readouterr().err
    assert cli_eval.main(base) == 0  # its own attention is fine


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--config", "tiny-qwen3", "--checkpoint", "x"], "exactly one"),
        (["--finetune", "lora"], "checkpoint"),
        (["--position", "native", "--sigma", "4"], "native"),
        (["--position", "window-alibi"], "window"),
        (["--checkpoint", "/nonexistent/model"], "not a directory"),
        (["--config", "/nonexistent/config.json"], "no such file"),
        (["--resume"], "train_config.json"),
        (["--scheme", "nope"], "scheme"),
    ],
)
def test_cli_refusals_are_one_line_and_change_nothing(tmp_path: Path, hf_text_dir: Path, capsys, argv, match) -> None:
    out = tmp_path / "run"
    capsys.readouterr()
    code = cli.main(["--out", str(out), *flags(hf_text_dir), *argv])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1 and match in err[0] and err[0].startswith("plsh train-hf: error:"), err
    assert not out.exists() or not any(out.iterdir())


def test_resume_refuses_a_conflicting_flag_and_takes_more_steps(base_run: Path, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    assert cli.main(["--out", str(base_run), "--resume", "--num-samples", "9"]) == 2
    assert "--num-samples 9 conflicts with the run's 4" in capsys.readouterr().err
    assert cli.main(["--out", str(base_run), "--preset", "tiny"]) == 2  # a new run over an old one: refused
    assert "--resume" in capsys.readouterr().err


def test_presets_and_flags_agree() -> None:
    assert set(PRESETS) == {"paper-qwen3-0.6b", "paper-mistral-7b", "tiny"}
    paper = PRESETS["paper-qwen3-0.6b"]
    assert (paper["seq_len"], paper["num_samples"], paper["sigma"], paper["config"]) == (8192, 100, 256.0, "qwen3-0.6b")
    mistral = PRESETS["paper-mistral-7b"]
    assert (mistral["seq_len"], mistral["num_samples"], mistral["sigma"], mistral["lora_r"]) == (4096, 15, 256.0, 16)
    for name, preset in PRESETS.items():  # every preset is valid (the Mistral one once a checkpoint is named)
        kw = dict(preset)
        if "config" not in kw:
            kw["checkpoint"] = "somewhere"
        HFTrainConfig(out_dir="x", **kw).validate()
        assert name
    assert set(cli.HF_TRAIN_FLAGS) == {f for f in HFTrainConfig.__dataclass_fields__}
    assert HF_POSITIONS == ("plsh", "alibi", "window-alibi", "native")


def test_datasets_folder_as_data(tmp_path: Path, hf_text_dir: Path) -> None:
    datasets = pytest.importorskip("datasets")
    texts = [p.read_text() for p in sorted(hf_text_dir.glob("*.txt"))]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:6]}),
                               "validation": datasets.Dataset.from_dict({"text": texts[6:8]}),
                               "test": datasets.Dataset.from_dict({"text": texts[8:]})})  # fmt: skip
    dd.save_to_disk(str(tmp_path / "ds"))
    splits = TD.load_training_splits(str(tmp_path / "ds"))
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [6, 2, 2]
    assert splits["train"][0].text == texts[0]


def test_two_process_ddp_equals_one_process_with_double_batch(
    hf_text_dir: Path, tok_file: Path, tmp_path: Path
) -> None:
    """torchrun --nproc_per_node 2 with batch 2 per process == one process with batch 4 (gloo on CPU)."""
    args = [*flags(hf_text_dir, tok_file), "--steps", "3", "--eval-interval", "3", "--ckpt-interval", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "positional_lsh.cli", "train-hf", "--out", str(tmp_path / "ddp"), *args, "--batch-size", "2"]  # fmt: skip
    proc = run_torchrun(cmd, env, done="checkpoint in")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cpu x 2" in proc.stdout
    assert cli.main(["--out", str(tmp_path / "one"), *args, "--batch-size", "4"]) == 0
    a, b = trained(tmp_path / "ddp"), trained(tmp_path / "one")
    for k in a:  # float32 all-reduce vs one batch: summation order only (as tests/lm/test_train.py)
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=5e-5)
    assert json.loads((checkpoint_dir(tmp_path / "ddp") / hf.SWAP_FILE).read_text())["step"] == 3


def test_sigterm_saves_a_checkpoint_and_resumes(hf_text_dir: Path, tok_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "sig"
    args = [*flags(hf_text_dir, tok_file), "--steps", "400", "--ckpt-interval", "1000", "--eval-interval", "1000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "positional_lsh.cli", "train-hf", "--out", str(out), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "log.jsonl").is_file() and (out / "log.jsonl").read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "interrupted by SIGTERM" in err
    step = torch.load(checkpoint_dir(out) / "trainer_state.pt", weights_only=True)["step"]
    assert 1 <= step < 400
    assert cli.main(["--out", str(out), "--resume", "--steps", str(step + 1), "--no-progress"]) == 0
    assert json.loads((checkpoint_dir(out) / hf.SWAP_FILE).read_text())["step"] == step + 1


def test_gradient_checkpointing_and_bf16_autocast(hf_text_dir: Path, tok_file: Path, tmp_path: Path) -> None:
    args = [*flags(hf_text_dir, tok_file), "--steps", "2", "--eval-interval", "2", "--ckpt-interval", "2"]
    runs = {"plain": [], "ckpt": ["--gradient-checkpointing"], "bf16": ["--autocast", "bfloat16"]}
    for name, extra in runs.items():
        assert cli.main(["--out", str(tmp_path / name), *args, *extra]) == 0
    plain, ckpt = trained(tmp_path / "plain"), trained(tmp_path / "ckpt")
    for k in plain:  # recomputation in the backward reuses the step's partitions: the same update
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-7)
    losses = {n: [r["loss"] for r in log(tmp_path / n) if "loss" in r] for n in runs}
    assert all(abs(a - b) < 0.05 for a, b in zip(losses["bf16"], losses["plain"], strict=True)), losses
