"""plsh train-hf, round four (issue 34, items 2-4): ``--fsdp`` (FSDP2) over 2 gloo processes equals one process and
resumes, its checkpoint loads in ``plsh eval``; ``--finetune full`` keeps float32 master weights and AdamW state; the
memory estimate models what the run keeps (its measured accuracy: benchmarks/train_memory.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_train_runs import flags, one_line_error, snapshot

from positional_lsh.cli import eval as cli_eval
from positional_lsh.cli import train_hf as cli
from positional_lsh.integrations import hf
from positional_lsh.integrations.hf import train_model as TM
from positional_lsh.integrations.hf_train_config import BUILTIN_CONFIGS, PRESETS, HFTrainConfig
from positional_lsh.lm.checkpoint import checkpoint_dir

from conftest import run_torchrun

# Under torchrun: one process group for three jobs: stopped after step 2, resumed to step 3, then a LoRA fine-tune of
# the result on a bfloat16 base (float32 adapters: FSDP2 units of one dtype each) with the arguments in $LORA_ARGS.
_DRIVER = """
import json, os, sys
import torch.distributed as dist
from positional_lsh.cli import main
dist.init_process_group("gloo")
args = sys.argv[1:]
assert main(["train-hf", *args, "--stop-after", "2"]) == 0
assert main(["train-hf", "--out", args[args.index("--out") + 1], "--resume", "--no-progress", "--threads", "1"]) == 0
assert main(["train-hf", *json.loads(os.environ["LORA_ARGS"]), "--batch-size", "2", "--fsdp"]) == 0
dist.destroy_process_group()
"""


def _trained(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint_dir(run) / "trainer_state.pt", weights_only=True)["trainable"]


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if "loss" in r]


def test_fsdp_on_two_processes_equals_one_process_resumes_and_evaluates(hf_text_dir: Path, tok_file: Path,
                                                                        tmp_path: Path, capsys) -> None:  # fmt: skip
    """2 gloo processes, --fsdp with gradient checkpointing, batch 2 each, stopped after step 2 and resumed to step 3
    == one process, batch 4, 3 steps uninterrupted (float32 summation order); the checkpoint loads with its swap and
    in plsh eval; a sharded LoRA fine-tune of it on a bf16 base follows one process."""
    args = [*flags(hf_text_dir, "--tokenizer", str(tok_file)), "--steps", "3", "--eval-interval", "3",
            "--ckpt-interval", "1"]  # fmt: skip
    (tmp_path / "driver.py").write_text(_DRIVER, encoding="utf-8")
    lora = [*flags(hf_text_dir), "--checkpoint", str(tmp_path / "fsdp"), "--finetune", "lora", "--lora-r", "4",
            "--dtype", "bfloat16"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "LORA_ARGS": json.dumps(["--out", str(tmp_path / "lora"), *lora])}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "driver.py"), "--out", str(tmp_path / "fsdp"), *args, "--batch-size", "2", "--fsdp",
           "--gradient-checkpointing"]  # fmt: skip
    proc = run_torchrun(cmd, env, done=None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cpu x 2 (FSDP)" in proc.stdout and "FSDP over 2 processes" in proc.stdout
    assert cli.main(["--out", str(tmp_path / "one"), *args, "--batch-size", "4"]) == 0
    a, b = _trained(tmp_path / "fsdp"), _trained(tmp_path / "one")
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "fsdp")), torch.tensor(_losses(tmp_path / "one")),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    step_dir = checkpoint_dir(tmp_path / "fsdp")
    assert json.loads((step_dir / hf.SWAP_FILE).read_text())["step"] == 3
    model, _ = hf.load_local_model(step_dir)  # a full state dict: the saved weights are the trained ones
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), a[name], rtol=0, atol=0)
    capsys.readouterr()
    common = ["--data", str(hf_text_dir), "--factors", "1", "--max-tokens", "200", "--samples", "none",
              "--no-progress", "--cache-dir", ""]  # fmt: skip
    assert cli_eval.main([str(tmp_path / "fsdp"), *common]) == 0
    assert "saved with the checkpoint" in capsys.readouterr().err
    # LoRA on a bf16 base, sharded: the losses of one process (bf16 rounding apart), an adapter that loads
    assert cli.main(["--out", str(tmp_path / "lora1"), *lora, "--batch-size", "4"]) == 0
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "lora")), torch.tensor(_losses(tmp_path / "lora1")),
                               rtol=1e-2, atol=0)  # fmt: skip
    assert (checkpoint_dir(tmp_path / "lora") / "adapter_model.safetensors").is_file()
    adapted, _ = hf.load_local_model(checkpoint_dir(tmp_path / "lora"))
    assert hf.current_swap(adapted) is not None
    capsys.readouterr()
    before = snapshot(tmp_path / "fsdp")  # a sharded run resumed in one process: one line, nothing changed
    assert cli.main(["--out", str(tmp_path / "fsdp"), "--resume", "--no-progress"]) == 2
    assert "resume it under torchrun" in one_line_error(capsys)
    assert snapshot(tmp_path / "fsdp") == before


@pytest.mark.parametrize("extra", [["--fsdp"], ["--nproc", "2"]])
def test_fsdp_mistakes_are_one_line_and_change_nothing(tmp_path: Path, hf_text_dir: Path, capsys,
                                                       extra: list[str]) -> None:  # fmt: skip
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n", encoding="utf-8")
    before = snapshot(out)
    capsys.readouterr()
    assert cli.main(["--out", str(out), "--overwrite", *flags(hf_text_dir), *extra]) == 2
    assert extra[0] in one_line_error(capsys)
    assert snapshot(out) == before


def test_full_fine_tuning_keeps_float32_masters(tmp_path: Path, hf_text_dir: Path, tok_file: Path, capsys) -> None:
    """A bfloat16 checkpoint fine-tuned fully trains float32 weights and AdamW state, and saves float32 weights;
    --dtype bfloat16 with --finetune full is refused (one line naming --dtype); the Mistral preset's bf16 base dtype
    applies to LoRA only."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(BUILTIN_CONFIGS["tiny-qwen3"], vocab_size=300)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "m")
    run = tmp_path / "full"
    assert cli.main(["--out", str(run), *flags(hf_text_dir, "--tokenizer", str(tok_file)), "--checkpoint",
                     str(tmp_path / "m"), "--autocast", "bfloat16", "--steps", "1"]) == 0  # fmt: skip
    state = torch.load(checkpoint_dir(run) / "trainer_state.pt", weights_only=True)
    assert {t.dtype for t in state["trainable"].values()} == {torch.float32}
    moments = [v for s in state["optimizer"]["state"].values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    assert {t.dtype for t in load_file(checkpoint_dir(run) / "model.safetensors").values()} == {torch.float32}
    capsys.readouterr()
    assert cli.main(["--out", str(tmp_path / "bf"), *flags(hf_text_dir), "--dtype", "bfloat16"]) == 2
    assert "--dtype" in one_line_error(capsys) and not (tmp_path / "bf").exists()
    parser = argparse.ArgumentParser()
    cli.add_train_hf_arguments(parser)
    args = parser.parse_args(["--out", "x", "--preset", "paper-mistral-7b", "--finetune", "full", "--checkpoint", "x"])
    applied, skipped = cli.preset_settings(args)
    assert PRESETS["paper-mistral-7b"]["dtype"] == "bfloat16" and "dtype" not in applied and "dtype" in skipped
    with pytest.raises(ValueError, match="dtype"):
        HFTrainConfig(out_dir="x", config="tiny-qwen3", dtype="bfloat16").validate()


def _qwen3(**kw: int):
    from transformers import AutoConfig

    d = dict(BUILTIN_CONFIGS["tiny-qwen3"], **kw)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _saved_bytes_per_token(config, position: str, seq_len: int) -> float:
    """The bytes autograd keeps for the backward (unique storages, parameters left out) per token, counted with
    saved_tensors_hooks on a real forward: an independent measure of the estimate's activation term."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    if position == "plsh":
        hf.use_positional_lsh(model, num_samples=4, slopes=1 / 16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randint(0, config.vocab_size, (1, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=x, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
    return sum(seen.values()) / seq_len


@pytest.mark.parametrize("position", ["native", "plsh"])
def test_memory_estimate_terms(position: str) -> None:
    """The activation term matches what autograd keeps (counted, within 5 %) and does not grow with T; LoRA adapters
    count float32 on a bf16 base; full fine-tuning counts float32 weights; FSDP divides the states by the world."""
    config = _qwen3(hidden_size=128, intermediate_size=384, num_hidden_layers=3, head_dim=32)
    cfg = HFTrainConfig(config="tiny-qwen3", out_dir="x", seq_len=256, batch_size=1, position=position,
                        **({"num_samples": 4, "sigma": 16.0} if position == "plsh" else {}))  # fmt: skip
    m = TM.estimate_memory(cfg, config, 1000, 1000)
    measured = _saved_bytes_per_token(config, position, 256) * 256
    assert abs(m["activations"] / measured - 1) < 0.05, (m["activations"], measured)
    if position == "plsh":
        more_t = TM.estimate_memory(HFTrainConfig(**{**cfg.__dict__, "num_samples": 64}), config, 1000, 1000)
        assert more_t == m  # the op keeps its merged out and lse, not T outputs
    assert (m["params"], m["grads"], m["optimizer"]) == (4000, 4000, 8000)
    lora = HFTrainConfig(**{**cfg.__dict__, "config": None, "checkpoint": "c", "finetune": "lora", "dtype": "bfloat16"})
    m_lora = TM.estimate_memory(lora, config, 1000, 100)
    assert (m_lora["params"], m_lora["grads"], m_lora["optimizer"]) == (900 * 2 + 100 * 4, 400, 800)
    ckpt = TM.estimate_memory(HFTrainConfig(**{**cfg.__dict__, "gradient_checkpointing": True}), config, 1000, 1000)
    assert ckpt["activations"] < m["activations"] / 2
    sharded = TM.estimate_memory(HFTrainConfig(**{**cfg.__dict__, "fsdp": True}), config, 1000, 1000, world=4)
    assert (sharded["params"], sharded["grads"], sharded["optimizer"]) == (1000, 1000, 2000)
    assert sharded["activations"] == m["activations"]
    big = [TM.estimate_memory(HFTrainConfig(**{**cfg.__dict__, "fsdp": f}), config, 10**6, 10**6, world=4)
           for f in (False, True)]  # fmt: skip
    assert big[1]["working"] > big[0]["working"]  # gathered layers


def test_dry_run_estimates_per_rank_under_fsdp(tmp_path: Path, hf_text_dir: Path, tok_file: Path, capsys) -> None:
    capsys.readouterr()
    base = ["--out", str(tmp_path / "run"), *flags(hf_text_dir, "--tokenizer", str(tok_file)), "--dry-run"]
    assert cli.main(base) == 0
    one = capsys.readouterr().out.splitlines()[-1]
    assert cli.main([*base, "--fsdp", "--nproc", "4"]) == 0
    four = capsys.readouterr().out.splitlines()[-1]
    assert "FSDP over 4 processes" in four and "FSDP" not in one
    grads = [float(x.split("gradients ")[1].split(" ")[0]) for x in (one, four)]
    assert grads[1] == pytest.approx(grads[0] / 4, rel=0.01)
    assert not (tmp_path / "run").exists()
