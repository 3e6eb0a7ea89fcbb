"""Where a sweep's runs train, and where its measures and report run once every run is done: `local`, this
machine's pool of processes (pool.py), or `slurm`, one Slurm job per run through submitit (slurm.py). Both
reuse finished runs and resume stopped ones from their checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ...train.config import TrainConfig
from .pool import threads_per_run, train_runs


class Launcher(Protocol):
    name: str  # local or slurm
    threads: int  # CPU threads of each run (TrainConfig.threads; 0: torch's default)

    def train(self, jobs: list[tuple[TrainConfig, Path]], desc: str) -> dict[str, float]:
        """Train every (config, run directory); the wall seconds of each run trained now, by run directory."""

    def finish(self, report: Callable[..., Path], *args, device: str) -> Path:
        """`report(*args, device=...)` once every run is done: the measures and the report of the sweep.
        `device`: the training runs' device."""

    def side_by_side(self, runs: int) -> int:
        """How many of `runs` train at once (what a report says)."""


class LocalLauncher:
    """`workers` runs side by side on this machine, each with its share of the CPU cores."""

    name = "local"

    def __init__(self, workers: int):
        self.workers = workers
        self.threads = threads_per_run(workers)

    def train(self, jobs: list[tuple[TrainConfig, Path]], desc: str) -> dict[str, float]:
        return train_runs(jobs, self.workers, desc)

    def finish(self, report: Callable[..., Path], *args, device: str) -> Path:
        return report(*args, device=device)

    def side_by_side(self, runs: int) -> int:
        return self.workers
