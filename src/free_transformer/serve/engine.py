"""A loaded model behind the completions API: a request is checked into a `Plan` (every refusal a
`RequestError` with one line), then sampled. Each public method holds the engine's lock: requests
use the model one at a time.

Completion i of a prompt samples with seed + i, so a prompt's completions do not depend on the other
prompts of its request, on n, or on streaming, and equal `free-transformer generate --seed SEED`'s."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..data.tokenizer import Tokenizer
from ..inference.batches import Prompt, prepare_prompts, sample_prompts
from ..inference.latents import parse_latents
from ..inference.params import SamplingError, SamplingParams, new_token_room
from ..inference.stops import stop_at, stop_check
from ..model.latent import ENCODER
from ..model.transformer import FreeTransformer
from .protocol import SAMPLING_NAMES, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REPLACEMENT = "\ufffd"  # what decoding shows for the bytes of a character not yet complete


class RequestError(ValueError):
    """A request the server refuses: a one-line message, the field at fault, the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(" ".join(message.split()))
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class Plan:
    """A checked request: what sampling needs and nothing that can still be refused."""
    prompts: list[Prompt]
    n: int
    seed: int
    stops: list[str]

    def index(self, prompt: int, sample: int) -> int:
        """The choice's index in the response: the prompts' completions in order."""
        return prompt * self.n + sample


@dataclass(frozen=True)
class Sample:
    index: int
    text: str  # the completion, cut before its first stop string
    finish_reason: str  # "stop" (a stop string) or "length" (max_tokens)
    tokens: int  # tokens generated


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed completion: text now final, and at its end the finish reason."""
    index: int
    text: str
    finish_reason: str | None = None


class Engine:
    def __init__(self, model: FreeTransformer, tokenizer: Tokenizer, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.lock = threading.Lock()

    def plan(self, request: CompletionRequest) -> Plan:
        with self.lock:  # "reference" runs the encoder
            return self._plan(request)

    def complete(self, plan: Plan) -> list[Sample]:
        """Every choice, in order, decoded in batches (free_transformer.inference.batches)."""
        should_stop = stop_check(self.tokenizer.decode, plan.stops)
        with self.lock:
            return [self._sample(plan, plan.index(row.prompt, row.sample), row.tokens)
                    for row in sample_prompts(self.model, plan.prompts, plan.n, plan.seed, should_stop=should_stop)]

    def stream(self, plan: Plan, send: Callable[[Delta], bool]) -> None:
        """Every choice, one after the other, handed to `send` piece by piece as its tokens are sampled:
        text is sent once no later token can change it (see `settled`). `send` returning False (the
        client left) ends the stream."""
        with self.lock:
            for p, prompt in enumerate(plan.prompts):
                for i in range(plan.n):
                    if not self._stream_one(plan, prompt, i, plan.index(p, i), send):
                        return

    def _stream_one(self, plan: Plan, prompt: Prompt, i: int, index: int, send) -> bool:
        shown, listening = "", True

        def step(new: list[int]) -> bool:  # generate's should_stop, called after each new token
            nonlocal shown, listening
            text = self.tokenizer.decode(new)
            end = stop_at(text, plan.stops)
            final = settled(text, plan.stops) if end is None else text[:end]
            if len(final) > len(shown) and final.startswith(shown):
                listening = send(Delta(index, final[len(shown):]))
                shown = final
            return end is not None or not listening

        # one row: a sample depends on its seed, not on its batch, so this is complete()'s choice
        [row] = sample_prompts(self.model, [prompt], 1, plan.seed + i, should_stop=step)
        if not listening:
            return False
        sample = self._sample(plan, index, row.tokens)
        rest = sample.text[len(shown):] if sample.text.startswith(shown) else ""
        return send(Delta(index, rest, sample.finish_reason))

    def _sample(self, plan: Plan, index: int, tokens: list[int]) -> Sample:
        text = self.tokenizer.decode(tokens)
        end = stop_at(text, plan.stops)
        return Sample(index, text if end is None else text[:end], "length" if end is None else "stop", len(tokens))

    def _plan(self, request: CompletionRequest) -> Plan:
        if request.model != self.name:
            raise RequestError(f"the model {request.model!r} does not exist; this server serves {self.name!r}",
                               "model", 404, "model_not_found")
        texts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        ids = [self.tokenizer.encode(text) for text in texts]
        if not ids or not all(ids):
            raise RequestError("prompt must not be empty (give at least one character)", "prompt")
        context, longest = self.model.config.max_seq_len, max(map(len, ids))
        try:
            room = new_token_room(longest, context)
        except ValueError as error:
            raise RequestError(str(error), "prompt", code="context_length_exceeded") from None
        max_tokens = request.max_tokens or min(DEFAULT_MAX_TOKENS, room)
        if max_tokens > room:
            raise RequestError(f"max_tokens {max_tokens} does not fit: the prompt has {longest} tokens and this "
                               f"model reads at most {context}, so max_tokens can be at most {room}", "max_tokens",
                               code="context_length_exceeded")
        params = self._params(request, max_tokens)
        reference = self._reference(params.reference)
        latent_seed = params.seed if params.latent_seed is None else params.latent_seed
        try:  # each prompt's Z as `free-transformer generate --seed latent_seed` resolves it
            prompts = prepare_prompts(self.model, ids, [params.generation_config(max_tokens)] * len(ids),
                                      params.latents, reference=reference, latent_seed=latent_seed)
        except ValueError as error:
            raise RequestError(str(error), "reference" if reference is not None else "latents") from None
        return Plan(prompts, params.n, params.seed, list(params.stop))

    @staticmethod
    def _params(request: CompletionRequest, max_tokens: int) -> SamplingParams:
        """The request's sampling fields as the SamplingParams they stand for, with the server's defaults
        (max_tokens: DEFAULT_MAX_TOKENS or fewer, seed: a fresh random one)."""
        values = {name: getattr(request, field) for name, field in SAMPLING_NAMES.items()}
        try:
            values["latents"] = ENCODER if request.latents is None else parse_latents(request.latents, indices=False)
        except ValueError as error:
            raise RequestError(str(error), "latents") from None
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
        ids, context = self.tokenizer.encode(text), self.model.config.max_seq_len
        if len(ids) > context:
            raise RequestError(f"reference has {len(ids)} tokens; this model reads at most {context}", "reference")
        return torch.tensor([ids])


def settled(text: str, stops: list[str]) -> str:
    """The part of a completion's text so far that no later token can change: without the replacement
    characters it ends with (a character whose bytes are not all there yet) and without the longest
    end that begins a stop string (it may become one)."""
    text = text.rstrip(REPLACEMENT)
    held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return text[: len(text) - held]
