"""The server's loop over the decoding engine (free_transformer.inference.engine) and its scheduler: every
completion in flight is a row of the engine, which decodes rows of any lengths and settings together, each as
it would alone. A new completion joins at the next step (its prompt prefilled into a free slot) and a finished
or abandoned one leaves at once, so that a short request never waits for a long one to end, and concurrent clients share
each step's cost. A completion therefore equals `free-transformer generate --seed SEED`'s, up to float rounding,
whatever else is in flight.

One request cannot harm another:
- admission is fair (free_transformer.inference.admission, the rule generate's rows follow too): the next free
  slot goes to the request with the fewest rows in flight, then the one due first (the step it arrived plus
  every row's max_tokens), then the oldest; a request's rows take at most all but one slot;
- a row that fails (logits not finite, a prefill or a logprob that raises) ends alone, as its own request's
  error: rows prefilled together that fail are prefilled again one by one, afresh, so that only the failing
  one's request ends; only an exception of the step itself ends every request in flight."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..data.tokenizer import Tokenizer
from ..inference.admission import Request
from ..inference.batches import Prompt, prompt_row
from ..inference.engine import DecodeEngine, Row
from ..inference.stops import stop_at
from ..model.transformer import FreeTransformer

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what decoding shows for the bytes of a character not yet complete


@dataclass(frozen=True, kw_only=True)
class RowSpec:
    """One completion to decode: nothing about it can still be refused."""

    index: int  # the choice's index in the response
    prompt: Prompt  # its ids, settings and Z
    seed: int  # the row's seed: sample_seed(the request's seed, prompt, sample)


@dataclass(kw_only=True)
class Job:
    """A request's rows and where their results go. `emit` is called on the loop's thread with each
    `Delta`, then `finish` once with None or the exception that ended the request; `cancelled`, set
    by the caller, drops the request's rows at the next step. `admission` is its record in the scheduler's
    admission queue (rows admitted and in flight, arrival order, due step)."""

    rows: list[RowSpec]
    stops: list[str]
    logprobs: int | None  # alternatives per token, None: no logprobs
    echo: bool
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt alone, without the token its prefill drew
    stream: bool  # deltas as the text grows (else one per row, when it ends)
    scored: bool = False  # each row's mean token log-probability in its last Delta (`Delta.score`, the engine's
    # `Row.score`, best_of()'s too): best_of
    emit: Callable[[Delta], None]
    finish: Callable[[Exception | None], None]
    cancelled: bool = False
    done: int = 0  # rows ended and delivered
    admission: Request[RowSpec] = field(init=False)

    def __post_init__(self) -> None:
        # the tokens it asks for, every row's max_tokens (fed - len(ids) + 1): when it is due
        tokens = sum(spec.prompt.positions - len(spec.prompt.ids) + 1 for spec in self.rows)
        self.admission = Request(self.rows, tokens=tokens, tag=self)


@dataclass(kw_only=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None: the first token of a prompt
    top: dict[str, float] | None


@dataclass(frozen=True, kw_only=True)
class Delta:
    """A piece of a completion: text now final, the log-probabilities of the tokens sampled since the
    last piece (with logprobs), and at its end the finish reason and the number of tokens sampled."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: Literal["stop", "length"] | None = None
    tokens: int = 0
    score: float | None = None  # at the end of a scored row: its tokens' mean log-probability (Job.scored)


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


@dataclass(kw_only=True)
class Served:
    """A completion in flight: the engine's row (its tag is this) and what its client has been sent."""

    spec: RowSpec
    job: Job
    text: RowText
    row: Row
    shown: int = 0  # characters of the text already sent (stream)
    head: str = ""  # the echoed prompt, sent before the first piece
    pending: list[TokenLogprob] = field(default_factory=list)  # logprobs not yet sent

    @property
    def sampled(self) -> int:
        return len(self.text.tokens)

    @property
    def ended(self) -> bool:
        return self.row.done or self.text.stop_end is not None


def _job(request: Request[RowSpec]) -> Job:
    """The Job a request of the scheduler's admission queue stands for: its tag (`Job.admission`)."""
    assert isinstance(request.tag, Job), "every request the scheduler queues is tagged with its Job"
    return request.tag


def _served(row: Row) -> Served:
    """What a row of the scheduler's engine serves: its tag (`Batcher._serve`)."""
    assert isinstance(row.tag, Served), "every row of the server's engine is tagged with its Served"
    return row.tag


class Batcher:
    """The scheduler, on a thread of its own (`start`); `submit` hands it a Job."""

    def __init__(self, model: FreeTransformer, tokenizer: Tokenizer, max_batch: int, *, compile: bool = False):
        if max_batch < 1:
            raise ValueError(f"the batch must hold at least 1 row, got {max_batch}")
        self.tokenizer, self.max_batch = tokenizer, max_batch
        # a cache of the model's whole context; its scheduler queues the requests with rows not yet started
        # (`waiting`), a request's rows taking at most all but one slot
        self.engine = DecodeEngine(model, max_batch, compile=compile, share=max(1, max_batch - 1))
        self.queue = self.engine.scheduler
        self.wakeup = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="free-transformer-decoding", daemon=True)

    @property
    def rows(self) -> list[Row]:
        return self.engine.rows

    @property
    def waiting(self) -> list[Request[RowSpec]]:
        """The requests with rows not yet started, in arrival order."""
        return self.queue.waiting

    @property
    def steps(self) -> int:
        return self.engine.steps

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, job: Job) -> None:
        with self.wakeup:
            self.queue.add(job.admission, now=self.steps)
            self.wakeup.notify()

    def _run(self) -> None:
        while True:
            with self.wakeup:
                while not self.engine.rows and not self.waiting:
                    self.wakeup.wait()
            self._drop_cancelled()
            self._guarded(self._admit)
            if self.engine.rows:
                self._guarded(self._step)

    def _guarded(self, work: Callable[[], None]) -> None:
        """work(); an exception ends every request with rows in flight (they shared the failed computation),
        and the loop goes on with the next requests."""
        try:
            work()
        except Exception as error:  # a server must outlive a failed step: each request gets its 500
            logger.error("decoding step failed", exc_info=error)
            jobs = {id(served.job): served.job for served in map(_served, self.engine.rows)}
            for row in list(self.engine.rows):
                self.engine.finish(row, "error")
            for job in jobs.values():
                try:
                    self._end(job, error)
                except Exception as failure:  # a caller's finish that fails must not stop the loop
                    logger.error("a request's end failed", exc_info=failure)

    def _end(self, job: Job, error: Exception) -> None:
        """The request fails: its rows leave the engine at the next step (`_drop_cancelled`)."""
        with self.wakeup:
            self.queue.drop(job.admission)
        if not job.cancelled:
            job.cancelled = True
            job.finish(error)

    def _drop_cancelled(self) -> None:
        with self.wakeup:
            for request in list(self.queue.waiting):
                if _job(request).cancelled:
                    self.queue.drop(request)
        for row in list(self.engine.rows):
            if _served(row).job.cancelled:
                self.engine.finish(row, "cancelled")

    # ---- admission (free_transformer.inference.admission) -----------------------------------------

    def _admit(self) -> None:
        with self.wakeup:
            taken = self.queue.take(self.engine.free)
        joining = [self._serve(_job(request), spec) for request, spec in taken]
        for served in joining:
            try:
                self.engine.check(served.row)
            except ValueError as error:  # this request only: its row never joins
                self._end(served.job, error)
        self._join([served for served in joining if not served.job.cancelled])

    def _join(self, joining: list[Served]) -> None:
        """Prefill `joining` together and take their first tokens. A prefill that fails is tried again row by
        row, each afresh from its spec (its generator unused), so that it fails the requests of the rows that
        fail alone, and the others' tokens are those they get alone."""
        if not joining:
            return
        try:
            added = self.engine.add([served.row for served in joining])
        except Exception as error:
            for served in joining:
                self.engine.finish(served.row, "error")
            if len(joining) == 1:  # this request only: its prefill failed
                logger.error("prefill failed", exc_info=error)
                self._end(joining[0].job, error)
                return
            for served in joining:
                if not served.job.cancelled:
                    self._join([self._serve(served.job, served.spec)])
            return
        for row in added:
            self._take_alone(_served(row))

    def _serve(self, job: Job, spec: RowSpec) -> Served:
        row = prompt_row(
            spec.prompt,
            spec.seed,
            keep_logits=job.logprobs is not None,
            scored=job.scored,
            keep_prompt_logits=job.echo and job.logprobs is not None,
        )
        served = Served(spec=spec, job=job, text=RowText(self.tokenizer.decode, job.stops), row=row)
        served.head = self.tokenizer.decode(spec.prompt.ids) if job.echo else ""
        row.tag = served
        return served

    def _prompt_logprobs(self, ids: list[int], logits: Tensor, k: int) -> list[TokenLogprob]:
        """The prompt's tokens with log P(token | the tokens before it), the first with None."""
        chosen, tops = self._logprobs(logits, torch.tensor(ids[1:], device=logits.device), k)
        decode = self.tokenizer.decode
        first = TokenLogprob(token=decode(ids[:1]), logprob=None, top=None)
        return [
            first,
            *(TokenLogprob(token=decode([t]), logprob=lp, top=top) for t, lp, top in zip(ids[1:], chosen, tops)),
        ]

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
        for row in self.engine.step():
            self._take_alone(_served(row))

    def _take_alone(self, served: Served) -> None:
        """`_take`; an exception there (its text, its logprobs) ends the row and its request only."""
        try:
            self._take(served)
        except Exception as error:
            logger.error("a row failed", exc_info=error)
            self.engine.finish(served.row, "error")
            self._end(served.job, error)

    def _take(self, served: Served) -> None:
        """The row's new token (or its failure): its text, its log-probability, and the piece or the end it makes."""
        row, job = served.row, served.job
        if row.error is not None:  # this row's logits were not finite: its request fails, alone
            job.admission.left()
            self._end(job, row.error)
            return
        if row.prompt_logits is not None and job.logprobs is not None:  # kept with echo and logprobs
            served.pending = self._prompt_logprobs(served.spec.prompt.ids, row.prompt_logits[:-1], job.logprobs)
            row.prompt_logits = None
        if job.prompt_only:  # the prompt (and its logprobs) alone: the token drawn is not part of the answer
            self._deliver(served)
            return
        token = row.tokens[-1]
        served.text.push(token)
        if job.logprobs is not None:
            logits = row.logits
            assert logits is not None, "a row of a request with logprobs keeps its logits (_serve)"
            values, tops = self._logprobs(logits[None], torch.tensor([token], device=logits.device), job.logprobs)
            decoded = self.tokenizer.decode([token])
            served.pending.append(TokenLogprob(token=decoded, logprob=values[0], top=tops[0]))
        if served.text.stop_end is not None and not row.done:
            self.engine.finish(row, "stop")
        if served.ended:
            served.text.flush()
        self._deliver(served)

    def _deliver(self, served: Served) -> None:
        """Send what the row has that its client lacks: for a stream, the settled text since the last
        piece; at the end, the rest with the finish reason."""
        job, ending = served.job, served.ended
        if job.cancelled or not (ending or job.stream):
            return
        text = served.text.final if ending else served.text.settled()
        piece = served.head + text[served.shown :]
        if not piece and not served.pending and not ending:
            return
        logprobs = served.pending if job.logprobs is not None else None
        served.shown, served.head, served.pending = len(text), "", []
        finish_reason: Literal["stop", "length"] | None = (
            ("stop" if served.text.stop_end is not None or served.row.finish_reason == "stop" else "length")
            if ending
            else None
        )
        job.emit(
            Delta(
                index=served.spec.index,
                text=piece,
                logprobs=logprobs,
                finish_reason=finish_reason,
                tokens=served.sampled,
                score=served.row.score if ending and job.scored and served.sampled else None,
            )
        )
        if ending:
            job.admission.left()
            job.done += 1
            if job.done == len(job.rows):
                job.finish(None)
