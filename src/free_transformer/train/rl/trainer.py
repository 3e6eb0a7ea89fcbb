"""`free-transformer rl`'s loop: a trained run in, a run out that holds the trained head (or decoder), which every
command that reads a run takes. Three modes, one loop:

    prior     the learned prior (prior.py): the policy head against the encoder's posterior, on the run's data
    latent    GRPO over Z: the actions are the Z_t of every fed position, drawn from the head; the decoder is
              frozen and its token draws are part of the environment; only the head learns
    tokens    GRPO over the tokens (the control): Z from the prior, the decoder's weights learn (not the latent
              path's); on a baseline this is plain GRPO

The KL of the latent policy is to the uniform prior (in bits per token, comparable to kappa) or to the learned prior
the run starts from (reference "learned"); the token policy's is to the decoder it started from. Progress, SIGTERM
(a checkpoint, then exit 143) and --resume, metrics.jsonl and training_curves.png are as `train`'s; under torchrun
every process rolls out its share of the step's prompts and the gradients are all-reduced (gloo on CPUs)."""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ...base.counter_random import row_keys
from ...base.devices import parse_device
from ...base.errors import Stopped, UserError
from ...base.plotting import draw, rl_panels
from ...base.progress import Bar
from ...base.seeding import generator, seed_of
from ...base.settings import build
from ...base.units import LN2
from ...data.config import DataConfig
from ...data.datasets import build_dataset
from ...distributed.env import ParallelEnv, setup
from ...model.transformer import FreeTransformer
from ...runs.checkpoint import (
    checkpoint_dirs,
    load_model,
    load_training_state,
    newest_intact_checkpoint,
    read_checkpoint_config,
    save_checkpoint,
)
from ...runs.runlock import RunLock
from ..metrics import MetricsLog, read_metrics
from ..trainer import StopSignals, _rng_state, _set_rng_state
from .config import Reference, RLConfig, load_rl_config
from .grpo import group_advantages, grpo_loss
from .prior import prior_kl
from .rewards import RewardTask, reward_task, score
from .rollout import Rollout, features, latent_log_probs, rollout, token_log_probs

Mode = Literal["prior", "latent", "tokens"]
MODES: tuple[Mode, ...] = ("prior", "latent", "tokens")
LOGGED = ("step",)  # what every line of an rl run's metrics.jsonl holds (the rest depends on the mode)


class RLError(UserError, ValueError):
    """A reinforcement-learning run that cannot start: a mode the model cannot take, a missing reference."""


@dataclass(frozen=True)
class RLSetup:
    """What a run is, saved with it (config.json's "rl"): --resume reads it back."""

    source: str  # the run it started from
    mode: Mode
    reward: str | None  # the reward task (GRPO), None for the learned prior
    reference: Reference  # what the latent policy's KL is to

    def to_dict(self) -> dict:
        return {"source": self.source, "mode": self.mode, "reward": self.reward, "reference": self.reference}


@dataclass
class RLResult:
    run_dir: Path
    step: int
    metrics: dict  # the last logged


def with_policy_head(model: FreeTransformer, seed: int) -> FreeTransformer:
    """`model` with a fresh policy head at the kind's prior (the same weights otherwise), or a one-line RLError for
    a kind that cannot have one."""
    config = model.config.replace(latent=model.config.latent.__class__(**{**vars(model.config.latent), "policy": True}))
    torch.manual_seed(seed_of(seed, "policy-head"))
    try:
        headed = FreeTransformer(config)
    except ValueError as error:
        raise RLError(str(error)) from None
    missing, unexpected = headed.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("latent.policy.") for name in missing), (missing, unexpected)
    assert headed.latent is not None and headed.latent.policy is not None
    headed.latent.policy.reset_parameters(headed.latent.mapper.prior_params())
    return headed.to(next(model.parameters()).device).eval()


def _check_setup(setup: RLSetup, model: FreeTransformer) -> None:
    if setup.mode in ("prior", "latent") and not model.config.is_free:
        what = "--learned-prior" if setup.mode == "prior" else "--actions latent"
        raise RLError(
            f"{what} needs a Free Transformer (latent_units > 0); {setup.source} is a baseline decoder, which has "
            "no Z: use --actions tokens"
        )
    if setup.reference == "learned" and (model.latent is None or model.latent.policy is None):
        raise RLError(
            f"--reference learned needs a run with a learned prior; {setup.source} has none: make one with "
            f"free-transformer rl {setup.source} --learned-prior --out DIR"
        )
    if setup.mode == "prior" and setup.reward is not None:
        raise RLError("--learned-prior trains against the encoder, with no reward: leave --reward out")
    if setup.mode != "prior" and setup.reward is None:
        raise RLError("GRPO needs a reward: give --reward (letters, coins, eval:TASK)")


class RLRun:
    """Everything one run holds from its start to its last step."""

    def __init__(self, setup: RLSetup, config: RLConfig, run_dir: Path, env: ParallelEnv, *, resume: bool):
        self.setup, self.config, self.run_dir, self.env = setup, config, run_dir, env
        source, saved = load_model(setup.source, env.device)
        _check_setup(setup, source)
        self.saved = saved
        self.task: RewardTask | None = (
            None if setup.reward is None else reward_task(setup.reward, saved, source.config, config)
        )
        self.reference_head = None
        if setup.reference == "learned":
            assert source.latent is not None and source.latent.policy is not None  # _check_setup
            self.reference_head = copy.deepcopy(source.latent.policy).requires_grad_(False)
        if resume:
            self.model, _ = load_model(run_dir, env.device)
        elif setup.mode == "tokens" or (source.latent is not None and source.latent.policy is not None):
            self.model = source
        else:
            self.model = with_policy_head(source, config.seed)
        # the token policy's reference: the decoder it started from
        self.reference_model = copy.deepcopy(source).requires_grad_(False) if setup.mode == "tokens" else None
        self.model.requires_grad_(False)
        self.trained = self._trained_parameters()
        for parameter in self.trained:
            parameter.requires_grad_(True)
        self.optimizer = torch.optim.Adam(self.trained, lr=config.lr)
        if self.task is not None:
            self._check_fits(len(self.task.episodes(1, generator(0))[0].prompt))
            if self.task.note is not None and env.is_main:
                print(f"note: {self.task.note}", file=sys.stderr)
        self.dataset = None
        if setup.mode == "prior":
            if "data" not in saved.get("train", {}):
                raise RLError(f"--learned-prior trains on the run's data: {setup.source} records no training config")
            self.dataset = build_dataset(
                build(DataConfig, saved["train"]["data"], "data"), seed_of(config.seed, "prior")
            )
        self.metadata = {
            "tokenizer": saved.get("tokenizer"),
            "train": {**saved.get("train", {}), "model": self.model.config.to_dict()},
            "rl": {**setup.to_dict(), "config": config.to_dict()},
        }

    def _trained_parameters(self) -> list[nn.Parameter]:
        if self.setup.mode == "tokens":  # the decoder: embeddings, blocks, norm, read-out; not the latent path
            return [p for name, p in self.model.named_parameters() if not name.startswith("latent.")]
        assert self.model.latent is not None and self.model.latent.policy is not None
        return list(self.model.latent.policy.parameters())

    def _check_fits(self, prompt_length: int) -> None:
        """A one-line RLError when a prompt of `prompt_length` tokens and the new tokens exceed the context."""
        assert self.task is not None
        if prompt_length + self.max_new_tokens > self.model.config.max_seq_len:
            raise RLError(
                f"reward {self.task.name}: a prompt and {self.max_new_tokens} new tokens exceed the model's "
                f"max_seq_len {self.model.config.max_seq_len}: set max_new_tokens=N lower"
            )

    @property
    def max_new_tokens(self) -> int:
        assert self.task is not None
        return self.config.max_new_tokens or self.task.max_new_tokens

    def optimizer_step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.env.world_size > 1:  # every process's gradient of its share of the rows, averaged
            for parameter in self.trained:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
                parameter.grad /= self.env.world_size
        self.optimizer.step()

    # ---- one step of each mode -----------------------------------------------------------------

    def prior_step(self, step: int) -> dict[str, float]:
        assert self.dataset is not None
        rows = self.env.rows(self.config.batch_size)
        tokens = self.dataset.batch(step, self.config.batch_size)[rows.start : rows.stop, :-1].to(self.env.device)
        kl, kl_uniform = prior_kl(self.model, tokens)
        loss = kl.mean()
        self.optimizer_step(loss)
        return {"kl_encoder_bits": float(loss.detach()) / LN2, "kl_uniform_bits": float(kl_uniform.mean()) / LN2}

    def grpo_step(self, step: int) -> dict[str, float]:
        config, task, G = self.config, self.task, self.config.group
        assert task is not None
        episodes = task.episodes(config.prompts, generator(config.seed, "rl-prompts", step))
        mine = [episodes[i] for i in self.env.rows(config.prompts)]  # this process's prompts
        self._check_fits(max(len(episode.prompt) for episode in mine))
        seeds = [seed_of(config.seed, "rl", step, i, j) for i in self.env.rows(config.prompts) for j in range(G)]
        keys = row_keys(torch.tensor(seeds, device=self.env.device))  # (B, ...) row k * G + j: sample j of prompt k
        latent = self.setup.mode == "latent"
        # one rollout per prompt length (its rows share their prompt's length), the lengths in order of appearance
        lengths = list(dict.fromkeys(len(episode.prompt) for episode in mine))
        samples, order = [], []  # order: the step's row of each rollout row, rollout after rollout
        for length in lengths:
            rows = [k * G + j for k, episode in enumerate(mine) if len(episode.prompt) == length for j in range(G)]
            prompts = torch.tensor([mine[r // G].prompt for r in rows], device=self.env.device)  # (B_length, P)
            picked = keys if len(lengths) == 1 else keys[torch.tensor(rows, device=keys.device)]
            sample = rollout(
                self.model, prompts, self.max_new_tokens, picked, policy=latent, temperature=config.temperature
            )
            samples.append(sample)
            order += rows
        generated: list[list[int]] = [[] for _ in order]
        for row, tokens in zip(order, (t for sample in samples for t in sample.generated())):
            generated[row] = tokens
        rewards = torch.tensor(
            [score(task.name, episode, generated[k * G + j]) for k, episode in enumerate(mine) for j in range(G)]
        ).view(len(mine), G)
        advantages = group_advantages(rewards).flatten()[torch.tensor(order)].to(self.env.device)  # (B,) as rolled out
        metrics = {"reward": float(rewards.mean()), "solved": float((rewards.max(-1).values > 0).float().mean())}
        if latent:
            metrics |= self._latent_updates(samples, advantages)
        else:
            metrics |= self._token_updates(samples, advantages)
        return metrics

    def _latent_updates(self, samples: list[Rollout], advantages: torch.Tensor) -> dict[str, float]:
        """GRPO over the Z of every fed position of the rollouts (each of one prompt length, so each its own count
        of actions: padded to one, the loss over each sample's own)."""
        config, space, latent = self.config, self.model.latent_space, self.model.latent
        assert space is not None and latent is not None
        fed = []  # (B_i, T_i, *value_shape) the Z of each rollout
        for sample in samples:
            assert sample.latents is not None
            fed.append(sample.latents)
        x_halves = [features(self.model, sample) for sample in samples]  # (B_i, T_i, D) each, no gradient
        with torch.no_grad():
            old = _padded([latent_log_probs(self.model, x, z)[0] for x, z in zip(x_halves, fed)])
            references = [
                space.prior_params().to(x.device).expand(*x.shape[:2], -1)
                if self.reference_head is None
                else latent.policy_params(x, z, self.reference_head)
                for x, z in zip(x_halves, fed)
            ]
        actions = _actions(x_halves)
        for _ in range(config.updates):
            parts = [latent_log_probs(self.model, x, z) for x, z in zip(x_halves, fed)]
            log_probs, params = _padded([p[0] for p in parts]), [p[1] for p in parts]
            kl = _padded([space.kl_between(p, r) for p, r in zip(params, references)])  # (B, T) nats
            out = grpo_loss(log_probs, old, advantages, kl, clip=config.clip, kl_coef=config.kl_coef, actions=actions)
            self.optimizer_step(out.loss)
        prior_kl = _padded([space.kl(p.detach()) for p in params])  # (B, T) to the uniform prior, per token
        return {
            "loss": float(out.loss.detach()),
            "kl_bits": float(prior_kl.mean() if actions is None else prior_kl[actions].mean()) / LN2,
            "kl_ref_bits": float(out.kl) / LN2,
            "clipped": float(out.clipped),
        }

    def _token_updates(self, samples: list[Rollout], advantages: torch.Tensor) -> dict[str, float]:
        """GRPO over the generated tokens of the rollouts (max_new_tokens actions in every sample)."""
        config = self.config
        assert self.reference_model is not None
        with torch.no_grad():
            old = _stacked([token_log_probs(self.model, s, config.temperature)[0] for s in samples])
            reference = _stacked([token_log_probs(self.reference_model, s, config.temperature)[1] for s in samples])
        for _ in range(config.updates):
            parts = [token_log_probs(self.model, s, config.temperature) for s in samples]
            log_probs, log_softmax = _stacked([p[0] for p in parts]), _stacked([p[1] for p in parts])
            kl = (log_softmax.exp() * (log_softmax - reference)).sum(-1)  # (B, N) nats, exact over the vocabulary
            out = grpo_loss(log_probs, old, advantages, kl, clip=config.clip, kl_coef=config.kl_coef)
            self.optimizer_step(out.loss)
        return {
            "loss": float(out.loss.detach()),
            "kl_bits": 0.0,
            "kl_ref_bits": float(out.kl) / LN2,
            "clipped": float(out.clipped),
        }

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self, step: int) -> None:
        if self.env.is_main:
            state = {"optimizer": self.optimizer.state_dict(), "rng": _rng_state(self.env.device), "step": step}
            save_checkpoint(self.run_dir, step, self.model, self.metadata, state)
        self.env.barrier()

    def restore(self) -> int:
        checkpoint = newest_intact_checkpoint(self.run_dir)
        if checkpoint is None:
            return 0
        state = load_training_state(checkpoint)
        self.optimizer.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"], self.env.device)
        return int(state["step"])


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rollouts' rows (B_i, ...) as one batch (B, ...), in the order rolled out."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-action values of the rollouts, (B_i, T_i) each, as one (B, max T_i), right-padded with 0."""
    width = max(part.shape[1] for part in parts)
    if len(parts) == 1:
        return parts[0]
    return _stacked([torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])


def _actions(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """(B, max T_i) bool: the actions of each row of rollouts (B_i, T_i, ...) padded to one width; None when every
    rollout has the same (nothing padded)."""
    widths = [part.shape[1] for part in parts]
    if len(set(widths)) == 1:
        return None
    marks = [torch.arange(max(widths), device=p.device)[None, :].expand(p.shape[0], -1) < p.shape[1] for p in parts]
    return torch.cat(marks)


def saved_setup(run_dir: Path) -> tuple[RLSetup, dict]:
    """The setup and settings of the run in `run_dir` (for --resume), or a one-line RLError."""
    checkpoint = newest_intact_checkpoint(run_dir, report=lambda message: None) if run_dir.is_dir() else None
    if checkpoint is None:
        raise RLError(f"nothing to resume: {run_dir} holds no checkpoint of an rl run")
    rl = read_checkpoint_config(checkpoint).get("rl")
    if not isinstance(rl, dict):
        raise RLError(f"{run_dir} is not a run of free-transformer rl (its checkpoint has no rl section)")
    return RLSetup(rl["source"], rl["mode"], rl["reward"], rl["reference"]), dict(rl.get("config") or {})


def _environment(config: RLConfig) -> ParallelEnv:
    device = parse_device(config.device)
    if "WORLD_SIZE" in os.environ:  # under torchrun: a process group, rows split over it
        return setup("ddp", "auto", device)
    return ParallelEnv("none", device)


def run_rl(setup: RLSetup | None, run_dir: str | Path, overrides: list[str], *, resume: bool = False) -> RLResult:
    """Start (setup given) or continue (resume) the run in `run_dir`; overrides: section.field=value settings."""
    run_dir = Path(run_dir)
    if resume:
        saved, saved_config = saved_setup(run_dir)
        if setup is not None and setup != saved:
            raise RLError(f"--resume continues {run_dir} as it was started ({saved.to_dict()}): leave the rest out")
        setup, config = saved, load_rl_config(overrides, saved_config)
    else:
        if setup is None:
            raise RLError("give the run to start from, or --resume")
        if checkpoint_dirs(run_dir) or read_metrics(run_dir / "metrics.jsonl", LOGGED):
            raise RLError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --out")
        config = load_rl_config(overrides)
    if config.threads:
        torch.set_num_threads(config.threads)
    env = _environment(config)
    try:
        if config.prompts % env.world_size or config.batch_size % env.world_size:
            raise RLError(f"prompts and batch_size must be multiples of the {env.world_size} processes")
        with RunLock(run_dir, "rl", enabled=env.is_main) as lock, StopSignals() as signals:
            run = RLRun(setup, config, run_dir, env, resume=resume)
            return _loop(run, lock, signals)
    finally:
        env.close()


def _loop(run: RLRun, lock: RunLock, signals: StopSignals) -> RLResult:
    config, env, run_dir = run.config, run.env, run.run_dir
    start = run.restore()
    if start >= config.steps:
        logged = read_metrics(run_dir / "metrics.jsonl", LOGGED)
        if env.is_main:
            print(f"{run_dir} already reached step {start} (steps={config.steps}): nothing to train", file=sys.stderr)
        return RLResult(run_dir, start, logged[-1] if logged else {})
    log = MetricsLog(run_dir, resume_step=start, required=LOGGED) if env.is_main else None
    progress = Bar(total=config.steps, initial=start, desc=run_dir.name, disable=not (config.progress and env.is_main))
    rows_per_step = config.rows  # reward calls of one GRPO step, over every process
    window: list[dict[str, float]] = []
    last: dict = {}
    began = time.perf_counter()
    try:
        for step in range(start, config.steps):
            values = run.prior_step(step) if run.setup.mode == "prior" else run.grpo_step(step)
            lock.check()
            window.append(values)
            done = step + 1
            stopping = signals.received is not None
            if env.world_size > 1:  # a signal on any process stops every one at the same step
                flag = torch.tensor([float(stopping)])
                dist.all_reduce(flag)
                stopping = bool(flag > 0)
            if done % config.log_every == 0 or done == config.steps or stopping:
                means = {key: sum(v[key] for v in window) / len(window) for key in window[0]}
                means = dict(zip(means, env.mean(torch.tensor(list(means.values()), dtype=torch.float64)).tolist()))
                last = {"step": done, **means, "seconds": time.perf_counter() - began}
                if run.setup.mode != "prior":
                    last["reward_calls"] = done * rows_per_step
                if log is not None:
                    log.write(last)
                shown = ("reward", "kl_bits") if "reward" in last else ("kl_encoder_bits",)
                progress.set_postfix({key: f"{last[key]:.3f}" for key in shown})
                window = []
            progress.update(1)
            if done % config.checkpoint_every == 0 or done == config.steps or stopping:
                run.save(done)
            if stopping and done < config.steps:
                signum = signals.received or signal.SIGTERM
                raise Stopped(
                    f"stopped by {signal.Signals(signum).name} after step {done} of {config.steps}; checkpoint saved "
                    f"in {run_dir / 'checkpoints'}; continue with: free-transformer rl --resume --out {run_dir}",
                    signum,
                )
    finally:
        progress.close()
        if log is not None:
            log.close()
            metrics = read_metrics(run_dir / "metrics.jsonl", LOGGED)
            if metrics:
                draw(rl_panels(metrics), run_dir / "training_curves.png", legend="panels", dpi=110)
    return RLResult(run_dir, config.steps, last)
