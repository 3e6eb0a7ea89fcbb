"""Several training runs side by side, one process each (on CPU each with its share of the cores; on a
GPU they share the device), followed by one progress bar over their metrics.jsonl files. The bar counts
training FLOPs, not steps: a sweep's runs may differ widely in the cost of a step, and its rate and time left
must hold from the start; the rate is the last minute's (base/progress.py), so start-up is not counted.
Finished runs are reused and partial ones resumed, so a sweep that was stopped continues where it was."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from pathlib import Path

from ...base.errors import Stopped, UserError
from ...base.progress import Bar
from ...data import build_dataset
from ...runs.checkpoint import checkpoint_dirs
from ...train.config import TrainConfig
from ...train.metrics import read_metrics, tokens_per_step
from ...train.trainer import StopSignals, train

CONTINUE = "run the same command again: finished runs are reused and stopped ones resumed"


def threads_per_run(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def finished(config: TrainConfig, run_dir: str) -> bool:
    return last_step(run_dir) >= config.steps  # steps >= 1: a run without a checkpoint is not finished


def train_one(job: tuple[TrainConfig, str]) -> tuple[str, float, int | None]:
    """Train one run unless it is finished: (run directory, wall seconds, the signal that stopped it or None)."""
    config, run_dir = job
    started = time.perf_counter()
    stopped = None
    if not finished(config, run_dir):  # finished runs are reused, partial ones resumed
        try:
            train(config, run_dir, resume=bool(checkpoint_dirs(run_dir)))
        except Stopped as stop:  # its checkpoint is saved; the sweep says how to continue
            stopped = stop.exit_code - 128
    return run_dir, time.perf_counter() - started, stopped


def _work(job: tuple[TrainConfig, str], answer) -> None:
    """A worker process: send back train_one's result, or the exception that ended it (re-raised by the parent).
    A second signal (KeyboardInterrupt) ends it with nothing sent, and without a traceback."""
    try:
        answer.send(train_one(job))
    except KeyboardInterrupt:
        pass
    except Exception as error:
        answer.send(error)


def train_runs(jobs: list[tuple[TrainConfig, Path]], workers: int, desc: str) -> dict[str, float]:
    """Train every (config, run directory), `workers` at a time, longest first (so they finish close
    together); one worker trains in this process. Returns the wall seconds of each run trained now, by
    run directory (finished runs are not started again). SIGTERM / SIGINT stop the sweep: no run starts
    after it, the running ones save a checkpoint and stop, and Stopped says how to continue."""
    by_dir = [(config, str(run_dir)) for config, run_dir in jobs]  # run directories as str: the keys of wall
    todo = sorted((job for job in by_dir if not finished(*job)), key=lambda job: -job[0].steps)
    runs = run_work([config for config, _ in by_dir])  # datasets built here, before any worker starts
    wall: dict[str, float] = {}
    stopped: dict[str, int] = {}  # run directory -> the signal that stopped it

    def progress() -> tuple[float, int, dict[str, dict]]:
        latest = latest_metrics(by_dir)
        return (*work_done(runs, [latest[run_dir].get("step", 0) for _, run_dir in by_dir]), latest)

    before, _, _ = progress()  # the work of reused runs: not part of the rate
    total = sum(steps * step for steps, step in runs)
    bar_format = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"
    with (
        Bar(total=total, initial=before, desc=desc, bar_format=bar_format, dynamic_ncols=True) as bar,
        StopSignals() as signals,
    ):

        def show() -> None:
            bar.n, runs_done, latest = progress()
            kl = (
                " ".join(f"{Path(d).name}:{m['kl_bits']:.2f}b" for d, m in latest.items() if "kl_bits" in m)
                if len(by_dir) <= 6
                else ""
            )
            bar.set_postfix_str(f"{runs_done} of {len(by_dir)} runs done {kl}".rstrip(), refresh=False)
            bar.refresh()

        show()
        if workers == 1 or len(todo) <= 1:
            for job in todo:  # train() catches the signals while it runs; this loop's StopSignals between runs
                if signals.received or stopped:
                    break
                run_dir, wall[run_dir], signum = train_one(job)
                if signum:
                    stopped[run_dir] = signum
                show()
        elif todo:
            _train_processes(todo, workers, signals, wall, stopped, show)
        if signals.received or stopped:
            signum = signals.received or next(iter(stopped.values()))
            raise Stopped(_stop_message(todo, wall, stopped, signum), signum)
        bar.n = total
        bar.set_postfix_str(f"{len(by_dir)} of {len(by_dir)} runs done")
    return wall


def step_work(config: TrainConfig, sequence_length: int) -> float:
    """The training FLOPs of one step (ModelConfig.training_flops_per_token x the step's tokens): the unit of
    the progress bar, as a step of the demo's coin model costs a fraction of one of its letters models."""
    return config.model.training_flops_per_token(sequence_length) * tokens_per_step(config, sequence_length)


def run_work(configs: list[TrainConfig]) -> list[tuple[int, float]]:
    """Each run's (steps, work of one step), its datasets built (prepare_data)."""
    return [(config.steps, step_work(config, length)) for config, length in zip(configs, prepare_data(configs))]


def work_done(runs: list[tuple[int, float]], steps_reached: list[int]) -> tuple[float, int]:
    """The work done by runs that reached the given steps, and how many are done: runs are each run's
    (steps, work of one step), as run_work gives."""
    work = sum(min(reached, steps) * step for (steps, step), reached in zip(runs, steps_reached))
    return work, sum(reached >= steps for (steps, _), reached in zip(runs, steps_reached))


def _train_processes(todo, workers: int, signals: StopSignals, wall: dict, stopped: dict, show) -> None:
    """Train `todo` in spawned processes, `workers` at a time, filling `wall` and `stopped`. After a signal no
    process starts; a SIGTERM is passed on to the running ones (Ctrl-C's SIGINT reaches the whole process group
    already), which save a checkpoint and stop. After an error in one (or a second signal here) the others get a
    SIGTERM too, and this waits for them: no worker outlives the sweep."""
    context = multiprocessing.get_context("spawn")
    waiting = list(todo)
    running: dict[SpawnProcess, tuple[str, Connection]] = {}  # -> (run directory, the end its answer arrives at)
    forwarded, shown = False, time.monotonic()
    try:
        while running or (waiting and not (signals.received or stopped)):
            while waiting and len(running) < workers and not (signals.received or stopped):
                job = waiting.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=_work, args=(job, send), daemon=True)
                process.start()
                send.close()
                running[process] = (job[1], receive)
            if signals.received == signal.SIGTERM and not forwarded:
                for process in running:
                    assert process.pid is not None  # started above
                    os.kill(process.pid, signal.SIGTERM)
                forwarded = True
            ended = wait([process.sentinel for process in running], timeout=0.25)  # a signal is seen within 0.25 s
            for process in [process for process in running if process.sentinel in ended]:
                run_dir, receive = running.pop(process)
                try:  # it has ended: its answer is there, or nothing (EOF)
                    answer = receive.recv()
                except EOFError:
                    answer = None
                receive.close()
                process.join()
                if isinstance(answer, BaseException):
                    raise answer
                if answer is None and not signals.received:  # killed (out of memory?) before it could answer
                    raise UserError(
                        f"the process training {run_dir} died (exit code {process.exitcode}); the other "
                        f"runs saved a checkpoint and stopped; to continue, {CONTINUE}"
                    )
                if answer is not None:
                    _, wall[run_dir], signum = answer
                    if signum:
                        stopped[run_dir] = signum
            if time.monotonic() - shown > 2.0:  # reading every metrics.jsonl is not free
                show()
                shown = time.monotonic()
    finally:
        for process in running:  # only after an error or a second signal: they checkpoint and stop
            process.terminate()
        for process in running:
            process.join()


def _stop_message(todo, wall: dict, stopped: dict, signum: int) -> str:
    """One line: the runs stopped at which step, those not started, and how to continue."""
    steps = {run_dir: config.steps for config, run_dir in todo}
    at = [f"{run_dir} at step {last_step(run_dir)} of {steps[run_dir]}" for run_dir in stopped]
    not_started = [run_dir for run_dir in steps if run_dir not in wall]
    return (
        f"sweep stopped by {signal.Signals(signum).name}: "
        f"{'; '.join(at) or 'no run was running'} (checkpoints saved)"
        f"{f', {len(not_started)} run(s) not started' if not_started else ''}; to continue, {CONTINUE}"
    )


def last_step(run_dir: str) -> int:
    """The step of the run's newest checkpoint, 0 without one."""
    done = checkpoint_dirs(run_dir)
    return int(done[-1].name[5:]) if done else 0


def prepare_data(configs: list[TrainConfig]) -> list[int]:
    """Build each distinct dataset once in this process, so that a corpus is tokenized into its cache
    before the pool starts: a pool's workers are daemonic processes, which may not start the tokenizer's
    worker processes (and several runs would tokenize the same corpus at once). Returns each config's
    sequence length (the model's input length T)."""
    built: list[tuple] = []  # (data config, its sequence length)
    lengths = []
    for config in configs:
        length = next((length for data, length in built if data == config.data), None)
        if length is None:
            length = build_dataset(config.data, config.seed).sequence_length
            built.append((config.data, length))
        lengths.append(length)
    return lengths


def latest_metrics(jobs) -> dict[str, dict]:
    return {run_dir: (read_metrics(Path(run_dir) / "metrics.jsonl") or [{}])[-1] for _, run_dir in jobs}
