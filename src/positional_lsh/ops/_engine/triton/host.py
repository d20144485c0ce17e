"""The multiplicity form as Triton kernels: one launch for the forward, two for the backward (the GPU path).

Same estimator as :mod:`positional_lsh.ops._engine.multiplicity` (docs/implementation.md, "The multiplicity form")::

    out_i = softmax_j(scale * q_i . k_j + log c[i,j]) v_j

with ``c[i,j] = #{t : start_t(i) <= j}`` for ``j <= i`` when causal (0 above the diagonal) and
``c[i,j] = #{t : start_t(i) <= j < end_t(i)}`` when bidirectional; ``log 0 = -inf``.

This module is a backend of :mod:`positional_lsh.ops._engine.engine` — :func:`triton_plan` → :func:`triton_forward` →
:func:`triton_backward` (which, asked, also returns the slopes' surrogate gradient term ``sum dS |i - j|``, computed
inside the ``dq`` kernel), and :func:`check_triton_call` — over three pieces:

* :mod:`~positional_lsh.ops._engine.triton.plan` (torch only): the block configurations (:data:`BLOCK_TABLE
  <positional_lsh.ops._engine.triton.plan.BLOCK_TABLE>`, per architecture, dtype and head dim) and the per-call plan —
  each query tile's *events* (the blocks of its first and last rows in every sample, sorted) and the *near
  table* (the counts of the keys next to the tile). Built on the tensors' device in ``O(H * n * T)`` elementwise
  work; ``O(H * n * width + H * n / BLOCK_M * T)`` memory, never ``n x n``.
* :mod:`~positional_lsh.ops._engine.triton.kernels`: the kernels. Counting a score entry's ``c`` costs a few integer
  operations whatever ``T`` is (:mod:`~positional_lsh.ops._tools.triton_work` computes how many).
* :mod:`~positional_lsh.ops._tools.triton_compile`: ahead-of-time compilation for sm_80/sm_90 without a GPU (registers,
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

from positional_lsh.ops._engine.triton.kernels import LOG2E, triton
from positional_lsh.ops._engine.triton.plan import BlockConfig, TritonPlan, TritonWork, block_config
from positional_lsh.ops.partitions.partition import Partitions

if triton is not None:
    from positional_lsh.ops._engine.triton.kernels import bwd_dkdv_kernel, bwd_dq_kernel, fwd_kernel

__all__ = [
    "DTYPES",
    "MAX_HEAD_DIM",
    "MAX_REGISTERS",
    "Launch",
    "backward_launches",
    "check_triton_call",
    "config_for",
    "device_arch",
    "forward_launch",
    "interpreting",
    "triton_available",
    "triton_backward",
    "triton_forward",
    "triton_plan",
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
    """The block configuration for ``q (B, Hq, Lq, d)``: :func:`~positional_lsh.ops._engine.triton.plan.block_config` of
    its
    dtype, head dim and device architecture (tests replace this to run small tiles)."""
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


def triton_plan(partitions: Partitions, q_len: int, causal: bool, device: torch.device) -> TritonWork:
    """The call's plan (:class:`~positional_lsh.ops._engine.triton.plan.TritonWork`); its tensors are built by the
    forward,
    when the inputs' dtype and head dim fix the block configuration."""
    if partitions.num_samples >= 2**31 or partitions.seq_len >= 2**31 - 1:
        raise ValueError("partitions: num_samples and seq_len must fit in int32")
    return TritonWork(partitions, q_len, causal, device)


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


def _constexprs(plan: TritonPlan, q: torch.Tensor) -> dict[str, object]:
    cfg, d = plan.config, q.shape[-1]
    return {
        "CAUSAL": plan.causal, "IEEE": q.dtype == torch.float32, "UPCAST": _upcast(q.dtype), "HEAD_DIM": d,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_D": max(16, triton.next_power_of_2(d)),
        "NEAR": cfg.near,
    }  # fmt: skip


def _plan_args(plan: TritonPlan) -> tuple[torch.Tensor, ...]:
    return (
        plan.near, plan.left_u, plan.left_v, plan.left_ns, plan.left_cuts, plan.right_u, plan.right_v, plan.right_ns,
        plan.right_cuts, plan.cut_base,
    )  # fmt: skip


def _strides(*xs: torch.Tensor) -> tuple[int, ...]:
    return tuple(s for x in xs for s in x.stride()[:3])


def forward_launch(
    plan: TritonPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    scale: float,
) -> Launch:  # fmt: skip
    """The forward launch for contiguous ``q, k, v``, writing ``out`` and ``lse``."""
    b, hq, lq, _ = q.shape
    args = (
        q, k, v, out, lse, *_plan_args(plan), plan.tile_first, plan.tile_last, *_strides(q, k, v, out),
        hq, hq // k.shape[1], lq, k.shape[2], plan.num_samples, plan.num_tiles, plan.grid0, plan.width,
        scale * LOG2E,
    )  # fmt: skip
    return Launch(fwd_kernel, (plan.num_tiles, b * hq), args, _constexprs(plan, q), *plan.config.launch("fwd"))


def backward_launches(
    plan: TritonPlan, saved: tuple[torch.Tensor, ...], dout: torch.Tensor, delta: torch.Tensor,
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
    cfg, t = plan.config, plan.num_samples
    const = _constexprs(plan, q)
    common = (*_plan_args(plan),)
    dq_args = (
        q, k, v, dout, lse, delta, dq, dist, *common, plan.tile_first, plan.tile_last, *_strides(q, k, v, dout),
        hq, hq // hkv, lq, lk, t, plan.num_tiles, plan.grid0, plan.width, scale, scale * LOG2E,
    )  # fmt: skip
    dkdv_args = (
        q, k, v, dout, lse, delta, dk, dv, *common, plan.kb_first, plan.kb_last, *_strides(q, k, v, dout),
        hq, hkv, hq // hkv, lq, lk, t, plan.num_tiles, plan.num_kb, plan.grid0, plan.width, scale, scale * LOG2E,
    )  # fmt: skip
    dkdv_const = {**const, "SUB_M": cfg.sub_m, "SUB_N": cfg.sub_n}
    dkdv_grid = (plan.num_kb * (cfg.block_n // cfg.sub_n), b * hkv)
    dq_const = {**const, "DIST_GRAD": dist is not None}
    return (
        Launch(bwd_dq_kernel, (plan.num_tiles, b * hq), dq_args, dq_const, *cfg.launch("dq")),
        Launch(bwd_dkdv_kernel, dkdv_grid, dkdv_args, dkdv_const, *cfg.launch("dkdv")),
    )


def triton_forward(
    work: TritonWork,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the forward kernel for contiguous ``q, k, v`` and the plan ``work`` of :func:`triton_plan`:
    ``out`` (``q``'s dtype) and ``lse (B, Hq, Lq)`` float32."""
    assert causal == work.causal
    plan = work.plan_for(config_for(q))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    forward_launch(plan, q, k, v, out, lse, scale).run()
    return out, lse


def triton_backward(
    work: TritonWork,
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    causal: bool,
    scale: float,
    dist_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dist)`` from ``saved = (q, k, v, out, lse)`` (contiguous, as :func:`triton_forward` took and
    returned them) and the upstream gradient ``dout``: ``dq, dk, dv`` in the inputs' dtypes; ``dist (Hq,)`` float32
    ``= sum over batch, i, j of dS[b, h, i, j] * |i - j|`` (``dS`` the estimator's own score gradient, query row ``r``
    at position ``Lk - Lq + r``; the slope gradient of the bias ``-m_h |i - j|`` is ``-dist``) when ``dist_grad``,
    else ``None`` (and no extra work)."""
    assert causal == work.causal
    q, k, v, out, _ = saved
    plan = work.plan_for(config_for(q))
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, Hq, Lq)
    # All contiguous: the kernels index dq with q's strides, dk with k's and dv with v's.
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    b, hq = q.shape[:2]
    # One float32 partial per (batch, head, query tile), each written once by its dq program; summed here.
    parts = torch.empty((b, hq, plan.num_tiles), dtype=torch.float32, device=q.device) if dist_grad else None
    for launch in backward_launches(plan, saved, dout, delta, grads, scale, parts):
        launch.run()
    return (*grads, None if parts is None else parts.sum(dim=(0, 2)))
