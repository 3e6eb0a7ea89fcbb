"""The one definition of sampling: every setting a sample depends on, declared once with its type, default,
check and docstring, and how each entry point spells it. `generate()` takes a `GenerationConfig` (a
`Sampling` plus stop token ids); `free-transformer generate` (its options and its --interactive commands),
the server's completion requests and the Hugging Face wrapper's `generate()` arguments are derived from
`SamplingParams` (a `Sampling` plus what a request adds: n, seeds, stop strings, where Z comes from), and
checked by it.

No torch here: `--help` reads these classes without loading it."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..base.latent_choice import ROW_CHOICES, LatentChoice

DEFAULT_BATCH_SIZE = 64  # rows decoded at once unless the caller says otherwise
DEFAULT_NEW_TOKENS = 64  # max_new_tokens left unset: this many, or fewer where the model's context is shorter
MAX_INT = 2**63 - 1  # every integer setting is an int64 on the device (top_k) or in torch.Generator (seeds)
MAX_SEED = MAX_INT
MAX_CANDIDATES = 128  # samples scored per prompt: best_of, --best-of, eval's --generation-samples (OpenAI's cap on n)
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (as vLLM does): logits / 1e-39 would overflow


# What differs between the samples (or best-of candidates) of one prompt (free_transformer.inference.search).
Variation = Literal["both", "latent", "tokens"]
VARIATIONS: tuple[str, ...] = get_args(Variation)


def new_token_room(prompt_length: int, context: int) -> int:
    """How many new tokens fit after a prompt of `prompt_length` tokens in a model that reads `context`
    (the last new token is never fed back); a one-line ValueError when not even one does."""
    room = context - prompt_length + 1
    if room < 1:
        raise ValueError(f"the prompt has {prompt_length} tokens; this model reads at most {context}")
    return room


def check_room(prompt_length: int, new_tokens: int, context: int, name: str = "max_new_tokens") -> None:
    """The one check of a row's context room, at every entry point that decodes: a prompt of `prompt_length`
    tokens and `new_tokens` new ones feed prompt_length + new_tokens - 1 positions (the last new token is never
    fed back), at most `context`. A one-line ValueError otherwise, the new tokens named `name` (the entry
    point's word for max_new_tokens)."""
    room = new_token_room(prompt_length, context)
    if new_tokens > room:
        raise ValueError(
            f"prompt ({prompt_length}) + {name} ({new_tokens}) - 1 exceeds max_seq_len {context}: "
            f"{name} can be at most {room}"
        )


@dataclass(frozen=True)
class Spelling:
    """How one setting is written at each entry point; None where that entry point does not offer it."""

    flag: str | None  # `free-transformer generate`'s option
    command: str | None  # `generate --interactive`'s command
    request: str | None  # the completions request's field (free_transformer.serve.protocol)
    hf: str | None  # the argument of Hugging Face's generate() / a field of its GenerationConfig
    unset: str = "off"  # the word that leaves the setting unset (None) in an interactive command
    metavar: str | None = None


def spelt(
    name: str,
    *,
    flag: str | None = "",
    command: str | None = "",
    request: str | None = "",
    hf: str | None = "",
    unset: str = "off",
    metavar: str | None = None,
) -> dict:
    """A field's metadata: its Spelling, each entry point's name derived from `name` unless given."""
    dashed = name.replace("_", "-")
    return {
        "spelling": Spelling(
            f"--{dashed}" if flag == "" else flag,
            f"/{dashed}" if command == "" else command,
            name if request == "" else request,
            name if hf == "" else hf,
            unset,
            metavar,
        )
    }


class SamplingError(ValueError):
    """A sampling setting that cannot be used: `field` names it, so that each entry point can say it its way."""

    def __init__(self, field_name: str, requirement: str, value):
        self.field, self.requirement, self.value = field_name, requirement, value
        super().__init__(f"{field_name} {requirement}, got {value!r}")

    def spelt(self, name: str) -> str:
        """The one-line message with the setting named as an entry point names it (`--top-p`, `/top-p`)."""
        return f"{name} {self.requirement}, got {self.value!r}"


def check_variation(vary: str, temperature: float) -> None:
    """A SamplingError when `vary` leaves a prompt's samples nothing to differ by: vary=tokens shares one Z between
    them, and below GREEDY_BELOW each takes the likeliest tokens. The one check of every entry point that varies
    samples (`SamplingParams`, `search.best_of`, eval's settings)."""
    if vary == "tokens" and temperature < GREEDY_BELOW:
        raise SamplingError(
            "vary", "must not be tokens at temperature 0 (the samples share one Z: greedy ones are all alike)", vary
        )


def check_policy_variation(vary: str, latents: object) -> None:
    """A SamplingError when samples whose Z come from a policy head are to share their Z or their token noise:
    vary=latent and vary=tokens draw every Z before decoding, and a policy's Z_t depends on the tokens before t.
    The one check of every entry point that varies samples, as check_variation."""
    if vary != "both" and latents == LatentChoice.POLICY:
        raise SamplingError(
            "vary", "must be both with latents policy (the head draws each Z from the tokens before it)", vary
        )


def check_seed(value, name: str = "seed") -> int:
    """The one check of a seed, at every entry point (generate(), best_of(), the CLI's options, the server's
    requests, through SamplingParams): an integer in [0, 2**63) (torch.Generator's int64), as an int. A bool, a
    float (5.0), a string ("5") or a number out of range is a one-line SamplingError naming `name`."""
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or not 0 <= value <= MAX_SEED:
        raise SamplingError(name, "must be in [0, 2**63) (an int)", value)
    return int(value)


def check_candidates(value: int, name: str) -> int:
    """The one bound on the samples scored per prompt (best_of's candidates, eval's generations): from 1 to
    MAX_CANDIDATES, else a one-line SamplingError naming `name` and the limit."""
    integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integer or not 1 <= value <= MAX_CANDIDATES:
        raise SamplingError(name, f"must be an integer from 1 to {MAX_CANDIDATES} (MAX_CANDIDATES per prompt)", value)
    return int(value)


def _check(name: str, value, ok: bool, requirement: str) -> None:
    if value is not None and not ok:
        raise SamplingError(name, requirement, value)


def _check_count(name: str, value: int | None, note: str = "") -> None:
    """An integer setting from 1 to MAX_INT (an int64)."""
    _check(name, value, value is not None and value >= 1, "must be >= 1")
    _check(name, value, value is not None and value <= MAX_INT, f"must be at most 2**63 - 1{note}")


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How many tokens follow a prompt and how each is chosen from the model's logits: the logits divided
    by the temperature, then the top-k, top-p and min-p filters in that order (as Hugging Face applies
    them), then a draw from the softmax of what is left."""

    max_new_tokens: int | None = field(
        default=None, metadata=spelt("max_new_tokens", request="max_tokens", unset="auto", metavar="N")
    )
    """Tokens to generate after each prompt, fewer if every sample hits a stop (unset: 64, or fewer where the
    model's context is shorter; the server gives 16, as OpenAI does)."""
    temperature: float = field(default=1.0, metadata=spelt("temperature", metavar="T"))
    """Softmax temperature; 0 for greedy decoding."""
    top_k: int | None = field(default=None, metadata=spelt("top_k", metavar="K"))
    """Sample among the k likeliest tokens (unset, or above the vocabulary: all)."""
    top_p: float | None = field(default=None, metadata=spelt("top_p", metavar="P"))
    """Nucleus sampling: keep the smallest set of likeliest tokens whose probability reaches top_p, in (0, 1]
    (unset: all)."""
    min_p: float | None = field(default=None, metadata=spelt("min_p", metavar="P"))
    """Min-p sampling: keep the tokens whose probability is at least min_p times the likeliest one's, in
    (0, 1] (unset: all)."""

    def __post_init__(self) -> None:
        _check("max_new_tokens", self.max_new_tokens, isinstance(self.max_new_tokens, int), "must be an integer")
        _check_count("max_new_tokens", self.max_new_tokens)
        _check("temperature", self.temperature, 0 <= self.temperature < math.inf, "must be a finite number >= 0")
        _check_count("top_k", self.top_k, " (any value above the vocabulary keeps every token)")
        _check("top_p", self.top_p, self.top_p is not None and 0 < self.top_p <= 1, "must be in (0, 1]")
        _check("min_p", self.min_p, self.min_p is not None and 0 < self.min_p <= 1, "must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        """Whether the likeliest token is taken: a temperature below GREEDY_BELOW."""
        return self.temperature < GREEDY_BELOW

    def new_tokens(self, prompt_length: int, context: int, default: int = DEFAULT_NEW_TOKENS) -> int:
        """max_new_tokens, or when unset `default` capped at what fits after the prompt (`new_token_room`;
        a one-line ValueError when not even one token does)."""
        room = new_token_room(prompt_length, context)
        return self.max_new_tokens if self.max_new_tokens is not None else min(default, room)


@dataclass(frozen=True, kw_only=True)
class GenerationConfig(Sampling):
    """What `free_transformer.generate` samples a batch of prompts with: the Sampling rule and the token ids
    that end a row."""

    stop_tokens: tuple[int, ...] = ()
    """A row stops after emitting any of these (the stop token is kept in its output)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "stop_tokens", tuple(self.stop_tokens))


@dataclass(frozen=True, kw_only=True)
class SamplingParams(Sampling):
    """Everything a request's samples depend on besides its prompts and the model: the Sampling rule, how
    many samples, their seeds, where they stop and where their Z comes from. Each entry point reads these
    settings under its own names (the `spelling` of each field's metadata): `free-transformer generate`'s
    options and --interactive commands, the completion request's fields, the Hugging Face arguments."""

    n: int = field(default=1, metadata=spelt("n", flag="--num-samples", hf=None, metavar="N"))
    """Samples of each prompt."""
    seed: int | None = field(default=None, metadata=spelt("seed", hf=None, metavar="N"))
    """The call's seed: sample i of prompt p samples with its own random stream, derived from (seed, p, i), and
    the Z of latents shared and reference is drawn with latent_seed, which is seed when unset. The same prompts
    and settings give the same samples; a server request without a seed gets a fresh random one."""
    stop: tuple[str, ...] = field(default=(), metadata=spelt("stop", hf=None, metavar="TEXT"))
    """Stop strings: a sample ends where one first appears, which is not part of it."""
    latents: LatentChoice = field(default=LatentChoice.ENCODER, metadata=spelt("latents"))
    """Free Transformer: where Z comes from. encoder: the prompt's Z from the encoder (the paper's prefill),
    each new token's from the prior, per sample; prior: every Z from the prior, per sample; shared: one prior
    Z sequence for all samples; reference: Z inferred by the encoder from the reference text; policy: every Z from
    the run's learned prior or policy over Z (free-transformer rl), drawn as it decodes."""
    reference: str | None = field(default=None, metadata=spelt("reference", hf=None, metavar="TEXT"))
    """The text whose encoder latents condition every sample, at least as long as each prompt (goes with
    latents reference)."""
    latent_seed: int | None = field(default=None, metadata=spelt("latent_seed", flag=None, command=None))
    """The seed of the one draw of latents shared and reference (unset: seed)."""
    best_of: int | None = field(default=None, metadata=spelt("best_of", hf=None, metavar="N"))
    """Candidates of each prompt, at least n: with more than n, the n of the highest mean token log-probability
    under their own Z are returned, best first (OpenAI's best_of; docs/test-time-search.md) (unset: n, every
    sample returned)."""
    vary: Variation = field(default="both", metadata=spelt("vary", hf=None))
    """Free Transformer: what differs between the samples of one prompt. both: Z and token noise; latent: Z
    only (one token-noise stream); tokens: token noise only (one Z). Other than both, or with best_of above n,
    the samples are best-of candidates (free_transformer.inference.search), whose Z is encoder, prior or (with
    vary both) policy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count("n", self.n)
        for name in ("seed", "latent_seed"):
            if getattr(self, name) is not None:
                check_seed(getattr(self, name), name)
        # the one parse of a request's choice of Z: every entry point that samples builds these settings
        try:
            object.__setattr__(self, "latents", LatentChoice.parse(self.latents))
        except ValueError:
            raise SamplingError("latents", LatentChoice.requirement(self.latents), self.latents) from None
        object.__setattr__(self, "stop", tuple(stop for stop in self.stop if stop))
        if self.best_of is not None:
            check_candidates(self.best_of, "best_of")
        _check("best_of", self.best_of, self.best_of is not None and self.best_of >= self.n, f"must be >= n ({self.n})")
        _check("vary", self.vary, self.vary in VARIATIONS, f"must be one of {', '.join(VARIATIONS)}")
        if self.searched and self.latents not in ROW_CHOICES:  # a row draws them
            raise SamplingError("latents", "must be 'encoder', 'prior' or 'policy' with best_of above n", self.latents)
        check_policy_variation(self.vary, self.latents)
        check_variation(self.vary, self.temperature)

    @property
    def candidates(self) -> int:
        """Samples decoded per prompt: best_of, or n when unset."""
        return self.n if self.best_of is None else self.best_of

    @property
    def searched(self) -> bool:
        """Whether the samples are best-of candidates (free_transformer.inference.search's seeds and Z): with
        best_of above n, or vary other than both. Otherwise sample i of prompt p samples with
        sample_seed(seed, p, i)."""
        return self.candidates > self.n or self.vary != "both"

    def seeds(self) -> tuple[int, int]:
        """(seed, latent_seed), once the entry point has set the seed (generate's --seed, the server's fresh one
        for a request without one): latent_seed unset is seed. A ValueError while the seed is unset."""
        if self.seed is None:
            raise ValueError("the sampling settings have no seed yet: the entry point sets one before sampling")
        return self.seed, self.seed if self.latent_seed is None else self.latent_seed

    def generation_config(self, max_new_tokens: int | None) -> GenerationConfig:
        """What `generate()` takes for one prompt: this rule with `max_new_tokens` (see `Sampling.new_tokens`);
        stop strings are checked by the caller (free_transformer.inference.stops)."""
        values = {item.name: getattr(self, item.name) for item in dataclasses.fields(Sampling)}
        return GenerationConfig(**{**values, "max_new_tokens": max_new_tokens})


def spelling(cls, name: str) -> Spelling:
    """How the entry points write the field `name` of `cls` (SamplingParams or Sampling)."""
    return next(item.metadata["spelling"] for item in dataclasses.fields(cls) if item.name == name)


def spelt_fields(cls, surface: str) -> dict[str, str]:
    """{field: its name at `surface` ("flag", "command", "request" or "hf")} of the fields offered there."""
    spellings = {
        item.name: item.metadata["spelling"] for item in dataclasses.fields(cls) if "spelling" in item.metadata
    }
    return {name: getattr(spelt, surface) for name, spelt in spellings.items() if getattr(spelt, surface) is not None}
