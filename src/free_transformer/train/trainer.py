"""The training loop: seeded, resumable to the bit on CPU, checkpointed atomically, stopped with a clear
message on a non-finite loss or gradient norm (the last good checkpoint is kept).

SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) stops the run at the next step boundary with a
checkpoint of that step (a second signal stops at once); `--resume` continues it. On resume the newest
checkpoint is verified first, and a damaged one is moved aside for the newest intact one.

Under torchrun (distributed.strategy ddp or fsdp) every rank runs this same loop on its own slice of
each global batch; rank 0 alone logs and writes; checkpoints are sharded (DCP). docs/distributed.md."""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..base.checks import ConfigError
from ..base.devices import parse_device
from ..base.errors import Stopped
from ..base.fileio import open_append, refuse_links
from ..base.progress import Bar
from ..base.units import LN2
from ..data import build_dataset
from ..data.datasets import Dataset
from ..data.tokenizer import get_tokenizer
from ..distributed import ParallelEnv, setup
from ..distributed.parallelize import apply_activation_checkpointing, apply_compile, gradient_sync, parallelize
from ..distributed.sharded_checkpoint import is_sharded, load_sharded, load_single_file, save_sharded
from ..model.config import ModelConfig
from ..model.transformer import FreeTransformer
from ..runs.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    load_training_state,
    load_verified_weights,
    load_weights,
    newest_intact_checkpoint,
    optimizer_param_names,
    read_checkpoint_config,
    resolve_checkpoint,
    save_checkpoint,
)
from ..runs.memory import build_model
from ..runs.migrations import upgrade_optimizer_state
from ..runs.runlock import RunLock
from .config import TrainConfig, changed_settings, load_train_config, save_train_config
from .errors import TrainingError
from .metrics import MetricsLog, read_metrics, tokens_per_step
from .noise import latent_generators
from .optim import build_optimizer, clip_gradients, lr_factor, set_lr
from .periodic import periodic_evaluation
from .validation import autocast_context, latent_warning, settled, validate


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    metrics: dict  # the last logged metrics


class StopSignals:
    """Record SIGTERM / SIGINT instead of dying mid-step: the loop checks `received` at each step
    boundary. A second signal raises KeyboardInterrupt at once (checkpoints are atomic: nothing breaks),
    except a SIGTERM within DUPLICATE_S of the first one: that is the same request arriving twice (a
    scheduler signals every process of a job, and a sweep's parent also passes its SIGTERM on to its
    workers). Installed only in the main thread (Python allows no handler elsewhere); the old handlers
    come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    DUPLICATE_S = 1.0

    def __init__(self):
        self.received: int | None = None
        self.received_at = 0.0
        self.previous: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            if signum == self.received == signal.SIGTERM and time.monotonic() - self.received_at < self.DUPLICATE_S:
                return
            raise KeyboardInterrupt
        self.received, self.received_at = signum, time.monotonic()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def init_from_checkpoint(model: FreeTransformer, path: str | Path) -> list[str]:
    """Load decoder weights from another checkpoint; latent-path tensors absent there stay fresh.
    Returns the names left at their initialisation."""
    weights = load_verified_weights(resolve_checkpoint(path))
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # shape mismatch: another architecture
        raise CheckpointError(f"cannot initialise from {path}: {error}") from None
    not_latent = [name for name in missing if not name.startswith("latent.")]
    if unexpected or not_latent:
        raise CheckpointError(
            f"cannot initialise from {path}: unexpected {unexpected[:5]}, missing decoder weights {not_latent[:5]}"
        )
    return missing


def _rng_state(device: torch.device) -> dict:
    """Every RNG stream as tensors and plain Python values (state.pt is read with weights_only=True)."""
    legacy = np.random.get_state()
    assert isinstance(legacy, tuple)  # legacy=True, the default: (name, key, position, has_gauss, cached_gaussian)
    name, key, position, has_gauss, cached_gaussian = legacy
    numpy_state = (name, torch.from_numpy(key.astype(np.int64)), position, has_gauss, cached_gaussian)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, key, position, has_gauss, cached_gaussian = state["numpy"]  # key: a tensor (an ndarray in older checkpoints)
    np.random.set_state((name, np.asarray(key).astype(np.uint32), position, has_gauss, cached_gaussian))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _quiet(message: str) -> None:
    pass


def _check_fresh_run_dir(run_dir: Path) -> None:
    """A run is a checkpoint or a logged step: what a start that failed before either leaves (its config.yaml,
    an empty metrics.jsonl) is replaced by the next start, so the corrected command runs."""
    if checkpoint_dirs(run_dir) or read_metrics(run_dir / "metrics.jsonl"):
        raise TrainingError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --out")


def train(
    config: TrainConfig, run_dir: str | Path, *, resume: bool = False, init_from: str | Path | None = None
) -> TrainResult:
    """Train (or resume) the run in `run_dir` to config.steps optimizer steps."""
    config.validate()
    env = setup(config.distributed.strategy, config.distributed.backend, parse_device(config.device))
    try:  # one writer per run: rank 0 holds the run's lock
        with StopSignals() as signals, RunLock(run_dir, "free-transformer train", enabled=env.is_main) as lock:
            return _train(config, Path(run_dir), env, resume, init_from, signals, lock)
    finally:
        env.close()


def _resume_hint(run_dir: Path, distributed: bool = False) -> str:
    hint = f"free-transformer train --out {run_dir} --resume"
    return hint + " (under torchrun, the same torchrun command)" if distributed else hint


def _check_same_model(config: TrainConfig, checkpoint: Path) -> None:
    """--resume must rebuild the checkpoint's model: name the fields that differ instead of a page of
    size mismatches."""
    saved = ModelConfig.from_dict(read_checkpoint_config(checkpoint)["model"]).to_dict()  # defaults filled in
    ours = config.model.to_dict()
    changed = [
        f"{key} {saved.get(key)} -> {ours.get(key)}"
        for key in sorted(set(saved) | set(ours))
        if saved.get(key) != ours.get(key)
    ]
    if changed:
        raise TrainingError(
            f"cannot resume {checkpoint}: the model differs from the checkpoint's "
            f"({', '.join(changed)}); resume without model overrides or another --config, "
            "or train into another --out (where --init-from reuses its decoder if only the latent "
            "path changed)"
        )


@dataclass
class Run:
    """What one training run holds from build to its last step."""

    config: TrainConfig
    run_dir: Path
    env: ParallelEnv
    dataset: Dataset
    model: FreeTransformer
    runner: torch.nn.Module  # what forward calls: the model, or DDP around it
    optimizer: torch.optim.Optimizer
    metadata: dict  # saved with every checkpoint

    @property
    def device(self) -> torch.device:
        return self.env.device


@dataclass
class StepResult:
    """One optimizer step, still on the device (nothing read back)."""

    means: torch.Tensor  # (4,) loss, cross-entropy, KL (nats), stop flag: the global batch's means
    non_finite: torch.Tensor  # () bool: the loss or the gradient norm was not finite (the step was skipped)
    grad_norm: torch.Tensor  # () before clipping
    lr: float
    kappa_nats: float
    stop: bool  # a signal asked every rank to stop after this step


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    if not resume:
        _check_fresh_run_dir(run_dir)
    elif not checkpoint_dirs(run_dir) and not (run_dir / "config.yaml").is_file():
        raise TrainingError(f"nothing to resume: no run in {run_dir} (no config.yaml, no checkpoint)")
    else:  # a line this package did not write, refused before the resumed run changes anything
        read_metrics(run_dir / "metrics.jsonl")


def check_run(config: TrainConfig, run_dir: str | Path | None = None, *, resume: bool = False) -> str:
    """What `--dry-run` checks, training nothing and writing nothing but a text corpus's token cache: the
    config, the run directory when given (a new run's must hold no run, a resumed one must exist), the data
    (built, so a missing file or a too-short corpus shows) against the model, and the model (built on the
    meta device: no memory). Returns a one-line summary of what would train."""
    config.validate()
    if run_dir is not None:
        _check_run_dir(Path(run_dir), resume)
    dataset = build_dataset(config.data, config.seed)
    _check_data_fits_model(config, dataset, get_tokenizer(dataset.tokenizer_name))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in FreeTransformer(config.model).parameters())
    return (
        f"{parameters:,} parameters; {config.data.kind} data, {dataset.tokenizer_name} tokens, sequences of "
        f"{dataset.sequence_length}; {config.steps} steps of {config.batch_size} sequences"
    )


def build(config: TrainConfig, run_dir: Path, env: ParallelEnv, *, resume: bool, init_from) -> Run:
    """Check the run directory and the config against the data, then build the dataset, the model (seeded,
    optionally initialised from another checkpoint, transformed by the config's options) and the optimizer."""
    _check_run_dir(run_dir, resume)
    if config.batch_size % (env.world_size * config.grad_accum):
        raise ConfigError(
            f"batch_size ({config.batch_size}) must be a multiple of processes ({env.world_size}) "
            f"x grad_accum ({config.grad_accum})"
        )
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    random.seed(config.seed)
    np.random.seed(config.seed)
    with env.main_first():  # rank 0 tokenizes a text corpus into its cache once; the others read the cache
        dataset = build_dataset(config.data, config.seed)
    tokenizer = get_tokenizer(dataset.tokenizer_name)
    _check_data_fits_model(config, dataset, tokenizer)

    # every rank has checked the run directory and the config before rank 0 writes: a failed start leaves no
    # empty run directory behind
    env.barrier()
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in (run_dir / "checkpoints").glob(".tmp_step_*"):  # left by a process killed mid-write
            shutil.rmtree(refuse_links(stale, run_dir), ignore_errors=True)  # a planted link is refused, not followed

    model = build_model(config.model).to(env.device)
    model.init_weights(post_sampler_std=config.post_sampler_init_std)
    if init_from is not None and not resume:
        fresh = init_from_checkpoint(model, init_from)
        if env.is_main:
            print(
                f"initialised from {init_from}; fresh: {', '.join(sorted({n.split('.')[0] for n in fresh})) or 'none'}"
            )
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    if config.compile:
        apply_compile(model)
    runner = parallelize(model, env, config.distributed)
    optimizer = build_optimizer(model, config.optim)
    metadata = {"tokenizer": tokenizer.name, "train": config.to_dict()}
    return Run(config, run_dir, env, dataset, model, runner, optimizer, metadata)


def _check_data_fits_model(config: TrainConfig, dataset: Dataset, tokenizer) -> None:
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({config.model.vocab_size}) is smaller than the {tokenizer.name} tokenizer's "
            f"({tokenizer.vocab_size}): add model.vocab_size={tokenizer.vocab_size}"
        )
    if dataset.sequence_length > config.model.max_seq_len:
        raise ConfigError(
            f"sequences of {dataset.sequence_length} tokens exceed model.max_seq_len ({config.model.max_seq_len}): "
            f"add model.max_seq_len={dataset.sequence_length}"
        )


def restore(run: Run, *, resume: bool) -> int:
    """Load the newest intact checkpoint when resuming (weights, optimizer, RNG streams); save the config of
    a fresh run. Returns the step to start from."""
    env, run_dir, config = run.env, run.run_dir, run.config
    checkpoint = None
    if resume:
        with env.main_first():  # rank 0 verifies and moves damaged checkpoints aside; the others then agree
            checkpoint = newest_intact_checkpoint(run_dir, report=_stderr if env.is_main else _quiet)
        if checkpoint is None and env.is_main:
            print(f"resuming {run_dir} from step 0: it holds no intact checkpoint", file=sys.stderr)
    if checkpoint is None:
        if resume and (run_dir / "config.yaml").is_file():  # resumed from step 0: its settings, as from a checkpoint
            _record_settings(run, 0)
        elif env.is_main:
            save_train_config(config, run_dir / "config.yaml")
        return 0
    _check_same_model(config, checkpoint)
    step = int(read_checkpoint_config(checkpoint)["step"])
    _record_settings(run, step)
    if is_sharded(checkpoint):  # written by ddp / fsdp, on any number of processes
        return load_sharded(checkpoint, run.model, run.optimizer)
    if env.distributed:  # a one-process run continued on several
        return load_single_file(checkpoint, run.model, run.optimizer)
    run.model.load_state_dict(load_weights(checkpoint, str(run.device)))
    state = load_training_state(checkpoint)
    run.optimizer.load_state_dict(
        upgrade_optimizer_state(state["optimizer"], optimizer_param_names(run.model, run.optimizer))
    )
    _set_rng_state(state["rng"], run.device)
    return step


def _record_settings(run: Run, step: int) -> None:
    """The settings a run resumed at `step` (0: it holds no intact checkpoint) goes on with are its record:
    config.yaml is rewritten with them and RUN/config-changes.jsonl gets {"step": N, "changes": {"field":
    [before, after]}}, so that a plain `--resume` (a scheduler's requeue) continues with them. The data is
    fixed for a run."""
    saved_path = run.run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    changes = changed_settings(load_train_config(saved_path), run.config)
    data_changes = [f"{key} {old} -> {new}" for key, (old, new) in changes.items() if key.startswith("data.")]
    if data_changes and step:  # from step 0 nothing trained on the old data is kept
        raise TrainingError(
            f"cannot resume {run.run_dir} on other data ({', '.join(data_changes)}): a run's data is "
            "fixed; train into another --out (--init-from reuses this run's weights)"
        )
    if changes and run.env.is_main:
        with open_append(run.run_dir / "config-changes.jsonl") as record:
            record.write(json.dumps({"step": step, "changes": changes}) + "\n")
        save_train_config(run.config, saved_path)
        print(
            f"resuming at step {step} with changed settings: "
            + ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items()),
            file=sys.stderr,
        )


def train_step(run: Run, step: int, signals: StopSignals) -> StepResult:
    """Forward and backward over this rank's micro-batches of batch `step`, then the optimizer step.

    Nothing here reads a value back from the device or writes a Python value into a device tensor (a
    GPU then runs ahead of Python): losses and the gradient norm stay tensors until they are logged. A
    non-finite loss or gradient norm (a finite bf16 loss can have overflowing gradients) makes the
    fused optimizer skip its step on the device (found_inf); the caller reports it at the next
    read-back. Without a fused AdamW they are checked here, every step. The fused AdamW also applies
    the clipping scale as it reads the gradients (`clip_gradients`)."""
    config, env, device = run.config, run.env, run.device
    rows = env.rows(config.batch_size)  # this rank's slice of every global batch
    micro_batch = len(rows) // config.grad_accum
    lr = set_lr(run.optimizer, config.optim.lr, lr_factor(step, config.steps, config.optim))
    kappa_nats = config.kappa_nats(step)
    batch = run.dataset.batch(step, config.batch_size)[rows.start : rows.stop]
    batch = batch.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batch.to(device)
    generators = latent_generators(
        config.latent_noise, config.seed, step, rows, device, rank=env.rank if env.distributed else None
    )
    totals = torch.zeros(4, device=device)  # loss, cross-entropy, KL (nats); 4th: a stop signal
    for first in range(0, len(rows), micro_batch):
        tokens = batch[first : first + micro_batch]
        generator = None if generators is None else generators[first : first + micro_batch]
        # gradients are averaged over ranks (ddp / fsdp) once, after the last micro-batch
        with gradient_sync(run.runner, enabled=first + micro_batch == len(rows)):
            with autocast_context(config.precision, device):
                out = run.runner(tokens[:, :-1], tokens[:, 1:], kappa_nats=kappa_nats, generator=generator)
            (out.loss / config.grad_accum).backward()
        kl = out.kl_nats if out.kl_nats is not None else torch.zeros((), device=device)
        totals[:3] += torch.stack([out.loss, out.cross_entropy_nats, kl]).detach() / config.grad_accum
    # fill_ takes the flag as a kernel argument; `totals[3] = flag` would copy it from the host, and wait
    totals[3].fill_(signals.received is not None)  # any rank's signal stops every rank, same step
    means = env.mean(totals)  # over ranks: the global batch's means (on the device)
    # a signal on any rank stops every rank at the same step: that needs the reduced flag on the host
    stop = bool(means[3] > 0) if env.distributed else signals.received is not None
    # grad_clip = 0 clips nothing but the norm is still computed: it is logged and checked
    grad_norm = clip_gradients(run.optimizer, run.model.parameters(), config.optim.grad_clip or math.inf)
    non_finite = ~(torch.isfinite(means[0]) & torch.isfinite(grad_norm))
    if run.optimizer.defaults.get("fused"):
        run.optimizer.found_inf = non_finite.float()  # type: ignore[attr-defined]  # read by torch's fused step
    elif bool(non_finite):
        _stop_on_non_finite(step, run.run_dir)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(means, non_finite, grad_norm, lr, kappa_nats, stop)


def save(run: Run, step: int) -> None:
    """Checkpoint after `step` optimizer steps: sharded (DCP) under ddp / fsdp, else one safetensors file
    with the optimizer and RNG state beside it."""
    config = run.config
    if run.env.distributed:
        save_sharded(run.run_dir, step, run.model, run.optimizer, run.metadata, run.env, keep=config.keep_checkpoints)
    else:
        state = {"optimizer": run.optimizer.state_dict(), "rng": _rng_state(run.device), "step": step}
        save_checkpoint(run.run_dir, step, run.model, run.metadata, state, keep=config.keep_checkpoints)


def step_metrics(run: Run, done: int, result: StepResult, seconds_per_step: float) -> dict:
    """The logged metrics after `done` steps (reads the step's values back from the device)."""
    config = run.config
    loss, ce, kl = result.means[:3].tolist()
    metrics = {
        "step": done,
        "loss": loss,
        "cross_entropy_bits": ce / LN2,
        "kl_bits": kl / LN2,
        "kappa_bits": result.kappa_nats / LN2,
        "lr": result.lr,
        "grad_norm": float(result.grad_norm),
        "tokens_per_s": tokens_per_step(config, run.dataset.sequence_length) / max(seconds_per_step, 1e-9),
    }
    if config.validate_every and done % config.validate_every == 0:
        metrics.update(validate(run.runner, run.dataset, config, run.device, run.env))
        warning = latent_warning(metrics, metrics["kappa_bits"], settled=settled(config, done))
        if warning:
            metrics["latent_warning"] = warning
    return metrics


def _train(
    config: TrainConfig, run_dir: Path, env: ParallelEnv, resume: bool, init_from, signals: StopSignals, lock: RunLock
) -> TrainResult:
    run = build(config, run_dir, env, resume=resume, init_from=init_from)
    start_step = restore(run, resume=resume)
    if start_step >= config.steps:  # a finished run: nothing to train, its last metrics to report
        logged = read_metrics(run_dir / "metrics.jsonl")
        if env.is_main:
            print(
                f"{run_dir} already reached step {start_step} (steps={config.steps}): nothing to train; "
                f"pass steps=N with N > {start_step} to train further",
                file=sys.stderr,
            )
        return TrainResult(run_dir, start_step, logged[-1] if logged else {})
    benchmarks = periodic_evaluation(run)  # None unless config.eval.every
    if benchmarks is not None:
        benchmarks.at(start_step)  # a due step not scored yet (a stop signal skips the evaluation)
    log = (
        MetricsLog(
            run_dir,
            resume_step=start_step,
            tensorboard=config.tensorboard,
            wandb_project=config.wandb_project if config.wandb else None,
            config=config.to_dict(),
        )
        if env.is_main
        else None
    )
    progress = Bar(  # its time left: from the last minute's steps, after the first (compiled) one
        total=config.steps,
        initial=start_step,
        desc=run_dir.name,
        disable=not (config.progress and env.is_main),
        dynamic_ncols=True,
        leave=True,
    )
    first_bad_step = torch.full((), -1, dtype=torch.int64, device=env.device)  # () the first non-finite step, or -1
    last_metrics: dict = {}
    shown_warning = None  # the kind of latent warning in force ("Z is unused", ...), printed when it starts
    window_start, window_steps = time.perf_counter(), 0
    run.model.train()
    try:
        for step in range(start_step, config.steps):
            result = train_step(run, step, signals)
            lock.check()  # before this step writes anything: RUN/.lock deleted lets another writer in
            first_bad_step = torch.where(result.non_finite & (first_bad_step < 0), step, first_bad_step)
            window_steps += 1
            done = step + 1
            logging = done % config.log_every == 0 or done == config.steps
            checkpointing = done % config.checkpoint_every == 0 or done == config.steps or result.stop
            if (logging or checkpointing) and int(first_bad_step) >= 0:  # before any checkpoint is written
                _stop_on_non_finite(int(first_bad_step), run_dir)
            if logging:
                last_metrics = step_metrics(run, done, result, (time.perf_counter() - window_start) / window_steps)
                if log is not None:
                    log.write(last_metrics)
                    if "val_cross_entropy_bits" in last_metrics:  # an evaluation: the state it found
                        warning = last_metrics.get("latent_warning")
                        kind = warning.split(":")[0] if warning else None  # "Z is unused", ...
                        if kind is not None and kind != shown_warning:  # said once per kind
                            progress.write(f"{run_dir.name} step {done}: {warning}", file=sys.stderr)
                        shown_warning = kind
                progress.set_postfix(
                    ce=f"{last_metrics['cross_entropy_bits']:.3f}b",
                    kl=f"{last_metrics['kl_bits']:.3f}b",
                    lr=f"{result.lr:.2e}",
                    tok_s=f"{last_metrics['tokens_per_s']:.0f}",
                )
                window_start, window_steps = time.perf_counter(), 0
            progress.update(1)
            if checkpointing:
                save(run, done)
            if benchmarks is not None and not result.stop:  # a stop signal must not wait for an evaluation
                window_start += benchmarks.at(done)  # evaluation time is not training time
            if result.stop and done < config.steps:
                signum = signals.received or signal.SIGTERM  # another rank's signal
                raise Stopped(
                    f"stopped by {signal.Signals(signum).name} after step {done} of {config.steps}; "
                    f"checkpoint saved in {run_dir / 'checkpoints'}; continue with: "
                    f"{_resume_hint(run_dir, env.distributed)}",
                    signum,
                )
    finally:
        progress.close()
        if log is not None:
            log.close()
            log.plot(run_dir / "training_curves.png")  # a run stopped by a signal or an error has its curves too
    return TrainResult(run_dir, config.steps, last_metrics)


def _stop_on_non_finite(step: int, run_dir: Path) -> None:
    kept = checkpoint_dirs(run_dir)
    raise TrainingError(
        f"non-finite loss or gradient norm at step {step + 1}; training stopped, "
        + (
            f"last good checkpoint: {kept[-1]}"
            if kept
            else f"no checkpoint yet: `{_resume_hint(run_dir)} section.field=value ...` starts it again from step 0 "
            "with the settings changed (e.g. a lower optim.lr), recorded in config-changes.jsonl"
        )
    )
