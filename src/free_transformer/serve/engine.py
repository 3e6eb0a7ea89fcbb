"""A loaded model behind the completions API: a request is checked into a `Plan` (every refusal a
`RequestError` with one line, before any sampling), whose rows the scheduler (free_transformer.serve.batcher)
hands to the decoding engine, batched with every other request's.

Completion i of prompt p samples with its own seed, sample_seed(seed, p, i) (free_transformer.base.seeding): a
request with a seed gives the same completions again (OpenAI's meaning of the seed), each of its prompts and
samples its own random stream, none depending on streaming or on the batch, and equal to `free-transformer
generate --seed SEED`'s with the same prompts (up to float rounding)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from ..base.latent_choice import ContextChoice, LatentChoice
from ..base.seeding import sample_seed
from ..data.tokenizer import Tokenizer
from ..inference.batches import prepare_prompts
from ..inference.params import SamplingError, SamplingParams, new_token_room
from ..model.transformer import FreeTransformer
from .batcher import Batcher, RowSpec
from .config import DEFAULT_MAX_BATCH
from .protocol import SAMPLING_NAMES, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Bounds on one request, checked before any sampling (a client cannot make the server sample for minutes
# or scan a huge stop string at every token).
MAX_COMPLETIONS = 1024  # prompts x n
MAX_STOPS = 16
MAX_STOP_CHARS = 256


class RequestError(ValueError):
    """A request the server refuses: a one-line message, the field at fault, the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(" ".join(message.split()))
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class Plan:
    """A checked request: its rows (prompt p's completion i is choice p * n + i) and what the
    response holds."""

    rows: list[RowSpec]
    stops: list[str]
    prompt_tokens: int  # every prompt's tokens, each counted once

    @property
    def completions(self) -> int:
        return len(self.rows)


class Engine:
    def __init__(
        self,
        model: FreeTransformer,
        tokenizer: Tokenizer,
        name: str,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        latents: ContextChoice = LatentChoice.ENCODER,  # a request's Z when it names none: ServeConfig.latents
        compile: bool = False,
    ):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.latents = latents
        self.batcher = Batcher(model, tokenizer, max_batch, compile=compile)

    @property
    def context(self) -> int:
        return self.model.config.max_seq_len

    def start(self) -> None:
        self.batcher.start()

    def plan(self, request: CompletionRequest) -> Plan:
        if request.model != self.name:
            raise RequestError(
                f"the model {request.model!r} does not exist; this server serves {self.name!r}",
                "model",
                404,
                "model_not_found",
            )
        ids = self._prompt_ids(request.prompt)
        if len(ids) * request.n > MAX_COMPLETIONS:
            raise RequestError(
                f"{len(ids)} prompts x n = {request.n} asks for {len(ids) * request.n} completions; "
                f"one request may ask for at most {MAX_COMPLETIONS}",
                "n",
                code="too_many_completions",
            )
        max_tokens = self._max_tokens(request, max(map(len, ids)))
        params = self._params(request, max_tokens)
        stops = params.stop
        if len(stops) > MAX_STOPS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise RequestError(
                f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters, got "
                f"{len(stops)} of at most {max(map(len, stops))}",
                "stop",
            )
        config = params.generation_config(max_tokens)
        seed, latent_seed = params.seeds()
        reference = self._reference(params.reference)
        try:  # each prompt's Z as `free-transformer generate --seed latent_seed` resolves it
            prompts = prepare_prompts(
                self.model, ids, [config] * len(ids), params.latents, reference=reference, latent_seed=latent_seed
            )
        except ValueError as error:
            raise RequestError(str(error), "reference" if reference is not None else "latents") from None
        rows = [
            RowSpec(p * request.n + i, prompt, sample_seed(seed, p, i))
            for p, prompt in enumerate(prompts)
            for i in range(request.n)
        ]
        return Plan(rows, [stop for stop in stops if stop], sum(map(len, ids)))

    def _prompt_ids(self, prompt: str | list) -> list[list[int]]:
        """Each prompt's token ids: text encoded, token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        elif prompt and isinstance(prompt[0], list):
            prompts = prompt
        else:
            prompts = [self.tokenizer.encode(text) for text in prompt]
        if not prompts or not all(prompts):
            raise RequestError("prompt must not be empty (give at least one character or token)", "prompt")
        vocab = self.model.config.vocab_size
        if any(not 0 <= token < vocab for ids in prompts for token in ids):
            raise RequestError(f"prompt: token ids must lie in [0, {vocab})", "prompt")
        return prompts

    def _max_tokens(self, request: CompletionRequest, longest: int) -> int:
        try:
            room = new_token_room(longest, self.context)
        except ValueError as error:
            raise RequestError(str(error), "prompt", code="context_length_exceeded") from None
        max_tokens = min(DEFAULT_MAX_TOKENS, room) if request.max_tokens is None else request.max_tokens
        if max_tokens > room:
            raise RequestError(
                f"max_tokens {max_tokens} does not fit: the prompt has {longest} tokens and this "
                f"model reads at most {self.context}, so max_tokens can be at most {room}",
                "max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def _params(self, request: CompletionRequest, max_tokens: int) -> SamplingParams:
        """The request's sampling fields as the SamplingParams they stand for, with the server's defaults
        (max_tokens: DEFAULT_MAX_TOKENS or fewer, latents: serve --latents, seed: a fresh random one)."""
        values = {name: getattr(request, field) for name, field in SAMPLING_NAMES.items()}
        values["latents"] = self.latents if request.latents is None else request.latents  # parsed by SamplingParams
        values["stop"] = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
        values["max_new_tokens"] = max_tokens
        values["seed"] = secrets.randbits(62) if request.seed is None else request.seed
        try:
            return SamplingParams(**values)
        except SamplingError as error:
            raise RequestError(str(error), SAMPLING_NAMES[error.field]) from None

    def _reference(self, text: str | None) -> torch.Tensor | None:
        """The reference text as (1, T) ids, T within the model's context (resolve_latents checks the rest)."""
        if text is None:
            return None
        ids = self.tokenizer.encode(text)
        if len(ids) > self.context:
            raise RequestError(f"reference has {len(ids)} tokens; this model reads at most {self.context}", "reference")
        return torch.tensor([ids])
