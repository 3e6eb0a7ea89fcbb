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
from ..data import build_dataset
from ..train.config import TrainConfig
from ..train.metrics import read_metrics
from ..train.trainer import train


def threads_per_run(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def _finished(config: TrainConfig, run_dir: str) -> bool:
    done = checkpoint_dirs(run_dir)
    return bool(done) and int(done[-1].name[5:]) >= config.steps


def _train_one(job: tuple[TrainConfig, str]) -> tuple[str, float]:
    config, run_dir = job
    started = time.perf_counter()
    if not _finished(config, run_dir):  # finished runs are reused, partial ones resumed
        train(config, run_dir, resume=bool(checkpoint_dirs(run_dir)))
    return run_dir, time.perf_counter() - started


def train_runs(jobs: list[tuple[TrainConfig, Path]], workers: int, desc: str) -> dict[str, float]:
    """Train every (config, run directory), `workers` at a time, longest first (so they finish close
    together); one worker trains in this process. Returns the wall seconds of each run trained now, by
    run directory (finished runs are not started again)."""
    jobs = [(config, str(run_dir)) for config, run_dir in jobs]
    todo = sorted((job for job in jobs if not _finished(*job)), key=lambda job: -job[0].steps)
    total = sum(config.steps for config, _ in jobs)
    wall: dict[str, float] = {}
    with tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True) as bar:
        if workers == 1 or len(todo) <= 1:
            for job in todo:
                run_dir, wall[run_dir] = _train_one(job)
                bar.n = sum(m.get("step", 0) for m in _latest(jobs).values())
                bar.refresh()
        elif todo:
            prepare_data([config for config, _ in todo])
            context = multiprocessing.get_context("spawn")
            with context.Pool(workers, maxtasksperchild=1) as pool:
                pending = pool.map_async(_train_one, todo, chunksize=1)
                while not pending.ready():
                    pending.wait(2.0)
                    latest = _latest(jobs)
                    bar.n = sum(m.get("step", 0) for m in latest.values())
                    if len(jobs) <= 6:
                        bar.set_postfix_str(" ".join(f"{Path(d).name}:{m['kl_bits']:.2f}b"
                                                     for d, m in latest.items() if "kl_bits" in m))
                    bar.refresh()
                wall.update(pending.get())
        bar.n = total
    return wall


def prepare_data(configs: list[TrainConfig]) -> None:
    """Build each distinct dataset once in this process, so that a corpus is tokenized into its cache
    before the pool starts: a pool's workers are daemonic processes, which may not start the tokenizer's
    worker processes (and several runs would tokenize the same corpus at once)."""
    built = []
    for config in configs:
        if config.data not in built:
            build_dataset(config.data, config.seed)
            built.append(config.data)


def _latest(jobs) -> dict[str, dict]:
    return {run_dir: (read_metrics(Path(run_dir) / "metrics.jsonl") or [{}])[-1] for _, run_dir in jobs}
