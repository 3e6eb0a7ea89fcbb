"""Every random draw a row of the decoding engine reads, made as it joins: `RowDraws`, the engine's one source of
Z per position and of token noise.

A row's draws are counter-based (free_transformer.base.counter_random), functions of its key (of its seed) and a
position: the Z fed at position t is its explicit value there or the row's LATENT stream at t (by the rule of
free_transformer.model.latent.dispenser), the noise of the token sampled from position t's logits its TOKEN
stream at t; every joining row's are drawn in one operation on the group (`draw`), so that a step only reads them
at its rows' positions (`at`). A sample therefore depends only on its prompt, settings, seed and Z, never on the
other rows in flight nor on the order of the draws."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..base.counter_random import row_keys
from ..base.latent_choice import LatentChoice
from ..model.latent import LatentSource, LatentSpace
from ..model.latent.dispenser import planned_z
from .sampling import token_uniforms


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

    def draw(self, slots: slice, seeds: Sequence[int], ends: Sequence[int], explicit: Sequence[Tensor | None]) -> None:
        """Every draw the rows joining `slots` will read, made now for the group: at each position t they feed,
        [0, end), their Z (explicit[i] (N_i, ...) where given, else the prior's LATENT stream at t) and the uniform
        of the token sampled from t's logits (TOKEN stream at t)."""
        device = self.key.device
        self.key[slots] = row_keys(torch.tensor(list(seeds), dtype=torch.int64, device=device))
        end = max(ends)
        keys = self.key[slots]  # (k,)
        self.uniforms[slots, :end] = token_uniforms(keys[:, None], torch.arange(end, device=device)[None, :])
        if self.space is not None:
            self.fed[slots, :end] = planned_z(self.space, len(seeds), 0, end, explicit=explicit, keys=keys)

    def prompt_latents(self, slots: slice, length: int, source: LatentSource) -> LatentSource:
        """What the prefill of the rows in `slots` (one kind of prompt Z) takes as latents for positions [0, length):
        LatentChoice.ENCODER, or the Z drawn for them (explicit values, or the prior's); PRIOR for a baseline."""
        if self.space is None:
            return LatentChoice.PRIOR
        if isinstance(source, str) and source == LatentChoice.ENCODER:
            return LatentChoice.ENCODER
        return self.fed[slots, :length]  # (k, length, ...)

    def record(self, slots: slice, length: int, latents: Tensor) -> None:
        """Keep the Z a prefill used for positions [0, length) (the encoder's posterior sample)."""
        self.fed[slots, :length] = latents

    def at(self, index: Tensor, position: Tensor, *, sampled: bool) -> tuple[LatentSource, Tensor | None]:
        """Each row's draws at its own position: its Z (n, 1, ...) (PRIOR for a baseline) and, when the step
        samples, its token's uniform (n,)."""
        latent: LatentSource = LatentChoice.PRIOR if self.space is None else self.fed[index, position][:, None]
        return latent, self.uniforms[index, position] if sampled else None

    def column(self, rows: slice, start: int, *, sampled: bool) -> tuple[LatentSource, Tensor | None]:
        """The draws of rows all at position `start`: a column of each buffer (a view, no gather)."""
        latent: LatentSource = LatentChoice.PRIOR if self.space is None else self.fed[rows, start : start + 1]
        return latent, self.uniforms[rows, start] if sampled else None

    def fed_of(self, slot: int, length: int) -> Tensor | None:
        """(length, ...) a copy of the Z fed to the row of `slot` at positions [0, length); None for a baseline."""
        return self.fed[slot, :length].clone() if self.space is not None else None

    def move(self, source: int, slot: int, end: int) -> None:
        self.key[slot] = self.key[source]
        self.fed[slot, :end] = self.fed[source, :end]
        self.uniforms[slot, :end] = self.uniforms[source, :end]
