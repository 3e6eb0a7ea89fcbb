"""What a checkpoint holds is data, checked before it is used: no entry of a sharded (DCP) checkpoint is
unpickled beyond tensors and plain values, SHA256SUMS lists every file a loader reads, a file that
matches its digest is still checked against its schema, and writing a checkpoint (consolidate, convert)
either completes or leaves nothing."""

import json
import os
import resource
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import TINY, Payload, rewrite_checksums, tiny_checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import free_transformer
from free_transformer.base.fileio import sha256_file
from free_transformer.cli import main
from free_transformer.model.config import ModelConfig
from free_transformer.model.transformer import FreeTransformer
from free_transformer.runs.checkpoint import CheckpointError, checkpoint_dirs, load_model, verify_checkpoint


def _one_line_error(capsys_or_err) -> str:
    """The one error line of a command's stderr (after any notes or progress bars), with no traceback."""
    err = capsys_or_err if isinstance(capsys_or_err, str) else capsys_or_err.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.strip().endswith(errors[0]) and "Traceback" not in err, err
    return errors[0]


def _cli(*args, file_size_limit=None):
    """A real `free-transformer` process (the package under test); files larger than `file_size_limit`
    bytes fail to write (EFBIG; Python ignores SIGXFSZ), as on a full disk or over a quota."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(free_transformer.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    limit = (
        None
        if file_size_limit is None
        else (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit)))
    )
    return subprocess.run(
        [sys.executable, "-m", "free_transformer.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two steps with a checkpoint each: one process (strategy none), and fsdp in a world of one (sharded
    checkpoints, no torchrun)."""
    root = tmp_path_factory.mktemp("runs")
    for name, strategy in (("single", "none"), ("sharded", "fsdp")):
        assert (
            main(
                [
                    "train",
                    "--out",
                    str(root / name),
                    *TINY,
                    "steps=2",
                    "checkpoint_every=1",
                    f"distributed.strategy={strategy}",
                ]
            )
            == 0
        )
    return root


# -- a sharded checkpoint's entries are never unpickled beyond tensors and plain values -------------------


def _resave_dcp(checkpoint: Path, state: dict) -> None:
    """Replace a checkpoint's dcp/ by `state` (DCP pickles every value that is not a tensor), with its
    SHA256SUMS rewritten to match: what an attacker who can write the checkpoint does."""
    shutil.rmtree(checkpoint / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=checkpoint / "dcp", no_dist=True)
    rewrite_checksums(checkpoint)


def test_a_crafted_sharded_checkpoint_entry_never_runs(runs, tmp_path, capsys):
    """An entry stored as bytes (its .metadata lists only DCP's own records, which the allow-list accepts)
    holding a pickled payload: consolidate and train --resume refuse it in one line, and it never runs."""
    marker = tmp_path / "payload-ran"
    # consolidate: the payload where a weight is expected
    run = shutil.copytree(runs / "sharded", tmp_path / "weights")
    newest = checkpoint_dirs(run)[-1]
    config = ModelConfig.from_dict(json.loads((newest / "config.json").read_text())["model"])
    _resave_dcp(newest, {"model": {**FreeTransformer(config).state_dict(), "embed_tokens.weight": Payload(marker)}})
    assert main(["consolidate", str(newest)]) == 2
    assert "refused" in _one_line_error(capsys)
    assert not marker.exists() and not (newest / "model.safetensors").exists()
    # train --resume: the payload where a plain value (the optimizer's eps) is expected
    run = shutil.copytree(runs / "sharded", tmp_path / "optimizer")
    newest = checkpoint_dirs(run)[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(newest / "dcp", tmp_path / "state.pt")  # the test's own file: trusted
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    state["optim"]["param_groups"][0]["eps"] = Payload(marker)
    _resave_dcp(newest, state)
    assert main(["train", "--out", str(run), "--resume", "steps=3"]) == 2
    assert "refused, not run" in _one_line_error(capsys)
    assert not marker.exists()


# -- SHA256SUMS lists every file a loader reads ----------------------------------------------------------


@pytest.mark.parametrize("sums", ["", "config.json"], ids=["emptied", "truncated"])
def test_sha256sums_that_leave_out_a_file_mark_the_checkpoint_damaged(tmp_path, capsys, sums):
    """A flipped weight with an emptied SHA256SUMS, or one cut to config.json's line, used to load silently."""
    checkpoint = tiny_checkpoint(tmp_path, "run", 0) / "checkpoints" / "step_00000001"
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    lines = (checkpoint / "SHA256SUMS").read_text().splitlines()
    (checkpoint / "SHA256SUMS").write_text("".join(f"{line}\n" for line in lines if sums and line.endswith(sums)))
    unlisted = "model.safetensors" if sums else "config.json"  # the first file a loader reads that is left out
    assert f"{unlisted} is not in SHA256SUMS" in verify_checkpoint(checkpoint)
    with pytest.raises(CheckpointError, match=f"is damaged: {unlisted} is not in SHA256SUMS"):
        load_model(checkpoint)
    assert main(["generate", str(checkpoint), "--prompt", "K>", "-n", "1"]) == 2
    assert f"is damaged: {unlisted} is not in SHA256SUMS" in _one_line_error(capsys)


def test_consolidate_records_the_weights_it_writes_in_sha256sums(runs, tmp_path, capsys):
    run = shutil.copytree(runs / "sharded", tmp_path / "sharded")
    newest = checkpoint_dirs(run)[-1]
    for args, written in (([], newest), (["--out", str(tmp_path / "out")], tmp_path / "out")):
        assert main(["consolidate", str(newest), *args]) == 0
        listed = dict(reversed(line.split("  ")) for line in (written / "SHA256SUMS").read_text().splitlines())
        assert listed["model.safetensors"] == sha256_file(written / "model.safetensors")
        assert verify_checkpoint(written) is None
        load_model(written)
    assert {"config.json", "dcp/.metadata", "model.safetensors"} <= {
        line.split("  ")[1] for line in (newest / "SHA256SUMS").read_text().splitlines()
    }
    capsys.readouterr()
    # a damaged sharded checkpoint is not consolidated: its damage would be recorded as intact
    damaged = shutil.copytree(runs / "sharded", tmp_path / "damaged")
    newest = checkpoint_dirs(damaged)[-1]
    (newest / "config.json").write_text((newest / "config.json").read_text().replace('"step": 2', '"step": 1'))
    assert main(["consolidate", str(newest)]) == 2
    assert "is damaged: config.json does not match its SHA-256" in _one_line_error(capsys)
    assert not (newest / "model.safetensors").exists()


# -- a file that matches its digest is still checked against its schema -----------------------------------


def _edit_config(checkpoint, edit):
    config = json.loads((checkpoint / "config.json").read_text())
    edit(config)
    (checkpoint / "config.json").write_text(json.dumps(config))


def _edit_state(checkpoint, edit):
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    torch.save(edit(state), checkpoint / "state.pt")


def _rng(state, key, value):
    state["rng"][key] = value
    return state


CONFIG_DAMAGE = {
    "latent-null": lambda c: c["model"].update(latent=None),
    "tokenizer-5": lambda c: c.update(tokenizer=5),
    "step-text": lambda c: c.update(step="2"),
}
STATE_DAMAGE = {
    "empty": lambda s: {},
    "list": lambda s: [s],
    "step-only": lambda s: {"step": s["step"]},  # resume would read the optimizer and RNG state it lacks
    "torch-rng": lambda s: _rng(s, "torch", torch.zeros(3, dtype=torch.uint8)),
    "python-rng": lambda s: _rng(s, "python", (3, (1, 2), None)),
    "numpy-rng": lambda s: _rng(s, "numpy", ("MT19937", torch.zeros(3, dtype=torch.int64), 0, 0, 0.0)),
}


@pytest.mark.parametrize("damage", CONFIG_DAMAGE, ids=list(CONFIG_DAMAGE))
def test_a_config_of_the_wrong_shape_is_one_line(runs, tmp_path, capsys, damage):
    """config.json rewritten with its digest: generate refuses it in one line, --resume passes it over."""
    run = shutil.copytree(runs / "single", tmp_path / "run")
    newest = checkpoint_dirs(run)[-1]
    _edit_config(newest, CONFIG_DAMAGE[damage])
    rewrite_checksums(newest)
    assert "corrupt checkpoint config" in verify_checkpoint(newest)
    assert main(["generate", str(newest), "--prompt", "K>", "-n", "1"]) == 2
    assert "corrupt checkpoint config" in _one_line_error(capsys)
    assert main(["train", "--out", str(run), "--resume", "steps=3"]) == 0
    assert "moved to step_00000002.damaged" in capsys.readouterr().err


@pytest.mark.parametrize("damage", STATE_DAMAGE, ids=list(STATE_DAMAGE))
def test_a_training_state_of_the_wrong_shape_is_passed_over(runs, tmp_path, capsys, damage):
    """state.pt rewritten with its digest: verification names it, and --resume moves the checkpoint aside
    and continues from the previous one (as for any damaged checkpoint)."""
    run = shutil.copytree(runs / "single", tmp_path / "run")
    newest = checkpoint_dirs(run)[-1]
    _edit_state(newest, STATE_DAMAGE[damage])
    rewrite_checksums(newest)
    assert "corrupt, unsafe or missing training state" in verify_checkpoint(newest)
    assert main(["train", "--out", str(run), "--resume", "steps=3"]) == 0
    assert "moved to step_00000002.damaged" in capsys.readouterr().err
    assert [p.name for p in checkpoint_dirs(run)] == ["step_00000001", "step_00000002", "step_00000003"]


def test_a_metrics_line_that_is_not_an_object_is_ignored(runs, tmp_path, capsys):
    run = shutil.copytree(runs / "single", tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write("[1, 2]\n5\n")
    assert main(["train", "--out", str(run), "--resume", "steps=3"]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]


# -- convert and consolidate: a step loaders find, and a full disk leaves nothing -------------------------


@pytest.mark.parametrize("step", ["-5", "1000000000"])
def test_convert_refuses_a_step_no_loader_finds(tmp_path, capsys, step):
    checkpoint = tiny_checkpoint(tmp_path, "run", 0)
    assert main(["convert", str(checkpoint), str(tmp_path / "dest"), "--to", "checkpoint", "--step", step]) == 2
    assert "step must be an integer in [0, 99999999]" in _one_line_error(capsys)
    assert not (tmp_path / "dest").exists()


def _nothing_left(folder: Path, name: str) -> None:
    """No `name` in `folder`, and no temporary directory of a write there."""
    assert not (folder / name).exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("to", ["checkpoint", "hf"])
def test_convert_on_a_full_disk_is_one_line_and_can_be_run_again(tmp_path, to):
    """The weights (183 kB) do not fit under the limit: one line, nothing written, and the same command
    (with room) then succeeds."""
    source = tiny_checkpoint(tmp_path, "run", 0)
    command = ["convert", str(source), str(tmp_path / "dest"), "--to", to]
    full = _cli(*command, file_size_limit=100_000)
    assert full.returncode == 2, full.stderr[-2000:]
    assert _one_line_error(full.stderr).startswith(f"error: cannot write {tmp_path / 'dest'}: is the disk full")
    assert not (tmp_path / "dest").exists() or not list((tmp_path / "dest").iterdir())
    _nothing_left(tmp_path, "dest/checkpoints")
    assert main(command) == 0  # with room, in this process: only the full disk needs a process of its own
    if to == "checkpoint":
        assert verify_checkpoint(checkpoint_dirs(tmp_path / "dest")[-1]) is None


def test_consolidate_on_a_full_disk_is_one_line_and_leaves_nothing(runs, tmp_path):
    run = shutil.copytree(runs / "sharded", tmp_path / "sharded")
    newest = checkpoint_dirs(run)[-1]
    before = {f.name: sha256_file(f) for f in newest.iterdir() if f.is_file()}
    for args in ([], ["--out", str(tmp_path / "out")]):
        full = _cli("consolidate", str(newest), *args, file_size_limit=100_000)
        assert full.returncode == 2, full.stderr[-2000:]
        error = _one_line_error(full.stderr)
        assert error.startswith("error: cannot write model.safetensors in ") and "is the disk full" in error
    _nothing_left(newest, "model.safetensors")
    _nothing_left(tmp_path, "out")
    assert {f.name: sha256_file(f) for f in newest.iterdir() if f.is_file()} == before
    assert verify_checkpoint(newest) is None
    assert main(["consolidate", str(newest)]) == 0  # with room, in this process
    assert verify_checkpoint(newest) is None


# -- links and storage paths: a checkpoint's files are its own ------------------------------------------


def test_a_checkpoint_file_or_step_that_is_a_link_is_not_read_through(tmp_path, capsys):
    """model.safetensors replaced by a link (to an identical copy outside, so that its digest matches) is
    damage; a checkpoints/step_N link is refused in one line by every command that looks for a checkpoint."""
    checkpoint = checkpoint_dirs(tiny_checkpoint(tmp_path, "run", 0))[-1]
    outside = tmp_path / "outside.safetensors"
    shutil.copy(checkpoint / "model.safetensors", outside)
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors").symlink_to(outside)
    assert (
        verify_checkpoint(checkpoint) == "model.safetensors is a symbolic link (a checkpoint's files must be its own)"
    )
    run = tmp_path / "run2"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000009").symlink_to(checkpoint)
    assert main(["generate", str(run), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    assert "step_00000009 is a symbolic link" in _one_line_error(capsys)


def test_a_sharded_checkpoint_whose_storage_path_leaves_it_is_refused_naming_it(runs, tmp_path, capsys):
    """A .metadata storage path of ../../../etc/passwd (DCP would read that file; it used to be refused only
    as EOFError) is unsafe metadata: consolidate says which path, and verification counts it damaged."""
    import pickle

    run = shutil.copytree(runs / "sharded", tmp_path / "sharded")
    newest = checkpoint_dirs(run)[-1]
    metadata_path = newest / "dcp" / ".metadata"
    with open(metadata_path, "rb") as handle:
        metadata = pickle.load(handle)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    with open(metadata_path, "wb") as handle:
        pickle.dump(metadata, handle)
    rewrite_checksums(newest)
    assert main(["consolidate", str(newest)]) == 2
    error = _one_line_error(capsys)
    assert "storage path '../../../etc/passwd' is not a file of the checkpoint's dcp/ folder" in error, error
    assert "../../../etc/passwd" in verify_checkpoint(newest)


@pytest.mark.parametrize("to", ["hf", "checkpoint"])
def test_convert_into_a_link_to_an_empty_folder_says_so(tmp_path, capsys, to):
    """It used to be refused as "is the disk full ..."."""
    checkpoint = tiny_checkpoint(tmp_path, "run", 0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "dest").symlink_to(tmp_path / "empty")
    assert main(["convert", str(checkpoint), str(tmp_path / "dest"), "--to", to]) == 2
    assert "dest is a symbolic link: nothing is written through one" in _one_line_error(capsys)
    assert list((tmp_path / "empty").iterdir()) == []
