"""plsh train-hf settings (issue 27, items 1, 2, 14, 19, 25): presets apply only what the run uses and say what they
set, flags the run would ignore are refused, a bad ``--config`` size is one line, attention dropout is really off,
and ``plsh eval`` scores a native run at its recorded training length. Nothing is downloaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from positional_lsh.cli import eval as cli_eval
from positional_lsh.cli import train_hf as cli
from positional_lsh.integrations.hf import train_model as TM
from positional_lsh.integrations.hf_train_config import BUILTIN_CONFIGS, PRESETS, HFTrainConfig
from positional_lsh.lm.eval_models import load_for_eval


def flags(data: Path, tok: Path | None = None) -> list[str]:
    out = ["--preset", "tiny", "--data", str(data), "--cache-dir", "", "--seq-len", "32", "--steps", "2",
           "--eval-interval", "2", "--ckpt-interval", "2", "--no-progress", "--threads", "1"]  # fmt: skip
    return out + (["--tokenizer", str(tok)] if tok is not None else [])


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_train_hf_arguments(p)
    return p.parse_args(["--out", "x", *argv])


def one_error(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [x for x in capsys.readouterr().err.splitlines() if x.strip()]


# item 2: a preset sets only what applies to the chosen position, and says what it set


def test_native_preset_drops_the_plsh_settings() -> None:
    cfg = cli.config_from_args(parse(["--preset", "tiny", "--position", "native"]))
    cfg.validate()  # refused before: "sigma/slopes set the ALiBi slopes ..."
    assert cfg.sigma is None and cfg.num_samples == HFTrainConfig.num_samples
    assert (cfg.seq_len, cfg.config, cfg.lr) == (PRESETS["tiny"]["seq_len"], "tiny-qwen3", PRESETS["tiny"]["lr"])


def test_alibi_preset_keeps_the_slopes_not_the_samples() -> None:
    cfg = cli.config_from_args(parse(["--preset", "tiny", "--position", "alibi"]))
    assert cfg.num_samples == HFTrainConfig.num_samples != PRESETS["tiny"]["num_samples"]  # T is plsh-only
    assert cfg.sigma == PRESETS["tiny"]["sigma"]
    line = cli.describe_preset(parse(["--preset", "tiny", "--position", "alibi", "--lr", "1e-3"]))
    assert line is not None and line.startswith("plsh train-hf: preset tiny sets config=tiny-qwen3")
    assert "sigma=16.0" in line and ", lr=" not in line and "not applied" in line
    assert "num_samples" in line.split("not applied")[1]


def test_flags_given_override_the_preset_even_across_sigma_and_slopes() -> None:
    cfg = cli.config_from_args(parse(["--preset", "tiny", "--slopes", "0.5,0.25,0.125,0.0625"]))
    cfg.validate()  # refused before: the preset's sigma and the flag's slopes
    assert cfg.sigma is None and cfg.slopes == (0.5, 0.25, 0.125, 0.0625)
    mistral = cli.config_from_args(parse(["--preset", "paper-mistral-7b", "--finetune", "full", "--checkpoint", "m"]))
    assert mistral.lora_r == HFTrainConfig.lora_r and mistral.finetune == "full"  # LoRA settings not applied


def test_help_says_flags_override_the_preset() -> None:
    p = argparse.ArgumentParser()
    cli.add_train_hf_arguments(p)
    help_text = " ".join(p.format_help().split())
    assert "flags given override them" in help_text and "only what applies" in help_text


# item 14: flags the run would ignore are refused in one line, nothing written


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--position", "native", "--scheme", "gamma"], "--scheme applies to --position plsh only"),
        (["--lora-r", "8"], "--lora-r applies to --finetune lora only"),
        (["--position", "alibi", "--num-samples", "3"], "--num-samples applies to --position plsh only"),
        (["--position", "native", "--sigma", "4"], "--sigma sets the ALiBi slopes"),
    ],
)
def test_ignored_flags_are_refused(tmp_path: Path, hf_text_dir: Path, capsys, argv, match) -> None:
    out = tmp_path / "run"
    capsys.readouterr()
    code = cli.main(["--out", str(out), *flags(hf_text_dir), *argv])
    err = one_error(capsys)
    assert code == 2 and len(err) == 1 and match in err[0] and err[0].startswith("plsh train-hf: error:"), err
    assert not out.exists()


# item 19: a bad size in --config is one line naming the file and the field


@pytest.mark.parametrize(("field", "value"), [("hidden_size", -5), ("num_hidden_layers", 0), ("head_dim", "16")])
def test_bad_config_size_is_one_line(tmp_path: Path, hf_text_dir: Path, capsys, field, value) -> None:
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**BUILTIN_CONFIGS["tiny-qwen3"], field: value}), encoding="utf-8")
    out = tmp_path / "run"
    capsys.readouterr()
    code = cli.main(["--out", str(out), *flags(hf_text_dir), "--config", str(file)])
    err = one_error(capsys)
    assert code == 2 and len(err) == 1 and str(file) in err[0] and field in err[0], err
    assert not out.exists()


# item 25: attention dropout in --config is set to 0 in the attention modules too, not refused


def test_attention_dropout_is_really_off(tmp_path: Path, hf_text_dir: Path, tok_file: Path, capsys) -> None:
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**BUILTIN_CONFIGS["tiny-qwen3"], "attention_dropout": 0.1}), encoding="utf-8")
    cfg = HFTrainConfig(out_dir=str(tmp_path / "x"), config=str(file), num_samples=2, sigma=16.0)
    model, _ = TM.build_model(cfg, 300)
    assert model.config.attention_dropout == 0
    assert [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")] == [0.0, 0.0]
    x = torch.randint(0, 300, (2, 16))
    model(input_ids=x).logits.sum().backward()  # refused before: "attention dropout (p=0.1) is not supported"
    out = tmp_path / "run"
    assert cli.main(["--out", str(out), *flags(hf_text_dir, tok_file), "--config", str(file)]) == 0
    assert "attention dropout 0.1 is set to 0" in capsys.readouterr().out


def test_attention_dropout_off_in_bloom_modules() -> None:
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, attention_dropout=0.2))
    assert TM.disable_attention_dropout(model) == pytest.approx(0.2)
    assert model.config.attention_dropout == 0
    assert all(m.self_attention.attention_dropout.p == 0 for m in model.transformer.h)


# item 1 (and 2): the §5.1 RoPE baseline is one flag away, and plsh eval scores it at its training length


def test_native_run_is_scored_at_its_recorded_training_length(tmp_path: Path, hf_text_dir: Path, tok_file: Path,
                                                              capsys) -> None:  # fmt: skip
    out = tmp_path / "native"
    capsys.readouterr()
    assert cli.main(["--out", str(out), *flags(hf_text_dir, tok_file), "--position", "native"]) == 0
    printed = capsys.readouterr().out
    assert "plsh train-hf: preset tiny sets" in printed and "not applied (unused by this run): num_samples" in printed
    saved = json.loads((out / "train_config.json").read_text())["train"]
    assert (saved["position"], saved["sigma"], saved["seq_len"]) == ("native", None, 32)
    kw = {"label": None, "data": str(hf_text_dir), "split": "validation", "tokenizer": None, "cache_dir": None,
          "seed": 0, "device": torch.device("cpu")}  # fmt: skip
    adapter, _ = load_for_eval(out, train_len=None, **kw)
    assert adapter.train_len == 32  # was 4096, the config's max_position_embeddings
    step = next((out / "steps").iterdir())
    assert load_for_eval(step, train_len=None, **kw)[0].train_len == 32  # a step directory of the run, too
    assert load_for_eval(out, train_len=64, **kw)[0].train_len == 64  # --train-len still overrides
    assert cli_eval.main([str(out), "--data", str(hf_text_dir), "--no-progress", "--cache-dir", "", "--factors", "1",
                          "--max-tokens", "200"]) == 0  # fmt: skip
