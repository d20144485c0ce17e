"""A compact decoder-only transformer language model whose attention position mode is one argument.

Pre-norm blocks (RMSNorm -> causal self-attention -> residual, RMSNorm -> GELU MLP -> residual), tied
input/output embeddings, no biases, nanoGPT-style initialization. The only thing that changes between
position modes is how the attention turns ``q, k, v`` into an output; every mode calls the core library
or torch's own attention, never a second implementation:

* ``"alibi"`` — exact ALiBi (bias ``-m_h |i - j|`` after scaling). Short sequences use torch's
  ``scaled_dot_product_attention`` with the bias built by :func:`~positional_lsh.alibi_bias` (fastest for
  training at short lengths); long ones use :func:`~positional_lsh.alibi_attention` (``O(n)`` memory).
  ``alibi_impl`` forces one or the other; both compute the same function.
* ``"plsh"`` — positional-LSH attention: each layer's attention is the library's module,
  :class:`~positional_lsh.PositionalLSHAttention` (around :func:`~positional_lsh.plsh_attention`), with
  ``num_samples`` partitions of a ``scheme``, for the standard per-head ALiBi slopes or one constant ``sigma`` for
  every head (as the paper did). It samples with the package's one policy
  (:class:`~positional_lsh.ops.partitions.sampling.PartitionSampler`): training call ``c`` of layer ``l`` draws from
  ``layer_seed(layer_seed(seed, l), c)`` (fresh partitions every call; the per-layer call counters are the
  model's :meth:`~TransformerLM.rng_state`, saved for exact resume); eval mode uses the partitions seeded by
  ``layer_seed(eval_seed, l)``, the same at every call and every length (the law of a partition does not depend
  on the length), so evaluation is deterministic and decoding with a KV cache equals a full recomputation. Queries
  that continue a KV cache (``generate``) go to the op layer's KV-cache entry point,
  :func:`~positional_lsh.ops.kvcache.plsh_attention_with_kvcache`, which reads only the keys of their blocks.
  The draw and the estimator are compile-safe: the model compiles with ``torch.compile(fullgraph=True)``.
  Context parallelism is an argument: ``model(shard, context=ContextShards(group))``
  (:class:`positional_lsh.distributed.ContextShards`, a :class:`~positional_lsh.ops.module.ShardedAttention`).
* ``"window-alibi"`` — exact ALiBi restricted to keys with ``|i - j| <= window_h``: ``window`` tokens for
  every head, or ``window_factor * sigma_h`` per head.
* ``"rope"`` — rotary position embedding (GPT-NeoX half-split layout) and causal attention.
* ``"nope"`` — no position information: causal attention only.

Learned slopes (``ModelConfig.learn_slopes``): each layer's slopes are ``exp`` of a parameter ``log_slopes``
``(n_head,)`` of the layer, one for every ALiBi-type mode (so they survive :meth:`TransformerLM.set_position`).
``alibi`` gets their exact gradient (SDPA with a bias built from them every call by
:func:`~positional_lsh.alibi_bias`, which keeps the slopes' graph, or ``alibi_attention``'s slope gradient),
``window-alibi`` too (inside a window ``window_factor / m_h`` that follows the current slopes, detached), and
``plsh`` passes them to its module per call, which draws its partitions from the current slopes (detached) and
gives them the surrogate gradient of ``plsh_attention`` (eager and compiled alike). Without ``learn_slopes``
there is no such parameter and nothing changes.

The mode can be changed after training without touching the weights (:meth:`TransformerLM.set_position`),
e.g. to evaluate an ALiBi-trained model with positional-LSH attention at several ``T``.

The configuration is :class:`~positional_lsh.lm.config.ModelConfig`; checkpoints (save, load, the shipped
model) are in :mod:`positional_lsh.lm.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from positional_lsh.lm.config import ModelConfig, check_float
from positional_lsh.lm.generation import PREFILL_CHUNK, LiveKV, sampling_generator
from positional_lsh.lm.generation import generate as generate_tokens
from positional_lsh.ops.checks import nonnegative_int, positive_int
from positional_lsh.ops.exact.alibi import alibi_attention
from positional_lsh.ops.exact.bias import alibi_bias
from positional_lsh.ops.kvcache import DecodeState, plsh_attention_with_kvcache
from positional_lsh.ops.module import PositionalLSHAttention, ShardedAttention, log_slopes_parameter
from positional_lsh.ops.partitions.partition import Partitions
from positional_lsh.ops.partitions.sampling import layer_seed

# alibi_impl="auto" uses SDPA with a prebuilt (H, Lq, Lk) bias up to this many bias entries.
_SDPA_MAX_BIAS_ENTRIES = 2**22


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``(L, head_dim // 2)`` for integer ``positions (L,)``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, H, L, d)`` by position: pairs ``(x[..., i], x[..., i + d/2])`` (GPT-NeoX layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values ``(B, H, L, head_dim)``: what a layer returns and takes back as its cache."""
KVCache = Sequence["LayerKV | LiveKV | None"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the position mode is set by :meth:`configure`.

    Its parameters are the projections ``qkv`` and ``proj``, and with ``cfg.learn_slopes`` the log-slopes
    ``log_slopes (n_head,)`` float32 (:func:`~positional_lsh.ops.module.log_slopes_parameter` of ``cfg.slopes()``;
    the slopes used are their ``exp``), the one slopes state of every ALiBi-type mode. In ``plsh`` mode the attention
    is the library's module, ``plsh`` (a :class:`~positional_lsh.PositionalLSHAttention` with this layer's seeds and
    ``persistent=False``: its step is in :meth:`TransformerLM.rng_state`, its slopes in the config, so the state
    dict holds the weights only); ``alibi`` and ``window-alibi`` call the exact ops.
    """

    log_slopes: nn.Parameter | None
    plsh: PositionalLSHAttention | None

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout
        # Learned slopes: a parameter only when asked for (without it the state dict is what it always was).
        self.log_slopes = log_slopes_parameter(cfg.slopes()) if cfg.learn_slopes else None
        self.plsh = None
        self.configure(cfg)

    def configure(self, cfg: ModelConfig) -> None:
        """Set the position mode and its settings from ``cfg`` (weights, learned slopes included, untouched; a
        ``plsh`` layer that stays ``plsh`` keeps its training step)."""
        if cfg.learn_slopes != (self.log_slopes is not None):
            raise ValueError(
                f"learn_slopes={cfg.learn_slopes} cannot change on a built model (the log_slopes parameter is "
                f"{'there' if self.log_slopes is not None else 'absent'}); build a new TransformerLM"
            )
        self.cfg = cfg
        self.position = cfg.position
        self.slopes = cfg.slopes()
        # A fixed window stays fixed; window-alibi's window_factor / m_h follows learned slopes (see current_window).
        self.window = cfg.windows() if cfg.position == "window-alibi" else None
        self.plsh = self._plsh_module(cfg) if cfg.position == "plsh" else None
        self._bias_cache: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self._decode_state = DecodeState()  # what decoding with a KV cache keeps from token to token

    def _plsh_module(self, cfg: ModelConfig) -> PositionalLSHAttention:
        """This layer's positional-LSH attention for ``cfg``, on the layer's device and in its mode, continuing the
        step of the one it replaces (if any)."""
        module = PositionalLSHAttention(
            cfg.n_head,
            self.slopes,
            num_samples=cfg.num_samples,
            scheme=cfg.scheme,
            causal=True,
            seed=layer_seed(cfg.seed, self.layer_idx),
            eval_seed=layer_seed(cfg.eval_seed, self.layer_idx),
            backend=cfg.attn_backend,
            method=cfg.plsh_method,
            persistent=False,
        ).to(self.qkv.weight.device)
        module.train(self.training)  # a layer rebuilt by set_position on an eval-mode model stays in eval mode
        if self.plsh is not None:
            module.calls.copy_(self.plsh.calls)
        return module

    def extra_repr(self) -> str:
        return f"position={self.cfg.describe()!r}"

    def reset_slopes(self) -> None:
        """Set learned log-slopes back to ``log cfg.slopes()`` (nothing without ``learn_slopes``)."""
        if self.log_slopes is not None:
            with torch.no_grad():
                self.log_slopes.copy_(self.cfg.slopes().log())

    def current_slopes(self) -> torch.Tensor:
        """The ``(n_head,)`` slopes this layer uses now: ``log_slopes.exp()`` (float32, on the parameter's device,
        differentiable) when learned, else the configured ``cfg.slopes()`` (float64 CPU)."""
        if self.log_slopes is not None:
            return self.log_slopes.exp()
        return self.slopes

    def learned_slopes(self) -> torch.Tensor | None:
        """``log_slopes.exp()`` (differentiable) with learned slopes, else ``None``."""
        return None if self.log_slopes is None else self.log_slopes.exp()

    def current_window(self) -> torch.Tensor | None:
        """``window-alibi``'s ``(n_head,)`` float64 window now (``None`` in other modes): the fixed ``cfg.window``, or
        ``window_factor / m_h`` of the current (learned, detached) slopes."""
        if self.window is None or self.log_slopes is None or self.cfg.window is not None:
            return self.window
        m = self.log_slopes.detach().double().exp()
        return (self.cfg.window_factor / m).clamp(max=2.0**40)

    def partitions(self, seq_len: int) -> Partitions:
        """The positional-LSH partitions the next call at ``seq_len`` keys draws (does not advance the step); with
        learned slopes, drawn from the current slopes (detached)."""
        if self.plsh is None:
            raise ValueError(f"partitions exist only in position mode 'plsh', this layer is {self.position!r}")
        return self.plsh.sample(seq_len, self.learned_slopes())

    @property
    def step(self) -> int:
        """Training calls of this layer's positional-LSH attention so far (the step key of its draws); 0 in other
        modes."""
        return 0 if self.plsh is None else int(self.plsh.calls)

    def set_step(self, step: int) -> None:
        """Restore :attr:`step` (only 0 for a layer without positional-LSH attention: it draws nothing)."""
        if self.plsh is not None:
            self.plsh.calls.fill_(step)
        elif step:
            raise ValueError(
                f"a training step of {step} for layer {self.layer_idx}, which has no positional-LSH attention "
                f"(position={self.position!r}); only 0"
            )

    def _sdpa_bias(self, lq: int, lk: int, window: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
        if self.log_slopes is not None or torch.compiler.is_compiling():
            # A bias that depends on a parameter, or one inside a graph (built by the graph, for every length under
            # dynamic=True: a cache keyed by the sizes would guard on them): built every call, never cached.
            return alibi_bias(lq, lk, self.current_slopes(), causal=True, window=window, q_offset=lk - lq,
                              dtype=q.dtype, device=q.device)  # fmt: skip
        key = (lq, lk, q.dtype, q.device, None if window is None else tuple(window.tolist()))
        if self._bias_cache is None or self._bias_cache[0] != key:
            bias = alibi_bias(
                lq, lk, self.slopes, causal=True, window=window, q_offset=lk - lq, dtype=q.dtype, device=q.device
            )
            self._bias_cache = (key, bias)
        return self._bias_cache[1]

    def _alibi(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: torch.Tensor | None) -> torch.Tensor:
        lq, lk = q.shape[2], k.shape[2]
        impl = self.cfg.alibi_impl
        if impl == "auto":
            impl = "sdpa" if self.n_head * lq * lk <= _SDPA_MAX_BIAS_ENTRIES else "chunked"
        if impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._sdpa_bias(lq, lk, window, q))
        slopes = self.current_slopes()  # learned: a tensor requiring grad, alibi_attention returns its gradient
        return alibi_attention(q, k, v, slopes, causal=True, window=window, backend=self.cfg.attn_backend)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ShardedAttention | None = None,
        key_offset: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """Attention of ``q (B, H, Lq, d)`` to ``k, v (B, H, Lk, d)``; queries are the last ``Lq`` positions, the
        first key at position ``key_offset`` (a :class:`~positional_lsh.lm.generation.LiveKV` dropped those before).

        ``context``: this rank's shard of a context-parallel sequence (``plsh`` only; see
        :meth:`TransformerLM.forward`).
        """
        lq, lk = q.shape[2], k.shape[2]
        if context is not None and self.plsh is None:
            raise ValueError(f"context parallelism supports position='plsh' only, got {self.position!r}")
        if self.position == "alibi":
            return self._alibi(q, k, v, None)
        if self.position == "window-alibi":
            return self._alibi(q, k, v, self.current_window())
        if self.plsh is not None:
            if context is not None and self.log_slopes is not None:
                raise ValueError(
                    "learn_slopes=True with context parallelism: the sharded attention carries no gradient for "
                    "the slopes; train learned slopes without --context-parallel"
                )
            if (lq < lk or key_offset) and context is None and not self.training and not torch.compiler.is_compiling():
                return self._with_kvcache(q, k, v, key_offset)
            # Learned slopes: the tensor carries plsh_attention's surrogate gradient; the partitions follow it.
            return self.plsh(q, k, v, self.learned_slopes(), context=context)
        # rope / nope: plain causal attention (rotation already applied for rope).
        if lq == lk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if lq == 1:
            return F.scaled_dot_product_attention(q, k, v)
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _with_kvcache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_offset: int = 0) -> torch.Tensor:
        """Eval-mode ``plsh`` queries that continue a KV cache: the op layer's KV-cache entry point, with the
        partitions the module draws (eval mode: the same at every length, drawn here for a length that grows
        geometrically so that consecutive tokens pass the same draw) and the layer's decoding state. Learned slopes
        get no gradient here (the entry point has no slope gradient): a call that needs one goes to the module."""
        assert self.plsh is not None
        slopes = self.learned_slopes()
        if slopes is not None and slopes.requires_grad and torch.is_grad_enabled():
            return self.plsh(q, k, v, slopes)
        parts = self.partitions(max(2 * (key_offset + k.shape[2]), 1024))
        return plsh_attention_with_kvcache(
            q, k, v, parts, key_offset=key_offset, backend=self.cfg.attn_backend, method=self.cfg.plsh_method,
            state=self._decode_state,
        )  # fmt: skip

    def forward(
        self, x: torch.Tensor, cache: LayerKV | LiveKV | None = None, context: ShardedAttention | None = None
    ) -> tuple[torch.Tensor, LayerKV | LiveKV]:
        """``x (B, L, d_model)`` -> ``(y (B, L, d_model), (k, v))``; ``cache`` holds earlier keys/values,
        ``context`` a context-parallel shard (:meth:`attend`)."""
        b, l, c = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        past = 0 if cache is None else cache.seen if isinstance(cache, LiveKV) else cache[0].shape[2]
        if self.position == "rope":
            pos = torch.arange(past, past + l, device=x.device)
            cos, sin = rope_cos_sin(pos, self.head_dim, self.cfg.rope_base)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        offset = 0
        if isinstance(cache, LiveKV):
            k, v, offset = cache.update(k, v)
        elif cache is not None:
            k = torch.cat((cache[0], k), dim=2)
            v = torch.cat((cache[1], v), dim=2)
        if self.cfg.attn_fp32 and q.dtype in (torch.float16, torch.bfloat16):
            with torch.autocast(x.device.type, enabled=False):
                y = self.attend(q.float(), k.float(), v.float(), context, offset).to(q.dtype)
        else:
            y = self.attend(q, k, v, context, offset)
        y = y.transpose(1, 2).reshape(b, l, c)
        y = F.dropout(self.proj(y), self.dropout, self.training)
        return y, cache if isinstance(cache, LiveKV) else (k, v)


class MLP(nn.Module):
    """The feed-forward half of a block: ``Linear(d, mlp_ratio d)``, GELU, ``Linear(mlp_ratio d, d)``, dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cache: LayerKV | LiveKV | None = None, context: ShardedAttention | None = None
    ) -> tuple[torch.Tensor, LayerKV | LiveKV]:
        a, kv = self.attn(self.norm1(x), cache, context)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return x, kv


class TransformerLM(nn.Module):
    """Decoder-only transformer language model; see the module docstring.

    ``model(idx)`` takes ``idx (B, L)`` int64 token ids and returns float32 logits ``(B, L, vocab_size)``;
    ``model(idx, targets)`` also returns the mean cross-entropy over targets that are not ``-100``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nanoGPT initialization: N(0, 0.02), residual projections scaled by ``1/sqrt(2 n_layer)``."""
        for name, p in self.named_parameters():
            if name.endswith("log_slopes"):
                continue  # learned slopes start at log cfg.slopes() (below); they draw no random numbers
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            else:
                nn.init.ones_(p)
        for block in self._layers():
            block.attn.reset_slopes()

    def num_params(self) -> int:
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def set_position(self, position: str | None = None, **settings: Any) -> ModelConfig:
        """Change the attention position mode or its settings in place, keeping the weights.

        ``settings`` are :class:`ModelConfig` fields (``num_samples``, ``scheme``, ``sigma``, ``window``,
        ``window_factor``, ``eval_seed``, ``seed``, ``alibi_impl``, ``attn_backend``). Returns the new config.
        Example: ``model.set_position("plsh", num_samples=16, scheme="gamma")``.

        A model with learned slopes (``cfg.learn_slopes``) keeps them in every mode it can switch to (``alibi``,
        ``window-alibi``, ``plsh``: e.g. an ALiBi-trained model evaluated with positional LSH draws its partitions
        from its learned slopes); its ``sigma`` (which only set their starting value) cannot change.
        """
        allowed = {"num_samples", "scheme", "sigma", "window", "window_factor", "eval_seed", "seed", "alibi_impl"}
        allowed |= {"attn_backend", "attn_fp32", "rope_base"}
        bad = sorted(set(settings) - allowed)
        if bad:
            raise ValueError(f"set_position got settings that are not position settings: {bad}")
        if self.cfg.learn_slopes and "sigma" in settings and settings["sigma"] != self.cfg.sigma:
            raise ValueError(
                f"sigma cannot change on a model with learned slopes (sigma={self.cfg.sigma} only set their starting "
                "value; the slopes are the layers' log_slopes parameters)"
            )
        changes = dict(settings)
        if position is not None:
            changes["position"] = position
        cfg = dataclasses.replace(self.cfg, **changes)  # validates
        self.cfg = cfg
        for block in self._layers():
            block.attn.configure(cfg)
        return cfg

    def slopes(self) -> torch.Tensor | None:
        """``(n_layer, n_head)`` float64 CPU: the slopes every layer uses now (learned ones with
        ``cfg.learn_slopes``, else ``cfg.slopes()`` in every layer); ``None`` for ``rope``/``nope``."""
        if self.cfg.position not in ("alibi", "window-alibi", "plsh"):
            return None
        return torch.stack([b.attn.current_slopes().detach().to("cpu", torch.float64) for b in self._layers()])

    def windows(self) -> torch.Tensor | None:
        """``(n_layer, n_head)`` float64 CPU: ``window-alibi``'s window in every layer now (with learned slopes and no
        fixed ``window``, ``window_factor / m_h`` of each layer's slopes); ``None`` in other modes."""
        if self.cfg.position != "window-alibi":
            return None
        return torch.stack(
            [cast(torch.Tensor, b.attn.current_window()).to("cpu", torch.float64) for b in self._layers()]
        )

    def learned_slopes(self) -> torch.Tensor | None:
        """``(n_layer, n_head)`` float64 CPU learned slopes (``exp`` of the layers' ``log_slopes``), or ``None``
        when the model does not learn its slopes."""
        return self.slopes() if self.cfg.learn_slopes else None

    def _layers(self) -> list[Block]:
        """The blocks, typed (iterating an ``nn.ModuleList`` gives ``nn.Module``)."""
        return cast("list[Block]", list(self.blocks))

    def rng_state(self) -> list[int]:
        """The per-layer training call counters, which key the partition draws (for exact resume; 0 for a layer
        without positional-LSH attention)."""
        return [block.attn.step for block in self._layers()]

    def set_rng_state(self, states: list[int]) -> None:
        """Restore :meth:`rng_state`: one non-negative int per layer."""
        if not isinstance(states, (list, tuple)) or len(states) != len(self.blocks):
            raise ValueError(
                f"states must be a list with one entry per layer ({len(self.blocks)}, an int each), "
                f"got {str(states)[:80]}"
            )
        counts = [nonnegative_int("states", s) for s in states]
        layers = [block.attn for block in self._layers()]
        for attn, c in zip(layers, counts, strict=True):
            if attn.plsh is None:
                attn.set_step(c)  # refuses a count other than 0 before any layer changes
        for attn, c in zip(layers, counts, strict=True):
            if attn.plsh is not None:
                attn.set_step(c)

    def _check_idx(self, idx: object, name: str = "idx") -> torch.Tensor:
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dtype not in (torch.long, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"{name} must be an integer tensor, got dtype {idx.dtype}")
        if idx.dim() != 2 or idx.shape[0] < 1 or idx.shape[1] < 1:
            raise ValueError(f"{name} must have shape (batch, seq_len) with both >= 1, got {tuple(idx.shape)}")
        if torch.compiler.is_compiling():
            # Reading the ids' range would end the graph: a traced call checks it inside the graph instead.
            torch._assert_async(((idx >= 0) & (idx < self.cfg.vocab_size)).all(), f"{name} holds ids out of range")
        elif int(idx.min()) < 0 or int(idx.max()) >= self.cfg.vocab_size:
            raise ValueError(f"{name} holds ids outside [0, {self.cfg.vocab_size})")
        return idx.long()

    def forward_with_cache(
        self, idx: torch.Tensor, cache: KVCache | None = None, *, last: bool = False
    ) -> tuple[torch.Tensor, list[LayerKV | LiveKV]]:
        """Logits ``(B, L, V)`` float32 of ``idx (B, L)`` that follow the cached positions (``last``: of the last
        position only, ``(B, 1, V)``), and the new cache (a layer's :class:`~positional_lsh.lm.generation.LiveKV` is
        updated in place and returned)."""
        idx = self._check_idx(idx)
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"cache must have one entry per layer ({len(self.blocks)}), got {len(cache)}")
        x = F.dropout(self.embed(idx), self.cfg.dropout, self.training)
        new_cache: list[LayerKV | LiveKV] = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if cache is None else cache[i])
            new_cache.append(kv)
        logits = self.head(self.norm(x[:, -1:] if last else x)).float()
        return logits, new_cache

    @overload
    def forward(
        self, idx: torch.Tensor, targets: None = None, *, context: ShardedAttention | None = None
    ) -> torch.Tensor: ...

    @overload
    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor, *, context: ShardedAttention | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, context: ShardedAttention | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``idx (B, L)`` -> logits ``(B, L, V)``; with ``targets (B, L)`` -> ``(logits, loss)``.

        ``context``: context parallelism, as an argument. ``idx`` is then this rank's contiguous shard of longer
        sequences and ``context`` says how the ranks share them (a
        :class:`~positional_lsh.ops.module.ShardedAttention`, e.g.
        :class:`positional_lsh.distributed.ContextShards`); every ``plsh`` layer draws the whole sequence's
        partitions (with its own seeds and step, so every rank draws the same) and returns this rank's rows, equal
        to the single-process model's. ``plsh`` only, and not with learned slopes.
        """
        idx = self._check_idx(idx)
        x = F.dropout(self.embed(idx), self.cfg.dropout, self.training)
        for block in self.blocks:
            x, _ = block(x, None, context)
        logits = self.head(self.norm(x)).float()
        if targets is None:
            return logits
        if not isinstance(targets, torch.Tensor) or targets.shape != idx.shape:
            shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets must be a tensor of shape {tuple(idx.shape)}, got {shape}")
        loss = F.cross_entropy(logits.flatten(0, 1), targets.long().flatten(), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | int | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
        prefill_chunk: int | None = PREFILL_CHUNK,
        on_token: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Continue ``idx (B, L)`` by ``max_new_tokens`` sampled tokens; returns ``(B, L + new)`` int64.

        ``temperature = 0`` is greedy decoding. ``top_k`` keeps the ``k`` most likely tokens. ``generator``
        (CPU ``torch.Generator`` or int seed) makes sampling reproducible. With ``use_cache`` keys and values
        are cached (one forward per new token); without it every step recomputes the whole sequence — both
        give the same tokens (for ``plsh``, eval-mode partitions are fixed, so this holds exactly). With a cache,
        ``plsh`` and ``window-alibi`` generate bounded: each layer keeps only the keys a later query can reach and the
        prompt goes in chunks of ``prefill_chunk`` tokens (``None``: at once), so memory and the cost of a token do
        not grow with the prompt (:mod:`positional_lsh.lm.generation`); other modes keep every key. ``on_token``
        gets each ``(B, 1)`` new token as it comes. Generation stops early when every row has produced
        ``stop_token``. The model is put in eval mode.
        """
        idx = self._check_idx(idx)
        max_new_tokens = nonnegative_int("max_new_tokens", max_new_tokens)
        temperature = check_float("temperature", temperature, allow_zero=True)
        if top_k is not None:
            top_k = positive_int("top_k", top_k)
        self.eval()
        return generate_tokens(
            self, idx.to(self.device), max_new_tokens, temperature=temperature, top_k=top_k,
            generator=sampling_generator(generator), use_cache=use_cache, stop_token=stop_token,
            prefill_chunk=prefill_chunk, on_token=on_token,
        )  # fmt: skip
