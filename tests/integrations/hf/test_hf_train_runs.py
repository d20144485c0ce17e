"""plsh train-hf, round three (issue 27, items 5, 7, 8, 16, 23): refusals that only the attention call makes leave
``--out`` as it was; a stale ``tokenizer.json`` in ``--out`` is refused; step counts say optimizer steps (and
micro-batches); ``hf:`` data offline is one line before any retry; ``--dry-run`` prints the memory estimate from the
model config alone. Nothing is downloaded, nothing touches the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from positional_lsh.cli import train_hf as cli
from positional_lsh.integrations.hf import train as T
from positional_lsh.integrations.hf import train_data as TD
from positional_lsh.integrations.hf import train_model as TM
from positional_lsh.integrations.hf_train_config import BUILTIN_CONFIGS, HFTrainConfig
from positional_lsh.lm import data as D
from positional_lsh.lm.train_loop import step_label


def flags(data: Path, *more: str) -> list[str]:
    return ["--preset", "tiny", "--data", str(data), "--cache-dir", "", "--seq-len", "32", "--steps", "2",
            "--eval-interval", "2", "--ckpt-interval", "2", "--no-progress", "--threads", "1", *more]  # fmt: skip


def snapshot(folder: Path) -> dict[str, bytes] | None:
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("plsh train-hf: error:"), err
    return err[0]


def gqa_config(tmp_path: Path) -> Path:
    d = dict(BUILTIN_CONFIGS["tiny-qwen3"], num_key_value_heads=3)  # 4 query heads: not a multiple of 3
    (tmp_path / "gqa.json").write_text(json.dumps(d), encoding="utf-8")
    return tmp_path / "gqa.json"


# -- item 23: refusals after the start leave --out as it was ----------------------------------------------------------


@pytest.mark.parametrize("prepared", [False, True])
def test_a_head_mismatch_refused_by_the_attention_leaves_out_unchanged(tmp_path: Path, hf_text_dir: Path, capsys,
                                                                       prepared: bool) -> None:  # fmt: skip
    out = tmp_path / "run"
    if prepared:
        out.mkdir()
        (out / "notes.txt").write_text("mine\n", encoding="utf-8")
    before = snapshot(out)
    capsys.readouterr()
    code = cli.main(
        ["--out", str(out), *flags(hf_text_dir, "--config", str(gqa_config(tmp_path)), "--vocab-size", "300")]
    )
    assert code == 2 and "key/value heads (3)" in one_line_error(capsys)
    assert snapshot(out) == before  # absent, or the same files with the same bytes: no tokenizer, config or log


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton backend runs on a GPU")
def test_triton_on_cpu_refused_before_anything_is_written(tmp_path: Path, hf_text_dir: Path, tok_file: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests' interpreter would run it
    env["PYTHONPATH"] = str(Path(T.__file__).parents[3]) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "positional_lsh.cli", "train-hf", "--out", str(out),
                           *flags(hf_text_dir, "--tokenizer", str(tok_file), "--attn-backend", "triton")],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(err) == 1 and "Triton" in err[0] and "CUDA" in err[0], proc.stderr
    assert not out.exists()


def test_the_probe_leaves_the_run_unchanged(hf_text_dir: Path, tok_file: Path, tmp_path: Path) -> None:
    """The attention probe restores the swap's step and the random state: the run trains as without it."""
    cfg = HFTrainConfig(config="tiny-qwen3", out_dir=str(tmp_path / "x"), position="plsh", num_samples=4, sigma=16.0,
                        seq_len=16, seed=3)  # fmt: skip
    model, _ = TM.build_model(cfg, 300)
    swap = T.current_swap(model)
    assert swap is not None
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=x, use_cache=False).logits
    swap.set_step(0)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    TM.probe_attention(model, cfg, torch.device("cpu"), None)
    assert swap.step == 0 and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model(input_ids=x, use_cache=False).logits, ref)


# -- item 16: a stale tokenizer in --out ----------------------------------------------------------------------------


def test_a_tokenizer_of_another_size_in_out_is_refused(tmp_path: Path, hf_text_dir: Path, tok_file: Path,
                                                       capsys) -> None:  # fmt: skip
    out = tmp_path / "run"
    out.mkdir()
    (out / "tokenizer.json").write_bytes(tok_file.read_bytes())  # 300 tokens, e.g. left by an earlier attempt
    before = snapshot(out)
    capsys.readouterr()
    assert cli.main(["--out", str(out), *flags(hf_text_dir, "--vocab-size", "400")]) == 2
    line = one_line_error(capsys)
    assert str(out / "tokenizer.json") in line and "300" in line and "400" in line
    assert snapshot(out) == before
    # Asked for its own size, the prepared tokenizer is used.
    assert cli.main(["--out", str(out), *flags(hf_text_dir, "--vocab-size", "300")]) == 0
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes()


def test_a_refused_attempt_then_another_vocab_size_trains_a_new_tokenizer(tmp_path: Path, hf_text_dir: Path,
                                                                          capsys) -> None:  # fmt: skip
    out = tmp_path / "run"
    code = cli.main(
        ["--out", str(out), *flags(hf_text_dir, "--config", str(gqa_config(tmp_path)), "--vocab-size", "300")]
    )
    assert code == 2 and not out.exists()
    capsys.readouterr()
    assert cli.main(["--out", str(out), *flags(hf_text_dir, "--vocab-size", "400")]) == 0
    tok = D.BPETokenizer.load(out / "tokenizer.json")
    saved = json.loads((out / "train_config.json").read_text())
    assert tok.vocab_size > 300 and saved["model"]["vocab_size"] == tok.vocab_size


# -- item 5: optimizer steps and micro-batches --------------------------------------------------------------------


def test_step_counts_say_optimizer_steps_and_micro_batches(tmp_path: Path, hf_text_dir: Path, tok_file: Path,
                                                           capsys) -> None:  # fmt: skip
    assert step_label(10, 1) == "step 10"
    assert step_label(10, 2) == "step 10 (optimizer; 20 micro-batches)"
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(["--out", str(out), *flags(hf_text_dir, "--tokenizer", str(tok_file), "--grad-accum", "2")]) == 0
    text = capsys.readouterr().out
    assert "x 2 optimizer steps" in text and "(2 micro-batches)" in text
    assert "step 2 (optimizer; 4 micro-batches): train loss" in text
    assert [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r] == [1, 2]


# -- item 7: hf: data offline ---------------------------------------------------------------------------------------


def _no_hub(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """``datasets.load_dataset`` as it is offline without the data cached; records the offline flag it saw."""
    datasets = pytest.importorskip("datasets")
    seen: list[bool] = []

    def load_dataset(*args: object, **kwargs: object) -> None:
        seen.append(bool(datasets.config.HF_HUB_OFFLINE))
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return seen


def test_hub_data_offline_is_one_line_before_any_retry(tmp_path: Path, capsys, monkeypatch) -> None:
    seen = _no_hub(monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(TD, "hub_reachable", lambda timeout=3.0: False)  # simulated: no network in tests
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(["--preset", "paper-qwen3-0.6b", "--device", "cpu", "--out", str(out)]) == 2
    line = one_line_error(capsys)
    assert "hf:wikitext:wikitext-103-raw-v1" in line and "offline" in line and "--data FOLDER" in line
    assert "HF_HUB_OFFLINE=1" in line and "load_dataset('wikitext', 'wikitext-103-raw-v1')" in line
    assert seen == [True]  # one try, in offline mode (the cache only): no retries against the Hub
    assert not out.exists()


def test_hf_hub_offline_is_honoured_without_probing_the_network(tmp_path: Path, capsys, monkeypatch) -> None:
    seen = _no_hub(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def probe(timeout: float = 3.0) -> bool:
        raise AssertionError("HF_HUB_OFFLINE=1: the network must not be probed")

    monkeypatch.setattr(TD, "hub_reachable", probe)
    capsys.readouterr()
    assert cli.main(["--preset", "paper-qwen3-0.6b", "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    assert "offline" in one_line_error(capsys) and seen == [True]


def test_hub_offline_reads_the_environment(monkeypatch) -> None:
    monkeypatch.setattr(TD, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert not TD.hub_offline()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert TD.hub_offline()


# -- item 8: the memory estimate and --dry-run --------------------------------------------------------------------


def test_dry_run_prints_the_estimate_from_the_config_alone(tmp_path: Path, hf_text_dir: Path, tok_file: Path, capsys,
                                                           monkeypatch) -> None:  # fmt: skip
    out = tmp_path / "run"
    capsys.readouterr()
    with monkeypatch.context() as m:  # no weights are loaded or built on a real device
        m.setattr(TM, "build_model", lambda *a, **k: pytest.fail("--dry-run built the model"))
        m.setattr(TM, "load_local_model", lambda *a, **k: pytest.fail("--dry-run loaded weights"))
        assert cli.main(["--out", str(out), *flags(hf_text_dir, "--tokenizer", str(tok_file), "--dry-run")]) == 0
    printed = capsys.readouterr().out.splitlines()
    lines = [line for line in printed if line.startswith("plsh train-hf: memory estimate")]  # (and the preset's line)
    assert len(lines) == 1 and lines[0].startswith("plsh train-hf: memory estimate per process: parameters ")
    assert all(line.startswith("plsh train-hf: preset ") for line in printed if line not in lines)
    assert not out.exists()
    model, _ = TM.build_model(HFTrainConfig(config="tiny-qwen3", out_dir=str(out)), 300)
    n = sum(p.numel() for p in model.parameters())
    assert f"parameters {n:,} ({n:,} trained)" in lines[0] and "seq_len 32, T=4, batch 4" in lines[0]
    for part in ("gradients", "optimizer state", "activations"):
        assert part in lines[0]
    # A normal run prints the same line first (after the preset's line).
    assert cli.main(["--out", str(out), *flags(hf_text_dir, "--tokenizer", str(tok_file))]) == 0
    run_lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("plsh train-hf: preset ")]
    assert run_lines[0] == lines[0]


def test_dry_run_of_a_lora_checkpoint_counts_the_adapters(tmp_path: Path, capsys, monkeypatch) -> None:
    pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(BUILTIN_CONFIGS["tiny-qwen3"])
    AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d)).save_pretrained(tmp_path / "m")
    monkeypatch.setattr(TM, "load_local_model", lambda *a, **k: pytest.fail("--dry-run loaded weights"))
    capsys.readouterr()
    assert cli.main(["--out", str(tmp_path / "run"), "--checkpoint", str(tmp_path / "m"), "--finetune", "lora",
                     "--device", "cpu", "--dry-run"]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip()
    trained = int(line.split("(")[1].split(" trained")[0].replace(",", ""))
    total = int(line.split("parameters ")[1].split(" ")[0].replace(",", ""))
    assert 0 < trained < total and not (tmp_path / "run").exists()
