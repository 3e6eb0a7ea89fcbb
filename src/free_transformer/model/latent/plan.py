"""`LatentPlan`: which Z each position of a sequence takes, handed out call by call. A user's choice of Z
(encoder, prior, shared, reference, values) is parsed and resolved in free_transformer.inference.latents;
what it resolves to is a plan."""

from __future__ import annotations

import torch
from torch import Tensor

from ...base.latent_choice import LatentChoice, RowChoice
from .dispenser import planned_z, prior_z
from .draws import Generators, counter_policy_words, fill_rows_
from .sources import LatentSource, PolicyDraw
from .space import LatentSpace


class LatentPlan:
    """Z for each position of a sequence, handed to the model's forward call by call, by the rule of
    free_transformer.model.latent.dispenser (which the decoding engine's rows draw by too): for the model's own
    prior draws (a forward with LatentChoice.PRIOR), `FreeTransformerForCausalLM`, evaluation's scoring, the
    held-out likelihoods, validation and analysis.

    Positions [0, N) take the explicit (B, N, *value_shape) values when given. Otherwise the first call (at
    position 0) takes the encoder when `prompt_source` is LatentChoice.ENCODER, and every other position one prior
    draw of the latent space, made once when its token is fed and then kept: with `keys`, (B,) counter-based row
    keys (free_transformer.base.counter_random), row i's draw at position t is a function of (keys[i], t), as the
    decoding engine draws it; else `LatentSpace.prior` with `generators` (one per row, or the global RNG): a
    forward that re-feeds positions already planned (Hugging Face without a cache) gets the same Z again.
    With `prompt_source` LatentChoice.POLICY every Z comes from the model's policy head (a learned prior or policy
    over Z), drawn by the forward from the noise of the rows' random words at each position (`PolicyDraw`): with
    `keys`, the counter-based words the decoding engine's step draws with (`counter_policy_noise`), else words from
    `generators` (or the global RNG); it depends on the prefix, so positions are planned only as they are fed.
    The plan records every Z the model used, so generate can return them. With no latent space (a
    baseline) it hands out LatentChoice.PRIOR, which a baseline ignores, and records nothing.
    """

    def __init__(
        self,
        batch_size: int,
        space: LatentSpace | None,
        *,
        explicit: Tensor | None = None,
        prompt_source: RowChoice = LatentChoice.ENCODER,
        generators: Generators = None,
        keys: Tensor | None = None,
    ):
        self.batch_size = batch_size
        self.space = space
        self.explicit = explicit  # (B, N, *value_shape), resolved by resolve_latents
        self.prompt_source = prompt_source  # LatentChoice.ENCODER, PRIOR or POLICY
        self.generators = generators
        self.keys = keys  # (B,) int64 counter-based row keys, or None
        self.used: list[Tensor] = []  # (B, t, *value_shape) chunks, the Z of positions [0, length)
        self.length = 0

    def source(self, start: int, length: int, device=None) -> LatentSource:
        """What the model's forward gets as `latents` for positions [start, start + length)."""
        if self.space is None:
            return LatentChoice.PRIOR
        if start > self.length:
            raise RuntimeError(
                f"the latent plan has Z for positions [0, {self.length}) but the model is fed position {start}"
            )
        end, new = start + length, max(start, self.length)
        known = torch.cat(self.used, dim=1)[:, start:new] if new > start else None  # (B, new - start, ...)
        if known is not None and new == end:  # every position already planned
            return known
        explicit = self.explicit
        if explicit is not None and new < explicit.shape[1] < end:
            raise ValueError(
                f"explicit latents cover positions [0, {explicit.shape[1]}) but the model is fed "
                f"[{start}, {end}) in one call"
            )
        if new == 0 and self.prompt_source == LatentChoice.ENCODER and (explicit is None or not explicit.shape[1]):
            return LatentChoice.ENCODER  # the model samples it, and the caller records it
        if self.prompt_source == LatentChoice.POLICY:
            if known is not None:
                raise ValueError("Z from the policy is drawn as positions are fed: decode with the KV cache")
            previous = self.used[-1][:, -1] if new else None  # (B, ...) the Z fed at new - 1, the last recorded
            return PolicyDraw(self._space().policy_noise(self.policy_words(new, end, device)), previous)
        fresh = planned_z(
            self._space(),
            self.batch_size,
            new,
            end,
            explicit=explicit,
            keys=self.keys,
            generators=self.generators,
            device=device if known is None else known.device,
        )
        return fresh if known is None else torch.cat([known, fresh], dim=1)

    def draw(self, length: int, device=None, start: int = 0) -> Tensor:
        """(B, length, *value_shape) prior Z for positions [start, start + length) (model.latent.dispenser): row i's
        from its counter-based stream at those positions with `keys`, else from generators[i]."""
        return prior_z(
            self._space(),
            self.batch_size,
            start,
            start + length,
            keys=self.keys,
            generators=self.generators,
            device=device,
        )

    def policy_words(self, start: int, end: int, device=None) -> Tensor:
        """(B, end - start, policy_words) the rows' random words for the policy's draws at positions [start, end):
        their counter-based LATENT streams with `keys`, else draws of generators[i] (or the global RNG)."""
        space = self._space()
        if self.keys is not None:
            positions = torch.arange(start, end, device=self.keys.device)[None, :]
            return counter_policy_words(space, self.keys[:, None], positions)
        out = torch.empty(self.batch_size, end - start, space.policy_words, dtype=torch.int64, device=device)
        return fill_rows_(out, lambda row, g: row.random_(-(2**63), 2**63 - 1, generator=g), self.generators)

    def _space(self) -> LatentSpace:
        """The latent space that draws Z, or a RuntimeError for a baseline's plan, which draws none."""
        if self.space is None:
            raise RuntimeError("a baseline decoder has no latent space: its plan draws no Z")
        return self.space

    def record(self, start: int, latents: Tensor | None) -> None:
        """Keep the Z the model used for positions [start, ...) that the plan had not recorded yet."""
        if latents is None:
            return
        new = latents[:, self.length - start :]
        new = new.expand(self.batch_size, *new.shape[1:])
        if new.shape[1]:
            self.used.append(new)
            self.length += new.shape[1]

    def latents(self, length: int | None = None) -> Tensor | None:
        """(B, length, *value_shape) the Z used at the first `length` positions (all recorded ones by
        default); None for a baseline."""
        if self.space is None:
            return None
        used = (
            torch.cat(self.used, dim=1)
            if self.used
            else torch.zeros(self.batch_size, 0, *self.space.value_shape, dtype=self.space.value_dtype)
        )
        return used if length is None else used[:, :length]
