"""What one Slurm job of a sweep runs on its node(s): one training run, or its resumption from the run's newest
checkpoint. A job of several tasks (one per GPU, on one node or several) is one distributed run: each task
is a rank, set up from Slurm's environment as torchrun would set it up (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), and the run's distributed section says how they share the work (fsdp, ddp).

Every job runs through `run_in_job`, whose task 0 writes what the job's function returned as JSON: the
launcher reads that, and never submitit's pickled result, which anyone who can write the sweep's folder
could replace with a pickle that runs code when loaded."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

from ...base.fileio import atomic_write_text
from ...train.config import TrainConfig
from .pool import train_one
from .slurm_record import result_file


def _stop_as_on_preemption(signum, frame) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def train_in_job(config: TrainConfig, run_dir: str) -> tuple[str, float, int | None]:
    """pool.train_one in a job: (run directory, wall seconds, the signal that stopped it or None). A SIGTERM
    (preemption, `scancel --signal=TERM`) checkpoints and stops the run at the next step, and so does the
    USR2 that Slurm sends before the time limit (sbatch --signal, submitit's signal_delay_s)."""
    import submitit

    environment = submitit.JobEnvironment()
    if environment.num_tasks > 1:
        # every task sees the node's GPUs; distributed.setup takes GPU LOCAL_RANK
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    signal.signal(signal.SIGUSR2, _stop_as_on_preemption)  # replaces submitit's requeue: the trainer checkpoints
    return train_one((config, run_dir))


def run_in_job(function: Callable, *args, **keywords):
    """function(*args, **keywords) in a job; its task 0 writes {"value": what it returned} (JSON), or {"error":
    one line} if it raised, to the job's result_file."""
    import submitit

    environment = submitit.JobEnvironment()
    path = result_file(Path(environment.paths.folder), environment.job_id)
    try:
        value = function(*args, **keywords)
    except Exception as error:
        if environment.global_rank == 0:
            atomic_write_text(path, json.dumps({"error": " ".join(f"{type(error).__name__}: {error}".split())}))
        raise
    if environment.global_rank == 0:
        atomic_write_text(path, json.dumps({"value": value}, default=str))  # a Path as its text
    return value
