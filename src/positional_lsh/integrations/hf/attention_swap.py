""":class:`AttentionSwap`: the replacement installed on one model — its settings, partitions and attention call.

The replacement forwards (:mod:`~positional_lsh.integrations.hf.forward`) find the swap attached to their module
under :data:`SWAP_ATTR` and call :meth:`AttentionSwap.attend`; :mod:`~positional_lsh.integrations.hf.swap` creates
and installs it. Partitions are drawn by one :class:`~positional_lsh.ops.partitions.sampling.PartitionSampler` per
layer,
with ``seed = eval_seed = layer_seed(swap.seed, layer)``: eval mode draws from ``layer_seed(seed, layer)``,
training step ``c`` from ``layer_seed(layer_seed(seed, layer), c)`` (the formula the project's language model uses).

How :meth:`AttentionSwap.attend` runs a call:

* **mixed precision**: under ``torch.autocast``, ``q, k, v`` are cast to the autocast dtype (float64 stays), as
  the stock attention (``scaled_dot_product_attention`` or eager matmuls) computes them, and the op runs with
  autocast off (it accumulates in float32 itself);
* **decoding**: a call continuing a cache with at most :data:`DECODE_QUERIES` queries, or one whose cache dropped
  dead keys (:mod:`~positional_lsh.integrations.hf.cache`), runs :func:`positional_lsh.ops.decode.plsh_decode`:
  each query reads only the keys of its own blocks, with no per-call plan;
* **padding**: each batch row is computed on its valid run of keys; under ``torch.compile`` this is the custom op
  ``positional_lsh::swap_padded_forward`` (and its backward), so a padding mask never breaks the graph;
* **torch.compile**: the training step is an int64 tensor advanced in place and the partitions are drawn by the
  sampling op, so ``fullgraph=True`` traces the whole attention.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from positional_lsh.integrations.hf.masks import valid_runs
from positional_lsh.ops import alibi_attention, plsh_attention
from positional_lsh.ops._checks import nonnegative_int
from positional_lsh.ops._engine.engine import Route, backward, dispatch, forward, kernel_inputs, plan
from positional_lsh.ops._engine.kernels import acc_dtype
from positional_lsh.ops.decode import key_reach, plsh_decode
from positional_lsh.ops.partitions.partition import Partitions
from positional_lsh.ops.partitions.sampling import PartitionSampler, layer_seed

__all__ = [
    "DECODE_QUERIES",
    "SWAP_ATTR",
    "AttentionSwap",
    "split_rows",
    "swap_alibi_backward",
    "swap_alibi_forward",
    "swap_padded_backward",
    "swap_padded_forward",
]

#: Attribute under which the installed :class:`AttentionSwap` is attached to the model and to each of its
#: attention modules (in the instance ``__dict__``; removed by :meth:`AttentionSwap.restore`).
SWAP_ATTR = "_positional_lsh_swap"

#: Calls continuing a KV cache with at most this many queries take the decoding path
#: (:func:`positional_lsh.ops.decode.plsh_decode`) instead of :func:`~positional_lsh.plsh_attention`.
DECODE_QUERIES = 16


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
    # The training step, an int64 tensor advanced in place: torch.compile traces it (an int would be a constant
    # of the graph, recompiled at every step) and the sampling op reads it.
    _step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long), repr=False)
    _samplers: dict[int, PartitionSampler] = field(default_factory=dict, repr=False)
    _active: bool = field(default=True, repr=False)
    # Decoding: per layer, the partitions of the current (mode, step), drawn for a length that grows geometrically,
    # and their key reach; so that a decoded token does not build partitions.
    _decoding: dict[int, tuple[tuple[bool, int], Partitions, int | None]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.mode == "plsh":
            # Build every layer's sampler now, outside any torch.compile trace (its constructor checks the scheme
            # with a draw).
            config = getattr(self.model, "config", None)
            layers = getattr(config, "num_hidden_layers", None)
            for layer_idx in range(layers if isinstance(layers, int) else 0):
                self.sampler(layer_idx)

    @property
    def active(self) -> bool:
        """Whether the swap is still installed."""
        return self._active

    @property
    def step(self) -> int:
        """The training step: how many training-mode model calls have started a step (see :meth:`advance_step`)."""
        return int(self._step)

    def advance_step(self) -> None:
        """Start a new training step: the next training-mode draws are fresh partitions (in place: traceable)."""
        self._step.add_(1)

    def set_step(self, step: int) -> None:
        """Set the training step, e.g. to the one saved with a checkpoint when a run resumes (exact resume)."""
        self._step.fill_(nonnegative_int("step", step))

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

    def _decode_partitions(self, layer_idx: int, seq_len: int, training: bool) -> tuple[Partitions, int | None]:
        """The layer's partitions for at least ``seq_len`` positions, and their key reach, reused across decoding
        steps (the same pitches and shifts as :meth:`partitions`; redrawn when the step or the mode changes)."""
        resample = bool(training) and self.resample_in_training
        key = (resample, int(self._step) if resample else 0)
        held = self._decoding.get(layer_idx)
        if held is None or held[0] != key or held[1].seq_len < seq_len:
            length = max(2 * seq_len, 1024)  # redrawn about log2(n) times in a generation of n tokens
            parts = self.partitions(layer_idx, length, training=training)
            held = (key, parts, key_reach(parts))
            self._decoding[layer_idx] = held
        return held[1], held[2]

    def key_reach(self, layer_idx: int, *, training: bool = False) -> int | None:
        """How far back a query of layer ``layer_idx`` can reach: no query at position ``i`` (nor any later one)
        attends to a key before ``i - key_reach``; ``None`` when every key may be reached (exact ALiBi, a slope 0).

        Positional LSH: :func:`positional_lsh.ops.decode.key_reach` of the layer's partitions (eval mode unless
        ``training``); windowed ALiBi: the largest window. Used by
        :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` to drop dead keys.
        """
        if self.mode == "plsh":
            return self._decode_partitions(layer_idx, 1, training)[1]
        if self.window is None:
            return None
        return int(torch.floor(self.window).max().item())

    def new_cache(self) -> Any:
        """A fresh :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache` for this swap's model: a KV cache
        that keeps only the keys a later query can reach (``model.generate(ids, use_cache=True, cache=...)``).
        """
        from positional_lsh.integrations.hf.cache import LiveKeyCache

        return LiveKeyCache(self)

    # ------------------------------------------------------------------------------------------------------------
    # The attention call
    # ------------------------------------------------------------------------------------------------------------

    def _kernel(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        key_offset: int = 0,
    ) -> torch.Tensor:
        """One row group's attention: keys ``k, v`` are positions ``key_offset ..`` of the row (``key_offset > 0``
        when a cache dropped the keys before), the queries its last positions."""
        lq, lk = q.shape[-2], k.shape[-2]
        if self.mode == "alibi":
            if key_offset > 0:
                first_query = key_offset + lk - lq
                reach = None if self.window is None else int(torch.floor(self.window).max().item())
                if reach is None or first_query - reach < key_offset:
                    raise ValueError(
                        f"the KV cache dropped keys before position {key_offset} that this ALiBi attention needs"
                    )
            return alibi_attention(
                q, k, v, self.slopes, causal=True, window=self.window, scale=scale, backend=self.backend
            )
        assert self.method is not None
        n = key_offset + lk
        if not torch.compiler.is_compiling() and (key_offset > 0 or lq < min(n, DECODE_QUERIES + 1)):
            parts, _ = self._decode_partitions(layer_idx, n, training)
            return plsh_decode(q, k, v, parts, key_offset=key_offset, scale=scale)
        if key_offset > 0:
            raise ValueError("a KV cache that drops keys (LiveKeyCache) is not supported under torch.compile")
        parts = self.partitions(layer_idx, n, training=training)
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

        ``key_valid`` is ``None`` or a ``(B, m)`` bool mask of the sequence's ``m >= Lk`` positions, of which ``k``
        holds the last ``Lk`` (``m > Lk`` when a :class:`~positional_lsh.integrations.hf.cache.LiveKeyCache`
        dropped the first ones); each row's valid keys must be contiguous and the row is computed on them alone
        (positions counted from its first valid key). Query rows at padded positions get zeros. Under
        ``torch.autocast`` the inputs are cast to the autocast dtype first (module docstring). Returns
        ``(B, Hq, Lq, d)``.
        """
        device = q.device.type
        if torch.is_autocast_enabled(device):
            low = torch.get_autocast_dtype(device)
            q, k, v = (x.to(low) if x.is_floating_point() and x.dtype != torch.float64 else x for x in (q, k, v))
            with torch.autocast(device, enabled=False):
                return self._attend(layer_idx, training, q, k, v, key_valid, scale)
        return self._attend(layer_idx, training, q, k, v, key_valid, scale)

    def _attend(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._compiled(layer_idx, training, q, k, v, key_valid, scale)

        def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_offset: int) -> torch.Tensor:
            return self._kernel(layer_idx, training, q, k, v, scale, key_offset)

        return split_rows(q, k, v, key_valid, kernel)

    def _compiled(
        self,
        layer_idx: int,
        training: bool,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_valid: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """A call under ``torch.compile``: the engine's compiled op without padding, else an opaque custom op
        (``swap_padded_forward`` for positional LSH, ``swap_alibi_forward`` for exact or windowed ALiBi)."""
        if key_valid is not None and key_valid.shape[-1] != k.shape[-2]:
            raise ValueError("a KV cache that drops keys (LiveKeyCache) is not supported under torch.compile")
        if self.mode == "alibi":
            return swap_alibi_forward(q, k, v, key_valid, self.slopes, self.window, scale, self.backend)
        if key_valid is None:
            return self._kernel(layer_idx, training, q, k, v, scale)
        assert self.method is not None
        parts = self.partitions(layer_idx, k.shape[-2], training=training)
        route = dispatch(q, causal=True, scale=scale, backend=self.backend, method=self.method)
        out, _ = swap_padded_forward(
            q,
            k,
            v,
            key_valid,
            parts.pitch,
            parts.shift,
            parts.slopes,
            parts.scheme,
            parts.max_block,
            route.scale,
            route.kernel,
            route.method,
        )
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


# --------------------------------------------------------------------------------------------------
# Padding: each batch row on its valid run of keys
# --------------------------------------------------------------------------------------------------


def split_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """Causal attention with padding: ``kernel(q, k, v, key_offset)`` on each group of batch rows with one valid run.

    ``q (B, Hq, Lq, d)``, ``k, v (B, Hkv, Lk, d)``; ``key_valid`` is ``None`` or a ``(B, m)`` bool mask of the
    sequence's ``m >= Lk`` positions, of which ``k`` holds the last ``Lk``. ``kernel`` gets a group's queries and
    its cached valid keys, which are positions ``key_offset ..`` of the row (counted from its first valid key);
    query rows at padded positions get zeros (eager only: reads the mask).
    """
    if key_valid is None:
        return kernel(q, k, v, 0)
    lq, lk = q.shape[-2], k.shape[-2]
    m = key_valid.shape[-1]
    offset = m - lk  # position of the first cached key
    if bool(key_valid.all()):
        return kernel(q, k, v, offset)
    groups: dict[tuple[int, int], list[int]] = {}
    for row, run in enumerate(valid_runs(key_valid)):
        groups.setdefault(run, []).append(row)
    q0 = m - lq  # position of the first query
    out = q.new_zeros(q.shape)
    for (first, end), rows in groups.items():
        qs = max(first, q0)
        if end <= qs:
            continue  # every query of these rows is a padding position
        ks = max(first, offset)  # the row's first cached valid key
        idx = torch.tensor(rows, device=q.device)
        sub = kernel(
            q[idx][:, :, qs - q0 : end - q0],
            k[idx][:, :, ks - offset : end - offset],
            v[idx][:, :, ks - offset : end - offset],
            ks - first,
        )
        out[idx, :, qs - q0 : end - q0] = sub
    return out


# --------------------------------------------------------------------------------------------------
# torch.compile: exact / windowed ALiBi as an opaque custom op (backward by recomputation)
# --------------------------------------------------------------------------------------------------


def _alibi_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    slopes: torch.Tensor,
    window: torch.Tensor | None,
    scale: float,
    backend: str,
) -> torch.Tensor:
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_offset: int) -> torch.Tensor:
        return alibi_attention(q, k, v, slopes, causal=True, window=window, scale=scale, backend=backend)

    return split_rows(q, k, v, key_valid, kernel)


@torch.library.custom_op("positional_lsh::swap_alibi_forward", mutates_args=())
def swap_alibi_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    slopes: torch.Tensor,
    window: torch.Tensor | None,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """The swap's causal exact (``window=None``) or windowed ALiBi attention, with an optional ``(B, Lk)`` padding
    mask (:func:`split_rows` over :func:`~positional_lsh.alibi_attention`): the op ``torch.compile`` sees."""
    with torch.no_grad():
        return _alibi_rows(q, k, v, key_valid, slopes, window, scale, backend).contiguous()


@swap_alibi_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object) -> torch.Tensor:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("positional_lsh::swap_alibi_backward", mutates_args=())
def swap_alibi_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor | None,
    slopes: torch.Tensor,
    window: torch.Tensor | None,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`swap_alibi_forward`: its forward recomputed with autograd, then differentiated.

    A custom op's body runs with autograd off (``enable_grad`` has no effect there), so the recomputation runs in
    a short-lived thread, whose autograd state is the default one."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            lq, lk, lv = (x.detach().requires_grad_() for x in (q, k, v))
            leaves = [lq, lk, lv]
            out = _alibi_rows(lq, lk, lv, key_valid, slopes, window, scale, backend)
            grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
            result["grads"] = tuple(
                torch.zeros(x.shape, dtype=x.dtype, device=x.device) if g is None else g.contiguous()
                for x, g in zip(leaves, grads, strict=True)
            )
        except BaseException as exc:  # re-raised in the calling thread
            result["error"] = exc

    thread = threading.Thread(target=work, name="positional_lsh-alibi-backward")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["grads"]


def _empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` left empty, shaped like ``q, k, v``: what a backward op's fake returns."""
    dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    return dq, dk, dv


@swap_alibi_backward.register_fake
def _(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    return _empty_grads(q, k, v)


def _alibi_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, key_valid, slopes, window, scale, backend = inputs
    ctx.save_for_backward(q, k, v)
    ctx.rest = (key_valid, slopes, window, scale, backend)


def _alibi_backward_fn(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v = ctx.saved_tensors
    dq, dk, dv = swap_alibi_backward(dout, q, k, v, *ctx.rest)
    return (dq, dk, dv) + (None,) * 5


swap_alibi_forward.register_autograd(_alibi_backward_fn, setup_context=_alibi_setup_context)


# --------------------------------------------------------------------------------------------------
# torch.compile: positional LSH with padding, the row groups as opaque custom ops over the engine
# --------------------------------------------------------------------------------------------------


def _row_groups(key_valid: torch.Tensor, q_len: int, k_len: int) -> list[tuple[torch.Tensor | slice, int, int, int]]:
    """``(rows, first key, first query, end)`` per group of batch rows with one valid run (``key_valid (B, Lk)``);
    groups whose queries are all padding are left out. ``rows`` is ``slice(None)`` (every row, no copy) when every
    key is valid, else an index tensor."""
    q0 = k_len - q_len
    if bool(key_valid.all()):
        return [(slice(None), 0, q0, k_len)]
    groups: dict[tuple[int, int], list[int]] = {}
    for row, run in enumerate(valid_runs(key_valid)):
        groups.setdefault(run, []).append(row)
    out: list[tuple[torch.Tensor | slice, int, int, int]] = []
    for (first, end), rows in groups.items():
        qs = max(first, q0)
        if end > qs:
            out.append((torch.tensor(rows, device=key_valid.device), first, qs, end))
    return out


def _group_plan(
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    scheme: str,
    max_block: int | None,
    route: Route,
    num_kv_heads: int,
    first: int,
    qs: int,
    end: int,
    device: torch.device,
) -> Any:
    parts = Partitions(end - first, slopes, pitch, shift, scheme, max_block=max_block)
    return plan(route, parts, num_kv_heads, end - qs, device)


@torch.library.custom_op("positional_lsh::swap_padded_forward", mutates_args=())
def swap_padded_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    scheme: str,
    max_block: int | None,
    scale: float,
    kernel: str,
    method: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the swap's causal positional-LSH attention with a ``(B, Lk)`` padding mask: each group of
    batch rows with one valid run goes through the engine (:func:`positional_lsh.ops._engine.engine.forward`) on that
    run;
    padded query rows get ``out = 0`` and ``lse = -inf``. The op ``torch.compile`` sees instead of the row split."""
    route = Route(method, kernel, False, True, scale)
    lq, lk = q.shape[2], k.shape[2]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    q0 = lk - lq
    for rows, first, qs, end in _row_groups(key_valid, lq, lk):
        p = _group_plan(pitch, shift, slopes, scheme, max_block, route, k.shape[1], first, qs, end, q.device)
        o, l, _ = forward(p, q[rows][:, :, qs - q0 : end - q0], k[rows][:, :, first:end], v[rows][:, :, first:end])
        out[rows, :, qs - q0 : end - q0] = o
        lse[rows, :, qs - q0 : end - q0] = l.to(lse.dtype)
    return out, lse


@swap_padded_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object) -> tuple[torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(q.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)


@torch.library.custom_op("positional_lsh::swap_padded_backward", mutates_args=())
def swap_padded_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pitch: torch.Tensor,
    shift: torch.Tensor,
    slopes: torch.Tensor,
    scheme: str,
    max_block: int | None,
    scale: float,
    kernel: str,
    method: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`swap_padded_forward`, group by group
    (:func:`positional_lsh.ops._engine.engine.backward`
    against the saved ``out`` and ``lse``); padded positions get zero gradients."""
    route = Route(method, kernel, False, True, scale)
    lq, lk = q.shape[2], k.shape[2]
    dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))  # contiguous, as the fake
    q0 = lk - lq
    for rows, first, qs, end in _row_groups(key_valid, lq, lk):
        p = _group_plan(pitch, shift, slopes, scheme, max_block, route, k.shape[1], first, qs, end, q.device)
        qsl, ksl = slice(qs - q0, end - q0), slice(first, end)
        qp, kp, vp, _ = kernel_inputs(q[rows][:, :, qsl], k[rows][:, :, ksl], v[rows][:, :, ksl], kernel)
        saved = (qp, kp, vp, out[rows][:, :, qsl].contiguous(), lse[rows][:, :, qsl].contiguous())
        gq, gk, gv, _ = backward(p, saved, dout[rows][:, :, qsl])
        dq[rows, :, qsl] = gq
        dk[rows, :, ksl] = gk
        dv[rows, :, ksl] = gv
    return dq, dk, dv


@swap_padded_backward.register_fake
def _(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The fake: only the tensors that shape the outputs are named; the other arguments do not.
    return _empty_grads(q, k, v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, key_valid, pitch, shift, slopes, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, key_valid, out, lse, pitch, shift, slopes)
    ctx.args = args
    ctx.mark_non_differentiable(lse)


def _backward_fn(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    q, k, v, key_valid, out, lse, pitch, shift, slopes = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = swap_padded_backward(dout, q, k, v, key_valid, out, lse, pitch, shift, slopes, *ctx.args)
    return (dq, dk, dv) + (None,) * 9


swap_padded_forward.register_autograd(_backward_fn, setup_context=_setup_context)
