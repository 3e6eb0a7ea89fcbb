"""The settings of `free-transformer rl`, one dataclass (section.field=value overrides, --help lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...base.checks import ConfigError, check_range
from ...base.settings import build, describe, help_text, parse_overrides, to_dict
from ...eval.sandbox import SandboxLimits

Actions = Literal["latent", "tokens"]
Reference = Literal["uniform", "learned"]


@dataclass(frozen=True)
class RLConfig:
    steps: int = 100
    """Optimizer steps. A GRPO step makes prompts x group reward calls; a learned-prior step reads one batch."""
    prompts: int = 8
    """Prompts per step (split over the processes under torchrun)."""
    group: int = 16
    """G, samples of each prompt: the group whose rewards give each other's advantages."""
    lr: float = 3e-3
    """Adam's learning rate (the policy head's for latent actions, the decoder's for token actions: a few 1e-5)."""
    clip: float = 0.2
    """epsilon of the clipped ratio, min(r A, clip(r, 1 - epsilon, 1 + epsilon) A)."""
    kl_coef: float = 0.02
    """beta, the weight of the KL to the reference in the loss, per action, in nats."""
    updates: int = 1
    """Gradient steps on each step's rollouts (1: the ratio is 1 and the clip inactive, plain policy gradient)."""
    temperature: float = 1.0
    """Softmax temperature of the sampled tokens (rollouts and the token log-probabilities alike)."""
    max_new_tokens: int | None = None
    """Tokens generated after each prompt (unset: the reward task's own, 64 for letters, an eval task's budget at
    most half the model's max_seq_len as eval caps it)."""
    batch_size: int = 64
    """Learned prior: training sequences per step."""
    seed: int = 0
    """Prompts, rollouts and the head's initialisation follow from it."""
    log_every: int = 10
    """Steps between logged metrics (and the last step)."""
    checkpoint_every: int = 50
    """Steps between checkpoints (and the last step, and a stop signal)."""
    progress: bool = True
    """Show a progress bar."""
    threads: int = 0
    """torch threads (0: torch's default)."""
    device: str = "auto"
    """auto (cuda when available), cpu, cuda, cuda:N."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """--reward eval:TASK of a code task: the limits of each generated program its tests run (eval/sandbox.py)."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "group", "updates", "batch_size", "log_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.group < 2:
            raise ConfigError(f"group must be >= 2 (advantages compare a prompt's samples), got {self.group}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        check_range("lr", self.lr, low_open=True)
        check_range("clip", self.clip, low_open=True)
        check_range("kl_coef", self.kl_coef)
        check_range("temperature", self.temperature, low_open=True)
        try:
            self.sandbox.check()
        except ValueError as error:
            raise ConfigError(f"sandbox.{error}") from None

    @property
    def rows(self) -> int:
        """Samples per step: prompts x group."""
        return self.prompts * self.group

    def to_dict(self) -> dict:
        return to_dict(self)


def load_rl_config(overrides: list[str], saved: dict | None = None) -> RLConfig:
    """The settings from `saved` (a run's own, on --resume) then the section.field=value overrides."""
    values = dict(saved or {})
    values.update(parse_overrides(overrides))
    return build(RLConfig, values, "")


def rl_settings_help() -> str:
    return "settings (field=value):\n" + help_text(describe(RLConfig()))
