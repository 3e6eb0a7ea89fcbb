"""The server's one decoding loop: continuous batching. Every completion in flight is a row of one
batch; each step feeds every row its last token at its own position (free_transformer.model's
per-row decoding step) and samples each row with its own settings and generator. A new completion
joins the batch at the next step (its prompt prefilled alone, into its row of the shared KV cache) and
a finished or abandoned one leaves it at once, so a short request never waits for a long one to end,
and concurrent clients share each step's cost.

A row draws its random numbers as `free_transformer.inference.generate` draws them for a row of its
own: the prefill's encoder sampling, then for each token the race of `sample_next`, and for each fed
position after the prompt one prior Z (unless explicit Z covers it). So a completion equals
`free-transformer generate --seed SEED`'s, up to float rounding, whatever else is in the batch.

Rows are admitted in turns, the request with the fewest rows in flight first; a request's rows take at
most all but one of the batch's rows, so a newcomer finds a free row unless others fill the batch."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..data.tokenizer import Tokenizer
from ..inference.generate import GenerationConfig, sample_next
from ..inference.stops import stop_at
from ..model.latent import ENCODER, PRIOR, LatentPlan
from ..model.transformer import FreeTransformer

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what decoding shows for the bytes of a character not yet complete


@dataclass(frozen=True)
class RowSpec:
    """One completion to decode: nothing about it can still be refused."""
    index: int  # the choice's index in the response
    ids: list[int]  # the prompt, token ids
    config: GenerationConfig  # how the row samples (temperature and the filters)
    latents: str | Tensor  # "encoder" or "prior" for the prompt, or (1, N) explicit Z of positions [0, N)
    seed: int  # the row's generator
    max_tokens: int  # new tokens, >= 1


@dataclass
class Job:
    """A request's rows and where their results go. `emit` is called on the loop's thread with each
    `Delta`, then `finish` once with None or the exception that ended the request; `cancelled`, set
    by the caller, drops the request's rows at the next step."""
    rows: list[RowSpec]
    stops: list[str]
    logprobs: int | None  # alternatives per token, None: no logprobs
    echo: bool
    stream: bool  # deltas as the text grows (else one per row, when it ends)
    emit: Callable[[Delta], None]
    finish: Callable[[Exception | None], None]
    cancelled: bool = False
    admitted: int = 0  # rows started
    in_flight: int = 0
    done: int = 0


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None  # None: the first token of a prompt
    top: dict[str, float] | None


@dataclass(frozen=True)
class Delta:
    """A piece of a completion: text now final, the log-probabilities of the tokens sampled since the
    last piece (with logprobs), and at its end the finish reason and the number of tokens sampled."""
    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    tokens: int = 0


class RowText:
    """A row's text as its tokens come: decoded incrementally (a window from the last complete
    character, not the whole text each token), stop strings looked for in the new text only, and, for
    a stream, the part no later token can change (`settled`)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.longest = max(map(len, stops), default=0)
        self.tokens: list[int] = []
        self.text = ""  # the decoded text of tokens[:read]
        self.prefix = self.read = 0  # tokens[prefix:read] decode to the text's last piece
        self.stop_end: int | None = None  # where the first stop string begins, once found

    def push(self, token: int) -> None:
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix : self.read])
        window = self.decode(self.tokens[self.prefix :])
        if len(window) > len(before) and not window.endswith(REPLACEMENT):
            self._grow(window[len(before) :])
            self.prefix, self.read = self.read, len(self.tokens)

    def flush(self) -> None:
        """The row ended: the tokens of an incomplete last character are decoded as they are."""
        before = self.decode(self.tokens[self.prefix : self.read])
        window = self.decode(self.tokens[self.prefix :])
        self._grow(window[len(before) :])
        self.prefix = self.read = len(self.tokens)

    def _grow(self, piece: str) -> None:
        scanned = len(self.text)
        self.text += piece
        if self.stop_end is None and self.stops:  # a stop string may begin in the last longest - 1 characters
            self.stop_end = stop_at(self.text, self.stops, max(0, scanned - self.longest + 1))

    @property
    def final(self) -> str:
        return self.text if self.stop_end is None else self.text[: self.stop_end]

    def settled(self) -> str:
        """The text no later token can change (`settled`)."""
        return self.final if self.stop_end is not None else settled(self.text, self.stops)


def settled(text: str, stops: list[str]) -> str:
    """The part of a completion's text so far that no later token can change: without the replacement
    characters it ends with (a character whose bytes are not all there yet) and without the longest
    end that begins a stop string (it may become one). Reads the last len(stop) - 1 characters only."""
    text = text.rstrip(REPLACEMENT)
    held = 0
    for stop in stops:
        tail = text[len(text) - len(stop) + 1 :] if len(stop) > 1 else ""
        held = max(held, next((len(tail) - i for i in range(len(tail)) if stop.startswith(tail[i:])), 0))
    return text[: len(text) - held]


@dataclass
class Row:
    spec: RowSpec
    job: Job
    generator: torch.Generator
    plan: LatentPlan  # the row's Z, position by position (a baseline's plans hand out PRIOR, ignored)
    text: RowText
    position: int = 0  # the next position to feed = tokens in the KV cache
    token: int = 0  # the last token sampled, fed at the next step
    shown: int = 0  # characters of the text already sent (stream)
    head: str = ""  # the echoed prompt, sent before the first piece
    pending: list[TokenLogprob] = field(default_factory=list)  # logprobs not yet sent

    @property
    def sampled(self) -> int:
        return len(self.text.tokens)

    @property
    def ended(self) -> bool:
        return self.sampled >= self.spec.max_tokens or self.text.stop_end is not None


class Batcher:
    """The decoding loop, on a thread of its own (`start`); `submit` hands it a Job."""

    def __init__(self, model: FreeTransformer, tokenizer: Tokenizer, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"the batch must hold at least 1 row, got {max_batch}")
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.is_free = model.config.is_free
        self.device = model.rope_cos.device
        self.cache = None  # the KV cache of max_batch rows, made at the first row
        self.rows: list[Row] = []  # in flight: row i in slot i of the cache
        self.waiting: list[Job] = []  # requests with rows not yet started, oldest first
        self.wakeup = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="free-transformer-decoding", daemon=True)
        self.steps = 0  # decoding steps taken (for tests and logs)

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, job: Job) -> None:
        with self.wakeup:
            self.waiting.append(job)
            self.wakeup.notify()

    def _run(self) -> None:
        while True:
            with self.wakeup:
                while not self.rows and not self.waiting:
                    self.wakeup.wait()
            with torch.inference_mode():
                self._drop_cancelled()
                self._guarded(self._admit)
                if self.rows:
                    self._guarded(self._step)

    def _guarded(self, work: Callable[[], None]) -> None:
        """work(); an exception ends every request with rows in flight (the batch shared the failed
        computation), and the loop goes on with the next requests."""
        try:
            work()
        except Exception as error:  # a server must outlive a failed step: each request gets its 500
            logger.error("decoding step failed", exc_info=error)
            jobs = {id(row.job): row.job for row in self.rows}
            self.rows = []
            for job in jobs.values():
                try:
                    self._end(job, error)
                except Exception as failure:  # a caller's finish that fails must not stop the loop
                    logger.error("a request's end failed", exc_info=failure)

    def _end(self, job: Job, error: Exception) -> None:
        """The request fails: its rows leave the batch at the next step (`_drop_cancelled`)."""
        with self.wakeup:
            if job in self.waiting:
                self.waiting.remove(job)
        if not job.cancelled:
            job.cancelled = True
            job.finish(error)

    def _drop_cancelled(self) -> None:
        with self.wakeup:
            self.waiting = [job for job in self.waiting if not job.cancelled]
        if any(row.job.cancelled for row in self.rows):
            self._compact([row for row in self.rows if not row.job.cancelled])

    # ---- admission: prefill each new row into its slot ---------------------------------------------

    def _admit(self) -> None:
        while len(self.rows) < self.max_batch:
            with self.wakeup:
                ready = [job for job in self.waiting if job.in_flight < max(1, self.max_batch - 1)]
                if not ready:
                    return
                job = min(ready, key=lambda j: j.in_flight)  # the oldest among the fewest in flight
                spec = job.rows[job.admitted]
                job.admitted += 1
                if job.admitted == len(job.rows):
                    self.waiting.remove(job)
            job.in_flight += 1
            try:
                self._prefill(job, spec)
            except Exception as error:  # this request only: its rows are not in the shared batch yet
                logger.error("prefill failed", exc_info=error)
                self._end(job, error)

    def _prefill(self, job: Job, spec: RowSpec) -> None:
        generator = torch.Generator(device=self.device).manual_seed(spec.seed)
        explicit = spec.latents if isinstance(spec.latents, Tensor) else None
        plan = LatentPlan(1, self.model.latent_space if self.is_free else None, explicit=explicit,
                          prompt_source=ENCODER if explicit is not None else spec.latents, generators=[generator])
        row = Row(spec, job, generator, plan, RowText(self.tokenizer.decode, job.stops), position=len(spec.ids))
        row.head = self.tokenizer.decode(spec.ids) if job.echo else ""
        if self.cache is None:
            self.cache = self.model.new_cache(self.max_batch)
        slot, P = len(self.rows), len(spec.ids)
        ids = torch.tensor([spec.ids], device=self.device)  # (1, P)
        out = self.model(ids, latents=plan.source(0, P, self.device), generator=[generator],
                         cache=self.cache.view(slice(slot, slot + 1), P))
        plan.record(0, out.latents)
        logits = out.logits[0]  # (P, V)
        if job.echo and job.logprobs is not None:
            row.pending = self._prompt_logprobs(spec.ids, logits[:-1], job.logprobs)
        token = sample_next(logits[-1:], spec.config, [generator])  # (1,)
        self._take(row, int(token), logits[-1:], job.logprobs)
        if not row.ended:
            self.rows.append(row)  # in slot `slot`, where its prefill wrote

    def _prompt_logprobs(self, ids: list[int], logits: Tensor, k: int) -> list[TokenLogprob]:
        """The prompt's tokens with log P(token | the tokens before it), the first with None."""
        chosen, tops = self._logprobs(logits, torch.tensor(ids[1:], device=logits.device), k)
        first = TokenLogprob(self.tokenizer.decode(ids[:1]), None, None)
        return [first, *(TokenLogprob(self.tokenizer.decode([t]), lp, top) for t, lp, top in zip(ids[1:], chosen, tops))]

    def _logprobs(self, logits: Tensor, chosen: Tensor, k: int) -> tuple[list[float], list[dict[str, float]]]:
        """(N, V) logits and (N,) tokens -> the tokens' log-probabilities under the model's distribution
        (temperature 1, no top-k / top-p), and per position the k most likely tokens' with the chosen one's."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        values = logp.gather(-1, chosen[:, None])[:, 0].tolist()
        top_values, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], chosen[:, None][:, :0])
        decode = self.tokenizer.decode
        tops = []
        for token, value, row_values, row_ids in zip(chosen.tolist(), values, top_values.tolist(), top_ids.tolist()):
            top = {decode([i]): v for i, v in zip(row_ids, row_values)}
            top.setdefault(decode([token]), value)
            tops.append(top)
        return values, tops

    # ---- one step of every row in flight ----------------------------------------------------------

    def _step(self) -> None:
        rows = self.rows
        n = len(rows)
        tokens = torch.tensor([[row.token] for row in rows], device=self.device)  # (n, 1)
        positions = torch.tensor([row.position for row in rows], device=self.device)  # (n,)
        latents = PRIOR if not self.is_free else self._next_latents(rows)  # (n, 1, *value_shape)
        cache = self.cache.view(slice(0, n), max(row.position for row in rows) + 1)
        logits = self.model(tokens, latents=latents, cache=cache, start=positions).logits[:, -1]  # (n, V)
        if self.is_free:
            for i, row in enumerate(rows):
                row.plan.record(row.position, latents[i : i + 1])
        self.steps += 1
        for row in rows:
            row.position += 1
        sampled = torch.empty(n, dtype=torch.int64, device=self.device)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            config = row.spec.config
            groups.setdefault((config.temperature, config.rule()), []).append(i)  # rows sampled alike
        for members in groups.values():  # one draw per row, from its own generator
            index = torch.tensor(members, device=self.device)
            sampled[index] = sample_next(logits[index], rows[members[0]].spec.config,
                                         [rows[i].generator for i in members])
        for i, (row, token) in enumerate(zip(rows, sampled.tolist())):
            self._take(row, token, logits[i : i + 1], row.job.logprobs)
        self._compact([row for row in self.rows if not row.ended and not row.job.cancelled])

    def _next_latents(self, rows: list[Row]) -> Tensor:
        """(n, 1, *value_shape) the Z of each row's fed position, from its plan: its explicit Z, else one prior
        draw with the row's generator (as generate draws it)."""
        return torch.cat([row.plan.source(row.position, 1, self.device) for row in rows])

    def _take(self, row: Row, token: int, logits: Tensor, k: int | None) -> None:
        """The row's new token: its text, its log-probability, and the piece or the end it makes."""
        row.token = token
        row.text.push(token)
        if k is not None:
            values, tops = self._logprobs(logits, torch.tensor([token], device=logits.device), k)
            row.pending.append(TokenLogprob(self.tokenizer.decode([token]), values[0], tops[0]))
        if row.ended:
            row.text.flush()
        self._deliver(row)

    def _deliver(self, row: Row) -> None:
        """Send what the row has that its client lacks: for a stream, the settled text since the last
        piece; at the end, the rest with the finish reason."""
        job, ending = row.job, row.ended
        if job.cancelled or not (ending or job.stream):
            return
        text = row.text.final if ending else row.text.settled()
        piece = row.head + text[row.shown :]
        if not piece and not row.pending and not ending:
            return
        logprobs = row.pending if job.logprobs is not None else None
        row.shown, row.head, row.pending = len(text), "", []
        finish_reason = ("stop" if row.text.stop_end is not None else "length") if ending else None
        job.emit(Delta(row.spec.index, piece, logprobs, finish_reason, row.sampled))
        if ending:
            job.in_flight -= 1
            job.done += 1
            if job.done == len(job.rows):
                job.finish(None)

    def _compact(self, keep: list[Row]) -> None:
        """Keep these rows (in slot order), moved down to slots 0..len(keep)-1 of the cache."""
        for slot, row in enumerate(keep):
            old = self.rows.index(row)
            if old != slot:
                self.cache.keys[:, slot, :, : row.position] = self.cache.keys[:, old, :, : row.position]
                self.cache.values[:, slot, :, : row.position] = self.cache.values[:, old, :, : row.position]
        self.rows = keep
