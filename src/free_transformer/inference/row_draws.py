"""Every random draw a row of the decoding engine reads, made as it joins: `RowDraws`, the engine's one source of
Z per position and of token noise.

A row's draws are counter-based (free_transformer.base.counter_random), functions of its key (of its seed) and a
position: the Z fed at position t is its explicit value there or the row's LATENT stream at t (by the rule of
free_transformer.model.latent.dispenser), the noise of the token sampled from position t's logits its TOKEN
stream at t; every joining row's are drawn in one operation on the group (`draw`), so that a step only reads them
at its rows' positions (`at`). A row whose Z comes from the run's policy head (LatentChoice.POLICY: a learned
prior or an RL policy over Z, free_transformer.model.latent.policy) depends on its prefix: its Z at t is drawn in the
step, from the head's output at t (which reads the Z fed at t - 1, kept here) with the row's LATENT words at t
(`counter_policy_noise`, the same streams, drawn as it joins like every other draw: only the map from their noise to
Z waits for the step), and kept here as it is drawn (`keep`). A sample therefore depends only on its prompt,
settings, seed and Z, never on the other rows in flight nor on the order of the draws."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
from torch import Tensor

from ..base.counter_random import row_keys
from ..base.latent_choice import LatentChoice, RowChoice
from ..model.latent import LatentSource, LatentSpace, PolicyDraw, counter_policy_noise
from ..model.latent.dispenser import planned_z
from .sampling import token_uniforms


class PolicyRows(enum.IntEnum):
    """Which rows of a step draw their Z from the policy head, in the step (false when none does): SOME reads each
    row's flag there and keeps the other rows' Z; ALL, every row's Z from the head, skips that choice."""

    NONE = 0
    SOME = 1
    ALL = 2

    @classmethod
    def of(cls, flags: Sequence[bool], *, compiled: bool) -> PolicyRows:
        """The rows' flags as one value; a compiled engine keeps one step for every mix (SOME, never ALL)."""
        if not any(flags):
            return cls.NONE
        return cls.ALL if all(flags) and not compiled else cls.SOME


class RowDraws:
    """Per slot: the row's counter-based key, the Z of every position it feeds and the uniform of every token it
    samples. A `SlotState` of the engine's cache (free_transformer.inference.cache_manager)."""

    def __init__(self, space: LatentSpace | None, slots: int, capacity: int, device):
        self.space = space
        shape, dtype = (space.value_shape, space.value_dtype) if space is not None else ((), torch.int64)
        with torch.inference_mode():
            self.key = torch.zeros(slots, dtype=torch.int64, device=device)  # (S,) each row's counter-based key
            self.fed = torch.zeros(slots, capacity, *shape, dtype=dtype, device=device)  # (S, capacity, ...) Z
            # (S, capacity) the uniform of the token sampled from each position's logits, float64
            self.uniforms = torch.full((slots, capacity), 0.5, dtype=torch.float64, device=device)
            self.policy = torch.zeros(slots, dtype=torch.bool, device=device)  # (S,) its Z from the policy head
        # (S, capacity, ...): the policy noise of every position a row of the policy feeds (the kind's
        # `policy_noise` of its words), made when the first such row joins
        self.noise: Tensor | None = None
        self.capacity = capacity

    def draw(
        self,
        slots: slice,
        seeds: Sequence[int],
        ends: Sequence[int],
        explicit: Sequence[Tensor | None],
        policy: Sequence[bool],
    ) -> None:
        """Every draw the rows joining `slots` will read, made now for the group: at each position t they feed,
        [0, end), their Z (explicit[i] (N_i, ...) where given, else the prior's LATENT stream at t; a row of the
        policy draws its own in the step) and the uniform of the token sampled from t's logits (TOKEN stream at
        t)."""
        device = self.key.device
        self.key[slots] = row_keys(torch.tensor(list(seeds), dtype=torch.int64, device=device))
        self.policy[slots] = torch.tensor(list(policy), dtype=torch.bool, device=device)
        end = max(ends)
        keys = self.key[slots]  # (k,)
        self.uniforms[slots, :end] = token_uniforms(keys[:, None], torch.arange(end, device=device)[None, :])
        if self.space is not None:
            self.fed[slots, :end] = planned_z(self.space, len(seeds), 0, end, explicit=explicit, keys=keys)
        if any(policy):
            assert self.space is not None, "resolve_latents refuses the policy on a baseline"
            positions = torch.arange(end, device=device)[None, :]
            noise = counter_policy_noise(self.space, keys[:, None], positions)  # (k, end, ...)
            if self.noise is None:
                shape = (self.key.shape[0], self.capacity, *noise.shape[2:])
                self.noise = torch.zeros(shape, dtype=noise.dtype, device=device)
            self.noise[slots, :end] = noise

    def prompt_latents(self, slots: slice, length: int, source: RowChoice | Tensor) -> LatentSource:
        """What the prefill of the rows in `slots` (one kind of prompt Z) takes as latents for positions [0, length):
        LatentChoice.ENCODER, or the Z drawn for them (explicit values, or the prior's); PRIOR for a baseline."""
        if self.space is None:
            return LatentChoice.PRIOR
        if isinstance(source, str) and source == LatentChoice.ENCODER:
            return LatentChoice.ENCODER
        if isinstance(source, str) and source == LatentChoice.POLICY:
            assert self.noise is not None, "draw makes the noise of a row of the policy"
            return PolicyDraw(self.noise[slots, :length])  # (k, length, ...)
        return self.fed[slots, :length]  # (k, length, ...)

    def record(self, slots: slice, length: int, latents: Tensor) -> None:
        """Keep the Z a prefill used for positions [0, length) (the encoder's posterior sample)."""
        self.fed[slots, :length] = latents

    def at(
        self, index: Tensor, position: Tensor, *, sampled: bool, policy: PolicyRows = PolicyRows.NONE
    ) -> tuple[LatentSource, Tensor | None]:
        """Each row's draws at its own position: its Z (n, 1, ...) (PRIOR for a baseline; when rows of the policy are
        in flight, a PolicyDraw of the rows' noise there, with SOME the others' Z given) and, when the step samples,
        its token's uniform (n,)."""
        latent: LatentSource = LatentChoice.PRIOR if self.space is None else self.fed[index, position][:, None]
        if policy and isinstance(latent, Tensor) and self.noise is not None:
            noise = self.noise[index, position][:, None]  # (n, 1, ...)
            previous = self.fed[index, (position - 1).clamp(min=0)]  # (n, ...) the Z fed before (a step is past 0)
            every = policy == PolicyRows.ALL
            latent = PolicyDraw(noise, previous) if every else PolicyDraw(noise, previous, latent, self.policy[index])
        return latent, self.uniforms[index, position] if sampled else None

    def column(
        self, rows: slice, start: int, *, sampled: bool, policy: PolicyRows = PolicyRows.NONE
    ) -> tuple[LatentSource, Tensor | None]:
        """The draws of rows all at position `start`: a column of each buffer (a view, no gather); with
        `policy`, as `at`."""
        latent: LatentSource = LatentChoice.PRIOR if self.space is None else self.fed[rows, start : start + 1]
        if policy and isinstance(latent, Tensor) and self.noise is not None:
            noise = self.noise[rows, start : start + 1]  # (n, 1, ...)
            previous = self.fed[rows, max(start - 1, 0)]  # (n, ...) the Z fed before (a step is past position 0)
            every = policy == PolicyRows.ALL
            latent = PolicyDraw(noise, previous) if every else PolicyDraw(noise, previous, latent, self.policy[rows])
        return latent, self.uniforms[rows, start] if sampled else None

    def keep(self, index: Tensor, position: Tensor, latents: Tensor) -> None:
        """Keep the Z (n, 1, ...) a step drew from the policy for the rows of slots `index` at their positions."""
        self.fed[index, position] = latents[:, 0]

    def keep_column(self, rows: slice, start: int, latents: Tensor) -> None:
        """`keep` for rows all at position `start`: a column of the buffer written, no scatter."""
        self.fed[rows, start : start + 1] = latents

    def fed_of(self, slot: int, length: int) -> Tensor | None:
        """(length, ...) a copy of the Z fed to the row of `slot` at positions [0, length); None for a baseline."""
        return self.fed[slot, :length].clone() if self.space is not None else None

    def move(self, source: int, slot: int, end: int) -> None:
        self.key[slot] = self.key[source]
        self.fed[slot, :end] = self.fed[source, :end]
        self.uniforms[slot, :end] = self.uniforms[source, :end]
        self.policy[slot] = self.policy[source]
        if self.noise is not None:
            self.noise[slot, :end] = self.noise[source, :end]
