"""The process group: set up from torchrun's environment variables, torn down at the end of a run.

torchrun (single or multi-node) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; with
them `init_process_group` rendezvous through env://. Without them (a plain `free-transformer train`
with strategy ddp or fsdp) the run is a world of one process, so that the same configuration runs,
and resumes, with or without torchrun.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..base.checks import ConfigError


def is_main_process() -> bool:
    """Whether this process is rank 0 of torchrun's launch (or was started without torchrun): the one that
    speaks for all, before and after the process group exists."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass
class ParallelEnv:
    """Where this process stands: its rank among world_size processes and its device."""

    strategy: str  # none, ddp or fsdp
    device: torch.device
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # this run created the process group and destroys it at the end

    @property
    def distributed(self) -> bool:
        return self.strategy != "none"

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes metrics, progress, configs and finishes checkpoints."""
        return self.rank == 0

    def rows(self, batch_size: int) -> range:
        """The contiguous slice of a global batch that this rank computes."""
        if batch_size % self.world_size:
            raise ConfigError(f"batch_size ({batch_size}) must be a multiple of the {self.world_size} processes")
        local = batch_size // self.world_size
        return range(self.rank * local, (self.rank + 1) * local)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The average of `values` over ranks (every rank gets it); for logging, not for gradients."""
        if self.world_size > 1:
            values = values.clone()
            dist.all_reduce(values, op=dist.ReduceOp.SUM)  # gloo has no AVG
            values /= self.world_size
        return values

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. writes a cache); the others run it once rank 0 is done,
        or has failed (they then usually fail the same way, with the same message)."""
        if not self.is_main:
            self.barrier()
        try:
            yield
        finally:
            if self.is_main:
                self.barrier()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def _backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend nccl needs a cuda device")
    return name


def setup(strategy: str, backend: str, device: torch.device) -> ParallelEnv:
    """Join (or create) the process group for `strategy`; `device` becomes this rank's own GPU on cuda."""
    if strategy == "none":
        return ParallelEnv("none", device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda" and device.index is None:  # one GPU per process, as torchrun launches them
        device = torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = _backend(backend, device)
        if "WORLD_SIZE" in os.environ:  # launched by torchrun
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:  # a world of one, no rendezvous needed
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return ParallelEnv(strategy, device, dist.get_rank(), dist.get_world_size(), owns_group)
