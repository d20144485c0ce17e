"""The multiplicity form as Triton kernels: one launch for the forward, two for the backward (the GPU path).

Same estimator as :mod:`positional_lsh.ops._engine.multiplicity` (docs/implementation.md, "The multiplicity form")::

    out_i = softmax_j(scale * q_i . k_j + log c[i,j]) v_j

with ``c[i,j] = #{t : start_t(i) <= j}`` for ``j <= i`` when causal (0 above the diagonal) and
``c[i,j] = #{t : start_t(i) <= j < end_t(i)}`` when bidirectional; ``log 0 = -inf``.

This module is the Triton backend of the engine — :data:`TRITON` (:class:`TritonBackend`, implementing
:class:`~positional_lsh.ops._engine.backend.Backend`: its backward, asked, also returns the slopes' surrogate gradient
term ``sum dS |i - j|``, computed inside the ``dq`` kernel), the launches, and :func:`check_triton_call` — over three
pieces:

* :mod:`~positional_lsh.ops._engine.triton.plan` (torch only): the block configurations (:data:`BLOCK_TABLE
  <positional_lsh.ops._engine.triton.plan.BLOCK_TABLE>`, per architecture, dtype and head dim), the per-call plan
  and its layout for a block configuration — each query tile's *events* (the blocks of its first and last rows in
  every sample, sorted) and the *near table* (the counts of the keys next to the tile). Built on the tensors'
  device in ``O(H * n * T)`` elementwise work; ``O(H * n * width + H * n / BLOCK_M * T)`` memory, never ``n x n``.
* :mod:`~positional_lsh.ops._engine.triton.kernels`: the kernels. Counting a score entry's ``c`` costs a few integer
  operations whatever ``T`` is (``scripts/triton_work.py`` computes how many).
* ``scripts/triton_compile.py``: ahead-of-time compilation for sm_80/sm_90 without a GPU (registers,
  spills, shared memory, SASS), which the block table was chosen from.

The entry point is ``plsh_attention(..., backend="triton")``, and on CUDA ``backend="auto"`` whenever the
multiplicity form is chosen (``method="multiplicity"``, or ``"auto"`` when its cost model picks it), which adds
the op's non-finite-key rule and autograd. ``import triton`` is optional: without it this module still imports and
:func:`check_triton_call` raises a clear error. On CPU tensors the kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported) — that is how the tests run; no GPU has run or timed them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from positional_lsh.ops._engine.backend import Gradients, Saved
from positional_lsh.ops._engine.triton.kernels import LOG2E, triton
from positional_lsh.ops._engine.triton.plan import BlockConfig, TritonLayout, TritonPlan, block_config
from positional_lsh.ops.partitions.partition import Partitions

if triton is not None:
    from positional_lsh.ops._engine.triton.kernels import bwd_dkdv_kernel, bwd_dq_kernel, fwd_kernel

__all__ = [
    "DTYPES",
    "MAX_HEAD_DIM",
    "MAX_REGISTERS",
    "TRITON",
    "Launch",
    "TritonBackend",
    "backward_launches",
    "check_triton_call",
    "config_for",
    "device_arch",
    "forward_launch",
    "interpreting",
    "triton_available",
    "triton_refusal",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def triton_available() -> bool:
    """Whether Triton imported (it does not say whether a GPU or the interpreter can run the kernels)."""
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _upcast(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands are cast to float32 first: bfloat16 under the interpreter (see ``_dot``)."""
    return dtype == torch.bfloat16 and interpreting()


def device_arch(device: torch.device) -> int | None:
    """``major * 10 + minor`` of a CUDA device; ``None`` elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def config_for(q: torch.Tensor) -> BlockConfig:
    """The block configuration for ``q (B, Hq, Lq, d)``: :func:`~positional_lsh.ops._engine.triton.plan.block_config`
    of its dtype, head dim and device architecture (tests replace this to run small tiles)."""
    return block_config(q.dtype, q.shape[-1], device_arch(q.device))


def triton_refusal(q: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run on ``q (B, Hq, Lq, d)`` (``None`` if they can): triton missing, the dtype,
    the head dim, or CPU tensors without the interpreter. Reads only ``q.dtype``, ``q.shape`` and ``q.device``."""
    if triton is None:
        return (
            "the Triton path needs the optional dependency triton (pip install triton); "
            "without it use plsh_attention(..., method='multiplicity') with backend='auto' (the torch path)"
        )
    if q.dtype not in DTYPES:
        return (
            f"q: the Triton kernels take float32, bfloat16 or float16, got {q.dtype} "
            "(float64: use plsh_attention(..., method='multiplicity') with backend='auto' or 'math')"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"q: head_dim must be <= {MAX_HEAD_DIM} for the Triton kernels, got {q.shape[-1]}"
    if q.device.type != "cuda" and not interpreting():
        return (
            "q: the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported "
            f"(the slow CPU interpreter, for tests); got tensors on {q.device.type}"
        )
    return None


def check_triton_call(q: torch.Tensor) -> None:
    """Raise (``ImportError`` without triton, else ``ValueError``) unless the Triton kernels can run on ``q``
    (see :func:`triton_refusal`)."""
    why = triton_refusal(q)
    if why is not None:
        raise (ImportError if triton is None else ValueError)(why)


MAX_REGISTERS = 255
"""``maxnreg`` of every launch: the architecture's limit per thread. Without it ptxas caps some 8-warp kernels at 128
registers and spills (seen on sm_80 in the compile checks)."""


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **constexprs, **options)``."""

    kernel: Any  # a @triton.jit function: indexed by its grid to launch
    grid: tuple[int, int]
    args: tuple[object, ...]
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int

    @property
    def options(self) -> dict[str, int]:
        """The launch options (``num_warps``, ``num_stages``, ``maxnreg``)."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, "maxnreg": MAX_REGISTERS}

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def _constexprs(layout: TritonLayout, q: torch.Tensor) -> dict[str, object]:
    cfg, d = layout.config, q.shape[-1]
    return {
        "CAUSAL": layout.causal, "IEEE": q.dtype == torch.float32, "UPCAST": _upcast(q.dtype), "HEAD_DIM": d,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "NEAR": cfg.near,
    }  # fmt: skip


def _layout_args(layout: TritonLayout) -> tuple[torch.Tensor, ...]:
    return (
        layout.near, layout.left_u, layout.left_v, layout.left_ns, layout.left_cuts, layout.right_u, layout.right_v,
        layout.right_ns, layout.right_cuts, layout.cut_base,
    )  # fmt: skip


def _strides(*xs: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for x in xs for s in x.stride()[:3])


def forward_launch(
    layout: TritonLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float,
) -> Launch:  # fmt: skip
    """The forward launch over ``layout`` for contiguous ``q, k, v``, writing ``out`` and ``lse``."""
    b, hq, lq, _ = q.shape
    args = (
        q, k, v, out, lse, *_layout_args(layout), layout.tile_first, layout.tile_last, *_strides(q, k, v, out),
        hq, hq // k.shape[1], lq, k.shape[2], layout.num_samples, layout.num_tiles, layout.grid0, layout.width,
        scale * LOG2E,
    )  # fmt: skip
    return Launch(fwd_kernel, (layout.num_tiles, b * hq), args, _constexprs(layout, q), *layout.config.launch("fwd"))


def backward_launches(
    layout: TritonLayout, saved: tuple[torch.Tensor, ...], dout: torch.Tensor, delta: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float, dist: torch.Tensor | None = None,
) -> tuple[Launch, Launch]:  # fmt: skip
    """The ``dq`` and ``dk, dv`` launches for ``saved = (q, k, v, out, lse)`` (contiguous), ``dout`` (contiguous),
    ``delta = rowsum(dout * out)`` and the outputs ``grads = (dq, dk, dv)`` (allocated like ``q, k, v``).

    ``dist`` (float32, ``(B * Hq, num_tiles)`` elements, contiguous), when given, switches the ``dq`` kernel's
    ``DIST_GRAD`` on: its program ``(tile, b * Hq + h)`` writes ``sum over the tile's rows i and all keys j of
    dS_ij |i - j|`` to ``dist[b * Hq + h, tile]``. Without it the kernel is the plain one (``Dist`` is ``None``,
    a constexpr)."""
    q, k, v, _, lse = saved
    dq, dk, dv = grads
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    cfg, t = layout.config, layout.num_samples
    const = _constexprs(layout, q)
    common = (*_layout_args(layout),)
    dq_args = (
        q, k, v, dout, lse, delta, dq, dist, *common, layout.tile_first, layout.tile_last, *_strides(q, k, v, dout),
        hq, hq // hkv, lq, lk, t, layout.num_tiles, layout.grid0, layout.width, scale, scale * LOG2E,
    )  # fmt: skip
    dkdv_args = (
        q, k, v, dout, lse, delta, dk, dv, *common, layout.kb_first, layout.kb_last, *_strides(q, k, v, dout),
        hq, hkv, hq // hkv, lq, lk, t, layout.num_tiles, layout.num_kb, layout.grid0, layout.width, scale,
        scale * LOG2E,
    )  # fmt: skip
    dkdv_const = {**const, "SUB_M": cfg.sub_m, "SUB_N": cfg.sub_n}
    dkdv_grid = (layout.num_kb * (cfg.block_n // cfg.sub_n), b * hkv)
    dq_const = {**const, "DIST_GRAD": dist is not None}
    return (
        Launch(bwd_dq_kernel, (layout.num_tiles, b * hq), dq_args, dq_const, *cfg.launch("dq")),
        Launch(bwd_dkdv_kernel, dkdv_grid, dkdv_args, dkdv_const, *cfg.launch("dkdv")),
    )


@dataclass(frozen=True)
class TritonBackend:
    """The multiplicity form on the Triton kernels (:class:`~positional_lsh.ops._engine.backend.Backend`; the row
    ``("multiplicity", "triton")``): inputs contiguous, as ``torch_attention.kernel_inputs`` makes them."""

    @property
    def method(self) -> str:
        """``"multiplicity"``."""
        return "multiplicity"

    @property
    def kernel(self) -> str:
        """``"triton"``."""
        return "triton"

    def plan(
        self, partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool, device: torch.device
    ) -> TritonPlan:
        """The call's :class:`~positional_lsh.ops._engine.triton.plan.TritonPlan`; its layout's tensors are built by
        the forward on ``device``, when the inputs' dtype and head dim fix the block configuration."""
        if partitions.num_samples >= 2**31 or partitions.seq_len >= 2**31 - 1:
            raise ValueError("partitions: num_samples and seq_len must fit in int32")
        return TritonPlan(partitions, q_len, causal, device)

    def forward(
        self, plan: TritonPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch of the forward kernel for contiguous ``q, k, v``: ``out`` (``q``'s dtype) and ``lse (B, Hq,
        Lq)`` float32."""
        layout = plan.layout_for(config_for(q))
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        forward_launch(layout, q, k, v, out, lse, scale).run()
        return out, lse

    def backward(
        self, plan: TritonPlan, saved: Saved, dout: torch.Tensor, scale: float, dist_grad: bool
    ) -> Gradients:
        """Two launches (``dq``, then ``dk, dv``) for ``saved`` (contiguous, as :meth:`forward` took and returned
        them): ``dq, dk, dv`` in the inputs' dtypes; ``dist (Hq,)`` float32, computed inside the ``dq`` kernel, when
        ``dist_grad`` (else ``None``, and the plain kernel)."""
        q, k, v, out, _ = saved
        layout = plan.layout_for(config_for(q))
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, Hq, Lq)
        # All contiguous: the kernels index dq with q's strides, dk with k's and dv with v's.
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        b, hq = q.shape[:2]
        # One float32 partial per (batch, head, query tile), each written once by its dq program; summed here.
        parts = torch.empty((b, hq, layout.num_tiles), dtype=torch.float32, device=q.device) if dist_grad else None
        for launch in backward_launches(layout, tuple(saved), dout, delta, grads, scale, parts):
            launch.run()
        return (*grads, None if parts is None else parts.sum(dim=(0, 2)))


TRITON = TritonBackend()
"""The Triton backend (the row ``("multiplicity", "triton")`` of the engine's table)."""
