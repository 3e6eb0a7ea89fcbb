"""What reinforcement learning asks of a reward task (rewards.py names them): an episode is a prompt with its
reward, a callable (prompt ids, generated token ids) -> float, as best_of's scorer is
(free_transformer.inference.search); `score` calls it, and a reward that raises or is not a finite number stops the
run with one line naming it and the prompt."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ...base.errors import UserError

Reward = Callable[[list[int], list[int]], float]


class RewardError(UserError, ValueError):
    """An unknown reward, or a reward that raised or was not a finite number (named with its prompt)."""


@dataclass(frozen=True)
class Episode:
    prompt: list[int]  # token ids
    reward: Reward


class RewardTask(Protocol):
    name: str

    @property
    def note(self) -> str | None:
        """What the run is told once at its start (None: nothing)."""
        ...

    @property
    def max_new_tokens(self) -> int:
        """Tokens generated after each prompt."""
        ...

    def episodes(self, count: int, generator: torch.Generator) -> list[Episode]:
        """`count` prompts with their rewards, drawn from `generator`."""
        ...


def score(task_name: str, episode: Episode, tokens: list[int]) -> float:
    """The episode's reward of `tokens`, or a one-line RewardError naming the reward and the prompt when it raises
    or is not a finite number."""
    try:
        value = float(episode.reward(list(episode.prompt), list(tokens)))
    except Exception as error:  # a user's reward: whatever it raises is reported, in one line
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise RewardError(f"reward {task_name} raised on prompt {episode.prompt!r}: {reason}") from error
    if not math.isfinite(value):
        raise RewardError(f"reward {task_name} returned {value} on prompt {episode.prompt!r}: it must be finite")
    return value
