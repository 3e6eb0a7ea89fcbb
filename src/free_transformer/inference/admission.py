"""Admission: which waiting rows take the decoding engine's free slots, the one rule for `run_rows` (generate)
and the server's scheduler (free_transformer.serve.batcher).

Callers queue requests, each rows in its own order. The next free slot goes to the request with the fewest rows
in flight, then the one due first, then the oldest. A request is due at the step it arrived plus the tokens it
asks for, so that a short request starts at the next free slot unless one queued before it is due sooner, and a
long one is passed by newcomers only until its due step. Every third slot goes instead to the request that asks
for the fewest tokens (after the fewest rows in flight, then the oldest), so that no flood of requests due
earlier holds a short one: the bound is that a request is admitted within 3k + 3 slots freed after it arrived,
k the requests waiting that have no more rows in flight and ask for fewer tokens (as many: are older), however
many others wait; the requests due first still take two slots of every three, so none waits forever. (A flood
of 1,000 one-row requests of 100 tokens held a 4-token request that came 200 steps later behind all of them: 8.9
s against 0.06 s alone.) A request has at most `share` rows in flight (the
server: all but one slot, so that a newcomer finds one unless others fill the engine). One request alone, with a
share of every slot (generate), joins its rows in their order as slots free."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")  # a row, as its caller describes it


class Request(Generic[T]):
    """One caller's rows waiting for slots, and the counters admission orders requests by. The rows are read
    one ahead of the admitted ones (to know when none is left), so an iterator of them may be lazy."""

    def __init__(self, rows: Iterable[T], *, tokens: int = 0, tag: object = None):
        self._rows = iter(rows)
        self._next: list[T] = list(itertools.islice(self._rows, 1))  # the next row to admit, if any
        self.tokens = tokens  # what it asks for: with its arrival step, when it is due
        self.tag = tag  # the caller's
        self.admitted = 0  # rows taken
        self.in_flight = 0  # rows taken that have not left (`left`)
        self.order = 0  # its place in the arrival order (set by `Admission.add`)
        self.due = 0  # the step it arrived at plus its tokens (set by `Admission.add`)

    @property
    def waiting(self) -> bool:
        """Whether a row of it is still to be admitted."""
        return bool(self._next)

    def left(self) -> None:
        """One of its rows in flight left the engine (it ended, failed or was ended)."""
        self.in_flight -= 1

    def _admit(self) -> T:
        row = self._next.pop()
        self._next = list(itertools.islice(self._rows, 1))
        self.admitted += 1
        self.in_flight += 1
        return row


class Admission(Generic[T]):
    """The queue of requests with rows not yet admitted, and the rule that orders them (`take`)."""

    def __init__(self, share: int | None = None):
        if share is not None and share < 1:
            raise ValueError(f"a request's share must be at least 1 row, got {share}")
        self.share = share  # the most rows one request has in flight (None: every slot)
        self.waiting: list[Request[T]] = []  # requests with rows not yet admitted, in arrival order
        self._arrivals = itertools.count()
        self._slots = itertools.count()  # slots given so far: every third goes to the shortest request

    def add(self, request: Request[T], *, now: int = 0) -> Request[T]:
        """Queue `request`, arrived at step `now`."""
        request.order = next(self._arrivals)
        request.due = now + request.tokens
        if request.waiting:
            self.waiting.append(request)
        return request

    def drop(self, request: Request[T]) -> None:
        """No more rows of `request` are admitted (it was cancelled or failed); those in flight are the
        caller's to end."""
        if request in self.waiting:
            self.waiting.remove(request)

    def take(self, free: int) -> list[tuple[Request[T], T]]:
        """The rows to join now, at most `free`, each with its request: slot by slot, the next row of the request
        with the fewest rows in flight, then the one due first (every third slot: asking for the fewest tokens),
        then the oldest, among those under their share."""
        taken: list[tuple[Request[T], T]] = []
        while len(taken) < free:
            ready = [request for request in self.waiting if self.share is None or request.in_flight < self.share]
            if not ready:
                break
            shortest = next(self._slots) % 3 == 2
            request = min(ready, key=lambda r: (r.in_flight, r.tokens if shortest else r.due, r.order))
            taken.append((request, request._admit()))
            if not request.waiting:
                self.waiting.remove(request)
        return taken
