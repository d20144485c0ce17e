"""Where a training process stands in a ``torchrun`` launch (:class:`Dist`) and its device
(:func:`init_distributed`), for :func:`positional_lsh.lm.train.train`."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from positional_lsh.ops.errors import UserError


@dataclass
class Dist:
    """This process's place in the run; ``owns_group``: :func:`init_distributed` created the process group."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed(device_choice: str) -> tuple[Dist, torch.device]:
    """Join (creating it under ``torchrun`` if needed) the process group and choose the device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = device_choice.startswith("cuda") or (device_choice == "auto" and torch.cuda.is_available())
    if world > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if want_cuda:
            torch.cuda.set_device(local_rank)
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group(backend="nccl" if want_cuda else "gloo")
        info = Dist(dist.get_rank(), dist.get_world_size(), local_rank, owns)
        device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
        return info, device
    if device_choice == "auto":
        return Dist(), torch.device("cuda" if want_cuda else "cpu")
    return Dist(), check_device(device_choice)


def check_device(choice: str) -> torch.device:
    """The device named ``choice`` (``"auto"``: CUDA if available); ``UserError`` if it is not one or not here."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"--device {choice!r} is not a device ({exc}); use auto, cpu, cuda, cuda:1 ...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {choice}: CUDA is not available here; use --device cpu (or auto)")
    return device
