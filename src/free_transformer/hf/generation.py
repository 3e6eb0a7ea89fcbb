"""What `FreeTransformerForCausalLM.generate` adds to Hugging Face's decoding loop: where every Z_t
comes from (`LatentPlan`), and per-row seeded sampling (`RowSeededSampler`).

The rules are those of `free_transformer.generate`: the prompt is prefilled with Z from the
encoder's posterior (or the prior, or explicit indices), every new position's Z_t is drawn from the
uniform prior once, when its token is fed, and then lives in the cache with its keys and values; it
is never redrawn. A plan records every Z it hands out, so generate can return them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import LogitsProcessor

from ..generate import GenerationConfig, sample_next
from ..latent import Generators, uniform_latents
from ..model import LatentSource


class LatentPlan:
    """Z for each position of one generation, handed to the model's forward at every step.

    explicit: (B, N) indices for positions [0, N), or None. Positions not covered take
    `prompt_source` in the prefill (start = 0) and the uniform prior afterwards, drawn with
    `generators` (one per row) or the global RNG, in the same calls as `free_transformer.generate`.
    """

    def __init__(
        self,
        batch_size: int,
        latent_bits: int,
        *,
        explicit: Tensor | None = None,
        prompt_source: LatentSource = "posterior",
        generators: Generators = None,
    ):
        self.batch_size = batch_size
        self.latent_bits = latent_bits
        self.explicit = explicit
        self.prompt_source = prompt_source
        self.generators = generators
        self.used: list[Tensor] = []  # (B, t) chunks, the Z of positions [0, length)
        self.length = 0

    def source(self, start: int, length: int) -> LatentSource | Tensor:
        """What the model's forward gets as `latents` for positions [start, start + length).

        Positions already recorded keep their Z (a forward without a cache re-feeds the whole
        sequence at every step); the others take explicit indices where given, else the prompt
        source at position 0, else one prior draw each."""
        if start > self.length:
            raise RuntimeError(f"the latent plan has Z for positions [0, {self.length}) but the model is fed "
                               f"position {start}")
        end, new = start + length, max(start, self.length)
        known = torch.cat(self.used, dim=1)[:, start:new] if new > start else None  # (B, new - start)
        explicit = self.explicit
        if new == end:
            return known
        if explicit is not None and new < explicit.shape[1]:
            if end > explicit.shape[1]:
                raise ValueError(f"explicit latents cover positions [0, {explicit.shape[1]}) but the model is fed "
                                 f"[{start}, {end}) in one call")
            fresh = explicit[:, new:end]
        elif new == 0:
            return self.prompt_source
        elif known is None:
            return "prior"
        else:
            fresh = uniform_latents((self.batch_size, end - new), self.latent_bits, generator=self.generators,
                                    device=known.device)
        return fresh if known is None else torch.cat([known, fresh], dim=1)

    def record(self, start: int, latent_index: Tensor) -> None:
        """Keep the Z the model used for positions [start, ...) that the plan had not recorded yet."""
        new = latent_index[:, self.length - start :].expand(self.batch_size, -1)
        if new.shape[1]:
            self.used.append(new)
            self.length += new.shape[1]

    def latents(self, length: int | None = None) -> Tensor:
        """(B, length) the Z used at the first `length` positions (all recorded ones by default)."""
        used = torch.cat(self.used, dim=1) if self.used else torch.zeros(self.batch_size, 0, dtype=torch.int64)
        return used if length is None else used[:, :length]


class RowSeededSampler(LogitsProcessor):
    """Samples the next token of row i with generators[i], as `free_transformer.generate` does, and
    returns scores that are 0 at the chosen token and -inf elsewhere, so that Hugging Face's greedy
    step (argmax) takes exactly that token. It must be the last processor and generate must run with
    do_sample=False (FreeTransformerForCausalLM.generate arranges both when `seeds` is given)."""

    def __init__(self, sampling: GenerationConfig, generators: Sequence[torch.Generator]):
        self.sampling = sampling
        self.generators = generators

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        token = sample_next(scores, self.sampling, self.generators)  # (B,)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, token[:, None], 0.0)
