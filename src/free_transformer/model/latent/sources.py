"""Where Z comes from: one vocabulary for the model, `generate`, evaluation, the CLI and the Hugging Face
wrapper, the checks of explicit latents, and the decoding plan (which Z each position gets).

    "encoder"   Z_t sampled from the encoder's posterior Q(Z | S): training and KV-cache prefill.
                Needs the whole sequence (the encoder is non-causal).
    "prior"     every Z_t drawn uniformly and independently, P(Z_t = z) = 2^-H.
    indices     a (B or 1, T) integer tensor of explicit Z_t in [0, 2^H). `shared_prior_latents` (one
                prior sequence for a whole batch: the paper's green groups) and `infer_latents` (the
                encoder's posterior on a reference text) in free_transformer.inference.generate build them.

The old spelling "posterior" (for "encoder") still works, with a DeprecationWarning, until 0.3.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import Tensor

from .sampling import Generators, uniform_latents

ENCODER: Literal["encoder"] = "encoder"
PRIOR: Literal["prior"] = "prior"
LatentSource = Literal["encoder", "prior"] | Tensor
DEPRECATED_SOURCES = {"posterior": ENCODER}


def latent_source(value: str | Tensor, *, where: str = "latents") -> LatentSource:
    """The canonical form of a latent source; old spellings are accepted with a DeprecationWarning."""
    if isinstance(value, Tensor):
        return value
    if value in DEPRECATED_SOURCES:
        new = DEPRECATED_SOURCES[value]
        warnings.warn(f"{where}={value!r} is deprecated and will be removed in 0.3; use {new!r}",
                      DeprecationWarning, stacklevel=3)
        return new
    if value not in (ENCODER, PRIOR):
        raise ValueError(f"{where} must be 'encoder', 'prior' or a tensor of latent indices, got {value!r}")
    return value


def check_latent_indices(latents, bits: int, batch_size: int, *, min_length: int = 0, device=None) -> Tensor:
    """Explicit latents as a (batch_size, N) int64 tensor, N >= min_length, every index in [0, 2^bits).

    The range check reads the values on the host: entry points (generate, the CLI, the HF wrapper)
    call this once; the model's forward checks shapes only, so that it never synchronises."""
    if bits == 0:
        raise ValueError("explicit latents need a Free Transformer (latent_bits > 0); this is a baseline decoder")
    latents = torch.as_tensor(latents, device=device)
    if latents.is_floating_point() or latents.dtype == torch.bool or latents.dim() != 2 \
            or latents.shape[0] not in (1, batch_size) or latents.shape[1] < min_length:
        raise ValueError(f"latents must be integer indices of shape ({batch_size} or 1, N >= {min_length}), "
                         f"got {tuple(latents.shape)} {latents.dtype}")
    if latents.numel() and (int(latents.min()) < 0 or int(latents.max()) >= 2**bits):
        raise ValueError(f"latent indices must lie in [0, 2^{bits}), got min {int(latents.min())} max {int(latents.max())}")
    return latents.to(torch.int64).expand(batch_size, -1)


class LatentPlan:
    """Z for each position of one generation, handed to the model's forward at every step; the one
    decoding rule of `free_transformer.inference.generate` and `FreeTransformerForCausalLM.generate`.

    Positions [0, N) take the explicit (B, N) indices when given. Otherwise the prompt (the call at
    position 0) takes `prompt_source`, and every later position one uniform draw, made once when its
    token is fed (with `generators`, one per row, or the global RNG) and then kept: a forward that
    re-feeds positions already planned (Hugging Face without a cache) gets the same Z again. The plan
    records every Z the model used, so generate can return them. With bits = 0 (a baseline) it
    hands out "prior", which a baseline ignores, and records nothing.
    """

    def __init__(self, batch_size: int, bits: int, *, explicit: Tensor | None = None,
                 prompt_source: LatentSource = ENCODER, generators: Generators = None):
        self.batch_size = batch_size
        self.bits = bits
        self.explicit = explicit  # (B, N), checked by check_latent_indices
        self.prompt_source = latent_source(prompt_source, where="prompt latents")
        self.generators = generators
        self.used: list[Tensor] = []  # (B, t) chunks, the Z of positions [0, length)
        self.length = 0

    def source(self, start: int, length: int, device=None) -> LatentSource:
        """What the model's forward gets as `latents` for positions [start, start + length)."""
        if self.bits == 0:
            return PRIOR
        if start > self.length:
            raise RuntimeError(f"the latent plan has Z for positions [0, {self.length}) but the model is fed "
                               f"position {start}")
        end, new = start + length, max(start, self.length)
        known = torch.cat(self.used, dim=1)[:, start:new] if new > start else None  # (B, new - start)
        if new == end:
            return known
        explicit = self.explicit
        if explicit is not None and new < explicit.shape[1]:
            if end > explicit.shape[1]:
                raise ValueError(f"explicit latents cover positions [0, {explicit.shape[1]}) but the model is fed "
                                 f"[{start}, {end}) in one call")
            fresh = explicit[:, new:end]
        elif new == 0:
            return self.prompt_source
        else:
            fresh = uniform_latents((self.batch_size, end - new), self.bits, generator=self.generators,
                                    device=device if known is None else known.device)
        return fresh if known is None else torch.cat([known, fresh], dim=1)

    def record(self, start: int, latent_index: Tensor | None) -> None:
        """Keep the Z the model used for positions [start, ...) that the plan had not recorded yet."""
        if latent_index is None:
            return
        new = latent_index[:, self.length - start :].expand(self.batch_size, -1)
        if new.shape[1]:
            self.used.append(new)
            self.length += new.shape[1]

    def latents(self, length: int | None = None) -> Tensor | None:
        """(B, length) the Z used at the first `length` positions (all recorded ones by default);
        None for a baseline."""
        if self.bits == 0:
            return None
        used = torch.cat(self.used, dim=1) if self.used else torch.zeros(self.batch_size, 0, dtype=torch.int64)
        return used if length is None else used[:, :length]
