"""Where Z comes from, as every entry point names it, resolved in one place.

    "encoder"    the prompt's Z from the encoder's posterior (the paper's prefill), each new Z from the prior
    "prior"      every Z from the uniform prior
    "shared"     one prior Z sequence for every row (the paper's green groups)
    "reference"  Z sampled from the encoder's posterior on a reference text ("in the manner of" it)
    indices      a (B or 1, T) integer tensor of explicit Z

`resolve_latents` turns a choice into what the model's forward and `LatentPlan` take: the source of
the prompt's Z and, for the last three, explicit indices. `free-transformer generate`, the Hugging Face
`generate`, benchmark scoring (CONTEXT_CHOICES) and validation (latent.ENCODER, latent.PRIOR) name Z
through it. The spelling of 0.1, "posterior", means "encoder" (with a DeprecationWarning) until 0.3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..model.latent import ENCODER, PRIOR, LatentSource, latent_source
from ..model.latent.sources import DEPRECATED_SOURCES
from .generate import infer_latents, shared_prior_latents

LatentChoice = Literal["encoder", "prior", "shared", "reference"]
CHOICES: tuple[str, ...] = ("encoder", "prior", "shared", "reference")
CONTEXT_CHOICES: tuple[str, ...] = (ENCODER, PRIOR)  # what needs no model to resolve: a prompt's or a context's Z


@dataclass(frozen=True)
class ResolvedLatents:
    prompt_source: LatentSource  # "encoder" or "prior": the Z of the prompt when no explicit Z covers it
    explicit: Tensor | None = None  # (B or 1, N) indices of positions [0, N), unchecked against the batch


def check_choice(choice, *, where: str = "latents", allowed: tuple[str, ...] = CHOICES) -> None:
    """Raise a ValueError naming the allowed choices unless `choice` is one of them: with every choice
    allowed, also None (encoder) or an index tensor; a context's Z (CONTEXT_CHOICES) is named only."""
    anything = allowed == CHOICES
    if choice is None or isinstance(choice, Tensor):
        if anything:
            return
    elif choice in allowed or (anything and choice in DEPRECATED_SOURCES):
        return
    names = ", ".join(repr(c) for c in allowed)
    raise ValueError(f"{where} must be None, {names} or an index tensor, got {choice!r}" if anything
                     else f"{where} must be one of {names}, got {choice!r}")


def resolve_latents(model, choice: LatentChoice | Tensor | None, *, length: int = 0, reference=None,
                    generator: torch.Generator | None = None, where: str = "latents") -> ResolvedLatents:
    """`choice` (None: "encoder") for a generation whose fed positions number `length`; `reference`, (B or
    1, T) token ids, for "reference"; `generator` for the one-off draws of "shared" and "reference"."""
    check_choice(choice, where=where)
    if reference is not None and choice not in (None, "reference"):
        raise ValueError(f"a reference text goes with {where}='reference', not {choice!r}")
    if choice is None or (isinstance(choice, str) and choice not in ("shared", "reference")):
        return ResolvedLatents(latent_source(choice or ENCODER, where=where))
    if model.latent is None:
        raise ValueError(f"{where} {choice if isinstance(choice, str) else 'indices'} need a Free Transformer "
                         "(latent_bits > 0); this is a baseline decoder")
    if isinstance(choice, Tensor):
        return ResolvedLatents(ENCODER, choice)
    if choice == "shared":
        return ResolvedLatents(ENCODER, shared_prior_latents(model, length, generator))
    if reference is None:
        raise ValueError(f"{where}='reference' needs a reference text")
    return ResolvedLatents(ENCODER, infer_latents(model, reference, generator))
