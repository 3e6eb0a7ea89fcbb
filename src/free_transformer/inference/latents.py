"""Where Z comes from, resolved: a user's choice (a `LatentChoice`, free_transformer.base.latent_choice, parsed
once where it enters; explicit values parsed by `parse_latents`) becomes, in `resolve_latents`, what the
model's forward takes, and a `LatentPlan` (free_transformer.model.latent.plan, imported here too) hands it out
position by position.

    ENCODER      the prompt's Z from the encoder's posterior (the paper's prefill), each new Z from the prior
    PRIOR        every Z from the prior
    SHARED       one prior Z sequence for every row (the paper's green groups): `shared_prior_latents`
    REFERENCE    Z sampled from the encoder's posterior on a reference text ("in the manner of" it): `infer_latents`
    values       a (B or 1, N, *value_shape) tensor of explicit Z: for the binary kinds (B or 1, N) integer
                 indices, each in [0, 2^H); for the gaussian kind (B or 1, N, H) real vectors

What a value of Z is, how the prior draws it and how explicit values are checked is the model's latent
space's (free_transformer.model.latent.space): nothing here knows its form. The model's forward receives a
resolved source (LatentChoice.ENCODER, LatentChoice.PRIOR or checked values) and checks it no further.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base.latent_choice import CONTEXT, LatentChoice, RowChoice, as_context, named
from ..model.latent import Generators, LatentPlan, LatentSource
from ..model.transformer import FreeTransformer


def parse_latents(
    value: object, *, where: str = "latents", allowed: tuple[LatentChoice, ...] = ()
) -> LatentChoice | Tensor:
    """What an entry point that also takes explicit values reads (`generate()`, the Hugging Face calls): a
    tensor, or a nested list made one (its values are checked when resolved), or a named choice
    (`LatentChoice.parse`: one of `allowed`, default every choice; else a one-line ValueError)."""
    if isinstance(value, Tensor):
        return value
    if value is not None and not isinstance(value, str):  # nested lists, arrays
        with contextlib.suppress(TypeError, ValueError, RuntimeError):  # not numbers: refused below
            return torch.as_tensor(value)
    try:
        return LatentChoice.parse(value, where=where, allowed=allowed)
    except ValueError:
        requirement = LatentChoice.requirement(value, allowed)
        raise ValueError(f"{where} {requirement} or a tensor of values (B or 1, N, ...), got {value!r}") from None


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


def refuse_on_baseline(choice: LatentChoice | Tensor, is_free: bool, where: str = "latents") -> None:
    """A one-line ValueError when a named choice that is not a context's Z (SHARED, REFERENCE) meets a
    baseline decoder (is_free false: ModelConfig.is_free), which has no Z to share or infer."""
    if not is_free and isinstance(choice, str) and choice not in CONTEXT:
        raise ValueError(
            f"{named(where, choice)} needs a Free Transformer (latent_units > 0); this is a baseline decoder"
        )


def refuse_without_policy(model: FreeTransformer, where: str = "latents") -> None:
    """A one-line ValueError when LatentChoice.POLICY meets a model without a policy head (model.latent.policy)."""
    if model.latent is None or model.latent.policy is None:
        raise ValueError(
            f"{named(where, LatentChoice.POLICY)} needs a run with a learned prior or policy over Z "
            "(free-transformer rl); this run has none"
        )


@dataclass(frozen=True)
class ResolvedLatents:
    # ENCODER or PRIOR: the Z of the prompt when no explicit Z covers it; POLICY: every Z from the policy head
    prompt_source: RowChoice
    explicit: Tensor | None = None  # (batch_size or 1, N, *value_shape) Z of positions [0, N), N >= prompt length


def resolve_latents(
    model: FreeTransformer,
    choice: LatentChoice | Tensor | None,
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
    `reference`, (B or 1, T >= prompt_length) token ids, goes with REFERENCE; `generator` makes the one-off
    draws of SHARED and REFERENCE. Every check of the choice against the model is here, before any model work."""
    choice = LatentChoice.ENCODER if choice is None else choice
    is_reference = choice == LatentChoice.REFERENCE
    text = "--reference TEXT" if where.startswith("--") else "a reference text"  # as the command line names it
    if reference is not None and not is_reference:
        raise ValueError(f"{text} goes with {named(where, 'reference')}, not {named(where, choice)}")
    if isinstance(choice, str) and choice in CONTEXT:
        return ResolvedLatents(as_context(choice))
    if isinstance(choice, Tensor):
        rows = batch_size or (choice.shape[0] if choice.dim() >= 2 else 1)
        return ResolvedLatents(LatentChoice.ENCODER, check_latent_values(model, choice, rows, min_length=prompt_length))
    refuse_on_baseline(choice, model.config.is_free, where)
    if choice == LatentChoice.POLICY:
        refuse_without_policy(model, where)
        return ResolvedLatents(LatentChoice.POLICY)  # drawn in the decoding engine's step, from the prefix
    if choice == LatentChoice.SHARED:
        return ResolvedLatents(LatentChoice.ENCODER, shared_prior_latents(model, length, generator))
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
    return ResolvedLatents(LatentChoice.ENCODER, infer_latents(model, reference, generator))


def plan_latents(
    model: FreeTransformer,
    choice: LatentChoice | Tensor | None,
    batch_size: int,
    prompt_length: int,
    *,
    length: int,
    reference=None,
    generator: torch.Generator | None = None,
    generators: Generators = None,
    keys: Tensor | None = None,
    where: str = "latents",
) -> LatentPlan:
    """The plan of one generation of `batch_size` rows from a `prompt_length`-token prompt, `choice`
    resolved once (`resolve_latents`); the new positions' prior Z come from the rows' counter-based `keys`
    (B,) when given, else from `generators` (one per row)."""
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
        batch_size,
        model.latent_space,
        explicit=explicit,
        prompt_source=resolved.prompt_source,
        generators=generators,
        keys=keys,
    )


def forward_source(model: FreeTransformer, latents: object, batch_size: int, length: int, start: int) -> LatentSource:
    """What one forward of `length` tokens from position `start` takes, for a caller that names Z per call
    (the Hugging Face forward): None is the encoder for a sequence from position 0 and the prior for a
    continuation; "encoder", "prior" or (batch_size or 1, length, *value_shape) values otherwise. A baseline
    ignores "encoder" and "prior" and refuses values."""
    if latents is None:
        return LatentChoice.ENCODER if start == 0 else LatentChoice.PRIOR
    choice = parse_latents(latents, allowed=CONTEXT)
    if isinstance(choice, Tensor):
        return check_latent_values(model, choice, batch_size, min_length=length)
    return as_context(choice)  # one of CONTEXT, as parsed


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
    return model(reference, latents=LatentChoice.ENCODER, generator=generator).latents
