"""Data-parallel training across processes (torchrun): each rank's share of the sums and the
barriers; one process is a world of one."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run: rank ``rank`` of ``world`` processes (one
    process: rank 0 of 1, and every collective is the identity); ``device``: where the
    collectives' tensors go (the CPU with gloo, the process's GPU with NCCL)."""
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    def sum(self, values: Sequence[float]) -> List[float]:
        """Each value summed over the processes (float64)."""
        if self.world == 1:
            return [float(v) for v in values]

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, value: float) -> float:
        if self.world == 1:
            return value

        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group, all processes together (one leaving while another still
        talks to it can end the process with an abort)."""
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()


def init_distributed(device: str = "cpu") -> Ranks:
    """Join the process group when launched by ``torchrun`` with more than one process
    (``WORLD_SIZE``): gloo for training on the CPU; NCCL on ``device="cuda"``, each process on
    the GPU of its ``LOCAL_RANK``. One process: rank 0 of 1 (on ``device``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Ranks(device=device)

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Ranks(dist.get_rank(), dist.get_world_size(), device)
