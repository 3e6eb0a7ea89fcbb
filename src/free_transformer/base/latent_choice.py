"""Where Z comes from: the one type a user's choice is parsed into, once, where it enters (the command line,
generate --interactive, a completion request, evaluation's settings, the Python and Hugging Face calls) and
then passed down as it is. The model's forward takes its ENCODER or PRIOR (or explicit values:
free_transformer.model.latent.sources); SHARED and REFERENCE are drawn before decoding
(free_transformer.inference.latents). No torch here: --help reads it."""

from __future__ import annotations

from enum import Enum
from typing import Literal, get_args

from .compat import LATENT_CHOICES_RENAMED


class LatentChoice(str, Enum):
    """A named choice of Z. A str, so that it compares, hashes, prints and reprs (JSON, messages, --help) as its
    name: LatentChoice.PRIOR == "prior"."""

    ENCODER = "encoder"  # the prompt's Z from the encoder's posterior (the paper's prefill), each new Z from the prior
    PRIOR = "prior"  # every Z from the prior
    SHARED = "shared"  # one prior Z sequence for every row (the paper's green groups)
    REFERENCE = "reference"  # Z from the encoder's posterior on a reference text ("in the manner of" it)
    POLICY = "policy"  # every Z from the run's learned prior or policy over Z (model.latent.policy)

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def parse(cls, value: object, *, where: str = "latents", allowed: tuple[LatentChoice, ...] = ()) -> LatentChoice:
        """`value`, a name, as the choice it names: one of `allowed` (default: every choice), else a one-line
        ValueError, "<where> <requirement>, got <value>"."""
        allowed = allowed or tuple(cls)
        if isinstance(value, str) and value in allowed:
            return cls(value)
        raise ValueError(f"{where} {cls.requirement(value, allowed)}, got {value!r}")

    @classmethod
    def requirement(cls, value: object, allowed: tuple[LatentChoice, ...] = ()) -> str:
        """What a choice of `allowed` must be, as an error says it, with today's name of a spelling that 0.3
        stopped reading."""
        allowed = allowed or tuple(cls)
        names = ", ".join(repr(str(choice)) for choice in allowed)
        renamed = LATENT_CHOICES_RENAMED.get(value) if isinstance(value, str) else None
        hint = f" ({value!r} is now called {str(renamed)!r})" if renamed in allowed else ""
        return f"must be one of {names}{hint}"


# The choices of a context's Z (a prompt's, an evaluated context's), which need no model to resolve: what a
# setting of this set is typed by, so that its --help lists them.
ContextChoice = Literal[LatentChoice.ENCODER, LatentChoice.PRIOR]
CONTEXT: tuple[LatentChoice, ...] = get_args(ContextChoice)
# What a row of the decoding engine draws its prompt's Z from (explicit values aside): a context's choice, or the
# run's learned prior or policy, whose Z at t depends on the prefix and is drawn in the step
# (free_transformer.inference.row_draws).
RowChoice = Literal[LatentChoice.ENCODER, LatentChoice.PRIOR, LatentChoice.POLICY]
ROW_CHOICES: tuple[LatentChoice, ...] = get_args(RowChoice)


def as_context(choice: LatentChoice) -> ContextChoice:
    """A choice that is a context's (one of CONTEXT), typed as one (what the model's forward takes); a ValueError
    for a choice drawn before decoding (SHARED, REFERENCE: resolve_latents draws them)."""
    if choice == LatentChoice.ENCODER:
        return LatentChoice.ENCODER
    if choice == LatentChoice.PRIOR:
        return LatentChoice.PRIOR
    raise ValueError(f"{choice!r} is not a context's Z: {', '.join(map(repr, CONTEXT))}")


def as_row_choice(choice: LatentChoice) -> RowChoice:
    """A choice a decoding engine's row draws from (a context's, or POLICY), typed as one; a ValueError for SHARED
    and REFERENCE, which are drawn before decoding."""
    return LatentChoice.POLICY if choice == LatentChoice.POLICY else as_context(choice)


def named(where: str, value: object) -> str:
    """How an error names a setting and its value: `--latents shared` on the command line (`/latents shared` in
    generate --interactive), `latents='shared'` elsewhere; a value that is not a name is explicit latents."""
    if not isinstance(value, str):
        return "explicit latents"
    return f"{where} {value}" if where.startswith(("--", "/")) else f"{where}={str(value)!r}"
