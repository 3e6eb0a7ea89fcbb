"""Where Z comes from, as every entry point names it: parsed by `parse_latents`, resolved once by
`resolve_latents`, and handed out position by position by a `LatentPlan` (free_transformer.model.latent.plan,
imported here too).

    "encoder"    the prompt's Z from the encoder's posterior (the paper's prefill), each new Z from the prior
    "prior"      every Z from the prior
    "shared"     one prior Z sequence for every row (the paper's green groups): `shared_prior_latents`
    "reference"  Z sampled from the encoder's posterior on a reference text ("in the manner of" it): `infer_latents`
    values       a (B or 1, N, *value_shape) tensor of explicit Z: for the binary kinds (B or 1, N) integer
                 indices, each in [0, 2^H); for the gaussian kind (B or 1, N, H) real vectors

What a value of Z is, how the prior draws it and how explicit values are checked is the model's latent
space's (free_transformer.model.latent.space): nothing here knows its form.

The entry points (`free-transformer generate --latents`, `generate(latents=...)`, `SamplingParams.latents`,
the Hugging Face `forward` and `generate`, evaluation's `latents` setting) parse what the
user wrote with `parse_latents`; what a context needs no model to resolve is CONTEXT_CHOICES. The model's
forward receives a resolved source (free_transformer.model.latent: ENCODER, PRIOR or checked values)
and checks it no further. Old spellings (DEPRECATED_LATENT_CHOICES, base/compat.py) work, with one
DeprecationWarning per parse, until REMOVED_IN.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..base.compat import DEPRECATED_LATENT_CHOICES, REMOVED_IN
from ..model.latent import ENCODER, PRIOR, Generators, LatentPlan, LatentSource
from ..model.transformer import FreeTransformer
from .params import CONTEXT_LATENTS

LatentChoice = Literal["encoder", "prior", "shared", "reference"] | Tensor
CHOICES: tuple[str, ...] = (ENCODER, PRIOR, "shared", "reference")
CONTEXT_CHOICES = CONTEXT_LATENTS  # what needs no model to resolve: a prompt's or a context's Z


def named(where: str, value) -> str:
    """How an error names a setting and its value: `--latents shared` on the command line (`/latents shared`
    in generate --interactive), `latents='shared'` elsewhere."""
    if isinstance(value, Tensor):
        return "explicit latents"
    return f"{where} {value}" if where.startswith(("--", "/")) else f"{where}={value!r}"


def parse_latents(
    value, *, where: str = "latents", allowed: tuple[str, ...] = CHOICES, indices: bool = True
) -> LatentChoice:
    """The canonical form of a user's choice of Z: one of `allowed`, or (with `indices`) a tensor of values
    (a nested list becomes one; its values are checked when resolved). An old spelling gives one
    DeprecationWarning; anything else a one-line ValueError naming the allowed values."""
    if indices and isinstance(value, Tensor):
        return value
    if indices and value is not None and not isinstance(value, str):  # nested lists, arrays
        with contextlib.suppress(TypeError, ValueError, RuntimeError):  # not numbers: refused below
            return torch.as_tensor(value)
    if isinstance(value, str) and value in DEPRECATED_LATENT_CHOICES and DEPRECATED_LATENT_CHOICES[value] in allowed:
        new = DEPRECATED_LATENT_CHOICES[value]
        warnings.warn(
            f"{named(where, value)} is deprecated and will be removed in {REMOVED_IN}; use {named(where, new)}",
            DeprecationWarning,
            stacklevel=3,
        )
        return new
    if isinstance(value, str) and value in allowed:
        return value
    names = ", ".join(repr(name) for name in allowed) + (" or a tensor of values (B or 1, N, ...)" * indices)
    raise ValueError(f"{where} must be one of {names}; got {value!r}")


def check_latent_values(model: FreeTransformer, latents, batch_size: int, *, min_length: int = 0) -> Tensor:
    """Explicit latents as a (batch_size, N, *value_shape) tensor on the model's device, N >= min_length,
    each value checked by the model's latent space. Reads the values on the host: called once per
    generation, never by the model's forward."""
    space = model.latent_space
    if space is None:
        raise ValueError("explicit latents need a Free Transformer (latent_units > 0); this is a baseline decoder")
    latents = torch.as_tensor(latents, device=model.rope_cos.device)
    shape = ", ".join(["N", *map(str, space.value_shape)])
    if (
        latents.dim() != 2 + len(space.value_shape)
        or latents.shape[0] not in (1, batch_size)
        or latents.shape[1] < min_length
    ):
        raise ValueError(
            f"latents of kind {space.kind} must have shape ({batch_size} or 1, {shape}) with "
            f"N >= {min_length}, got {tuple(latents.shape)} {latents.dtype}"
        )
    return space.check_values(latents).expand(batch_size, *latents.shape[1:])


def refuse_on_baseline(choice: LatentChoice, is_free: bool, where: str = "latents") -> None:
    """A one-line ValueError when a named choice that is not a context's Z ("shared", "reference") meets a
    baseline decoder (is_free false: ModelConfig.is_free), which has no Z to share or infer."""
    if not is_free and isinstance(choice, str) and choice not in CONTEXT_CHOICES:
        raise ValueError(
            f"{named(where, choice)} needs a Free Transformer (latent_units > 0); this is a baseline decoder"
        )


@dataclass(frozen=True)
class ResolvedLatents:
    prompt_source: LatentSource  # ENCODER or PRIOR: the Z of the prompt when no explicit Z covers it
    explicit: Tensor | None = None  # (batch_size or 1, N, *value_shape) Z of positions [0, N), N >= prompt length


def resolve_latents(
    model: FreeTransformer,
    choice: LatentChoice | None,
    *,
    length: int = 0,
    reference=None,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    prompt_length: int = 0,
    where: str = "latents",
) -> ResolvedLatents:
    """`choice` (None: "encoder") for `batch_size` rows (default: as many as the indices or the reference
    have) whose first `prompt_length` positions are the prompt and whose fed positions number `length`.
    `reference`, (B or 1, T >= prompt_length) token ids, goes with "reference"; `generator` makes the
    one-off draws of "shared" and "reference". Every check of the choice is here, before any model work."""
    choice = ENCODER if choice is None else parse_latents(choice, where=where)
    is_reference = isinstance(choice, str) and choice == "reference"
    text = "--reference TEXT" if where.startswith("--") else "a reference text"  # as the command line names it
    if reference is not None and not is_reference:
        raise ValueError(f"{text} goes with {named(where, 'reference')}, not {named(where, choice)}")
    if isinstance(choice, str) and choice in CONTEXT_CHOICES:
        return ResolvedLatents(choice)
    if isinstance(choice, Tensor):
        rows = batch_size or (choice.shape[0] if choice.dim() >= 2 else 1)
        return ResolvedLatents(ENCODER, check_latent_values(model, choice, rows, min_length=prompt_length))
    refuse_on_baseline(choice, model.config.is_free, where)
    if choice == "shared":
        return ResolvedLatents(ENCODER, shared_prior_latents(model, length, generator))
    if reference is None:
        raise ValueError(f"{named(where, 'reference')} needs {text}")
    reference = torch.as_tensor(reference, dtype=torch.int64, device=model.rope_cos.device)
    if reference.dim() != 2 or reference.shape[0] not in (1, batch_size or reference.shape[0]):
        raise ValueError(
            f"the reference text must be token ids of shape ({batch_size or 'B'} or 1, T), got {tuple(reference.shape)}"
        )
    if reference.shape[1] < max(prompt_length, 1):
        raise ValueError(
            f"the reference text must be at least as long as the prompt ({prompt_length} tokens), "
            f"got {reference.shape[1]}"
        )
    return ResolvedLatents(ENCODER, infer_latents(model, reference, generator))


def plan_latents(
    model: FreeTransformer,
    choice: LatentChoice | None,
    batch_size: int,
    prompt_length: int,
    *,
    length: int,
    reference=None,
    generator: torch.Generator | None = None,
    generators: Generators = None,
    where: str = "latents",
) -> LatentPlan:
    """The plan of one generation of `batch_size` rows from a `prompt_length`-token prompt, `choice`
    resolved once (`resolve_latents`); `generators` (one per row) draw the new positions' prior Z."""
    resolved = resolve_latents(
        model,
        choice,
        length=length,
        reference=reference,
        generator=generator,
        batch_size=batch_size,
        prompt_length=prompt_length,
        where=where,
    )
    explicit = resolved.explicit
    if explicit is not None:
        explicit = explicit.expand(batch_size, *explicit.shape[1:])
    return LatentPlan(
        batch_size, model.latent_space, explicit=explicit, prompt_source=resolved.prompt_source, generators=generators
    )


def forward_source(
    model: FreeTransformer, latents: LatentChoice | None, batch_size: int, length: int, start: int
) -> LatentSource:
    """What one forward of `length` tokens from position `start` takes, for a caller that names Z per call
    (the Hugging Face forward): None is the encoder for a sequence from position 0 and the prior for a
    continuation; "encoder", "prior" or (batch_size or 1, length, *value_shape) values otherwise. A baseline
    ignores "encoder" and "prior" and refuses values."""
    if latents is None:
        return ENCODER if start == 0 else PRIOR
    choice = parse_latents(latents, allowed=CONTEXT_CHOICES)
    if isinstance(choice, Tensor):
        return check_latent_values(model, choice, batch_size, min_length=length)
    return choice


@torch.no_grad()
def shared_prior_latents(model: FreeTransformer, length: int, generator: torch.Generator | None = None) -> Tensor:
    """(1, length, *value_shape) Z drawn once from the prior, to share across a batch."""
    if not model.config.is_free:
        raise ValueError("latents exist only in a Free Transformer (latent_units > 0)")
    return LatentPlan(1, model.latent_space, generators=generator).draw(length, model.rope_cos.device)


@torch.no_grad()
def infer_latents(
    model: FreeTransformer, reference: Tensor | Sequence[Sequence[int]], generator: torch.Generator | None = None
) -> Tensor:
    """(B, T, *value_shape) Z sampled from the encoder's posterior Q(Z | reference) for a (B, T) reference text."""
    if not model.config.is_free:
        raise ValueError("latents exist only in a Free Transformer (latent_units > 0)")
    reference = torch.as_tensor(reference, dtype=torch.int64, device=model.rope_cos.device)
    model.check_tokens(reference)
    return model(reference, latents=ENCODER, generator=generator).latents
