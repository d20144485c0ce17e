""":class:`SwapStepCallback`: the swap's training step as part of a transformers ``Trainer`` checkpoint.

Positional-LSH training partitions are keyed by the swap's step (:attr:`AttentionSwap.step`, one per training-mode
model call): a run resumed with ``Trainer.train(resume_from_checkpoint=...)`` must continue from the saved step, or
its steps reuse the first steps' partitions. The callback is an ``ExportableState``: ``Trainer`` writes its state
(the step) into every checkpoint's ``trainer_state.json``, and on resume the callback sets the step back before the
first step, whatever ``TrainingArguments.restore_callback_states_from_checkpoint`` says. It also writes the swap's
settings (``positional_lsh_swap.json``) into each ``checkpoint-N`` folder, so a checkpoint of a ``PeftModel`` (an
adapter) carries them too.

This module imports ``transformers.TrainerCallback``, which needs accelerate (``pip install
'positional-lsh[train]'``); ``positional_lsh.integrations.hf`` loads it only when ``hf.SwapStepCallback`` is used.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from positional_lsh.integrations.hf.attention_swap import AttentionSwap
from positional_lsh.integrations.hf.saved import write_swap_settings
from positional_lsh.integrations.hf.swap import current_swap


class SwapStepCallback(TrainerCallback, ExportableState):
    """Saves and restores the swap's training step with ``Trainer`` checkpoints (exact resume).

    Args:
        swap: the swap to follow, or ``None``: the swap in effect on the trainer's model (looked up at each event).

    Usage::

        hf.use_positional_lsh(model, num_samples=16, slopes=1 / 256)
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[hf.SwapStepCallback()])
        trainer.train(resume_from_checkpoint=True)   # continues the partitions from the saved step
    """

    def __init__(self, swap: AttentionSwap | None = None, step: int | None = None) -> None:
        if swap is not None and not isinstance(swap, AttentionSwap):
            raise TypeError(f"swap must be an AttentionSwap or None, got {type(swap).__name__}")
        self.swap = swap
        self.step = step  # the step saved in the checkpoint (ExportableState), None before any

    def _swap(self, model: nn.Module | None) -> AttentionSwap | None:
        if self.swap is not None:
            return self.swap if self.swap.active else None
        return current_swap(model) if model is not None else None

    def state(self) -> dict[str, Any]:
        """``ExportableState``: the step, written into ``trainer_state.json`` at every checkpoint."""
        swap = self._swap(self._model)
        return {"args": {}, "attributes": {"step": swap.step if swap is not None else self.step}}

    _model: nn.Module | None = None

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        self._model = model

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        self._model = model if model is not None else self._model
        saved = (state.stateful_callbacks or {}).get(type(self).__name__) if state.global_step > 0 else None
        if isinstance(saved, list):
            saved = saved[0]
        step = (saved or {}).get("attributes", {}).get("step")
        swap = self._swap(self._model)
        if swap is not None and isinstance(step, int):
            swap.set_step(step)  # resuming: the partitions continue where the checkpoint left them

    def on_save(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kw: Any) -> None:
        swap = self._swap(model if model is not None else self._model)
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if swap is not None and state.is_world_process_zero and os.path.isdir(folder):
            write_swap_settings(swap, folder)
