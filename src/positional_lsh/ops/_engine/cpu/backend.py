"""The CPU kernel as a backend: the multiplicity form (:data:`CPU_KERNEL`, the row ``("multiplicity", "cpu")`` of
the engine's table) and the exact biases of ``alibi_attention`` / ``decay_attention`` (:func:`table_forward`,
:func:`table_backward`).

The kernel (``attention.cpp``, built by :mod:`~positional_lsh.ops._engine.cpu.build`) accumulates in float32. The
forward multiplies bfloat16 inputs as they are (batch-reduce GEMMs with float32 accumulation on VNNI-packed blocks;
the probabilities rounded to bfloat16 for ``P V``, as torch's flash kernels do); the backward, float16 (whose VNNI
GEMM needs AMX-FP16), odd head dims and float32 inputs compute in float32 (one conversion). ``out`` is returned in the
inputs' dtype, ``lse`` float32. The multiplicity form's bias ``log c`` is computed inside the kernel from the
partitions' pitches and shifts (no mask tensor); the exact biases come from one ``(Hq, Lk)`` line per head, the bias
at each distance.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from positional_lsh.ops._engine.backend import Gradients, Saved
from positional_lsh.ops._engine.kinds import Kernel, Method
from positional_lsh.ops._engine.multiplicity.mask import log_count_table
from positional_lsh.ops.partitions.partition import Partitions

__all__ = [
    "BLOCK_M", "BLOCK_N", "CPU_KERNEL", "DTYPES", "MAX_HEAD_DIM", "TABLE_BLOCK_M", "TABLE_BLOCK_N", "CpuBackend",
    "CpuPlan", "TableBias", "bf16_gemm", "table_backward", "table_forward",
]  # fmt: skip

#: Query rows per tile and keys per key block of the kernel.
BLOCK_M, BLOCK_N = 64, 64
#: The same for the exact biases' forward: larger tiles, whose longer GEMMs pay where the bias is a table read
#: (5-8 % faster at n = 1024-32768 than 64 x 64, paired A/B; the multiplicity form's counts were slower on them).
TABLE_BLOCK_M, TABLE_BLOCK_N = 128, 128
#: The dtypes the kernel takes (computed in float32).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The largest head dim the kernel takes.
MAX_HEAD_DIM = 512

_COUNT, _TABLE = 0, 1


def _inputs(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.to(torch.float32).contiguous() for x in xs]


@functools.cache
def bf16_gemm() -> bool:
    """Whether ATen's batch-reduce GEMM takes VNNI-packed bfloat16 here (one tiny call of the kernel, once): it
    needs oneDNN's ukernel (AVX-512 with bf16, or AMX). float16 needs AMX-FP16: it is computed in float32."""
    x = torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16)
    table = torch.zeros(1, 2)
    try:
        torch.ops.plsh_cpu.attention_forward(
            x, x, x, _empty(), _empty(), table, table, torch.ones(1, dtype=torch.int64), _TABLE, True, 1.0, 2, 2
        )
    except RuntimeError:
        return False
    return True


def _forward_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """The forward's inputs: bfloat16 as it is (contiguous; the kernel multiplies it with fp32 accumulation, ``P``
    rounded to bfloat16 for ``P V``) where the head dim is even and :func:`bf16_gemm`, else float32."""
    if q.dtype == torch.bfloat16 and q.shape[-1] % 2 == 0 and bf16_gemm():
        return [x.contiguous() for x in (q, k, v)]
    return _inputs(q, k, v)


def _empty() -> torch.Tensor:
    return torch.empty(0)


@dataclass(frozen=True)
class CpuPlan:
    """The multiplicity form of one call on the CPU kernel: the partitions and the call's shape (the kernel plans its
    tiles itself)."""

    partitions: Partitions
    q_len: int
    causal: bool

    def count_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The kernel's bias arguments: pitches, shifts (float64 ``(T, Hq)``), the ``log c`` table and the kind."""
        p = self.partitions
        pitch = p.pitch.detach().to("cpu", torch.float64).contiguous()
        shift = p.shift.detach().to("cpu", torch.float64).contiguous()
        table = log_count_table(p.num_samples, torch.float32, torch.device("cpu"))
        return pitch, shift, table, _empty(), _empty(), _COUNT


@dataclass(frozen=True)
class CpuBackend:
    """The multiplicity form on the CPU kernel (:class:`~positional_lsh.ops._engine.backend.Backend`)."""

    @property
    def method(self) -> Method:
        """``Method.MULTIPLICITY``."""
        return Method.MULTIPLICITY

    @property
    def kernel(self) -> Kernel:
        """``Kernel.CPU``."""
        return Kernel.CPU

    def plan(
        self, partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool, device: torch.device
    ) -> CpuPlan:
        """The call's :class:`CpuPlan` (nothing is computed host-side)."""
        if partitions.seq_len >= 2**31 - 1:
            raise ValueError(f"partitions: the CPU kernel takes fewer than 2**31 - 1 keys, got {partitions.seq_len}")
        return CpuPlan(partitions, q_len, causal)

    def forward(
        self, plan: CpuPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``: ``out`` in ``q``'s dtype, ``lse`` float32."""
        qf, kf, vf = _forward_inputs(q, k, v)
        out, lse = torch.ops.plsh_cpu.attention_forward(
            qf, kf, vf, *plan.count_args(), plan.causal, scale, BLOCK_M, BLOCK_N
        )
        return out.to(q.dtype), lse

    def backward(self, plan: CpuPlan, saved: Saved, dout: torch.Tensor, scale: float, dist_grad: bool) -> Gradients:
        """``(dq, dk, dv, slope_dist)`` from the saved ``out``/``lse`` (recomputed scores); ``slope_dist (Hq,)``
        float32 ``= sum dS |i - j|`` when ``dist_grad``."""
        dq, dk, dv, dsum = _backward(saved, dout, plan.count_args(), plan.causal, scale, dist_grad)
        slope_dist = None
        if dist_grad:
            lk = saved.k.shape[2]
            slope_dist = (dsum.double() * torch.arange(lk, dtype=torch.float64)).sum((0, 2)).to(torch.float32)
        return dq, dk, dv, slope_dist


def _backward(
    saved: Saved,
    dout: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
    causal: bool,
    scale: float,
    dist: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward: ``dq, dk, dv`` in the inputs' dtypes (``dk, dv`` summed over the query heads of each key
    head) and ``dsum (B, Hq, Lk)`` float32, ``dS`` summed per distance ``|i - j|`` (empty unless ``dist``)."""
    q, k, v, out, lse = saved
    dof, qf, kf, vf, of = _inputs(dout, q, k, v, out)
    dq, dk, dv, dsum = torch.ops.plsh_cpu.attention_backward(
        dof, qf, kf, vf, of, lse.to(torch.float32).contiguous(), *bias, causal, scale, dist, BLOCK_M, BLOCK_N
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsum


CPU_KERNEL = CpuBackend()
"""The CPU kernel's backend (the row ``("multiplicity", "cpu")`` of the engine's table)."""


@dataclass(frozen=True)
class TableBias:
    """An exact bias that depends on ``|i - j|`` only, for the kernel: ``line (Hq, Lk)`` float32 contiguous, the bias
    at each distance (``-inf`` beyond a window), ``rline`` the same reversed, and ``reach (Hq,)`` int64, each head's
    largest kept distance."""

    line: torch.Tensor
    rline: torch.Tensor
    reach: torch.Tensor

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return _empty(), _empty(), self.line, self.rline, self.reach, _TABLE

    @staticmethod
    def of(line: torch.Tensor, reach: list[float]) -> TableBias:
        """From the line and each head's largest kept distance (``inf``: every key)."""
        lk = line.shape[1]
        r = [lk if math.isinf(x) else min(lk, int(x)) for x in reach]
        line = line.to(torch.float32).contiguous()
        return TableBias(line, line.flip(-1).contiguous(), torch.tensor(r, dtype=torch.int64))


def table_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: TableBias, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of exact attention with the bias ``bias`` (``out`` in ``q``'s dtype, ``lse`` float32)."""
    qf, kf, vf = _forward_inputs(q, k, v)
    out, lse = torch.ops.plsh_cpu.attention_forward(
        qf, kf, vf, *bias.args(), causal, scale, TABLE_BLOCK_M, TABLE_BLOCK_N
    )
    return out.to(q.dtype), lse


def table_backward(
    dout: torch.Tensor, saved: tuple[torch.Tensor, ...], bias: TableBias, causal: bool, scale: float, dist: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """``((dq, dk, dv), dsum)``: ``dsum (B, Hq, Lk)`` float32, ``dS`` summed per distance, when ``dist`` (else
    ``None``): the gradient of any parameter of the line is ``sum dsum * d line / d parameter``."""
    dq, dk, dv, dsum = _backward(Saved(*saved), dout, bias.args(), causal, scale, dist)
    return (dq, dk, dv), (dsum if dist else None)
