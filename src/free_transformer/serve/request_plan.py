"""A loaded model behind the completions API: a request is checked into a `Plan` (every refusal a
`RequestError` with one line, before any sampling), whose rows the scheduler (free_transformer.serve.batcher)
hands to the decoding engine, batched with every other request's.

Completion i of prompt p samples with its own seed, sample_seed(seed, p, i) (free_transformer.base.seeding): a
request with a seed gives the same completions again (OpenAI's meaning of the seed), each of its prompts and
samples its own random stream, none depending on streaming or on the batch, and equal to `free-transformer
generate --seed SEED`'s with the same prompts (up to float rounding).

With best_of above n, or vary other than both, a prompt's rows are best-of candidates: their seeds and Z are
free_transformer.inference.search's (`candidate_sources`), so that they equal `free-transformer generate
--best-of`'s and `best_of()`'s for the same prompts and seed; every candidate is a row of the one engine,
scored by its tokens' mean log-probability as it decodes, and the response holds the n best (`Plan.returned`)."""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

import torch

from ..base.latent_choice import LatentChoice, RowChoice, as_row_choice
from ..base.seeding import sample_seed
from ..data.tokenizer import Tokenizer
from ..inference.batches import Prompt, prepare_prompts
from ..inference.params import SamplingError, SamplingParams, check_room, new_token_room
from ..inference.search import candidate_sources, ranking
from ..model.transformer import FreeTransformer
from .batcher import Batcher, Delta, RowSpec
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


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A checked request: its rows (prompt p's candidate j is row p * best_of + j) and what the response
    holds (prompt p's completion i is choice p * n + i)."""

    rows: list[RowSpec]
    stops: list[str]
    prompt_tokens: int  # every prompt's tokens, each counted once
    n: int  # completions returned per prompt
    best_of: int  # rows decoded per prompt, at least n

    @property
    def completions(self) -> int:
        """Rows decoded: every prompt's best_of candidates."""
        return len(self.rows)

    @property
    def ranked(self) -> bool:
        """Whether the response holds the n best of more candidates (so each row is scored as it decodes)."""
        return self.best_of > self.n

    def returned(self, pieces: dict[int, Delta]) -> list[Delta]:
        """The choices of the response from every row's whole completion (by row index): with best_of above n,
        each prompt's n candidates of the highest mean token log-probability (`Delta.score`), best first, the
        earlier on a tie (OpenAI's best_of), numbered as choices; otherwise every row, in order."""
        if not self.ranked:
            return [pieces[index] for index in range(self.completions)]
        chosen = []
        for p in range(self.completions // self.best_of):
            group = [pieces[p * self.best_of + j] for j in range(self.best_of)]
            scores = [float("-inf") if piece.score is None else piece.score for piece in group]
            for i, k in enumerate(ranking(scores)[: self.n]):
                chosen.append(dataclasses.replace(group[k], index=p * self.n + i))
        return chosen


class Engine:
    def __init__(
        self,
        model: FreeTransformer,
        tokenizer: Tokenizer,
        name: str,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        latents: RowChoice = LatentChoice.ENCODER,  # a request's Z when it names none: ServeConfig.latents
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
        vocab = self.model.config.vocab_size
        if request.logprobs is not None and request.logprobs > vocab:
            raise RequestError(
                f"logprobs {request.logprobs} exceeds the vocabulary: this model has {vocab} tokens", "logprobs"
            )
        max_tokens = self._max_tokens(request, max(map(len, ids)))
        params = self._params(request, max_tokens)
        count, name = params.candidates, "n" if params.best_of is None else "best_of"
        if len(ids) * count > MAX_COMPLETIONS:
            raise RequestError(
                f"{len(ids)} prompts x {name} = {count} asks for {len(ids) * count} completions; "
                f"one request may ask for at most {MAX_COMPLETIONS}",
                name,
                code="too_many_completions",
            )
        if request.stream and count > params.n:
            raise RequestError(
                f"best_of ({count}) above n ({params.n}) cannot be streamed: the best are known once every "
                "candidate has ended; leave stream out or give best_of equal to n",
                "best_of",
            )
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
        if params.searched:
            rows = self._candidates(prompts, params)
        else:
            rows = [
                RowSpec(index=p * request.n + i, prompt=prompt, seed=sample_seed(seed, p, i))
                for p, prompt in enumerate(prompts)
                for i in range(request.n)
            ]
        return Plan(
            rows=rows,
            stops=[stop for stop in stops if stop],
            prompt_tokens=sum(map(len, ids)),
            n=params.n,
            best_of=count,
        )

    def _candidates(self, prompts: list[Prompt], params: SamplingParams) -> list[RowSpec]:
        """Every prompt's best-of candidates (row p * best_of + j), with the seeds and Z of
        `search.candidate_sources`: what `best_of()` decodes for the same prompts, settings and seed."""
        seed, _ = params.seeds()
        count = params.candidates
        seeds, sources = candidate_sources(
            self.model,
            [prompt.ids for prompt in prompts],
            count,
            max(prompt.positions for prompt in prompts),
            seed=seed,
            vary=params.vary,
            context=as_row_choice(params.latents),  # SamplingParams refuses shared and reference here
        )
        rows = []
        for k, row_seed in enumerate(seeds):
            prompt = prompts[k // count]
            if isinstance(sources, torch.Tensor):  # (rows, positions, *value_shape): this row's own Z
                prompt = dataclasses.replace(prompt, latents=sources[k][None])
            rows.append(RowSpec(index=k, prompt=prompt, seed=row_seed))
        return rows

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
        """The tokens each row decodes. max_tokens 0 with echo (OpenAI's way to score a prompt) decodes the one
        token a prefill draws, which the batcher drops (Job.prompt_only)."""
        if request.max_tokens == 0 and not request.echo:
            raise RequestError("max_tokens must be >= 1, got 0 (0 goes with echo: the prompt alone)", "max_tokens")
        if request.max_tokens == 0:
            request = request.model_copy(update={"max_tokens": 1})
        try:
            room = new_token_room(longest, self.context)
        except ValueError as error:
            raise RequestError(str(error), "prompt", code="context_length_exceeded") from None
        max_tokens = min(DEFAULT_MAX_TOKENS, room) if request.max_tokens is None else request.max_tokens
        try:
            check_room(longest, max_tokens, self.context, "max_tokens")
        except ValueError as error:
            raise RequestError(str(error), "max_tokens", code="context_length_exceeded") from None
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
