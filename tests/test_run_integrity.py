"""A run directory stays the run's own: no write through a symbolic link out of it, one writer even when
RUN/.lock is deleted, the settings a run trains with always recorded, and a start that fails leaves
nothing that refuses the corrected command."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, tiny_checkpoint, wait_for_step

from free_transformer.base.errors import UserError
from free_transformer.cli import main
from free_transformer.eval.record import CurveRecord
from free_transformer.train.config import load_train_config
from free_transformer.train.metrics import read_metrics


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _outside(tmp_path) -> Path:
    victim = tmp_path / "outside.txt"
    victim.write_text("not the run's")
    return victim


def _one_line_error(capsys, *words) -> str:
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and all(word in error for word in words), error
    return error


def test_the_lock_file_is_not_opened_through_a_symbolic_link(tmp_path, capsys):
    victim, run = _outside(tmp_path), tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    assert main(["train", "--out", str(run), *TINY, "steps=1"]) == 2
    _one_line_error(capsys, "symbolic link")
    assert victim.read_text() == "not the run's"


@pytest.mark.parametrize("name", ["training_curves.png", "metrics.jsonl", "config.yaml"])
def test_run_files_are_not_written_through_a_symbolic_link(tmp_path, capsys, name):
    """The link is neither followed (the outside file rewritten) nor replaced."""
    victim, run = _outside(tmp_path), tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(victim)
    assert main(["train", "--out", str(run), *TINY, "steps=1"]) == 2
    _one_line_error(capsys, "symbolic link", name)
    assert victim.read_text() == "not the run's" and (run / name).is_symlink()


def test_config_changes_and_eval_record_are_not_written_through_a_symbolic_link(tmp_path, capsys):
    victim, run = _outside(tmp_path), tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY, "steps=1"]) == 0
    (run / "config-changes.jsonl").symlink_to(victim)
    assert main(["train", "--out", str(run), "--resume", "steps=2", "kappa_bits=0.5"]) == 2
    _one_line_error(capsys, "symbolic link", "config-changes.jsonl")
    (run / "eval").mkdir()
    (run / "eval" / "curve.jsonl").symlink_to(victim)
    with pytest.raises(UserError, match="symbolic link"):
        CurveRecord(run).append({"step": 1, "settings_key": "k"})
    assert victim.read_text() == "not the run's"


def test_a_resume_from_step_0_with_changed_settings_records_them(tmp_path, capsys):
    """They used to train but leave config.yaml at the old ones: a later plain --resume trained with those."""
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY, "steps=1"]) == 0
    shutil.rmtree(run / "checkpoints")  # as a run killed before its first checkpoint leaves it
    assert main(["train", "--out", str(run), "--resume", "steps=1", "kappa_bits=0.5"]) == 0
    assert "changed settings: kappa_bits 0.25 -> 0.5" in capsys.readouterr().err
    assert load_train_config(run / "config.yaml").kappa_bits == 0.5
    changes = [json.loads(line) for line in (run / "config-changes.jsonl").read_text().splitlines()]
    assert changes == [{"step": 0, "changes": {"kappa_bits": [0.25, 0.5]}}]
    assert main(["train", "--out", str(run), "--resume", "steps=2"]) == 0  # plain: goes on with kappa 0.5
    assert [m["kappa_bits"] for m in read_metrics(run / "metrics.jsonl")] == [0.5, 0.5]


BAD_SETTINGS = [
    "optim.latent_lr_scale=nan",
    "optim.grad_clip=nan",
    "model.rope_theta=nan",
    "optim.min_lr_ratio=nan",
    "optim.weight_decay=-1",
    "validation_batches=0",
    "validate_every=-1",
    "data.tokens.val_fraction=-1",
    "steps=100000000",
]  # a step whose checkpoint directory (step_ and 8 digits) no loader finds


def test_settings_out_of_range_are_refused_when_parsed(tmp_path, capsys):
    """NaN settings used to fail at step 1 or 2 (leaving a run that refused the corrected command), the
    others to train silently (validation_batches=0 wrote NaN into metrics.jsonl)."""
    run = tmp_path / "run"
    for override in BAD_SETTINGS:
        assert main(["train", "--out", str(run), *TINY, "steps=1", override]) == 2, override
        name = override.split("=")[0]
        _one_line_error(capsys, name.split(".")[-1])
        assert not run.exists(), override
    assert main(["train", "--out", str(run), *TINY, "steps=1"]) == 0  # the corrected command


def test_a_start_that_fails_before_logging_a_step_does_not_block_the_corrected_command(tmp_path, capsys):
    run = tmp_path / "run"
    diverging = [
        *TINY,
        "steps=20",
        "log_every=100",
        "checkpoint_every=100",
        "optim.lr=1e12",
        "optim.grad_clip=0",
        "optim.warmup_steps=1",
    ]
    assert main(["train", "--out", str(run), *diverging]) == 2
    _one_line_error(capsys, "non-finite loss", "--resume")
    assert main(["train", "--out", str(run), *TINY, "steps=1"]) == 0
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1]


def test_resume_with_init_from_is_refused(tmp_path, capsys):
    checkpoint = tiny_checkpoint(tmp_path, "ckpt", 4)
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "--init-from", str(checkpoint)]) == 2
    _one_line_error(capsys, "--init-from", "--resume")


@pytest.mark.parametrize(
    "option",
    [
        ["--num-fewshot", "nosuch=3"],
        ["--heldout-windows", "-2"],
        ["--max-new-tokens", "0"],
        ["--data", "nosuch=x.jsonl"],
    ],
)
def test_eval_options_out_of_range_are_refused(tmp_path, capsys, option):
    checkpoint = tiny_checkpoint(tmp_path, "ckpt", 4)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("a few words of held-out text\n" * 4)
    assert main(["eval", str(checkpoint), "--tasks", "none", "--heldout", str(heldout), "--no-progress", *option]) == 2
    _one_line_error(capsys, option[0].removeprefix("--"))
    assert not (checkpoint / "eval").exists()


def test_deleting_the_lock_stops_the_writer_before_a_second_one_gets_in(tmp_path):
    """A lock lives on the inode: RUN/.lock deleted, a second `train` could lock a new file and both wrote."""
    run = tmp_path / "run"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "free_transformer.cli",
            "train",
            "--out",
            str(run),
            *TINY,
            "steps=400",
            "checkpoint_every=1000",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(run, 2, first)
        (run / ".lock").unlink()
        assert first.wait(timeout=120) == 2
    finally:
        first.kill()
    error = first.stderr.read().strip()
    assert "deleted or replaced" in error and len(error.splitlines()) == 1, error
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] < 400


def test_a_folder_of_the_run_linked_outside_is_neither_written_nor_pruned_through(tmp_path, capsys):
    """RUN/checkpoints or RUN/eval made a link to a folder outside the run: training, resuming and eval
    refuse it in one line naming the link; the outside folder's checkpoint is neither joined by a new
    one nor deleted by rotation (both used to happen), and no eval result is written there."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    assert main(["train", "--out", str(run), *TINY, "steps=2", "checkpoint_every=1", "keep_checkpoints=1"]) == 0
    shutil.move(run / "checkpoints", outside)
    (run / "checkpoints").symlink_to(outside)
    kept = sorted(p.name for p in outside.iterdir())
    assert main(["train", "--out", str(run), "--resume", "steps=4"]) == 2
    _one_line_error(capsys, "symbolic link", str(run / "checkpoints"))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "checkpoints").symlink_to(outside)
    assert main(["train", "--out", str(fresh), *TINY, "steps=2", "checkpoint_every=1", "keep_checkpoints=1"]) == 2
    _one_line_error(capsys, "symbolic link", str(fresh / "checkpoints"))
    assert sorted(p.name for p in outside.iterdir()) == kept
    (run / "checkpoints").unlink()
    shutil.move(outside, run / "checkpoints")
    (tmp_path / "eval-outside").mkdir()
    (run / "eval").symlink_to(tmp_path / "eval-outside")
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("some held-out text " * 20)
    assert main(["eval", str(run), "--tasks", "none", "--heldout", str(heldout), "--no-progress"]) == 2
    _one_line_error(capsys, "symbolic link", str(run / "eval"))
    with pytest.raises(UserError, match="symbolic link"):
        CurveRecord(run)
    assert list((tmp_path / "eval-outside").iterdir()) == []


@pytest.mark.parametrize("name", [".tmp_step_00000001_removed", ".tmp_step_00000009_x1"])
def test_a_planted_temporary_checkpoint_link_is_one_line(tmp_path, capsys, name):
    """A `.tmp_step_*` link in RUN/checkpoints (the names a checkpoint is written and removed under),
    to a file outside the run, stopped a run with a raw `[Errno 20] Not a directory` when rotation moved
    a step onto it. It is refused in one line naming it, and the file outside is left as it was."""
    run, outside = tmp_path / "run", tmp_path / "outside.txt"
    assert main(["train", "--out", str(run), *TINY, "steps=1", "checkpoint_every=1", "keep_checkpoints=1"]) == 0
    outside.write_text("kept")
    (run / "checkpoints" / name).symlink_to(outside)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "steps=3", "checkpoint_every=1", "keep_checkpoints=1"]) == 2
    _one_line_error(capsys, "symbolic link", str(run / "checkpoints" / name))
    assert outside.read_text() == "kept"
