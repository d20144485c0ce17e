""":class:`AttentionSwap`: the replacement installed on one model — its settings, partitions and attention call.

The replacement forwards (:mod:`~positional_lsh.integrations.hf.forward`) find the swap attached to their module
under :data:`SWAP_ATTR` and call :meth:`AttentionSwap.attend`; :mod:`~positional_lsh.integrations.hf.swap` creates
and installs it. Partitions are drawn by one :class:`~positional_lsh.ops.sampling.PartitionSampler` per layer,
with ``seed = eval_seed = layer_seed(swap.seed, layer)``: eval mode draws from ``layer_seed(seed, layer)``,
training step ``c`` from ``layer_seed(layer_seed(seed, layer), c)`` (the formula the project's language model uses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from positional_lsh.integrations.hf.masks import valid_runs
from positional_lsh.ops import alibi_attention, plsh_attention
from positional_lsh.ops._checks import nonnegative_int
from positional_lsh.ops.partitions import Partitions
from positional_lsh.ops.sampling import PartitionSampler, layer_seed

__all__ = ["SWAP_ATTR", "AttentionSwap"]

#: Attribute under which the installed :class:`AttentionSwap` is attached to the model and to each of its
#: attention modules (in the instance ``__dict__``; removed by :meth:`AttentionSwap.restore`).
SWAP_ATTR = "_positional_lsh_swap"


@dataclass(eq=False)
class AttentionSwap:
    """The attention replacement installed on one model; returned by :func:`use_positional_lsh` / :func:`use_alibi`.

    Use :meth:`restore` (or :func:`restore`, or the object as a context manager) to put the model's own
    attention back. The attributes are read-only settings.

    Attributes:
        model: the model the swap is installed on.
        family: ``"bloom"``, ``"mpt"``, ``"falcon"`` or ``"rope"`` (Llama family).
        mode: ``"plsh"`` (positional LSH) or ``"alibi"`` (exact or windowed ALiBi).
        slopes: ``(H,)`` float64 slopes in this library's convention (bias ``-slope |i - j|`` added after
            scaling by ``1/sqrt(d)``).
        num_samples, scheme, seed, method: positional-LSH settings (``None`` in ``"alibi"`` mode); ``method`` is
            passed to :func:`~positional_lsh.plsh_attention` (one of ``positional_lsh.ops.options.METHODS``).
        window: ``(H,)`` float64 largest kept distance ``|i - j|`` for windowed ALiBi, or ``None``.
        resample_in_training: draw fresh partitions at every forward pass in training mode.
        backend: kernel backend passed to the attention functions (one of ``positional_lsh.ops.options.BACKENDS``;
            never ``"triton"`` in ``"alibi"`` mode).
    """

    model: nn.Module = field(repr=False)
    family: str
    mode: str
    slopes: torch.Tensor
    num_samples: int | None = None
    scheme: str | None = None
    seed: int | None = None
    window: torch.Tensor | None = None
    resample_in_training: bool = True
    backend: str = "auto"
    method: str | None = None
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _step: int = field(default=0, repr=False)
    _samplers: dict[int, PartitionSampler] = field(default_factory=dict, repr=False)
    _active: bool = field(default=True, repr=False)

    @property
    def active(self) -> bool:
        """Whether the swap is still installed."""
        return self._active

    @property
    def step(self) -> int:
        """The training step: how many training-mode model calls have started a step (see :meth:`advance_step`)."""
        return self._step

    def advance_step(self) -> None:
        """Start a new training step: the next training-mode draws are fresh partitions."""
        self._step += 1

    def add_undo(self, undo: Callable[[], None]) -> None:
        """Record how to undo one change made to the model; :meth:`restore` runs them in reverse order."""
        self._undo.append(undo)

    def sampler(self, layer_idx: int) -> PartitionSampler:
        """The partition sampler of layer ``layer_idx``: ``seed = eval_seed = layer_seed(self.seed, layer_idx)``."""
        if self.mode != "plsh":
            raise ValueError("partitions exist only in positional-LSH mode (use_positional_lsh)")
        layer_idx = nonnegative_int("layer_idx", layer_idx)
        sampler = self._samplers.get(layer_idx)
        if sampler is None:
            assert self.seed is not None and self.num_samples is not None and self.scheme is not None
            seed = layer_seed(self.seed, layer_idx)
            sampler = PartitionSampler(
                self.slopes.numel(),
                self.slopes,
                num_samples=self.num_samples,
                scheme=self.scheme,
                seed=seed,
                eval_seed=seed,
            )
            self._samplers[layer_idx] = sampler
        return sampler

    def partitions(self, layer_idx: int, seq_len: int, *, training: bool = False) -> Partitions:
        """The partitions layer ``layer_idx`` uses for ``seq_len`` keys (eval mode unless ``training``).

        Eval mode: drawn from ``layer_seed(seed, layer_idx)``. Training mode with ``resample_in_training``: the
        current step's, drawn from ``layer_seed(layer_seed(seed, layer_idx), step)`` (the step advances at each
        model call); without ``resample_in_training``, the eval partitions.
        """
        resample = bool(training) and self.resample_in_training
        return self.sampler(layer_idx).draw(seq_len, training=resample, step=self._step)

    def _kernel(
        self, layer_idx: int, training: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self.mode == "alibi":
            return alibi_attention(
                q, k, v, self.slopes, causal=True, window=self.window, scale=scale, backend=self.backend
            )
        assert self.method is not None
        parts = self.partitions(layer_idx, k.shape[-2], training=training)
        return plsh_attention(
            q, k, v, partitions=parts, causal=True, scale=scale, backend=self.backend, method=self.method
        )

    def attend(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q (B, Hq, Lq, d)`` on ``k, v (B, Hkv, Lk, d)``, queries aligned to the last keys.

        ``key_valid`` is ``None`` or a ``(B, Lk)`` bool mask; each row's valid keys must be contiguous and the
        row is computed on them alone (positions counted from its first valid key). Query rows at padded
        positions get zeros. Returns ``(B, Hq, Lq, d)``.
        """
        lq, lk = q.shape[-2], k.shape[-2]
        if key_valid is None or bool(key_valid.all()):
            return self._kernel(layer_idx, training, q, k, v, scale)
        groups: dict[tuple[int, int], list[int]] = {}
        for row, run in enumerate(valid_runs(key_valid)):
            groups.setdefault(run, []).append(row)
        q0 = lk - lq  # key position of the first query
        out = q.new_zeros(q.shape)
        for (first, end), rows in groups.items():
            qs = max(first, q0)
            if end <= qs:
                continue  # every query of these rows is a padding position
            idx = torch.tensor(rows, device=q.device)
            sub = self._kernel(
                layer_idx,
                training,
                q[idx][:, :, qs - q0 : end - q0],
                k[idx][:, :, first:end],
                v[idx][:, :, first:end],
                scale,
            )
            out[idx, :, qs - q0 : end - q0] = sub
        return out

    def restore(self) -> None:
        """Put the model's own attention back (idempotent)."""
        if not self._active:
            return
        while self._undo:
            self._undo.pop()()
        self._active = False

    def __enter__(self) -> AttentionSwap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
