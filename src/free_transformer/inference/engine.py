"""The decoding engine: the one loop that decodes every sequence, for `generate()`, `free-transformer generate`
(with --interactive) and the server (free_transformer.serve).

The engine has `slots` rows of one KV cache. A `Row` (a prompt, its sampling settings, its seed and where its Z
comes from) is prefilled into a free slot (`add`: rows of one prompt length and one kind of prompt Z are
prefilled together, the prompt's Z from the encoder's posterior, the prior or explicit values), its first token
sampled from the prefill's logits. Each `step` then feeds every row its last token at its own position and
samples the next. A row ends at a stop token, at its max_new_tokens, when the caller ends it (`finish`), or alone,
with an error, when its logits are not finite. Rows join and leave between steps.

The engine is four parts, each a module with one job, as vLLM's and gpt-fast's engines are split:
    scheduler       which waiting rows take free slots, and which step the rows in flight take
                    (free_transformer.inference.scheduler)
    cache manager   the slots of the KV cache, a row's release (its positions zeroed), compaction
                    (free_transformer.inference.cache_manager)
    step runner     the one-token forward, sampling, ends found on the device, compile, buckets, CUDA graphs and
                    the deferred read-back (free_transformer.inference.step_runner)
    row draws       every random draw a row reads, Z per position and token noise, counter-based and made as it
                    joins (free_transformer.inference.row_draws)
This module holds them together. Only the encoder's posterior sample of the prompt's Z, once at admission, takes
a torch.Generator seeded with the row's seed."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..base.latent_choice import LatentChoice, RowChoice
from ..base.seeding import generators
from ..model.transformer import FreeTransformer
from .admission import Request
from .cache_manager import SlotCache
from .params import MAX_SEED, GenerationConfig, check_room
from .row_draws import RowDraws
from .sampling import NON_FINITE, SamplingVariant, token_logprobs
from .scheduler import Scheduler, StepSchedule
from .step_runner import Launched, StepRunner


@dataclass(eq=False)
class Row:
    """One sequence to decode, and what it has become: what `DecodeEngine.add` takes, filled as it decodes."""

    ids: list[int]  # the prompt's token ids, at least one
    config: GenerationConfig  # temperature, filters, stop tokens, and max_new_tokens (set)
    seed: int | None  # keys every random draw of the row, in [0, 2^63) (None: one drawn from torch's global RNG)
    # the prompt's Z (ENCODER or PRIOR), every Z from the run's policy head (POLICY), or (1, N, *value_shape)
    # explicit Z of positions [0, N), N >= len(ids)
    latents: RowChoice | Tensor = LatentChoice.ENCODER
    keep_logits: bool = False  # set `logits` at every token (the server's logprobs)
    scored: bool = False  # sum `logprob` as it decodes (best-of)
    keep_prompt_logits: bool = False  # set `prompt_logits` (the server's echo with logprobs)
    tag: object = None  # the caller's
    tokens: list[int] = field(default_factory=list)  # the new tokens so far
    finish_reason: str | None = None  # "stop", "length", "error" or the caller's (`DecodeEngine.finish`)
    error: Exception | None = None  # why it ended, when its logits were not finite
    logits: Tensor | None = None  # (V,) what its last token was sampled from; valid until the next step
    prompt_logits: Tensor | None = None  # (P, V) the prefill's logits
    fed: Tensor | None = None  # (positions fed, *value_shape) the Z it was fed, once ended (Free Transformer)
    slot: int | None = None  # its row of the engine's cache while in flight
    logprob: float = 0.0  # when scored: the sum of its tokens' log-probabilities (sampling.token_logprobs)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """The next position to feed, the tokens in the cache: the prompt and every new token but the last (and
        the last too when the step that fed it failed)."""
        return len(self.ids) + len(self.tokens) - (0 if self.error is not None else 1)

    @property
    def score(self) -> float:
        """When scored: its tokens' mean log-probability under the logits they were sampled from (-inf without
        a token)."""
        return self.logprob / len(self.tokens) if self.tokens else float("-inf")

    @property
    def end(self) -> int:
        """The positions it feeds, [0, end): its prompt and every new token but the last."""
        assert self.config.max_new_tokens is not None, "add refuses a row without max_new_tokens (check)"
        return len(self.ids) + self.config.max_new_tokens - 1


class DecodeEngine:
    """Slots of one KV cache that rows join (`add`) and leave; `step` decodes every row in flight one token.
    `scheduler` queues the rows waiting for its slots (`run_rows`, the server's loop). share: the most rows one
    request has in flight (None: every slot)."""

    def __init__(
        self,
        model: FreeTransformer,
        slots: int,
        *,
        capacity: int | None = None,
        compile: bool = False,
        inductor: bool | None = None,
        deferred: bool | None = None,
        share: int | None = None,
    ):
        if slots < 1:
            raise ValueError(f"the engine must hold at least 1 row, got {slots}")
        # a weak reference: the engines kept per model (`decoding_engine`) must not keep the model alive
        self._model = weakref.ref(model)
        cache = model.new_cache(slots, capacity=capacity)
        self.slots, self.capacity = slots, cache.capacity
        self.device = cache.keys.device
        self.is_free = model.config.is_free
        self.draws = RowDraws(model.latent_space, slots, self.capacity, self.device)
        self.runner = StepRunner(slots, self.device, self.draws, compile=compile, inductor=inductor, deferred=deferred)
        self.cache: SlotCache[Row] = SlotCache(cache, (self.runner, self.draws))
        self.scheduler: Scheduler = Scheduler(share)
        self.schedule = StepSchedule.idle()
        self.pending: Launched | None = None  # the step launched but not read yet (deferred)
        self.scoring = False  # a row in flight is scored (best-of): its tokens' log-probabilities are summed

    @property
    def model(self) -> FreeTransformer:
        model = self._model()
        if model is None:
            raise RuntimeError("the decoding engine's model no longer exists")
        return model

    @property
    def rows(self) -> list[Row]:
        """The rows in flight, row i in slot i."""
        return self.cache.rows

    @property
    def free(self) -> int:
        return self.cache.free

    @property
    def steps(self) -> int:
        return self.runner.steps

    # ---- rows join ------------------------------------------------------------------------------

    def add(self, rows: Sequence[Row]) -> list[Row]:
        """Prefill `rows` into free slots and sample each one's first token; rows of one prompt length and one
        kind of prompt Z are prefilled together. Returns them (a row may already be done)."""
        if len(rows) > self.free:
            raise ValueError(f"{len(rows)} rows do not fit: {self.free} of {self.slots} slots are free")
        for row in rows:
            self.check(row)
            if row.seed is None:  # follows torch.manual_seed
                row.seed = int(torch.randint(0, MAX_SEED, ()))
        groups: dict[tuple, list[Row]] = {}
        for row in rows:
            kind = "explicit" if isinstance(row.latents, Tensor) else row.latents
            groups.setdefault((len(row.ids), kind), []).append(row)
        with torch.inference_mode():
            for group in groups.values():
                self._prefill(group)
            self._release()
            self._in_flight()
        return list(rows)

    def check(self, row: Row) -> None:
        """A one-line ValueError for a row this engine cannot decode."""
        P, new = len(row.ids), row.config.max_new_tokens
        if P < 1 or new is None:
            raise ValueError(f"a row needs a prompt and its max_new_tokens, got {P} tokens and {new}")
        if row.seed is not None and not 0 <= row.seed <= MAX_SEED:
            raise ValueError(f"a row's seed must be in [0, 2**63), got {row.seed}")
        check_room(P, new, self.capacity)

    def _prefill(self, rows: list[Row]) -> None:
        start, P = len(self.rows), len(rows[0].ids)
        slots = slice(start, start + len(rows))
        ids = torch.tensor([row.ids for row in rows], dtype=torch.int64, device=self.device)  # (k, P)
        seeds = [_seed(row) for row in rows]
        explicit = [row.latents[0] if isinstance(row.latents, Tensor) else None for row in rows]
        policy = [isinstance(row.latents, str) and row.latents == LatentChoice.POLICY for row in rows]
        self.draws.draw(slots, seeds, [row.end for row in rows], explicit, policy)
        latents = self.draws.prompt_latents(slots, P, rows[0].latents)
        # the encoder's posterior sample of the prompt's Z: the one draw with a generator, once per row
        encoder = isinstance(latents, str) and latents == LatentChoice.ENCODER
        out = self.model(
            ids,
            latents=latents,
            generator=generators(seeds, self.device) if encoder else None,
            cache=self.cache.cache.view(slots, P),
        )
        if self.is_free:
            self.draws.record(slots, P, out.latents)
        for j, row in enumerate(rows):
            if row.keep_prompt_logits:
                row.prompt_logits = out.logits[j]
        self.cache.join(rows)
        configs = [row.config for row in rows]
        self.runner.join(slots, configs, P, [row.end for row in rows])
        logits = out.logits[:, -1]  # (k, V)
        first = self.runner.first_tokens(slots, logits, configs, P)
        self._take(rows, first, None, logits, scoring=any(row.scored for row in rows))

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[Row]:
        """Feed every row in flight its last token and sample its next one. Returns the rows that got one.
        Deferred: the rows whose tokens of the step before arrived (this step's arrive at the next call).
        A row is fed until the host reads that it ended: its tokens from steps after the one whose `ended`
        recorded it are dropped (`_take`)."""
        rows = self.cache.rows  # `_release` makes a new list: this one stays what the step fed
        with torch.inference_mode():
            launched = None
            if rows and self.runner.steps < self.schedule.last_step:
                schedule = self.schedule
                launched = self.runner.launch(
                    self.model,
                    self.cache,
                    rows,
                    schedule.variant,
                    schedule.longest,
                    schedule.aligned,
                    schedule.keeps_logits,
                    schedule.policy,
                )
                schedule.longest = min(schedule.longest + 1, self.capacity - 1)  # every row fed one position
            arrived, self.pending = (self.pending, launched) if self.runner.deferred else (launched, None)
            if arrived is None:
                return []
            taken, ended = self._take(*arrived)
            if ended:
                self._release()
        return taken

    def warm_up(
        self, variants: Sequence[SamplingVariant] = (SamplingVariant(sampled=True, filtered=False, mixed=True),)
    ) -> None:
        """Compile and capture the step of every bucket for these variants now (a server, before its first
        request), on empty slots: nothing in flight changes."""
        if self.rows:
            raise RuntimeError("warm_up needs an engine with no row in flight")
        with torch.inference_mode():
            for variant in variants:
                for size in self.runner.buckets:
                    for _ in range(2):  # the compiling run, then the capture
                        self.runner.replay(self.model, self.cache, size, variant)

    # ---- tokens, and rows leave ------------------------------------------------------------------

    def _take(
        self, rows: list[Row], host: Tensor, event: torch.cuda.Event | None, logits: Tensor, scoring: bool = False
    ) -> tuple[list[Row], bool]:
        """Give each row its new token and end from `host` (3, rows: tokens, `ended`, non-finite), the step's
        copy, once it arrived (`event`). A row already done (it ended at an earlier step, or the caller ended it) gets
        nothing: what a deferred step fed it after its end is dropped. Returns the rows given something, and whether a
        row ended (at this step or before). scoring: a row of them may be scored (else `self.scoring` says)."""
        tokens, ended, errors = self.runner.read(host, event)
        taken = []
        scored = []
        if scoring or self.scoring:
            scored = [
                i for i, (row, error) in enumerate(zip(rows, errors)) if row.scored and not row.done and not error
            ]
        if scored:  # one read for the step's scored rows
            index = torch.tensor(scored, device=logits.device)
            chosen = torch.tensor([tokens[i] for i in scored], device=logits.device)
            for i, value in zip(scored, token_logprobs(logits[index], chosen).tolist()):
                rows[i].logprob += value
        for i, (row, token, end, error) in enumerate(zip(rows, tokens, ended, errors)):
            if row.done:
                continue
            taken.append(row)
            if error:
                row.finish_reason, row.error = "error", ValueError(NON_FINITE)
                continue
            row.tokens.append(token)
            if row.keep_logits:
                row.logits = logits[i]
            if end:  # found on the device; named here, once a row
                row.finish_reason = "stop" if token in row.config.stop_tokens else "length"
        return taken, any(ended)

    def finish(self, row: Row, reason: str = "stop") -> None:
        """End a row in flight (a stop string, a client gone): it leaves its slot now."""
        if row.done or row.slot is None:
            return
        row.finish_reason = reason
        with torch.inference_mode():
            self._release()

    def _release(self) -> None:
        """Rows that are done leave their slots (the cache manager compacts the rest into slots [0, n))."""

        def leaving(row: Row, slot: int) -> None:
            row.fed = self.draws.fed_of(slot, row.position)

        n = self.cache.release(self._written, lambda row: row.end, leaving)
        if n is not None:
            self._in_flight()
            self.runner.free(n)

    def _in_flight(self) -> None:
        """What the rows in flight set for their steps, once they have joined or left."""
        pending = {id(row) for row in self.pending[0]} if self.pending is not None else set()
        # the next position each row feeds: one past what it has read when the step in flight fed it too
        positions = [row.position + (id(row) in pending) for row in self.rows]
        self.schedule = StepSchedule.of(
            [row.config for row in self.rows],
            positions,
            [row.end for row in self.rows],
            steps=self.steps,
            compiled=self.runner.compile,
            keeps_logits=any(row.keep_logits or row.scored for row in self.rows),
            policy=[isinstance(row.latents, str) and row.latents == LatentChoice.POLICY for row in self.rows],
        )
        self.runner.stopping = self.schedule.stopping
        self.scoring = any(row.scored for row in self.rows)

    def _written(self, row: Row) -> int:
        """The positions of a row in flight that the cache may hold, the step in flight's included."""
        return min(row.position + 2, self.capacity)


def _seed(row: Row) -> int:
    """A row's seed, which `add` sets when the caller left it None."""
    assert row.seed is not None, "add draws a seed for every row without one"
    return row.seed


def run_rows(
    engine: DecodeEngine, rows: Iterable[Row], should_stop: Callable[[list[int]], bool] | None = None
) -> Iterator[Row]:
    """Decode `rows`, admitted in their order as slots free (one request of the engine's scheduler, with a share of
    every slot: free_transformer.inference.admission), and yield each one as it ends. should_stop: called with a
    row's new tokens after each one; True ends the row there (stop strings, which ids cannot express)."""
    scheduler = engine.scheduler
    request = scheduler.add(Request(rows))
    try:
        while True:
            joining = [row for _, row in scheduler.take(engine.free)]
            if not joining and not engine.rows:
                return
            if joining:  # the new rows' first tokens are checked before they step
                yield from _ended(engine, engine.add(joining), should_stop, request)
            if engine.rows:
                yield from _ended(engine, engine.step(), should_stop, request)
    finally:
        scheduler.drop(request)
        for row in list(engine.rows):  # the caller stopped early (an error, a closed generator)
            engine.finish(row, "cancelled")


def _ended(engine: DecodeEngine, rows: list[Row], should_stop, request: Request[Row]) -> Iterator[Row]:
    for row in rows:
        if not row.done and should_stop is not None and should_stop(row.tokens):
            engine.finish(row, "stop")
        if row.done:
            request.left()
            yield row
