"""The Slurm launcher: each run of a sweep one Slurm job, submitted through submitit (sbatch, then srun with one
task per GPU), recorded in OUT/slurm/record.json (slurm_record.py), and waited for with one progress bar.

Running the same command again reuses finished runs, waits for the jobs still queued or running, and
resubmits the runs whose job failed or was stopped (preemption, the time limit, scancel --signal=TERM): they
resume from their checkpoints. Ctrl-C (or a SIGTERM) while waiting leaves the jobs running. Measures and the
report run once every run is done, here or as one more job (`report_on`). docs/cluster.md."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tqdm.auto import tqdm

from ...base.bounded import loads_json
from ...base.devices import parse_device
from ...base.errors import Stopped, UserError
from ...base.install import install_hint
from ...train.config import TrainConfig
from ...train.trainer import StopSignals
from .pool import finished, last_step, latest_metrics, prepare_data
from .slurm_cluster import ACTIVE, SlurmError, check_cluster, job_states
from .slurm_job import run_in_job, train_in_job
from .slurm_record import FAILED, FINISHED, STOPPED, JobEntry, Record, jobs_dir, result_file

Key = TypeVar("Key", bound=str | None)  # a run's key in the record, or None for the report
LOG_LINES = 3  # of a failed job's log, in its one-line error
AGAIN = (
    "run the same command again: finished runs are reused, jobs still queued or running waited for, failed and "
    "stopped runs resubmitted (they resume from their checkpoints)"
)


@dataclass(frozen=True)
class SlurmOptions:
    """What each job asks Slurm for (docs/cluster.md maps each to sbatch)."""

    partition: str | None = None  # None: the cluster's default partition
    gpus_per_run: int = 0  # 0: a CPU run; N: N tasks per node, one per GPU (a distributed run when N x nodes > 1)
    nodes_per_run: int = 1
    cpus_per_run: int = 1  # CPUs of each task, and the run's torch threads
    time_minutes: int = 24 * 60  # the job's time limit; the run checkpoints and stops 2 minutes before it
    extra: tuple[tuple[str, str | bool], ...] = ()  # more sbatch options: ("account", "lab"), ("exclusive", True)
    report_on: str = "local"  # local: measures and report on this machine once the runs are done; slurm: as a job

    def validate(self) -> SlurmOptions:
        if self.gpus_per_run < 0 or self.nodes_per_run < 1 or self.cpus_per_run < 1 or self.time_minutes < 1:
            raise UserError("--gpus-per-run must be >= 0, and --nodes-per-run, --cpus-per-run, --time-limit >= 1")
        if self.nodes_per_run > 1 and self.gpus_per_run == 0:
            raise UserError("--nodes-per-run > 1 needs --gpus-per-run >= 1 (one process per GPU)")
        if self.report_on not in ("local", "slurm"):
            raise UserError(f"--report-on must be local or slurm, got {self.report_on!r}")
        return self

    @property
    def processes(self) -> int:
        """The run's ranks: one per GPU, or one CPU process."""
        return max(1, self.gpus_per_run) * self.nodes_per_run


def parse_slurm_args(items: list[str]) -> tuple[tuple[str, str | bool], ...]:
    """['account=lab', 'qos=high'] -> (('account', 'lab'), ('qos', 'high')); a name without a value is a flag."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().removeprefix("--")
        if not name:
            raise UserError(f"--slurm-arg takes an sbatch option as name=value (e.g. account=lab), got {item!r}")
        pairs.append((name, value if sep else True))
    return tuple(pairs)


class SlurmLauncher:
    """cluster: slurm (sbatch), or local (submitit's LocalExecutor: every job a process of this machine,
    the same record and resubmissions, without Slurm: what the tests use). poll_seconds: between two looks
    at the jobs' states. out_dir is made absolute before any job is submitted: the jobs' paths are."""

    name = "slurm"

    def __init__(self, options: SlurmOptions, out_dir: Path, *, cluster: str = "slurm", poll_seconds: float = 10.0):
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise UserError(f"--launcher slurm needs submitit: {install_hint('slurm')}") from None
        self.options, self.cluster, self.poll_seconds = options.validate(), cluster, poll_seconds
        self.out_dir = Path(out_dir).absolute()
        if cluster == "slurm":
            check_cluster(options.partition)
        self.threads = options.cpus_per_run
        self.local_jobs: dict = {}  # cluster local: job id -> submitit's job, whose process only this one can see

    def side_by_side(self, runs: int) -> int:
        return runs  # as many as the cluster lets run at once

    # ---- training -------------------------------------------------------------------------------------------

    def train(self, jobs: list[tuple[TrainConfig, Path]], desc: str) -> dict[str, float]:
        record = Record(self.out_dir)
        todo: dict[str, tuple[TrainConfig, Path]] = {}
        for config, run_dir in jobs:
            key = record.key(run_dir)
            entry = record.entry(key)
            if finished(config, str(run_dir)):
                if entry is None or entry.state != FINISHED:
                    record.set(
                        key,
                        JobEntry(
                            entry.job if entry else None,
                            FINISHED,
                            entry.log if entry else "",
                            entry.submissions if entry else 0,
                        ),
                    )
            else:
                todo[key] = (self._job_config(config), Path(run_dir))
        live = self._live({key: record.entry(key) for key in todo})
        submit = [key for key in todo if key not in live]
        if submit:
            prepare_data([todo[key][0] for key in submit])  # a corpus is tokenized once, here, not by every job
        for key in submit:
            config, run_dir = todo[key]
            self._submit(
                record,
                key,
                train_in_job,
                (config, str(run_dir.absolute())),
                processes=self.options.processes,
                gpus=self.options.gpus_per_run,
                nodes=self.options.nodes_per_run,
            )
        if live:
            print(f"waiting for {len(live)} job(s) submitted before: {', '.join(sorted(live))}", file=sys.stderr)
        results = self._wait(record, list(todo), desc, jobs)
        wall, stopped, failed = {}, [], []
        for key, (config, run_dir) in todo.items():
            outcome = results[key]
            if outcome is not None and outcome[2] is None and finished(config, str(run_dir)):
                wall[str(run_dir)] = outcome[1]
            elif record.submitted(key).state == STOPPED:
                stopped.append(key)
            else:
                failed.append(key)
        if failed:
            first = record.submitted(failed[0])
            raise SlurmError(
                f"{len(failed)} of {len(jobs)} runs failed: {failed[0]}, job {first.job}: {first.note}"
                f"{f'; {len(stopped)} stopped' if stopped else ''}; fix the cause, then {AGAIN}"
            )
        if stopped:
            notes = "; ".join(f"{key}: {record.submitted(key).note}" for key in stopped)
            raise Stopped(f"{len(stopped)} of {len(jobs)} runs stopped ({notes}); to continue, {AGAIN}", signal.SIGTERM)
        return wall

    def _job_config(self, config: TrainConfig) -> TrainConfig:
        """A run of several processes shards its model with FSDP2 unless its config says otherwise."""
        if self.options.processes > 1 and config.distributed.strategy == "none":
            return dataclasses.replace(config, distributed=dataclasses.replace(config.distributed, strategy="fsdp"))
        return config

    # ---- the report ---------------------------------------------------------------------------------------------

    def finish(self, report: Callable[..., Path], *args, device: str) -> Path:
        """The report here, on this machine's own device, or as one job with one task (one GPU if the runs have
        GPUs), on the runs' device. `report` returns the report's path."""
        if self.options.report_on == "local":
            return report(*args, device=str(parse_device("auto")))
        record = Record(self.out_dir)
        if not self._live({None: record.report}):
            self._submit(
                record,
                None,
                report,
                args,
                processes=1,
                gpus=min(1, self.options.gpus_per_run),
                nodes=1,
                keywords={"device": device},
            )
        outcome = self._wait(record, [None], "measures and report", [])[None]
        if outcome is None:
            raise SlurmError(f"the report's job {record.job_id(None)} failed: {record.submitted(None).note}; {AGAIN}")
        return Path(outcome)  # the job's JSON holds it as text

    # ---- jobs ---------------------------------------------------------------------------------------------

    def _submit(
        self,
        record: Record,
        key: str | None,
        function: Callable,
        args: tuple,
        *,
        processes: int,
        gpus: int,
        nodes: int,
        keywords: dict | None = None,
    ) -> None:
        import submitit

        executor = submitit.AutoExecutor(folder=record.jobs_dir, cluster=self.cluster)
        executor.update_parameters(
            name=f"free-transformer:{key or 'report'}",
            timeout_min=self.options.time_minutes,
            nodes=nodes,
            tasks_per_node=processes // nodes,
            gpus_per_node=gpus or None,
            cpus_per_task=self.options.cpus_per_run,
            slurm_partition=self.options.partition,
            slurm_signal_delay_s=120,
            slurm_additional_parameters=dict(self.options.extra),
        )
        try:  # submitit prints sbatch's complaint too: it is in the error, said once
            with contextlib.redirect_stderr(io.StringIO()):
                job = executor.submit(run_in_job, function, *args, **(keywords or {}))
        except Exception as error:  # sbatch's refusal (submitit's FailedJobError, CalledProcessError) as one line
            raise SlurmError(
                f"Slurm refused the job of {key or 'the report'}: {' '.join(str(error).split())[-600:]}"
            ) from None
        # recorded first: a job that runs is never left out of the record, whatever fails next
        previous = record.entry(key)
        log = Path(os.path.relpath(job.paths.stderr, self.out_dir)).as_posix()
        record.set(key, JobEntry(job.job_id, "PENDING", log, (previous.submissions if previous else 0) + 1))
        if self.cluster == "local":
            self.local_jobs[job.job_id] = job

    def _states(self, job_ids: list[str]) -> dict[str, str]:
        if self.cluster == "slurm":
            return job_states(job_ids)
        return {
            job_id: "RUNNING" if job_id in self.local_jobs and self.local_jobs[job_id].state == "RUNNING" else "ENDED"
            for job_id in job_ids
        }

    def _live(self, entries: dict[Key, JobEntry | None]) -> list[Key]:
        """The keys whose job is still queued or running (a later invocation attaches to them)."""
        ids = {
            key: entry.job
            for key, entry in entries.items()
            if entry is not None and entry.job and entry.state not in (FINISHED, STOPPED, FAILED)
        }
        states = self._states(list(ids.values()))
        return [key for key, job_id in ids.items() if states[job_id] in ACTIVE]

    def _wait(self, record: Record, keys: list[str | None], desc: str, jobs: list) -> dict:
        """Wait for the jobs of `keys` to end, recording each state change; {key: the job's result, None if it
        failed}. Ctrl-C or SIGTERM stops the waiting only: the jobs go on."""
        results: dict = {}
        waiting = list(keys)

        def done() -> int:  # steps trained, or jobs ended
            return sum(m.get("step", 0) for m in latest_metrics(jobs).values()) if jobs else len(results)

        total = sum(config.steps for config, _ in jobs) or 1
        with (
            tqdm(total=total, initial=done(), desc=desc, unit="step" if jobs else "job", dynamic_ncols=True) as bar,
            StopSignals() as signals,
        ):
            while waiting:
                states = self._states([record.job_id(key) for key in waiting])
                for key in list(waiting):
                    entry = record.submitted(key)
                    state = states[record.job_id(key)]
                    if state in ACTIVE:
                        if state != entry.state:
                            record.set(key, dataclasses.replace(entry, state=state))
                        continue
                    results[key] = self._ended(record, key, state)
                    waiting.remove(key)
                    if record.submitted(key).state != FINISHED:
                        bar.write(
                            f"{key or 'report'}: {record.submitted(key).state.lower()}, {record.submitted(key).note}",
                            file=sys.stderr,
                        )
                bar.update(done() - bar.n)
                waited = [record.submitted(key).state.lower() for key in waiting]
                bar.set_postfix_str(", ".join(f"{waited.count(state)} {state}" for state in sorted(set(waited))))
                deadline = time.monotonic() + (self.poll_seconds if waiting else 0)
                while time.monotonic() < deadline and not signals.received:
                    time.sleep(0.1)
                if signals.received:
                    self._detach(record, waiting, signals.received)
        return results

    def _ended(self, record: Record, key: str | None, state: str):
        """Record how the job of `key` ended; its result (None: it failed or left none)."""
        entry, job = record.submitted(key), record.job_id(key)
        self.local_jobs.pop(job, None)  # its process has ended
        paths = self._paths(job)
        outcome = read_result(result_file(jobs_dir(self.out_dir), job), training=key is not None)
        if outcome is not None and "value" in outcome:
            value = outcome["value"]
            if key is not None and value[2] is not None:  # a training run stopped by a signal, its checkpoint saved
                note = (
                    f"stopped by {signal.Signals(value[2]).name} at step {last_step(str(self.out_dir / key))} "
                    f"(checkpoint saved)"
                )
                record.set(key, dataclasses.replace(entry, state=STOPPED, note=note))
            else:
                record.set(key, dataclasses.replace(entry, state=FINISHED, note=""))
            return value
        how = "raised an error" if outcome is not None else f"ended ({state}) without a result"
        record.set(
            key,
            dataclasses.replace(
                entry, state=FAILED, note=f"the job {how}; its log {paths.stderr} ends: {log_tail(paths.stderr)}"
            ),
        )
        return None

    def _paths(self, job_id: str):
        from submitit.core.utils import JobPaths

        return JobPaths(jobs_dir(self.out_dir), job_id, task_id=0)

    def _detach(self, record: Record, waiting: list, signum: int) -> None:
        jobs = ", ".join(record.job_id(key) for key in waiting)
        raise Stopped(
            f"stopped waiting; the Slurm job(s) {jobs} go on (squeue --me), {record.path} says which "
            f"job trains which run; to attach again, {AGAIN}",
            signum,
        )


def read_result(path: Path, *, training: bool) -> dict | None:
    """A job's result file (slurm_job.run_in_job): {"value": ...} or {"error": ...}; None where it is missing
    or not what a job writes (a training job's value: [run directory, wall seconds, signal number or null])."""
    try:
        outcome = loads_json(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(outcome, dict) or not ("value" in outcome or "error" in outcome):
        return None
    value = outcome.get("value")
    if (
        "value" in outcome
        and training
        and not (
            isinstance(value, list)
            and len(value) == 3
            and isinstance(value[1], (int, float))
            and (value[2] is None or value[2] in set(signal.Signals))
        )
    ):
        return None
    if "value" in outcome and not training and not isinstance(value, str):
        return None
    return outcome


def log_tail(path: Path, lines: int = LOG_LINES) -> str:
    """The last non-empty lines of a job's log, as one line (' | ' between them), without srun's own."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log: {path} could not be read; the job may not have started)"
    kept = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("srun: ")]
    return " | ".join(kept[-lines:]) or "(empty)"
