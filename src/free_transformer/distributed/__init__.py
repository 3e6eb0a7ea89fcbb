"""Training on several processes with PyTorch's own engine (torchrun, DDP, FSDP2, DCP); no code here
reaches into the model file. docs/distributed.md."""

from .env import ParallelEnv, setup

__all__ = ["ParallelEnv", "setup"]
