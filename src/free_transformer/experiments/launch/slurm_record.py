"""The record of a sweep's Slurm jobs, OUT/slurm/record.json: for each run (its directory under OUT) the job
that trains it, the job's state and its log, and the same for the job that measures and reports, if any.
Rewritten (atomically) at every change; the next invocation of the same command reads it to reuse each
finished run, wait for the jobs still queued or running, and resubmit the others.

    {"runs": {"seed-0/baseline": {"job": "41", "state": "FINISHED", "log": "slurm/jobs/41_0_log.err",
                                  "submissions": 1, "note": ""}, ...},
     "report": {"job": "47", "state": "RUNNING", ...} or null}"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ...base.bounded import loads_json
from ...base.errors import UserError
from ...base.fileio import atomic_write_text

FOLDER = "slurm"  # under the sweep's output folder: record.json, and jobs/ (submitit's scripts, pickles, logs)

# A job's state: Slurm's own while it is queued or running (PENDING, RUNNING, ...), then one of these.
FINISHED = "FINISHED"  # the run reached its last step (the report: written)
STOPPED = "STOPPED"  # the job ended on a signal (preemption, the time limit, scancel --signal=TERM), checkpoint saved
FAILED = "FAILED"  # the job ended with an error, or without a result (killed, never started): its log says why


@dataclass
class JobEntry:
    job: str | None  # Slurm's job id; None for a run found finished before any job of this record
    state: str
    log: str = ""  # the job's stderr (its task 0's), relative to the sweep's output folder
    submissions: int = 0  # jobs submitted for it so far (each resubmission resumes from the run's checkpoint)
    note: str = ""  # why it stopped or failed, one line


def jobs_dir(out_dir: Path) -> Path:
    """submitit's folder of a sweep's jobs: each job's sbatch script, pickled call and result, and logs."""
    return out_dir / FOLDER / "jobs"


def result_file(jobs_folder: Path, job_id: str) -> Path:
    """What a job's function returned, as JSON (slurm_job.run_in_job): the launcher never reads submitit's
    pickled result."""
    return jobs_folder / f"{job_id}_result.json"


class Record:
    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir).absolute()  # as submitit's paths are: a job's log is named relative to it
        self.path = out_dir / FOLDER / "record.json"
        self.runs: dict[str, JobEntry] = {}
        self.report: JobEntry | None = None
        if self.path.is_file():
            try:
                saved = loads_json(self.path.read_text())
                self.runs = {key: JobEntry(**entry) for key, entry in saved["runs"].items()}
                self.report = JobEntry(**saved["report"]) if saved.get("report") else None
            except (ValueError, KeyError, TypeError) as error:
                raise UserError(
                    f"cannot read the Slurm record {self.path} ({error}): move it aside, then run the "
                    "same command again (finished runs are found by their checkpoints)"
                ) from None

    @property
    def jobs_dir(self) -> Path:
        return jobs_dir(self.out_dir)

    def key(self, run_dir: Path) -> str:
        """A run's name in the record: its directory under the sweep's output folder."""
        return Path(run_dir).absolute().relative_to(self.out_dir).as_posix()

    def entry(self, key: str | None) -> JobEntry | None:
        """The run's entry; key None: the report's."""
        return self.report if key is None else self.runs.get(key)

    def submitted(self, key: str | None) -> JobEntry:
        """The entry of a key whose job was submitted, by this invocation or an earlier one."""
        entry = self.entry(key)
        assert entry is not None and entry.job is not None, f"no job recorded for {key or 'the report'}"
        return entry

    def job_id(self, key: str | None) -> str:
        """The id of the job submitted for `key` (Record.submitted)."""
        job = self.submitted(key).job
        assert job is not None  # checked by submitted
        return job

    def set(self, key: str | None, entry: JobEntry) -> None:
        if key is None:
            self.report = entry
        else:
            self.runs[key] = entry
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        saved = {
            "runs": {key: asdict(entry) for key, entry in self.runs.items()},
            "report": asdict(self.report) if self.report else None,
        }
        atomic_write_text(self.path, json.dumps(saved, indent=1))
