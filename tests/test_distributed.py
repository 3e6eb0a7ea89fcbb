"""Distributed training on CPU with gloo (docs/distributed.md), against golden loss files.

The golden files hold the losses of one-process runs (strategy none) of a debug-size model, with
latent_noise=row so that Z is the same whatever the number of processes. Claims checked:
  * 2 processes (fsdp, and ddp) give the one-process losses within ATOL;
  * a 2-process run resumed from its sharded checkpoint continues with exactly the losses (atol 0) of
    the uninterrupted run;
  * a sharded checkpoint of 2 processes resumes on 1 (resharding), and a one-process checkpoint on 2,
    each continuing with the golden losses within ATOL;
  * the sharded checkpoint consolidates into the ordinary model.safetensors checkpoint.
Three torchrun launches (about 10 s each here), everything else in this process.
"""

import copy
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

import free_transformer
from free_transformer.base.checks import ConfigError
from free_transformer.cli import main
from free_transformer.distributed import ParallelEnv
from free_transformer.distributed.parallelize import apply_compile
from free_transformer.distributed.sharded_checkpoint import is_sharded
from free_transformer.model import loss, transformer
from free_transformer.model.config import LatentConfig
from free_transformer.model.latent import BinaryMapper
from free_transformer.model.transformer import FreeTransformer
from free_transformer.runs.checkpoint import CheckpointError, checkpoint_dirs, load_model
from free_transformer.train.config import load_train_config
from free_transformer.train.noise import latent_row_generators
from free_transformer.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
COMPARE = ROOT / "scripts" / "compare_losses.py"
# Observed: at most 9.5e-7 (2 float32 ulps at loss ~5) between 1 and 2 processes over 30 steps, fsdp or
# ddp; the difference is only the order of floating-point sums (batch halves, reduce-scatter, sharded
# clipping norm). 1e-5 leaves a 10x margin. With latent_noise=global instead, 1 and 2 processes draw
# different Z and differ by ~4e-3 after 30 steps: a tolerance that cannot tell a bug from noise.
ATOL = 1e-5
ARGS = [
    "model.size=debug",
    "model.vocab_size=256",
    "model.max_seq_len=72",
    "batch_size=8",
    "log_every=1",
    "optim.warmup_steps=2",
    "progress=false",
    "kappa_bits=0.25",
    "steps=6",
    "checkpoint_every=3",
    "latent_noise=row",
]
BASELINE = ["model.latent_units=0"]


def _golden_args(name):
    """The overrides recorded in a golden file's command (what produced it)."""
    command = json.loads((GOLDEN / name).read_text())["command"].split()
    return command[command.index("RUN") + 1 :]


def _compare(a, b, atol):
    result = subprocess.run(
        [sys.executable, str(COMPARE), str(a), str(b), f"--atol={atol}", "-q", "--keys=loss,kl_bits"],
        capture_output=True,
        text=True,
    )
    print(result.stdout, result.stderr)
    return result.returncode


def _torchrun(nproc, *cli_args):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(free_transformer.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "free_transformer.cli",
        "train",
        *cli_args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _interrupted_copy(run, to, step):
    """`run` as a process killed right after its checkpoint of `step` would have left it."""
    shutil.copytree(run, to)
    for checkpoint in checkpoint_dirs(to):
        if int(checkpoint.name.split("_")[1]) > step:
            shutil.rmtree(checkpoint)
    return to


def test_golden_files_are_current():
    """The goldens' commands still describe the test's runs (regenerate them when these change)."""
    assert _golden_args("debug-free.json") == ARGS
    assert _golden_args("debug-baseline.json") == ARGS + BASELINE


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process runs, trained in this process: the golden losses' (seconds)."""
    root = tmp_path_factory.mktemp("dist")
    train(load_train_config(None, ARGS), root / "one")
    train(load_train_config(None, ARGS + BASELINE), root / "one-baseline")
    return root


@pytest.fixture(scope="module")
def runs(single):
    """The runs the claims compare: the one-process runs, and 2 processes with torchrun (minutes: each torchrun
    starts processes that import torch, so the tests that read these are marked slow)."""
    root = single
    _torchrun(2, "--out", str(root / "fsdp"), *ARGS, "distributed.strategy=fsdp")
    _torchrun(2, "--out", str(_interrupted_copy(root / "fsdp", root / "fsdp-resumed", 3)), "--resume")
    # the baseline's one-process checkpoint of step 3, continued by 2 processes with ddp
    _torchrun(
        2,
        "--out",
        str(_interrupted_copy(root / "one-baseline", root / "ddp-resumed", 3)),
        "--resume",
        "distributed.strategy=ddp",
    )
    return root


def test_one_process_reproduces_the_golden_losses(single):
    assert _compare(single / "one", GOLDEN / "debug-free.json", ATOL) == 0
    assert _compare(single / "one-baseline", GOLDEN / "debug-baseline.json", ATOL) == 0


@pytest.mark.slow  # torchrun: processes that import torch
def test_two_processes_match_one_process(runs):
    assert is_sharded(checkpoint_dirs(runs / "fsdp")[-1])
    assert _compare(runs / "fsdp", GOLDEN / "debug-free.json", ATOL) == 0


@pytest.mark.slow  # torchrun: processes that import torch
def test_resumed_two_process_run_continues_exactly(runs):
    assert _compare(runs / "fsdp-resumed", runs / "fsdp", 0) == 0


@pytest.mark.slow  # torchrun: processes that import torch
def test_one_process_checkpoint_continues_on_two_with_ddp(runs):
    assert not is_sharded(checkpoint_dirs(runs / "one-baseline")[-1])
    assert _compare(runs / "ddp-resumed", GOLDEN / "debug-baseline.json", ATOL) == 0


@pytest.mark.slow  # torchrun: processes that import torch
@pytest.mark.parametrize("strategy", ["fsdp", "none"])
def test_two_process_checkpoint_resumes_on_one(runs, tmp_path, strategy):
    """Resharding: the 2-shard checkpoint of step 3 is read by one process (no torchrun): fsdp in a
    world of one, or no process group at all."""
    run = _interrupted_copy(runs / "fsdp", tmp_path / "fsdp-on-one", 3)
    train(load_train_config(run / "config.yaml", [f"distributed.strategy={strategy}"]), run, resume=True)
    assert is_sharded(checkpoint_dirs(run)[-1]) == (strategy == "fsdp")
    assert _compare(run, GOLDEN / "debug-free.json", ATOL) == 0
    assert _compare(run, runs / "fsdp", ATOL) == 0


@pytest.mark.slow  # torchrun: processes that import torch
def test_consolidate_gives_an_ordinary_checkpoint(runs, tmp_path, capsys):
    run = shutil.copytree(runs / "fsdp", tmp_path / "fsdp")
    with pytest.raises(CheckpointError, match="consolidate"):
        load_model(run)
    assert main(["consolidate", str(run / "checkpoints" / "step_00000003"), "--out", str(tmp_path / "step3")]) == 0
    written = (tmp_path / "step3" / "model.safetensors").read_bytes()
    assert main(["consolidate", str(run / "checkpoints" / "step_00000003"), "--out", str(tmp_path / "step3")]) == 2
    assert (tmp_path / "step3" / "model.safetensors").read_bytes() == written  # never overwritten
    garbled = shutil.copytree(run / "checkpoints" / "step_00000003", tmp_path / "garbled" / "step_00000003")
    (garbled / "dcp" / ".metadata").write_bytes(b"not a pickle")
    assert main(["consolidate", str(garbled)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "already holds a checkpoint" in errors[0]
    assert errors[1].startswith(f"error: corrupt sharded checkpoint metadata {garbled / 'dcp' / '.metadata'}: ")
    assert main(["consolidate", str(run)]) == 0
    assert "consolidated" in capsys.readouterr().out
    sharded, config = load_model(run)  # the newest step directory, now with model.safetensors
    single, _ = load_model(runs / "one")
    assert config["step"] == 6 and config["train"]["distributed"]["strategy"] == "fsdp"
    assert load_model(tmp_path / "step3")[1]["step"] == 3
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        # Adam divides by sqrt(v): weights whose gradient is near zero move by ~lr * (rounding / |g|);
        # lr=1e-3 bounds any weight's change per step, so 6 steps stay far below this.
        assert torch.allclose(a, b, rtol=0, atol=1e-4), name
    tokens, latents = torch.randint(0, 256, (2, 16)), torch.randint(0, 16, (2, 16))
    assert torch.allclose(sharded(tokens, latents=latents).logits, single(tokens, latents=latents).logits, atol=1e-4)


def test_row_noise_does_not_depend_on_how_the_batch_is_split():
    a = latent_row_generators(0, 5, range(8), torch.device("cpu"))
    b = latent_row_generators(0, 5, range(4, 8), torch.device("cpu"))
    assert torch.equal(
        torch.stack([torch.rand(3, generator=g) for g in a[4:]]), torch.stack([torch.rand(3, generator=g) for g in b])
    )
    c = latent_row_generators(0, 6, range(4, 8), torch.device("cpu"))
    assert not torch.equal(torch.rand(3, generator=b[0]), torch.rand(3, generator=c[0]))


def test_compile_asks_the_latent_mapper_to_compile_its_own_backward(monkeypatch):
    """apply_compile leaves to each latent kind what compiling its backward means (`compile_backward`),
    never reading its type or attributes: every kind is asked; the Binary Mapper's answer is to run its
    backward's chunk loop with compiled bodies."""
    from free_transformer.model.latent import LATENT_KINDS

    asked = []
    for kind in sorted(LATENT_KINDS):
        model = FreeTransformer(tiny_config(latent=LatentConfig(kind)))
        monkeypatch.setattr(model.latent.mapper, "compile_backward", lambda kind=kind: asked.append(kind))
        apply_compile(model)
    assert asked == sorted(LATENT_KINDS)
    mapper = BinaryMapper(units=4, dim=8)
    assert not mapper.compiled_backward
    mapper.compile_backward()
    assert mapper.compiled_backward


def test_compile_reaches_the_readout_loss_through_the_model_s_own_hook(monkeypatch):
    """After apply_compile the training loss runs each chunk through the compiled step, asked for by
    `readout_loss.compile()`; the eager model's does not. The step is replaced by a spy (the eager step,
    recorded: compiled numerics are tested in test_loss and test_train_options) and the blocks are left
    uncompiled, so nothing is compiled here. The model's source names no parallelisation layer."""
    calls = []

    def spy():
        return lambda *args: calls.append(args) or loss._nll_and_grad(*args)

    monkeypatch.setattr(loss, "_compiled_nll_and_grad", spy)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *args, **kwargs: None)
    eager = FreeTransformer(tiny_config())
    compiled = apply_compile(copy.deepcopy(eager))
    tokens = torch.randint(0, eager.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    a = eager(tokens[:, :-1], tokens[:, 1:], generator=torch.Generator().manual_seed(1)).loss
    assert not calls
    b = compiled(tokens[:, :-1], tokens[:, 1:], generator=torch.Generator().manual_seed(1)).loss
    assert calls and torch.equal(a, b)
    source = inspect.getsource(transformer)
    assert "compiled_loss" not in source and "parallelize" not in source and "distributed" not in source


def test_ranks_take_contiguous_slices():
    env = [ParallelEnv("fsdp", torch.device("cpu"), rank, 4) for rank in range(4)]
    assert [list(e.rows(8)) for e in env] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="multiple"):
        env[0].rows(6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["distributed.strategy=fsdp2"], "distributed.strategy"),
        (["distributed.backend=mpi"], "distributed.backend"),
        (["distributed.param_dtype=bf16"], "needs strategy fsdp"),
        (["distributed.strategy=fsdp", "distributed.reduce_dtype=fp16"], "reduce_dtype"),
        (["latent_noise=rank"], "latent_noise"),
    ],
)
def test_distributed_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, ARGS + overrides)


def test_compare_script_fails_beyond_tolerance(tmp_path):
    rows = json.loads((GOLDEN / "debug-free.json").read_text())
    rows["steps"][3]["loss"] += 2 * ATOL
    (tmp_path / "perturbed.json").write_text(json.dumps(rows))
    assert _compare(tmp_path / "perturbed.json", GOLDEN / "debug-free.json", ATOL) == 1
    assert _compare(tmp_path / "perturbed.json", GOLDEN / "debug-free.json", 3 * ATOL) == 0
    rows["steps"].pop()
    (tmp_path / "short.json").write_text(json.dumps(rows))
    assert _compare(tmp_path / "short.json", GOLDEN / "debug-free.json", 1.0) == 1


@pytest.mark.slow  # torchrun: processes that import torch
def test_sigterm_to_torchrun_saves_a_sharded_checkpoint_that_resumes(tmp_path):
    """torchrun passes SIGTERM on to its workers: every rank stops after the same step (the signal
    travels in the loss all-reduce), the sharded checkpoint of that step is written, and one process
    continues it with the losses of an uninterrupted one-process run."""
    import signal
    import time

    from free_transformer.train.metrics import read_metrics

    args = [*ARGS, "steps=20", "checkpoint_every=1000", "distributed.strategy=fsdp"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(free_transformer.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    out = tmp_path / "stopped"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "free_transformer.cli",
            "train",
            "--out",
            str(out),
            *args,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(read_metrics(out / "metrics.jsonl")) < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode != 0
    assert stderr.count("stopped by SIGTERM after step") == 1, stderr[-3000:]  # rank 0 says it, once
    [checkpoint] = checkpoint_dirs(out)
    step = int(checkpoint.name.split("_")[1])
    assert 3 <= step < 20 and is_sharded(checkpoint)
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == list(range(1, step + 1))
    train(load_train_config(out / "config.yaml"), out, resume=True)  # one process, fsdp in a world of one
    train(load_train_config(None, args), tmp_path / "one")
    assert _compare(out, tmp_path / "one", ATOL) == 0


@pytest.mark.slow  # torchrun: processes that import torch
def test_a_damaged_sharded_checkpoint_is_found_and_passed_over(runs, tmp_path, capsys):
    """Sharded checkpoints carry SHA256SUMS of config.json and every DCP file, as single-file ones do: a
    damaged shard fails verification, and --resume's search goes on to the previous intact checkpoint."""
    from free_transformer.runs.checkpoint import newest_intact_checkpoint, verify_checkpoint

    run = shutil.copytree(runs / "fsdp", tmp_path / "fsdp")
    newest = checkpoint_dirs(run)[-1]
    listed = [line.split("  ")[1] for line in (newest / "SHA256SUMS").read_text().splitlines()]
    assert "config.json" in listed and "dcp/.metadata" in listed and any(n.endswith(".distcp") for n in listed)
    assert verify_checkpoint(newest) is None
    shard = next((newest / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "does not match its SHA-256" in verify_checkpoint(newest)
    assert newest_intact_checkpoint(run, report=print) == checkpoint_dirs(run)[-1] != newest
    assert "is damaged" in capsys.readouterr().out


@pytest.mark.slow  # torchrun: processes that import torch
def test_a_crafted_sharded_checkpoint_metadata_never_runs(runs, tmp_path, capsys):
    """DCP reads dcp/.metadata with pickle.load: it is unpickled first with DCP's own records allowed only,
    so a payload (with SHA256SUMS rewritten to match) is refused by verification and by consolidate."""
    import pickle

    from conftest import Payload, rewrite_checksums

    from free_transformer.runs.checkpoint import verify_checkpoint

    run, marker = shutil.copytree(runs / "fsdp", tmp_path / "fsdp"), tmp_path / "payload-ran"
    newest = checkpoint_dirs(run)[-1]
    (newest / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_checksums(newest)
    assert "refused, not run" in verify_checkpoint(newest)
    assert main(["consolidate", str(newest)]) == 2
    assert "unsafe sharded checkpoint metadata" in capsys.readouterr().err and "refused, not run" in verify_checkpoint(
        newest
    )
    assert not marker.exists()
