import copy
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, legacy_run_in_todays_names, tiny_model
from conftest import run_losses as _losses
from conftest import tiny_run_config as _config
from conftest import wait_for_step as _wait_for_step

from free_transformer.base.checks import ConfigError
from free_transformer.cli import main
from free_transformer.distributed.parallelize import clip_grad_norm
from free_transformer.runs.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    load_model,
    load_training_state,
    save_checkpoint,
)
from free_transformer.train.config import load_train_config
from free_transformer.train.metrics import read_metrics, tokens_per_step
from free_transformer.train.optim import build_optimizer, clip_gradients, lr_factor, parameter_groups
from free_transformer.train.trainer import StopSignals, TrainingError, _rng_state, train


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    config = _config("steps=8", "checkpoint_every=4", "grad_accum=2")
    train(config, tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_00000008")
    train(config, tmp_path / "resumed", resume=True)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "full")  # bit-identical on CPU
    a, _ = load_model(tmp_path / "full")
    b, _ = load_model(tmp_path / "resumed")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_run_dir_is_never_overwritten(tmp_path):
    train(_config("steps=2"), tmp_path)
    before = (tmp_path / "checkpoints" / "step_00000002" / "model.safetensors").read_bytes()
    with pytest.raises(TrainingError, match="already holds a run"):
        train(_config("steps=2"), tmp_path)
    assert (tmp_path / "checkpoints" / "step_00000002" / "model.safetensors").read_bytes() == before
    with pytest.raises(TrainingError, match="nothing to resume"):
        train(_config("steps=2"), tmp_path / "other", resume=True)


def test_outputs_of_a_run(tmp_path):
    train(_config("steps=3", "keep_checkpoints=2", "checkpoint_every=1", "validate_every=3"), tmp_path)
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step_00000002", "step_00000003"]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and "val_cross_entropy_bits" in metrics[-1]
    assert {"cross_entropy_bits", "kl_bits", "lr", "tokens_per_s"} <= set(metrics[0])
    assert (tmp_path / "training_curves.png").stat().st_size > 0
    assert load_train_config(tmp_path / "config.yaml") == _config(
        "steps=3", "keep_checkpoints=2", "checkpoint_every=1", "validate_every=3"
    )
    state = load_training_state(tmp_path)
    assert state["step"] == 3 and "optimizer" in state and "rng" in state


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    rc = main(
        [
            "train",
            "--out",
            str(tmp_path),
            *TINY,
            "steps=20",
            "checkpoint_every=1",
            "optim.lr=1e12",
            "optim.grad_clip=0",
            "optim.warmup_steps=1",
        ]
    )
    assert rc == 2
    assert "non-finite loss" in capsys.readouterr().err
    kept = checkpoint_dirs(tmp_path)
    assert kept
    model, _ = load_model(kept[-1])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_finite_loss_with_non_finite_gradients_is_never_applied(tmp_path, capsys, monkeypatch):
    """A bf16 overflow can leave the loss finite and a gradient infinite: the gradient norm is checked with
    the loss, so the optimizer skips that step, training stops naming it, and no checkpoint holds it."""
    from free_transformer.train import trainer

    build, backwards = trainer.build, []

    def build_with_an_overflow_at_step_3(*args, **kwargs):
        run = build(*args, **kwargs)
        run.model.norm.weight.register_hook(
            lambda grad: backwards.append(1) or (grad * float("inf") if len(backwards) == 3 else grad)
        )
        return run

    monkeypatch.setattr(trainer, "build", build_with_an_overflow_at_step_3)
    assert main(["train", "--out", str(tmp_path), *TINY, "steps=6", "checkpoint_every=1"]) == 2
    assert "non-finite loss or gradient norm at step 3;" in capsys.readouterr().err
    assert [int(kept.name[5:]) for kept in checkpoint_dirs(tmp_path)] == [1, 2]
    for kept in checkpoint_dirs(tmp_path):
        model, _ = load_model(kept)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_tokens_per_step_counts_the_whole_batch_whatever_the_micro_batches():
    """tokens_per_s, an evaluation record's tokens and a sweep's work all read tokens_per_step: batch_size
    sequences of T tokens, which grad_accum splits but does not multiply."""
    whole, split = _config("batch_size=8"), _config("batch_size=8", "grad_accum=4")
    assert tokens_per_step(whole, 64) == tokens_per_step(split, 64) == 8 * 64


def test_lr_schedule_and_parameter_groups():
    config = _config("steps=100", "optim.warmup_steps=10", "optim.min_lr_ratio=0.1", "optim.latent_lr_scale=3")
    factors = [lr_factor(s, 100, config.optim) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=0.01) and all(a >= b for a, b in zip(factors[9:], factors[10:]))
    from free_transformer import FreeTransformer

    model = FreeTransformer(config.model)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in parameter_groups(model, config.optim):
        group_names = [names[id(p)] for p in group["params"]]
        if group["weight_decay"] > 0:
            assert not any("norm" in n or "embed" in n or "mapper" in n or n.endswith("zeta") for n in group_names)
        assert (group["lr_scale"] == 3) == group_names[0].startswith("latent.")


@pytest.mark.parametrize("max_norm", [0.05, 1e6, math.inf])  # clips; clips nothing; grad_clip=0
def test_the_fused_adamw_clips_in_its_step_as_clipping_then_stepping(max_norm):
    """clip_gradients hands the clipping scale to the fused AdamW (grad_scale) instead of scaling every
    gradient first: one step leaves the parameters and both moments of clip_grad_norm_ then the step, to
    float32 rounding (the scale divides there and multiplies here), and returns the same norm."""
    model = tiny_model(dtype=torch.float32, latent_bits=4).train()
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (3, 14), generator=torch.Generator().manual_seed(4))
    optimizers = []
    for m in (model, reference):
        m(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.05, generator=torch.Generator().manual_seed(0)).loss.backward()
        optimizers.append(build_optimizer(m, _config().optim))
    assert optimizers[0].defaults["fused"]
    norm = clip_gradients(optimizers[0], model.parameters(), max_norm)
    expected_norm = clip_grad_norm(reference.parameters(), max_norm)
    assert norm > 0.05 * 2  # so that 0.05 clips
    assert (optimizers[0].grad_scale is None) == (max_norm == math.inf)
    for optimizer in optimizers:
        optimizer.step()
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = optimizers[0].state[p][key], optimizers[1].state[q][key]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-12, msg=f"{name} {key}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lr=fast"], "optim.lr: expected float"),
        (["optim.nope=1"], "unknown setting optim.nope: optim has lr, latent_lr_scale"),
        (["batch_size=6", "grad_accum=4"], "must divide batch_size"),
        (["precision=fp8"], "precision"),
        (["model.size=huge"], "unknown model size"),
        (["data.kind=images"], "data.kind"),
        (["model.dim=30"], "must divide dim"),
        (["kappa_bits"], "section.field=value"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(*overrides)


def test_cli_reports_bad_inputs_in_one_line(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("optim: [1, 2\n")
    assert main(["train", "--out", str(tmp_path / "r"), "--config", str(tmp_path / "bad.yaml")]) == 2
    assert main(["train", "--out", str(tmp_path / "r"), *TINY, "model.vocab_size=64"]) == 2
    assert main(["train", "--out", str(tmp_path / "r"), *TINY, "model.max_seq_len=32"]) == 2
    assert main(["generate", str(tmp_path / "nothing"), "--prompt", "K>"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 4 and all(line.startswith("error: ") for line in errors)
    assert "vocab_size" in errors[1] and "max_seq_len" in errors[2]


def test_corrupt_checkpoint_is_reported(tmp_path):
    train(_config("steps=1"), tmp_path)
    weights = checkpoint_dirs(tmp_path)[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="is damaged: model.safetensors does not match its SHA-256"):
        load_model(tmp_path)
    (weights.parent / "SHA256SUMS").unlink()  # a checkpoint without digests: its files are still read whole
    with pytest.raises(CheckpointError, match="corrupt checkpoint weights"):
        load_model(tmp_path)
    (weights.parent / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt checkpoint config"):
        load_model(tmp_path)


def test_init_from_keeps_decoder_and_freshens_latent_path(tmp_path):
    train(_config("steps=1", "model.latent_units=0"), tmp_path / "base")
    result = train(_config("steps=1"), tmp_path / "free", init_from=tmp_path / "base")
    assert result.step == 1
    with pytest.raises(CheckpointError, match="cannot initialise"):
        train(_config("steps=1", "model.dim=64"), tmp_path / "wrong", init_from=tmp_path / "base")


def _run_cli(out, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "free_transformer.cli", "train", "--out", str(out), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow  # 6 processes importing torch; fast case: test_kill_while_pruning_never_leaves_a_partial_checkpoint
def test_sigkill_at_random_moments_never_corrupts_and_resume_continues(tmp_path):
    args = [*TINY, "steps=30", "checkpoint_every=1", "keep_checkpoints=2", "model.latent_units=12"]
    reference = tmp_path / "reference"
    assert (
        subprocess.run(
            [sys.executable, "-m", "free_transformer.cli", "train", "--out", str(reference), *args], capture_output=True
        ).returncode
        == 0
    )
    out = tmp_path / "killed"
    rng = random.Random(0)
    kill_steps = sorted(rng.sample(range(2, 28), 4))
    for index, kill_step in enumerate(kill_steps):
        process = _run_cli(out, *args, *(["--resume"] if index else []))
        _wait_for_step(out, kill_step, process)
        time.sleep(rng.uniform(0, 0.05))  # anywhere in the step: forward, backward, or a checkpoint write
        process.send_signal(signal.SIGKILL)
        process.wait()
        for checkpoint in checkpoint_dirs(out):  # every checkpoint on disk loads
            load_model(checkpoint)
            load_training_state(checkpoint)
    final = _run_cli(out, *args, "--resume")
    assert final.wait(timeout=300) == 0, final.stderr.read().decode()
    assert _losses(out) == _losses(reference)


@pytest.mark.parametrize("path", sorted(Path(__file__).parent.parent.glob("configs/*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    config = load_train_config(path, ["data.text.path=/corpus"])
    assert config.steps >= 1


def test_kappa_annealing_and_units():
    fixed = _config("kappa_bits=0.125")
    assert fixed.kappa_nats(0) == pytest.approx(0.125 * 0.6931471805599453)
    annealed = _config("kappa_bits=0.125", "kappa_start_bits=1", "kappa_anneal_steps=100")
    assert annealed.kappa_nats(0) == pytest.approx(0.6931471805599453)
    assert annealed.kappa_nats(50) == pytest.approx(0.5625 * 0.6931471805599453)
    assert annealed.kappa_nats(100) == annealed.kappa_nats(10_000) == fixed.kappa_nats(0)
    with pytest.raises(ConfigError, match="kappa_anneal_steps"):
        _config("kappa_start_bits=1")


def test_post_sampler_init_scale(tmp_path):
    train(_config("steps=1", "post_sampler_init_std=0.5", "optim.lr=1e-9"), tmp_path)
    model, _ = load_model(tmp_path)
    with torch.no_grad():
        assert 0.4 < float(model.latent.mapper.weight.std()) < 0.6
        assert float(model.layers[0].mlp.gate_up_proj.weight.std()) < 0.05


def test_kill_while_pruning_never_leaves_a_partial_checkpoint(tmp_path, monkeypatch):
    """Pruning an old checkpoint deletes file by file; a process killed half-way must not leave a step_*
    directory that lacks some of its files (it used to: test_sigkill found one)."""
    from free_transformer import FreeTransformer
    from free_transformer.runs import checkpoint as checkpoint_module

    model = FreeTransformer(_config().model)
    state = {"optimizer": torch.optim.AdamW(model.parameters()).state_dict(), "rng": _rng_state(torch.device("cpu"))}
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, {"tokenizer": "byte"}, {**state, "step": step}, keep=2)

    def killed_half_way(path, ignore_errors=False):
        if not Path(path).exists():
            return
        next(Path(path).iterdir()).unlink()
        raise KeyboardInterrupt  # stands for SIGKILL: nothing after this line runs

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, model, {"tokenizer": "byte"}, {**state, "step": 3}, keep=2)
    monkeypatch.undo()
    assert [d.name for d in checkpoint_dirs(tmp_path)] == ["step_00000002", "step_00000003"]
    for checkpoint in checkpoint_dirs(tmp_path):
        load_model(checkpoint)


LEGACY_RUN = Path(__file__).parent / "data" / "legacy-run"  # written by 0.1: the latent path as loose attributes


def test_a_run_written_before_the_latent_path_module_loads_and_resumes_to_the_same_losses(tmp_path):
    """Its checkpoints as 0.1 wrote them (tensor names, separate projections, optimizer state, numpy RNG
    state); its config.yaml renamed as 0.3.0 asks of a user (settings are read in today's names only)."""
    model, _ = load_model(LEGACY_RUN)
    assert model.latent.mapper.weight.shape == (8, 16) and model.latent.zeta.abs().sum() > 0
    run = legacy_run_in_todays_names(tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    train(load_train_config(run / "config.yaml", ["progress=false"]), run, resume=True)
    # Steps 3 and 4 as 0.1 computed them. 0.1 ran on another CPU, so equal up to float32 summation order
    # (~1e-6 at a loss of ~5, the tolerance of the golden losses); one tensor loaded wrong moves them by far more.
    resumed, recorded = _losses(run), _losses(LEGACY_RUN)
    assert [step for step, _ in resumed] == [step for step, _ in recorded] == [1, 2, 3, 4]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in recorded], rel=0, abs=1e-5)


def test_latent_kind_and_encoder_depth_from_the_command_line(tmp_path):
    from free_transformer.model.config import LatentConfig

    assert (
        main(
            [
                "train",
                "--out",
                str(tmp_path),
                *TINY,
                "steps=2",
                "model.latent.kind=bit_linear",
                "model.latent.encoder_layers=2",
            ]
        )
        == 0
    )
    model, config = load_model(tmp_path)
    assert model.config.latent == LatentConfig("bit_linear", encoder_layers=2)
    assert len(model.latent.encoder) == 2 and model.latent.mapper.weight.shape == (32, 4)
    assert load_train_config(tmp_path / "config.yaml").model.latent == LatentConfig("bit_linear", 2)
    with pytest.raises(ConfigError, match="unknown latent kind 'vq'"):
        _config("model.latent.kind=vq")


def test_a_non_finite_step_found_later_is_named_and_never_checkpointed(tmp_path, capsys):
    """The step reads nothing back from the device: a non-finite loss is seen at the next log or
    checkpoint, named by its own step; the fused optimizer skipped it, and no checkpoint holds it."""
    diverging = [*TINY, "steps=20", "optim.lr=1e12", "optim.grad_clip=0", "optim.warmup_steps=1"]
    assert main(["train", "--out", str(tmp_path / "every"), *diverging, "checkpoint_every=1"]) == 2
    first_bad = capsys.readouterr().err.split("non-finite loss or gradient norm at step ")[1].split(";")[0]
    assert main(["train", "--out", str(tmp_path / "later"), *diverging, "checkpoint_every=8", "log_every=8"]) == 2
    assert f"non-finite loss or gradient norm at step {first_bad};" in capsys.readouterr().err
    for kept in checkpoint_dirs(tmp_path / "later"):
        assert int(kept.name[5:]) < int(first_bad)
        model, _ = load_model(kept)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_sigterm_arriving_twice_at_once_is_one_request(monkeypatch):
    """A scheduler signals every process of a job and a sweep's parent passes its SIGTERM on: a worker gets two
    SIGTERMs at once, which must still let it save its checkpoint; a later second signal stops at once."""
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # within DUPLICATE_S: ignored
        assert signals.received == signal.SIGTERM
        monkeypatch.setattr(StopSignals, "DUPLICATE_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    with StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: at once
            os.kill(os.getpid(), signal.SIGINT)
