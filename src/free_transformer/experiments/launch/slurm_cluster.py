"""What the Slurm launcher asks the cluster itself, with Slurm's own commands: whether there is one, its
partitions, and the state of jobs (squeue while slurmctld remembers them, sacct after, where accounting is
on). Every way this can be wrong is one line."""

from __future__ import annotations

import getpass
import shutil
import subprocess

from ...base.errors import UserError

# The states of a job that is waiting or working (squeue's long names); any other state means it has ended.
ACTIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
    }
)
GONE = "GONE"  # neither squeue nor sacct knows the job any more: it ended long ago


class SlurmError(UserError):
    """No Slurm here, a partition it does not have, or a command of it that failed."""


def _slurm(*command: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SlurmError(f"`{' '.join(command)}` failed: {error}") from None
    if done.returncode:
        message = " ".join((done.stderr or done.stdout).split()) or f"exit status {done.returncode}"
        raise SlurmError(f"`{' '.join(command)}` failed: {message}")
    return done.stdout


def check_cluster(partition: str | None) -> None:
    """Slurm's commands are here, and so is `partition` (None: the cluster's default one)."""
    missing = [name for name in ("sbatch", "squeue", "sinfo", "srun") if shutil.which(name) is None]
    if missing:
        raise SlurmError(
            f"--launcher slurm needs Slurm's commands, and this machine's PATH lacks "
            f"{', '.join(missing)}: run from a cluster's login node, or use --launcher local"
        )
    if partition is not None:
        names = partitions()
        if partition not in names:
            raise SlurmError(f"Slurm has no partition {partition!r} (sinfo lists: {', '.join(names) or 'none'})")


def partitions() -> list[str]:
    """The cluster's partition names (sinfo marks the default one with `*`: removed)."""
    return sorted(
        {line.strip().rstrip("*") for line in _slurm("sinfo", "--noheader", "--format=%P").splitlines() if line.strip()}
    )


def job_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: Slurm's state, e.g. PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, PREEMPTED, TIMEOUT, or GONE}."""
    if not job_ids:
        return {}
    states = {}
    queue = _slurm("squeue", "--noheader", "--states=all", f"--user={getpass.getuser()}", "--format=%i|%T")
    for line in queue.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id in job_ids:
            states[job_id] = state
    missing = [job_id for job_id in job_ids if job_id not in states]
    if missing:
        states.update(_accounted_states(missing))
    return {job_id: states.get(job_id, GONE) for job_id in job_ids}


def _accounted_states(job_ids: list[str]) -> dict[str, str]:
    """sacct's states of jobs slurmctld no longer holds; none where accounting is off."""
    try:
        text = _slurm(
            "sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State", f"--jobs={','.join(job_ids)}"
        )
    except SlurmError:
        return {}
    states = {}
    for line in text.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id in job_ids and state:
            states[job_id] = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return states
