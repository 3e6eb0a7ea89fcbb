"""Nothing saved is lost, nothing breaks with a traceback: preemption signals, damaged checkpoints,
resuming with another model, and the fault-injection run (SIGTERM, a damaged checkpoint, a full disk)."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, Payload, rewrite_checksums
from conftest import run_losses as _losses
from conftest import tiny_run_config as _config
from conftest import wait_for_step as _wait_for_step

from free_transformer.cli import main
from free_transformer.runs.checkpoint import checkpoint_dirs, load_model, load_training_state, verify_checkpoint
from free_transformer.train.config import load_train_config
from free_transformer.train.metrics import read_metrics
from free_transformer.train.trainer import TrainingError, train


def _cli(out, *args, preexec_fn=None):
    """A real `free-transformer train` process (this checkout's package)."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",  # as _one_thread here
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "free_transformer.cli", "train", "--out", str(out), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
    )


@pytest.fixture()
def _one_thread():
    """In-process runs compared bit for bit with _cli's runs use one thread as they do (and two threads on
    a shared 2-core machine are many times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _every_checkpoint_loads(run_dir):
    for checkpoint in checkpoint_dirs(run_dir):
        assert verify_checkpoint(checkpoint) is None, checkpoint
        load_model(checkpoint)
        load_training_state(checkpoint)


# -- preemption ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "signum, code",
    [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],  # one signal by default
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_saves_a_checkpoint_and_resume_continues_exactly(tmp_path, signum, code, _one_thread):
    """No checkpoint is due before step 1000: everything saved comes from the signal."""
    args = [*TINY, "steps=14", "checkpoint_every=1000"]
    reference = tmp_path / "reference"
    train(_config(*args[len(TINY) :]), reference)
    out = tmp_path / "stopped"
    process = _cli(out, *args)
    _wait_for_step(out, 3, process)
    process.send_signal(signum)
    assert process.wait(timeout=120) == code
    message = process.stderr.read().strip().splitlines()[-1]
    assert message.startswith(f"stopped by {signal.Signals(signum).name} after step ")
    assert f"free-transformer train --out {out} --resume" in message
    [saved] = checkpoint_dirs(out)
    step = int(saved.name.split("_")[1])
    assert 3 <= step < 14 and f"after step {step} of 14" in message
    _every_checkpoint_loads(out)
    assert [s for s, _ in _losses(out)] == list(range(1, step + 1))
    assert (out / "training_curves.png").stat().st_size > 0  # the curves of the steps it trained
    assert main(["train", "--out", str(out), "--resume"]) == 0
    assert _losses(out) == _losses(reference)


def test_a_run_dir_without_checkpoint_resumes_from_step_0(tmp_path, capsys):
    config = _config("steps=3")
    train(config, tmp_path / "reference")
    shutil.copytree(tmp_path / "reference", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # as a run killed before its first checkpoint leaves it
    with pytest.raises(TrainingError, match="already holds a run"):
        train(config, tmp_path / "run")
    train(config, tmp_path / "run", resume=True)
    assert "from step 0" in capsys.readouterr().err
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")


def test_non_finite_loss_before_the_first_checkpoint_says_how_to_go_on(tmp_path, capsys):
    args = [*TINY, "steps=20", "checkpoint_every=100", "optim.lr=1e12", "optim.grad_clip=0", "optim.warmup_steps=1"]
    assert main(["train", "--out", str(tmp_path), *args]) == 2
    error = capsys.readouterr().err.strip()
    assert "non-finite loss" in error and "--resume" in error and len(error.splitlines()) == 1


# -- damaged checkpoints -----------------------------------------------------------------------------


def _truncate(path):
    os.truncate(path, 100_000 if path.stat().st_size > 100_000 else path.stat().st_size // 2)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01  # inside the tensor data: safetensors itself cannot tell
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name, damage",
    [  # one damage in the default suite (the one safetensors cannot tell), the others slow (a resume each)
        pytest.param("model.safetensors", _truncate, marks=pytest.mark.slow),
        ("model.safetensors", _flip_a_byte),
        pytest.param("state.pt", _flip_a_byte, marks=pytest.mark.slow),
        pytest.param("config.json", _truncate, marks=pytest.mark.slow),
    ],
    ids=["truncated-weights", "flipped-weights", "flipped-state", "truncated-config"],
)
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, capsys, name, damage):
    config = _config("steps=6", "checkpoint_every=2")
    train(config, tmp_path / "reference")
    shutil.copytree(tmp_path / "reference", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000006")  # as if killed after step 4's
    newest = tmp_path / "run" / "checkpoints" / "step_00000004"
    damage(newest / name)
    train(config, tmp_path / "run", resume=True)
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged" in err and name in err
    assert (newest.parent / "step_00000004.damaged" / name).exists()  # kept aside, not deleted
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")  # resumed from step 2
    _every_checkpoint_loads(tmp_path / "run")


def test_resume_with_every_checkpoint_damaged_starts_again(tmp_path, capsys):
    config = _config("steps=2", "checkpoint_every=1", "keep_checkpoints=1")
    train(config, tmp_path / "run")
    _truncate(tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors")
    first = _losses(tmp_path / "run")
    train(config, tmp_path / "run", resume=True)
    err = capsys.readouterr().err
    assert "is damaged" in err and "from step 0" in err
    assert _losses(tmp_path / "run") == first


@pytest.mark.parametrize("change", [["model.dim=64"], ["model.latent_units=6"]])
def test_resume_with_another_model_is_one_line(tmp_path, capsys, change):
    assert main(["train", "--out", str(tmp_path), *TINY, "steps=1"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path), "--resume", "steps=2", *change]) == 2
    error = capsys.readouterr().err.strip()
    field = change[0].split("=")[0].split(".")[1]
    assert error.startswith("error: cannot resume") and f"{field} " in error and len(error.splitlines()) == 1


# -- devices -------------------------------------------------------------------------------------------


def _bad_devices():
    """Device names that fail on this machine: typos always, CUDA and MPS where absent."""
    names = ["foo", "cuda:x", "CPU0", "meta"]
    if not torch.cuda.is_available():
        names += ["cuda", "cuda:0"]
    if not torch.backends.mps.is_available():
        names.append("mps")
    return names


@pytest.mark.parametrize("device", _bad_devices())
def test_every_entry_point_rejects_a_bad_device_in_one_line(tmp_path, capsys, device):
    from conftest import tiny_checkpoint

    checkpoint = tiny_checkpoint(tmp_path, "run", 4)
    assert main(["generate", str(checkpoint), "--prompt", "K>", "--device", device]) == 2
    assert main(["eval", str(checkpoint), "--tasks", "none", "--heldout", __file__, "--device", device]) == 2
    assert main(["train", "--out", str(tmp_path / "t"), *TINY, "steps=1", f"device={device}"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("error: ") and "device" in e for e in errors), errors
    assert not (tmp_path / "t").exists()


def test_parse_device_accepts_what_exists():
    from free_transformer.base.devices import parse_device

    assert parse_device("cpu") == torch.device("cpu") and parse_device(" CPU ") == torch.device("cpu")
    assert parse_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


# -- first-try examples --------------------------------------------------------------------------------


def test_the_example_in_train_help_runs(tmp_path, capsys):
    from free_transformer.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    [example] = [
        line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.strip().startswith("free-transformer train")
    ]
    argv = [str(tmp_path / "try") if word == "runs/try" else word for word in example[1:]]
    assert main([*argv, "steps=2", "progress=false"]) == 0  # later overrides win: 2 steps, not 100


def test_overrides_may_come_before_and_after_options(tmp_path):
    assert main(["train", *TINY[:4], "--out", str(tmp_path), *TINY[4:], "steps=1", "steps=2"]) == 0
    assert [s for s, _ in _losses(tmp_path)] == [1, 2]
    with pytest.raises(SystemExit):
        main(["train", "--out", str(tmp_path / "x"), "steps=1", "--nope"])


def test_a_failed_start_leaves_no_run_directory(tmp_path):
    assert main(["train", "--out", str(tmp_path / "run"), "model.size=debug", "model.vocab_size=64"]) == 2  # < 256
    assert not (tmp_path / "run").exists()


def test_a_dry_run_checks_the_data_against_the_model_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("a line of notes\n" * 2000)
    text = ["data.kind=text", f"data.text.path={tmp_path / 'notes.txt'}", f"data.text.cache_dir={tmp_path / 'cache'}"]
    assert main(["train", "--out", str(tmp_path / "run"), "model.size=debug", *text, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("dry run, nothing trained: ") and not (tmp_path / "run").exists()
    for wrong, message in (
        (["data.text.seq_len=200"], "exceed model.max_seq_len (128)"),
        (["model.vocab_size=64"], "smaller than the byte tokenizer's"),
        ([f"data.text.path={tmp_path / 'nope.txt'}"], "corpus not found"),
    ):
        assert main(["train", "--out", str(tmp_path / "run"), "model.size=debug", *text, *wrong, "--dry-run"]) == 2
        error = capsys.readouterr().err.strip()
        assert message in error and error.count("\n") == 0, error
    assert main(["train", "--out", str(tmp_path / "run"), *TINY, "steps=1"]) == 0
    assert main(["train", "--out", str(tmp_path / "run"), *TINY, "--dry-run"]) == 2  # a run is there
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "run"), "--resume", "steps=5", "--dry-run"]) == 0


def test_generate_caps_its_default_length_to_the_model(tmp_path, capsys, monkeypatch):
    from conftest import tiny_checkpoint

    from free_transformer.inference import batches as command  # where the command makes its rows

    lengths = []
    real = command.prompt_row
    monkeypatch.setattr(
        command,
        "prompt_row",
        lambda prompt, seed, **kw: lengths.append(prompt.config.max_new_tokens) or real(prompt, seed, **kw),
    )
    checkpoint = tiny_checkpoint(tmp_path, "run", 4, max_seq_len=16)
    assert main(["generate", str(checkpoint), "--prompt", "K>", "-n", "1"]) == 0
    assert lengths == [15]  # 2 prompt tokens + 15 new ones: 16 fed positions, the model's context
    assert main(["generate", str(checkpoint), "--prompt", "K>", "--max-new-tokens", "64"]) == 2  # asked: refused
    assert main(["generate", str(checkpoint), "--prompt", "K>", "--reference", "K>abc"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "max_seq_len" in errors[0] and "--latents reference" in errors[1]


def test_cli_version_and_generate_defaults_in_help(capsys):
    from free_transformer import __version__

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"free-transformer {__version__}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 4)" in capsys.readouterr().out


# -- permissions ---------------------------------------------------------------------------------------


def _modes(root):
    return {(p.is_dir(), p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")]}


def test_checkpoints_and_exports_are_readable_as_the_umask_allows(tmp_path):
    """mkdtemp made step directories 0700 and safetensors wrote weights 0600, while config.json was 0644."""
    pytest.importorskip("transformers")
    old = os.umask(0o022)
    try:
        train(_config("steps=1", "model.latent_units=0"), tmp_path / "run")  # a baseline converts to Llama too
        assert _modes(checkpoint_dirs(tmp_path / "run")[-1]) == {(True, 0o755), (False, 0o644)}
        for to in ("hf", "llama"):
            assert main(["convert", str(tmp_path / "run"), str(tmp_path / to), "--to", to]) == 0
            assert _modes(tmp_path / to) == {(True, 0o755), (False, 0o644)}, to
    finally:
        os.umask(old)


# -- smaller ones --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("- 1\n- 2\n", "must be a mapping"),
        ("hello\n", "must be a mapping"),
        ("", "is empty"),
        ("# only a comment\n", "is empty"),
        ("steps: 1\nsteps: 2\n", "duplicate key 'steps'"),
        ("optim:\n  lr: 1\n  lr: 2\n", "duplicate key 'lr'"),
        ("steps: [1\n", "cannot read config"),
    ],
)
def test_bad_yaml_configs_are_one_line(tmp_path, capsys, text, message):
    (tmp_path / "c.yaml").write_text(text)
    assert main(["train", "--out", str(tmp_path / "run"), "--config", str(tmp_path / "c.yaml")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error and len(error.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_override_into_a_value_is_one_line(capsys):
    assert main(["train", "--out", "unused", "model=3", "model.dim=4"]) == 2
    assert "model was given a value" in capsys.readouterr().err


def test_resuming_a_finished_run_reports_its_last_losses(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), *TINY, "steps=2"]) == 0
    first = capsys.readouterr().out
    assert main(["train", "--out", str(tmp_path), "--resume"]) == 0
    captured = capsys.readouterr()
    assert "nan" not in captured.out and "cross-entropy" in captured.out
    assert captured.out.split("cross-entropy")[1] == first.split("cross-entropy")[1]
    assert "nothing to train" in captured.err and [s for s, _ in _losses(tmp_path)] == [1, 2]


def test_info_rejects_a_negative_sequence_length(capsys):
    assert main(["info", "debug", "--seq-len", "-5"]) == 2
    assert "--seq-len must be >= 1" in capsys.readouterr().err


def test_eval_notes_answers_longer_than_the_context(tmp_path, capsys):
    from conftest import tiny_checkpoint

    checkpoint = tiny_checkpoint(tmp_path, "run", 0, max_seq_len=16)  # PIQA-like answers are far longer
    assert (
        main(
            [
                "eval",
                str(checkpoint),
                "--tasks",
                "arc_easy",
                "--limit",
                "3",
                "--no-progress",
                "--output",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "note: arc_easy:" in out and "answer longer than the model's context (16 tokens)" in out


# -- fault injection -----------------------------------------------------------------------------------


def _file_size_limit(limit):
    """preexec_fn: files of the child larger than `limit` bytes fail to write (EFBIG; Python ignores
    SIGXFSZ), as on a full disk or over a quota."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow  # three faults in a row, each a process importing torch; each has its own fast test
def test_faults_never_lose_what_was_saved_and_resume_reproduces_the_losses(tmp_path, _one_thread):
    """In the style of test_sigkill_at_random_moments: one run meets SIGTERM, a disk that fills up
    during a checkpoint, and a damaged newest checkpoint; every checkpoint on disk loads after each
    fault, and the run ends with the losses of an uninterrupted one."""
    args = [*TINY, "steps=16", "checkpoint_every=4", "keep_checkpoints=3"]
    reference = tmp_path / "reference"
    train(_config(*args[len(TINY) :]), reference)
    out = tmp_path / "faults"

    process = _cli(out, *args)  # 1. SIGTERM: a checkpoint at the next step boundary
    _wait_for_step(out, 5, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143
    stopped_at = int(checkpoint_dirs(out)[-1].name.split("_")[1])
    assert 5 <= stopped_at < 16
    _every_checkpoint_loads(out)

    # 2. the disk fills up: weights (183 kB) fit under the limit, the training state (397 kB) does not
    process = _cli(out, *args, "--resume", preexec_fn=_file_size_limit(250_000))
    assert process.wait(timeout=120) == 2
    error = process.stderr.read().strip().splitlines()[-1]
    assert error.startswith("error: cannot write the checkpoint of step") and "disk full" in error
    assert int(checkpoint_dirs(out)[-1].name.split("_")[1]) == stopped_at  # nothing newer, nothing partial
    assert not list((out / "checkpoints").glob(".tmp*"))
    _every_checkpoint_loads(out)

    # 3. the newest checkpoint is damaged (a flipped byte): resume falls back to the one before
    newest = checkpoint_dirs(out)[-1]
    _flip_a_byte(newest / "model.safetensors")
    process = _cli(out, *args, "--resume")
    assert process.wait(timeout=300) == 0, process.stderr.read()
    assert f"checkpoint {newest} is damaged" in process.stderr.read()
    _every_checkpoint_loads(out)
    assert _losses(out) == _losses(reference)


def test_a_fresh_run_writes_its_own_config_over_a_lone_one(tmp_path):
    """A process killed after writing config.yaml and before any step leaves config.yaml alone: a new run
    there (not --resume) saves its own config, which is the one --resume will read."""
    train(_config("steps=1", "seed=3"), tmp_path / "a")
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "config.yaml", tmp_path / "b" / "config.yaml")
    train(_config("steps=1", "seed=5"), tmp_path / "b")
    assert load_train_config(tmp_path / "b" / "config.yaml").seed == 5


def test_an_out_path_that_cannot_be_a_directory_is_one_line(capsys):
    assert main(["train", "--out", "/dev/null/run", *TINY, "steps=1"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "/dev/null/run" in error and len(error.splitlines()) == 1


# -- nothing executed, one writer per run, every loader verifies ---------------------------------------


def test_a_pickled_payload_in_a_checkpoint_never_runs(tmp_path, capsys):
    """state.pt is read with weights_only=True: a crafted one (with matching digests) is refused as damaged
    by verification, by load_training_state and by --resume (which goes on from the previous checkpoint);
    the payload never runs."""
    run, marker = tmp_path / "run", tmp_path / "payload-ran"
    assert main(["train", "--out", str(run), *TINY, "steps=2", "checkpoint_every=1"]) == 0
    newest = checkpoint_dirs(run)[-1]
    state = torch.load(newest / "state.pt", weights_only=True)  # written as tensors and plain values only
    state["rng"]["python"] = Payload(marker)
    torch.save(state, newest / "state.pt")
    rewrite_checksums(newest)
    with pytest.raises(Exception, match="refused, not run"):
        load_training_state(newest)
    assert "refused, not run" in verify_checkpoint(newest)
    assert main(["train", "--out", str(run), "--resume", "steps=3"]) == 0
    assert "moved to step_00000002.damaged" in capsys.readouterr().err
    assert not marker.exists()
    assert [p.name for p in checkpoint_dirs(run)] == ["step_00000001", "step_00000002", "step_00000003"]
    assert (run / "checkpoints" / "step_00000002.damaged").is_dir()


def test_every_command_that_loads_a_checkpoint_verifies_it(tmp_path, capsys):
    """generate, eval, convert and --init-from refuse a checkpoint whose files differ from SHA256SUMS, in
    one line (they used to load it silently)."""
    from conftest import tiny_checkpoint

    checkpoint = tiny_checkpoint(tmp_path, "run", 4, max_seq_len=72) / "checkpoints" / "step_00000001"
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit pattern in a weight: the file still parses
    weights.write_bytes(bytes(data))
    commands = [
        ["generate", str(checkpoint), "--prompt", "K>", "-n", "1"],
        ["convert", str(checkpoint), str(tmp_path / "hf"), "--to", "hf"],
        [
            "train",
            "--out",
            str(tmp_path / "new"),
            *TINY,
            "model.dim=32",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.n_layers=2",
            "model.ffn_hidden=64",
            "--init-from",
            str(checkpoint),
        ],
    ]
    for command in commands:
        assert main(command) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == len(commands)
    assert all("is damaged: model.safetensors does not match its SHA-256" in line for line in errors)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "new").exists()


def test_one_writer_per_run_directory(tmp_path, capsys):
    """A second `train` on a live run's --out, fresh or --resume, exits 2 at once naming the holder; the
    first run's files are its own; after the holder is SIGKILLed the run resumes (no stale lock)."""
    run = tmp_path / "run"
    first = _cli(run, *TINY, "steps=100000", "checkpoint_every=5")
    try:
        _wait_for_step(run, 3, first)
        began = time.monotonic()
        assert main(["train", "--out", str(run), *TINY, "steps=200", "seed=1", "kappa_bits=2"]) == 2
        assert main(["train", "--out", str(run), "--resume", "steps=200"]) == 2
        assert time.monotonic() - began < 5
        errors = capsys.readouterr().err.strip().splitlines()
        assert len(errors) == 2
        assert all(f"is in use by another process (PID {first.pid}, free-transformer train)" in e for e in errors)
        assert load_train_config(run / "config.yaml").kappa_bits == 0.25
        _wait_for_step(run, 6, first)
    finally:
        first.kill()
        first.wait()
    assert main(["train", "--out", str(run), "--resume", "steps=8"]) == 0
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 8


def test_values_that_would_train_or_sample_wrongly_are_refused(tmp_path, capsys):
    """Each used to run with exit 0: kappa inf (non-standard Infinity in metrics.jsonl), kappa nan,
    negative threads or table scale, a NaN temperature (garbage samples)."""
    from conftest import tiny_checkpoint

    for override in (
        "kappa_bits=inf",
        "kappa_bits=nan",
        "kappa_start_bits=nan",
        "threads=-1",
        "post_sampler_init_std=-1",
    ):
        assert main(["train", "--out", str(tmp_path / "run"), *TINY, override]) == 2
    checkpoint = tiny_checkpoint(tmp_path, "ckpt", 4)
    assert main(["generate", str(checkpoint), "--prompt", "K>", "--temperature", "nan"]) == 2
    assert main(["generate", str(checkpoint), "--prompt", "K>", "--batch-size", "0"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 7 and all(line.startswith("error: ") for line in errors)
    assert "kappa_bits must be a finite number >= 0, got inf" in errors[0] and "threads" in errors[3]
    assert "temperature must be a finite number >= 0, got nan" in errors[5]
    assert not (tmp_path / "run").exists()


def test_generate_decodes_many_samples_in_batches_with_the_same_samples(tmp_path, capsys):
    """-n N is decoded --batch-size samples at a time (N = 10^8 used to go into one batch and be killed
    for its memory); each sample depends on its seed only, so the lines are those of one batch."""
    from conftest import tiny_checkpoint

    checkpoint = str(tiny_checkpoint(tmp_path, "ckpt", 4))
    assert main(["generate", checkpoint, "--prompt", "K>", "-n", "5", "--max-new-tokens", "6"]) == 0
    one_batch = capsys.readouterr().out
    assert (
        main(["generate", checkpoint, "--prompt", "K>", "-n", "5", "--max-new-tokens", "6", "--batch-size", "2"]) == 0
    )
    assert capsys.readouterr().out == one_batch and len(one_batch.splitlines()) == 5


def test_help_gives_each_default_once():
    from free_transformer.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, command in commands.items():
        text = command.format_help().replace(command.epilog or "", "")  # the epilog lists config settings
        assert "(default: None)" not in text and "(default: )" not in text, name
        for line in text.split("\n  -"):
            assert line.count("default") <= 1 or "(default:" not in line, (name, line)


def test_a_resume_that_changes_settings_records_them(tmp_path, capsys):
    """Settings changed by a resume become the run's record (config.yaml, and config-changes.jsonl with the
    step they apply from), so a plain --resume after a stop goes on with them instead of reverting (or of
    answering "nothing to train" to a scheduler's requeue). The data and the model are fixed for a run."""
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY, "steps=2"]) == 0
    assert main(["train", "--out", str(run), "--resume", "steps=3", "kappa_bits=1"]) == 0
    saved = load_train_config(run / "config.yaml")
    assert saved.steps == 3 and saved.kappa_bits == 1
    changes = [json.loads(line) for line in (run / "config-changes.jsonl").read_text().splitlines()]
    assert changes == [{"step": 2, "changes": {"kappa_bits": [0.25, 1.0], "steps": [2, 3]}}]
    assert "resuming at step 2 with changed settings: kappa_bits 0.25 -> 1.0, steps 2 -> 3" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "steps=4"]) == 0  # kappa 1 is kept
    capsys.readouterr()
    assert [m["kappa_bits"] for m in read_metrics(run / "metrics.jsonl")] == [0.25, 0.25, 1.0, 1.0]
    before = (run / "config.yaml").read_text()
    assert main(["train", "--out", str(run), "--resume", "steps=5", "data.kind=coinflip"]) == 2
    assert main(["train", "--out", str(run), "--resume", "steps=5", "model.size=cpu-small"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert "on other data (data.kind letters -> coinflip)" in errors[0] and "model.size=cpu-small" in errors[1]
    assert (run / "config.yaml").read_text() == before and len(checkpoint_dirs(run)) == 3


def test_convert_never_writes_into_an_existing_run(tmp_path, capsys):
    """`convert --to checkpoint` into a training run used to add a step without state.pt, which then
    stopped the run's --resume."""
    pytest.importorskip("transformers")
    from conftest import tiny_checkpoint

    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *TINY, "steps=2"]) == 0
    source = tiny_checkpoint(tmp_path, "source", 4, max_seq_len=72)
    assert main(["convert", str(source), str(run), "--to", "checkpoint", "--step", "5"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert [p.name for p in checkpoint_dirs(run)] == ["step_00000002"]
    assert main(["train", "--out", str(run), "--resume", "steps=3"]) == 0


def test_tokenizing_clears_what_a_killed_tokenizer_left(tmp_path):
    """A SIGKILLed tokenize leaves NAME.partialPID files: the next run removes those of dead processes
    (never a live process's)."""
    from free_transformer.data.shards import ShardWriter
    from free_transformer.data.tokenizer import get_tokenizer
    from free_transformer.data.tokenizing import tokenize_files

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    corpus = tmp_path / "a.txt"
    corpus.write_text("some text to tokenize")
    cache = tmp_path / "cache"
    tokenize_files([corpus], get_tokenizer("byte"), cache)
    target = next(cache.glob("*.bin"))
    target.unlink()
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # another live tokenizer
    try:
        stale, live = target.with_suffix(f".partial{dead_pid}"), target.with_suffix(f".partial{writer.pid}")
        stale.write_bytes(b"half")
        live.write_bytes(b"being written")
        assert len(tokenize_files([corpus], get_tokenizer("byte"), cache)) == len("some text to tokenize") + 1  # + end
        assert not stale.exists() and live.exists()
    finally:
        writer.kill()
        writer.wait()
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / f"tok_train_000000.partial{dead_pid}").write_bytes(b"half")
    ShardWriter(shards, "tok", "train", 256, 1000).close()
    assert not list(shards.glob("*.partial*"))


def test_inspect_of_a_malformed_config_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {dim: [\n")
    assert main(["inspect", str(run)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith(f"error: cannot read config {run / 'config.yaml'}: ")


def test_eval_refuses_sandbox_limits_that_fail_every_program(tmp_path, capsys):
    """--code-timeout -1 or --code-memory-mb 0 used to score pass@1 = 0 with exit 0."""
    from conftest import tiny_checkpoint

    checkpoint = str(tiny_checkpoint(tmp_path, "ckpt", 4))
    for option in (["--code-timeout", "-1"], ["--code-memory-mb", "0"]):
        assert main(["eval", checkpoint, "--tasks", "none", "--no-progress", *option]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        "error: --code-timeout must be > 0 seconds, got -1.0",
        "error: --code-memory-mb must be >= 1, got 0",
    ]


# -- evaluation: nothing finished is lost, one writer of a record ----------------------------------------


def _eval_run(tmp_path):
    from conftest import tiny_checkpoint

    from free_transformer.runs.checkpoint import save_checkpoint

    run = tiny_checkpoint(tmp_path, "run", 4)
    model, metadata = load_model(run)
    save_checkpoint(run, 2, model, {"tokenizer": metadata["tokenizer"]})  # a second step
    return run


def test_an_interrupted_evaluation_keeps_the_tasks_it_finished(tmp_path, capsys, monkeypatch):
    from free_transformer.eval import runner

    checkpoint = _eval_run(tmp_path)
    output = tmp_path / "results.json"
    real, calls = runner._multiple_choice, []

    def interrupted_in_the_second_task(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(runner, "_multiple_choice", interrupted_in_the_second_task)
    assert (
        main(
            [
                "eval",
                str(checkpoint),
                "--tasks",
                "arc_easy,boolq",
                "--limit",
                "2",
                "--no-progress",
                "--output",
                str(output),
            ]
        )
        == 130
    )
    kept = json.loads(output.with_name("results.json.partial").read_text())
    assert list(kept["tasks"]) == ["arc_easy"] and not output.exists()
    assert "the 1 task(s) finished before are in" in capsys.readouterr().err
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main(["eval", str(checkpoint), "--tasks", "arc_easy", "--output", str(blocked / "out.json")]) == 2
    assert "cannot write the results in" in capsys.readouterr().err and calls == [1, 1]  # before any scoring


def test_one_writer_of_an_evaluation_record_and_no_step_recorded_twice(tmp_path, capsys, monkeypatch):
    """A second `eval --checkpoints` of a run exits 2 at once; two writers that both scored a step append
    it once; a checkpoint that training rotated away meanwhile is skipped, not an error."""
    from free_transformer.eval.record import CurveRecord, read_record
    from free_transformer.runs import checkpoint as checkpoints  # eval imports it when it runs
    from free_transformer.runs.runlock import RunLock

    run = _eval_run(tmp_path)
    args = ["eval", str(run), "--checkpoints", "all", "--tasks", "arc_easy", "--limit", "2", "--no-progress"]
    with RunLock(run / "eval", "another eval"):
        assert main(args) == 2
    assert "is in use by another process (PID" in capsys.readouterr().err
    listed = checkpoints.chosen_checkpoints
    monkeypatch.setattr(
        checkpoints,
        "chosen_checkpoints",
        lambda run_dir, spec: listed(run_dir, spec) + [(3, run / "checkpoints" / "step_00000003")],
    )  # listed, then removed by a live run's training
    assert main(args) == 0
    assert "step 3: step_00000003 was removed since it was listed" in capsys.readouterr().out
    entries = read_record(run / "eval" / "curve.jsonl")
    assert [e["step"] for e in entries] == [1, 2]
    first, second = CurveRecord(run), CurveRecord(run)  # both read the record before either appends
    entry = {**entries[0], "step": 7}
    first.append(entry)
    second.append(entry)
    assert [e["step"] for e in read_record(run / "eval" / "curve.jsonl")] == [1, 2, 7]
    shutil.rmtree(run / "eval")
    (run / "eval").write_text("not a folder")
    assert main(args) == 2
    assert "cannot write to" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["race_high", "humaneval_plus"])
def test_a_data_file_without_the_tasks_fields_is_one_line(task, tmp_path, capsys):
    from conftest import tiny_checkpoint

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"unrelated": 1}\n{"unrelated": 2}\n')
    checkpoint = str(tiny_checkpoint(tmp_path, "ckpt", 4))
    assert (
        main(
            [
                "eval",
                checkpoint,
                "--tasks",
                task,
                "--data",
                f"{task}={rows}",
                "--no-progress",
                "--output",
                str(tmp_path / "out.json"),
            ]
        )
        == 2
    )
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"{task}: the rows of user file {rows} lack the fields" in error
    assert not list(tmp_path.glob("out.json*"))  # nothing finished: nothing left behind


def test_a_full_disk_while_logging_is_one_line_that_says_how_to_go_on(tmp_path):
    from free_transformer.base.errors import UserError
    from free_transformer.train.metrics import MetricsLog

    log = MetricsLog(tmp_path)
    log.handle.close()
    log.handle = open("/dev/full", "a")  # noqa: SIM115 (the log owns and closes it); every write: ENOSPC
    with pytest.raises(UserError) as error:
        log.write({"step": 1, "loss": 1.0})
    assert str(error.value) == (
        f"cannot write {tmp_path / 'metrics.jsonl'} (No space left on device): make room, then continue with --resume"
    )


def test_failed_starts_of_the_demo_and_the_study_leave_no_directory(tmp_path, capsys):
    assert main(["demo", "--preset", "smoke", "--out", str(tmp_path / "demo"), "optim.lr=abc"]) == 2
    assert (
        main(["study", "--preset", "smoke", "--out", str(tmp_path / "study"), "data.text.path=/nonexistent.txt"]) == 2
    )
    errors = capsys.readouterr().err.strip().splitlines()
    assert "optim.lr: expected float" in errors[0] and "the study's corpus /nonexistent.txt does not exist" in errors[1]
    assert not (tmp_path / "demo").exists() and not (tmp_path / "study").exists()


def test_a_corpus_that_is_not_utf8_is_said_once(tmp_path, capsys):
    from free_transformer.data.readers import read_jsonl, read_text

    binary = tmp_path / "model.bin.txt"
    binary.write_bytes(b"some text\n\xff\xfe\x00\x80 binary\n")
    clean = tmp_path / "clean.txt"
    clean.write_text("caf\u00e9 \ufffd as written\n")  # a real U+FFFD in valid UTF-8 is not a warning
    assert "".join(piece for piece, _, _ in read_text(binary, "text")).startswith("some text\n\ufffd\ufffd")
    list(read_text(clean, "text"))
    lines = tmp_path / "rows.jsonl"
    lines.write_bytes(b'{"text": "ok \xc3\x28"}\n')
    list(read_jsonl(lines, "text"))
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        f"warning: {binary} is not valid UTF-8: 3 bytes were read as U+FFFD (a binary file, or another encoding?)",
        f"warning: {lines} is not valid UTF-8: 1 bytes were read as U+FFFD (a binary file, or another encoding?)",
    ]


def _sweep_cli(out, *args):
    """A real `free-transformer study --preset smoke` process: 3 runs, 2 worker processes."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "free_transformer.cli",
            "study",
            "--preset",
            "smoke",
            "--seeds",
            "1",
            "--kappas",
            "4",
            "--workers",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
            *args,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # its own process group, which _answer can kill


def _answer(process, timeout=60) -> str:
    """The process's stderr once it has exited; killed (its group: the workers too) if it takes longer."""
    try:
        return process.communicate(timeout=timeout)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _first_logged_run(out, process) -> Path:
    """Wait until a run of the sweep writing to `out` has logged a step; that run's directory."""
    deadline = time.monotonic() + 120
    while not (logged := [path.parent for path in out.glob("seed-0/*/metrics.jsonl") if read_metrics(path)]):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    return logged[0]


def _lock_pid(run) -> int:
    """The PID of the process that last held RUN/.lock ("PID N, command")."""
    return int((run / ".lock").read_text().split()[1].rstrip(","))


@pytest.mark.slow  # a sweep's spawned workers, each importing torch; its runs trained twice
def test_sigterm_to_a_sweep_stops_its_workers_with_their_checkpoints(tmp_path):
    """SIGTERM to `study` (or `demo`): no run starts after it, the running workers save a checkpoint and stop,
    and the parent exits 143 with one line saying how to continue; nothing keeps writing to a run, and the
    same command run again finishes the sweep."""
    out = tmp_path / "study"
    # 600 steps: a run must still be training when the signal comes, on a fast quiet CPU too (at 60 steps both
    # workers could end their runs between the first logged step and the signal)
    process = _sweep_cli(out, "steps=600", "log_every=1")
    _first_logged_run(out, process)
    process.send_signal(signal.SIGTERM)
    stderr = _answer(process)
    assert process.returncode == 143, stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("sweep stopped")]  # one line, after the bar
    assert line.startswith("sweep stopped by SIGTERM: ") and "run the same command again" in line, stderr
    assert "at step" in line, line  # the runs that were training say where they stopped
    runs = [run for run in (out / "seed-0").iterdir() if (run / ".lock").exists()]
    assert runs
    for run in runs:  # every worker is gone: none keeps writing to its run
        with pytest.raises(ProcessLookupError):
            os.kill(_lock_pid(run), 0)
        for checkpoint in checkpoint_dirs(run):
            load_model(checkpoint)
    again = _sweep_cli(out, "steps=600", "log_every=1")
    stderr = _answer(again, timeout=600)
    assert again.returncode == 0, stderr
    assert len(json.loads((out / "results.json").read_text())["runs"]) == 3


@pytest.mark.slow  # a sweep's spawned workers, each importing torch; its runs trained twice
def test_a_sweep_worker_killed_is_one_line_and_stops_the_others(tmp_path):
    """A worker SIGKILLed (by the out-of-memory killer, say) ends the sweep with one line, exit 2, and the
    other workers save a checkpoint and stop (a multiprocessing Pool waited for the dead one forever)."""
    out = tmp_path / "study"
    process = _sweep_cli(out, "steps=600", "log_every=1")  # still training when killed, on a fast CPU too
    killed = _first_logged_run(out, process)
    os.kill(_lock_pid(killed), signal.SIGKILL)
    stderr = _answer(process)
    assert process.returncode == 2, stderr
    [error] = [line for line in stderr.splitlines() if line.startswith("error:")]  # (the resource tracker then
    assert error.startswith(f"error: the process training {killed} died (exit code -9)")  # warns of a semaphore)
    for run in (out / "seed-0").iterdir():
        if (run / ".lock").exists():
            with pytest.raises(ProcessLookupError):
                os.kill(_lock_pid(run), 0)
