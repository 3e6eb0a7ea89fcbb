"""Several training runs side by side, one process each (on CPU each with its share of the cores; on a
GPU they share the device), followed by one progress bar over their metrics.jsonl files. Finished runs
are reused and partial ones resumed, so a sweep that was stopped continues where it was."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..checkpoint import checkpoint_dirs
from .config import TrainConfig
from .metrics import read_metrics
from .trainer import train


def threads_per_run(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def _train_one(job: tuple[TrainConfig, str]) -> tuple[str, float]:
    config, run_dir = job
    started = time.perf_counter()
    done = checkpoint_dirs(run_dir)
    if not (done and int(done[-1].name[5:]) >= config.steps):  # finished runs are reused, partial ones resumed
        train(config, run_dir, resume=bool(done))
    return run_dir, time.perf_counter() - started


def train_runs(jobs: list[tuple[TrainConfig, Path]], workers: int, desc: str) -> dict[str, float]:
    """Train every (config, run directory), `workers` at a time, longest first (so they finish close
    together). Returns the wall seconds of each run, by run directory."""
    jobs = sorted(((config, str(run_dir)) for config, run_dir in jobs), key=lambda job: -job[0].steps)
    total = sum(config.steps for config, _ in jobs)
    wall: dict[str, float] = {}
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, maxtasksperchild=1) as pool, tqdm(total=total, desc=desc, unit="step",
                                                                   dynamic_ncols=True) as bar:
        pending = pool.map_async(_train_one, jobs, chunksize=1)
        while not pending.ready():
            pending.wait(2.0)
            latest = {Path(d).name: (read_metrics(Path(d) / "metrics.jsonl") or [{}])[-1] for _, d in jobs}
            bar.n = sum(m.get("step", 0) for m in latest.values())
            if len(jobs) <= 6:
                bar.set_postfix_str(" ".join(f"{k}:{m['kl_bits']:.2f}b" for k, m in latest.items() if "kl_bits" in m))
            bar.refresh()
        for run_dir, seconds in pending.get():
            wall[run_dir] = seconds
        bar.n = total
    return wall
