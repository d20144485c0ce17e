"""The halo exchange: point-to-point sends of boundary keys/values, with a backward that returns their gradients.

Forward: every rank posts one ``irecv`` per incoming halo piece and one ``isend`` per outgoing piece (keys and
values of a piece travel together as one ``(2, B, Hkv, len, d)`` buffer), waits, and assembles its key window
``[left halo, own shard, right halo]``. Backward: the gradients of the halo pieces go back to their owners by
the same point-to-point pattern reversed, and each owner adds them to the gradient of its own shard.

Every byte that goes through ``isend`` is counted in :func:`comm_stats` (forward and backward separately).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from positional_lsh.distributed.halo import HaloPlan, Transfer

_STATS: dict[str, int] = {"forward_bytes": 0, "backward_bytes": 0, "forward_messages": 0, "backward_messages": 0}


def comm_stats() -> dict[str, int]:
    """Bytes and messages this process has sent through the halo exchange since the last reset."""
    return dict(_STATS)


def reset_comm_stats() -> None:
    """Zero the counters of :func:`comm_stats`."""
    for key in _STATS:
        _STATS[key] = 0


def _send(buf: torch.Tensor, dst: int, group: Any, phase: str) -> dist.Work:
    _STATS[f"{phase}_bytes"] += buf.numel() * buf.element_size()
    _STATS[f"{phase}_messages"] += 1
    work = dist.isend(buf, dst=dist.get_global_rank(group, dst), group=group)
    assert work is not None
    return work


def _recv(buf: torch.Tensor, src: int, group: Any) -> dist.Work:
    work = dist.irecv(buf, src=dist.get_global_rank(group, src), group=group)
    assert work is not None
    return work


def _pieces(k: torch.Tensor, v: torch.Tensor, offset: int, transfers: list[Transfer]) -> list[torch.Tensor]:
    """Stacked ``(2, B, Hkv, len, d)`` key/value buffers of the given transfers (``offset`` = the shard start)."""
    return [
        torch.stack(
            [k[:, :, tr.start - offset : tr.end - offset], v[:, :, tr.start - offset : tr.end - offset]]
        ).contiguous()
        for tr in transfers
    ]


def receive_halo(
    k: torch.Tensor, v: torch.Tensor, plan: HaloPlan, rank: int, group: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Send this rank's outgoing pieces and receive its halo (no autograd): ``(left, right)`` lists of
    ``(2, B, Hkv, len, d)`` key/value buffers, each in position order (left of the shard, right of it)."""
    start, end = plan.starts[rank], plan.ends[rank]
    incoming = sorted(plan.incoming(rank), key=lambda tr: tr.start)
    outgoing = plan.outgoing(rank)
    b, h, _, d = k.shape
    bufs = [torch.empty((2, b, h, tr.length, d), dtype=k.dtype, device=k.device) for tr in incoming]
    works = [_recv(buf, tr.src, group) for buf, tr in zip(bufs, incoming, strict=True)]
    sends = _pieces(k, v, start, outgoing)
    works += [_send(buf, tr.dst, group, "forward") for buf, tr in zip(sends, outgoing, strict=True)]
    for work in works:
        work.wait()
    left = [buf for buf, tr in zip(bufs, incoming, strict=True) if tr.start < start]
    right = [buf for buf, tr in zip(bufs, incoming, strict=True) if tr.start >= end]
    return left, right


def return_halo_grads(
    halo_grads: list[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, plan: HaloPlan, rank: int, group: Any
) -> None:
    """The backward of :func:`receive_halo`: send ``halo_grads`` (``(2, B, Hkv, len, d)``, one per incoming
    piece in ``plan.incoming(rank)`` order) to their owners, and add the gradients of this rank's outgoing pieces,
    received from the ranks they went to, into ``dk``, ``dv`` (this rank's shard, in place)."""
    start = plan.starts[rank]
    incoming, outgoing = plan.incoming(rank), plan.outgoing(rank)
    b, h, _, d = dk.shape
    bufs = [torch.empty((2, b, h, tr.length, d), dtype=dk.dtype, device=dk.device) for tr in outgoing]
    works = [_recv(buf, tr.dst, group) for buf, tr in zip(bufs, outgoing, strict=True)]
    works += [_send(g, tr.src, group, "backward") for g, tr in zip(halo_grads, incoming, strict=True)]
    for work in works:
        work.wait()
    for buf, tr in zip(bufs, outgoing, strict=True):
        dk[:, :, tr.start - start : tr.end - start] += buf[0]
        dv[:, :, tr.start - start : tr.end - start] += buf[1]


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx; the attributes set here are read by backward
        k: torch.Tensor,
        v: torch.Tensor,
        plan: HaloPlan,
        rank: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        left, right = receive_halo(k, v, plan, rank, group)
        k_win = torch.cat([*(p[0] for p in left), k, *(p[0] for p in right)], dim=2)
        v_win = torch.cat([*(p[1] for p in left), v, *(p[1] for p in right)], dim=2)
        ctx.plan, ctx.rank, ctx.group = plan, rank, group
        return k_win, v_win

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dk_win: torch.Tensor, dv_win: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: HaloPlan = ctx.plan
        rank, group = ctx.rank, ctx.group
        start, end, left = plan.starts[rank], plan.ends[rank], plan.left[rank]
        # The window gradients are fresh tensors of the attention backward and the halo pieces are copied out
        # (and sent): add the returned pieces in place and return views (no copy of the shard).
        dk = dk_win[:, :, start - left : end - left]
        dv = dv_win[:, :, start - left : end - left]
        return_halo_grads(_pieces(dk_win, dv_win, left, plan.incoming(rank)), dk, dv, plan, rank, group)
        return dk, dv, None, None, None


def halo_exchange(
    k: torch.Tensor, v: torch.Tensor, plan: HaloPlan, rank: int, group: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's key/value window ``[plan.left[rank], plan.right[rank])`` from its shard and its neighbours'.

    Args:
        k, v: ``(B, Hkv, n_local, d)`` this rank's shard (positions ``[plan.starts[rank], plan.ends[rank])``).
        plan: the :class:`~positional_lsh.distributed.HaloPlan` (identical on every rank).
        rank: this process's rank in ``group``.
        group: the process group (default: the world).

    Returns:
        ``(k_win, v_win)``, ``(B, Hkv, right - left, d)``, differentiable: the backward sends the halo
        gradients back to their owners (a collective step: every rank of the group must run it).
    """
    group = dist.group.WORLD if group is None else group
    return _HaloExchange.apply(k, v, plan, rank, group)
