"""The Slurm launcher: runs as jobs through submitit (its LocalExecutor: each job a process of this machine), the
record, resubmission of a stopped run that resumes to the uninterrupted losses, reuse of finished runs, a
detached wait, and bad input in one line. The last test runs on a real cluster, where sbatch exists
(scripts/slurm-check.sh starts one of one node)."""

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
from conftest import run_losses, tiny_run_config

from free_transformer.base.errors import Stopped, UserError
from free_transformer.cli import main
from free_transformer.experiments.launch.pool import train_one
from free_transformer.experiments.launch.slurm import SlurmLauncher, SlurmOptions
from free_transformer.experiments.launch.slurm_cluster import SlurmError
from free_transformer.experiments.launch.slurm_record import FAILED, FINISHED, STOPPED, Record
from free_transformer.train.metrics import read_metrics

pytest.importorskip("submitit")


def _launcher(out, cluster="local"):
    return SlurmLauncher(SlurmOptions(), out, cluster=cluster, poll_seconds=0.2)


def _when(condition, then, timeout=120):
    """Call `then()` from another thread once `condition()` holds (checked every 20 ms)."""

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not condition():
            time.sleep(0.02)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _steps(run_dir) -> int:
    metrics = read_metrics(run_dir / "metrics.jsonl")
    return metrics[-1]["step"] if metrics else 0


def test_a_run_stopped_in_its_job_is_resubmitted_resumes_and_ends_as_if_uninterrupted(tmp_path):
    config = tiny_run_config("steps=40", "checkpoint_every=4", "threads=1")  # stopped at step 8 or a little later
    run_dir = tmp_path / "sweep" / "seed-0" / "free"
    launcher = _launcher(tmp_path / "sweep")
    record = lambda: Record(tmp_path / "sweep").runs["seed-0/free"]  # noqa: E731

    # a preemption: Slurm's SIGTERM, which submitit's local controller passes on to the job's process
    _when(lambda: _steps(run_dir) >= 8, lambda: os.kill(int(record().job), signal.SIGTERM))
    with pytest.raises(Stopped, match=r"1 of 1 runs stopped \(seed-0/free: stopped by SIGTERM at step \d+") as stop:
        launcher.train([(config, run_dir)], "training")
    assert stop.value.exit_code == 143 and record().state == STOPPED and _steps(run_dir) < 40
    first_job = record().job

    wall = launcher.train([(config, run_dir)], "training")  # the same command again: resubmitted, resumed
    assert record().state == FINISHED and record().submissions == 2 and record().job != first_job
    assert list(wall) == [str(run_dir)]
    uninterrupted = tmp_path / "uninterrupted"
    train_one((config, str(uninterrupted)))
    assert run_losses(run_dir) == run_losses(uninterrupted)

    before = (tmp_path / "sweep" / "slurm" / "record.json").read_text()
    assert launcher.train([(config, run_dir)], "training") == {}  # finished: reused, nothing submitted
    assert (tmp_path / "sweep" / "slurm" / "record.json").read_text() == before


def test_ctrl_c_stops_the_wait_only_and_the_same_command_attaches_again(tmp_path):
    config = tiny_run_config("steps=20", "threads=1")
    run_dir = tmp_path / "sweep" / "free"
    launcher = _launcher(tmp_path / "sweep")
    _when(lambda: _steps(run_dir) >= 1, lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(Stopped, match="stopped waiting; the Slurm job.* go on .*to attach again, run the same command"):
        launcher.train([(config, run_dir)], "training")
    entry = Record(tmp_path / "sweep").runs["free"]
    assert launcher.local_jobs[entry.job].state == "RUNNING"  # the job goes on

    assert launcher.train([(config, run_dir)], "training") == {str(run_dir): pytest.approx(0, abs=1e6)}
    entry = Record(tmp_path / "sweep").runs["free"]
    assert (entry.state, entry.submissions) == (FINISHED, 1)  # waited for, not submitted again
    assert _steps(run_dir) == 20


def test_a_job_that_fails_at_start_is_one_line_with_its_logs_last_lines(tmp_path):
    config = tiny_run_config("model.max_seq_len=16")  # the letters' sequences do not fit: found in the job
    with pytest.raises(SlurmError) as error:
        _launcher(tmp_path / "sweep").train([(config, tmp_path / "sweep" / "free")], "training")
    message = str(error.value)
    assert "1 of 1 runs failed: free, job" in message and "\n" not in message
    assert (
        "_0_log.err ends: " in message
        and "ConfigError: sequences of 65 tokens exceed model.max_seq_len (16)" in message
    )
    assert Record(tmp_path / "sweep").runs["free"].state == FAILED


def _fake_slurm(tmp_path, monkeypatch, partitions="debug*\ngpu\n"):
    """A PATH whose Slurm commands answer like a cluster's; sbatch refuses every job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "sinfo": f"printf '{partitions}'",
        "squeue": "true",
        "srun": "true",
        "sbatch": "echo 'sbatch: error: Batch job submission failed: Invalid account' >&2; exit 1",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


STUDY = ["study", "--preset", "smoke", "--seeds", "1", "--kappas", "4", "--launcher", "slurm"]


def test_no_slurm_no_submitit_a_missing_partition_or_a_refused_job_is_one_line(tmp_path, monkeypatch, capsys):
    def error_of(*args) -> str:
        assert main([*STUDY, "--out", str(tmp_path / "out"), *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ")
        return lines[0]

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    assert "PATH lacks sbatch, squeue, sinfo, srun" in error_of()
    _fake_slurm(tmp_path, monkeypatch)
    assert "Slurm has no partition 'nope' (sinfo lists: debug, gpu)" in error_of("--slurm-partition", "nope")
    assert "Slurm refused the job of seed-0/baseline: " in error_of("--slurm-partition", "gpu")
    assert "Invalid account" in error_of()
    assert "--gpus-per-run is an option of --launcher slurm" in error_of("--launcher", "local", "--gpus-per-run", "1")
    assert "--workers is for --launcher local" in error_of("--workers", "2")
    assert "--nodes-per-run > 1 needs --gpus-per-run" in error_of("--nodes-per-run", "2")
    monkeypatch.setitem(__import__("sys").modules, "submitit", None)  # as if it were not installed
    from free_transformer.base.install import install_hint

    assert f"needs submitit: {install_hint('slurm')}" in error_of()
    assert not (tmp_path / "out" / "seed-0").exists()  # nothing trained, nothing written into a run


def _cluster_ready() -> str | None:
    """None where a Slurm cluster answers, else why the real-cluster test is skipped."""
    if shutil.which("sbatch") is None:
        return "needs a Slurm cluster (sbatch is not on PATH): scripts/slurm-check.sh starts one of one node"
    done = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True)
    if done.returncode or "idle" not in done.stdout and "mix" not in done.stdout:
        return f"the Slurm cluster has no node ready (sinfo: {' '.join((done.stdout + done.stderr).split())})"
    return None


@pytest.mark.skipif(_cluster_ready() is not None, reason=str(_cluster_ready()))
def test_on_a_real_cluster_a_run_warned_of_its_time_limit_stops_and_is_resubmitted(tmp_path):
    """On Slurm itself: the run's job gets the USR2 that comes before the time limit (scancel --signal=USR2, as
    sbatch --signal sends it), checkpoints and stops; the next call resubmits it and it finishes."""
    config = tiny_run_config("steps=40", "checkpoint_every=4", "threads=1")  # stopped at step 8 or a little later
    run_dir = tmp_path / "sweep" / "free"
    launcher = _launcher(tmp_path / "sweep", cluster="slurm")
    job = lambda: Record(tmp_path / "sweep").runs["free"].job  # noqa: E731
    _when(lambda: _steps(run_dir) >= 8, lambda: subprocess.run(["scancel", "--signal=USR2", job()], check=True))
    with pytest.raises(Stopped, match="stopped by SIGTERM at step"):
        launcher.train([(config, run_dir)], "training")
    launcher.train([(config, run_dir)], "training")
    saved = json.loads((tmp_path / "sweep" / "slurm" / "record.json").read_text())["runs"]["free"]
    assert (saved["state"], saved["submissions"]) == (FINISHED, 2) and _steps(run_dir) == 100
    with pytest.raises(UserError, match="exceed model.max_seq_len"):  # a job failing at start, from its log
        launcher.train([(tiny_run_config("model.max_seq_len=16"), tmp_path / "sweep" / "bad")], "training")
