"""transformers Trainer resumed from a checkpoint equals the uninterrupted run, bit for bit (issue 18 C)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf import V, tiny  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from positional_lsh.integrations import hf  # noqa: E402

STEPS, STOP = 6, 3


class _StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == STOP:
            control.should_training_stop = True


def _data(n: int = 24, length: int = 24) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(1, V, (n, length), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _run(out, *, resume: bool, stop: bool, callback: bool):
    model = tiny("llama", dtype=torch.float32)
    hf.use_positional_lsh(model, num_samples=3, seed=11, slopes=1 / 8)
    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=5e-3, save_steps=STOP, save_strategy="steps", logging_steps=1, report_to=[], use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    callbacks = ([hf.SwapStepCallback()] if callback else []) + ([_StopAt()] if stop else [])
    trainer = Trainer(model=model, args=args, train_dataset=_data(), callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{STOP}") if resume else None)
    losses = {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r}
    return model, losses


@pytest.fixture(autouse=True)
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def test_trainer_resume_equals_uninterrupted_with_the_callback(tmp_path):
    full, full_losses = _run(tmp_path / "full", resume=False, stop=False, callback=True)
    _, first = _run(tmp_path / "split", resume=False, stop=True, callback=True)
    assert sorted(first) == [1, 2, 3]
    ckpt = tmp_path / "split" / f"checkpoint-{STOP}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["SwapStepCallback"]["attributes"]["step"] == STOP * 2  # 2 micro-batches/step
    assert json.loads((ckpt / hf.SWAP_FILE).read_text())["step"] == STOP * 2  # the settings travel too
    resumed, rest = _run(tmp_path / "split", resume=True, stop=False, callback=True)
    assert hf.current_swap(resumed).step == STEPS * 2
    for step in range(1, STEPS + 1):  # bit for bit, float32 on the CPU
        assert (first | rest)[step] == full_losses[step], step
    for (name, a), b in zip(full.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_without_the_callback_resume_reuses_the_first_partitions(tmp_path):
    """What the callback fixes: without it the resumed steps restart at step 0 and their losses differ."""
    _, full_losses = _run(tmp_path / "full", resume=False, stop=False, callback=False)
    _run(tmp_path / "split", resume=False, stop=True, callback=False)
    resumed, rest = _run(tmp_path / "split", resume=True, stop=False, callback=False)
    assert hf.current_swap(resumed).step == (STEPS - STOP) * 2
    assert any(rest[s] != full_losses[s] for s in range(STOP + 1, STEPS + 1))
