"""The server's chat requests, from their body to their plan, on threads of their own: `ChatQueue`.

A chat request's body is parsed and checked and its messages go through the chat template in a worker process
(serve/chat_body.py, data/chat_template.py: up to its time bounds), then its prompt is tokenized into a plan: for
a conversation of 100,000 messages, seconds of work, of which the server's process holds its GIL only for the
tokenization's lists and the plan. That work runs on the queue's `workers` threads, as many as the template has
render workers, so that a request waiting for one waits on the event loop and holds nothing: /health, the other
requests' plans (the server's thread pool) and the decoding loop never wait behind a render. At most `waiting`
more chat requests wait for a thread; past them a request is refused at once (`Busy`: a 429 with Retry-After),
never left to stall."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ..data.chat_template import RENDER_SECONDS, WORKERS
from .config import DEFAULT_CHAT_QUEUE

T = TypeVar("T")


class Busy(Exception):
    """Every render thread is taken and `waiting` requests wait for one: the client should retry after `seconds`."""

    def __init__(self, message: str, seconds: int):
        super().__init__(message)
        self.seconds = seconds


class ChatQueue:
    """`await run(work)`: `work()` on one of `workers` threads once one is free, or Busy at once when `waiting`
    requests already wait. Used from one event loop (its count is the loop's alone)."""

    def __init__(self, waiting: int = DEFAULT_CHAT_QUEUE, workers: int = WORKERS, seconds: float = RENDER_SECONDS):
        self.waiting, self.workers, self.seconds = waiting, workers, seconds
        self.threads = ThreadPoolExecutor(workers, thread_name_prefix="chat")
        self.admitted = 0  # running and waiting

    async def run(self, work: Callable[[], T]) -> T:
        if self.admitted >= self.workers + self.waiting:
            # each request ahead renders within its bound: the queue drains within this
            seconds = math.ceil(self.seconds * self.admitted / self.workers)
            raise Busy(
                f"the server renders {self.workers} chat conversations at once and {self.waiting} wait for it, "
                f"all taken: retry after {seconds} s (serve --chat-queue)",
                seconds,
            )
        self.admitted += 1
        loop = asyncio.get_running_loop()
        task = self.threads.submit(work)
        # counted until its thread is done with it (a departed client's work, once started, runs to its end)
        task.add_done_callback(lambda _: self._release(loop))
        return await asyncio.wrap_future(task)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:  # on any thread
        def release() -> None:
            self.admitted -= 1

        with contextlib.suppress(RuntimeError):  # the event loop has closed (the server is stopping)
            loop.call_soon_threadsafe(release)
