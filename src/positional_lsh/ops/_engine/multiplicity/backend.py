"""The multiplicity form's backend on torch's attention ops (:class:`MultiplicityBackend`): every kernel call's
gathered tiles and mask, then the flash or math kernel. The method: :mod:`positional_lsh.ops._engine.multiplicity`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from positional_lsh.ops._engine.backend import Gradients, Saved, accumulators
from positional_lsh.ops._engine.kinds import Kernel, Method
from positional_lsh.ops._engine.multiplicity.mask import Workspace, count_mask, kernel_calls
from positional_lsh.ops._engine.multiplicity.plan import KEEP_MASK_ELEMENTS, Call, MultiplicityPlan, multiplicity_plan
from positional_lsh.ops._engine.torch_attention import Grad, acc_dtype, attend, attend_backward, attend_bias_grad
from positional_lsh.ops.partitions.partition import Partitions

__all__ = ["MULTIPLICITY_FLASH", "MULTIPLICITY_MATH", "MultiplicityBackend", "call_inputs", "gather_rows"]

def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` (no call where it is already: a short call makes a few hundred of these)."""
    return x if x.dtype == dtype else x.to(dtype)


def gather_rows(
    x: torch.Tensor, index: torch.Tensor, shape: torch.Size, ws: Workspace | None = None, role: str = ""
) -> torch.Tensor:
    """Rows ``index`` (flat ``head * L + position``) of ``x (B, H, L, ...)`` as ``(B, *shape, ...)`` (into
    ``ws``'s buffer of ``role`` where given and ``(H, L)`` flattens to a view)."""
    b, length, rest = x.shape[0], x.shape[2], x.shape[3:]
    if x.stride(1) == length * x.stride(2) or x.shape[1] == 1:  # (H, L) merges into one dim without a copy
        flat = x.flatten(1, 2)
        if ws is None:
            return flat.index_select(1, index).view(b, *shape, *rest)
        buf = ws.take(role, (b, index.numel(), *rest), x.dtype)
        return torch.index_select(flat, 1, index, out=buf).view(b, *shape, *rest)
    return x[:, index // length, index % length].view(b, *shape, *rest)


def call_inputs(
    c: Call,
    plan: MultiplicityPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cd: torch.dtype,
    ws: Workspace,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel call's mask and its gathered ``q, k, v`` tiles in the accumulation dtype ``cd`` (half inputs are
    converted tile by tile, in the cache: a whole-tensor conversion paged in a fresh copy and was slower). ``mask``:
    the call's mask where the forward kept it (``plan.KEEP_MASK_ELEMENTS``), else it is built (:func:`count_mask`)."""
    if mask is None:
        mask = count_mask(c, plan, cd, ws)
    qg = _as(gather_rows(q, c.q_index, c.rows.shape, ws, "q"), cd)
    kg = _as(gather_rows(k, c.kv_index, c.keys.shape, ws, "k"), cd)
    vg = _as(gather_rows(v, c.kv_index, c.keys.shape, ws, "v"), cd)
    return mask, qg, kg, vg


@dataclass(frozen=True)
class MultiplicityBackend:
    """The multiplicity form on a torch kernel (:class:`~positional_lsh.ops._engine.backend.Backend`). Tiles are
    computed in the accumulation dtype (``ops._engine.torch_attention.acc_dtype``: float32 for half inputs, so that the
    mask's ``log c`` is not rounded to 8 bits).

    Attributes:
        kernel: ``Kernel.FLASH`` or ``Kernel.MATH`` (``ops._engine.torch_attention.attend``; every call has the
            mask ``log c``).
    """

    kernel: Kernel

    @property
    def method(self) -> Method:
        """``Method.MULTIPLICITY``."""
        return Method.MULTIPLICITY

    def plan(
        self, partitions: Partitions, num_kv_heads: int, q_len: int, causal: bool, device: torch.device
    ) -> MultiplicityPlan:
        """:func:`multiplicity_plan` of every query head (host-side; the groups move to the inputs' device)."""
        return multiplicity_plan(partitions, list(range(partitions.num_heads)), num_kv_heads, q_len, causal)

    def forward(
        self, plan: MultiplicityPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group's masked call, its rows written into ``out``/``lse`` (no merge: each row is in one tile); the
        rows of heads outside ``plan.heads`` stay 0 and ``-inf``. ``out`` in ``q``'s dtype."""
        cd = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=cd, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=cd, device=q.device)
        b, d = q.shape[0], q.shape[-1]
        ws = Workspace(q.device)
        calls = kernel_calls(plan, q.device, b, d)
        keep = sum(c.rows.numel() * c.g.k_len for c in calls) <= KEEP_MASK_ELEMENTS
        masks = []
        out_f, lse_f = out.view(b, -1, d), lse.view(b, -1)
        for c in calls:
            mask, qg, kg, vg = call_inputs(c, plan, q, k, v, cd, ws)
            if keep:
                masks.append(mask.clone())
            o, l = attend(qg, kg, vg, causal=False, scale=scale, kernel=self.kernel, bias=mask.unsqueeze(0))
            # Padded rows repeat row Lq-1 of the same tile: they write the same values.
            out_f.index_copy_(1, c.q_index, _as(o.flatten(1, 2), cd))
            lse_f.index_copy_(1, c.q_index, _as(l.flatten(1, 2), cd))
        if keep:
            plan.kept_masks[(str(q.device), b, d, cd)] = tuple(masks)
        return _as(out, q.dtype), lse

    def backward(
        self, plan: MultiplicityPlan, saved: Saved, dout: torch.Tensor, scale: float, dist_grad: bool
    ) -> Gradients:
        """Every group's masked backward against the saved ``out``/``lse``, its key gradients scatter-added
        (accumulation dtype); with ``dist_grad`` each call's ``sum dS |i - j|`` into its tiles' heads."""
        q, k, v, out, lse = saved
        (dq, dk, dv), slope_dist = accumulators(saved, dist_grad)
        cd = acc_dtype(q.dtype)
        b, hq, lq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        dq_f, dk_f, dv_f = dq.view(b, hq * lq, d), dk.view(b, hkv * n, d), dv.view(b, hkv * n, d)
        lse_f = lse.reshape(b, hq * lq)
        ws = Workspace(q.device)
        calls = kernel_calls(plan, q.device, b, d)
        kept = plan.kept_masks.pop((str(q.device), b, d, cd), None)  # the forward's, where it kept them
        for i, c in enumerate(calls):
            mask, qg, kg, vg = call_inputs(c, plan, q, k, v, cd, ws, None if kept is None else kept[i])
            og = _as(gather_rows(out, c.q_index, c.rows.shape, ws, "out"), cd)
            lg = _as(lse_f.index_select(1, c.q_index).view(b, *c.rows.shape), cd)
            dg = _as(gather_rows(dout, c.q_index, c.rows.shape), cd)
            if c.padded:  # padding rows get a zero upstream gradient, so they contribute nothing
                dg = _as(dg * c.real[None, :, :, None], cd)
            grad = Grad(dg, qg, kg, vg, og, lg)
            gq, gk, gv = attend_backward(grad, causal=False, scale=scale, kernel=self.kernel, bias=mask.unsqueeze(0))
            dq_f.index_add_(1, c.q_index, _as(gq.flatten(1, 2), dq.dtype))
            dk_f.index_add_(1, c.kv_index, _as(gk.flatten(1, 2), dk.dtype))
            dv_f.index_add_(1, c.kv_index, _as(gv.flatten(1, 2), dv.dtype))
            if slope_dist is not None:  # the surrogate slope gradient: |i - j| of the tiles' rows and union keys
                w = (c.pos[:, :, None] - c.keys[:, None, :]).abs().to(cd).unsqueeze(0)
                total = attend_bias_grad(grad, w, causal=False, scale=scale, bias=mask.unsqueeze(0))
                slope_dist.index_add_(0, c.g.head, total.sum(0).to(slope_dist.dtype))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), slope_dist


MULTIPLICITY_FLASH = MultiplicityBackend(Kernel.FLASH)
"""The multiplicity form on torch's fused flash op of the device (the row ``("multiplicity", "flash")``)."""
MULTIPLICITY_MATH = MultiplicityBackend(Kernel.MATH)
"""The multiplicity form on batched matmuls (the row ``("multiplicity", "math")``)."""
