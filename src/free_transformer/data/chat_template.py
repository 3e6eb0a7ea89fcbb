"""A tokenizer's chat template rendered with bounds, in worker processes: the template is code that came with
the model, and Jinja's sandbox (transformers renders chat templates in an ImmutableSandboxedEnvironment, as
here: its own `render_jinja_template`) stops a template from reaching Python's internals, not from looping for
hours or building a string of gigabytes. A render therefore runs in a worker process, where:
- it takes at most RENDER_SECONDS: the caller stops waiting then and kills the worker (a thread cannot be
  stopped, and a single string operation in C cannot be interrupted), and the worker's own timer kills it a
  second later, should its caller be gone or late (a caller's thread that a loaded machine wakes late finds the
  worker ended by that timer: past the bound all the same, a ChatTemplateRefused);
- it allocates at most RENDER_MEMORY_MB beyond what the worker holds at its start (RLIMIT_AS), so that
  `strftime_now('%Y' * 10**8)` is a MemoryError in the worker, not gigabytes in the server;
- its text is at most MAX_PROMPT_CHARS characters.
A worker can also read a whole request's body (`read`): the caller hands it the body's bytes and names a reader
module, whose `read(body, render)` parses the body, renders its messages and answers what the caller needs; the
parse then holds the worker's interpreter, not the caller's (a server's main process parsing a 4.4 MB body of
100,000 messages holds its GIL for most of a second). The body's read takes at most READ_SECONDS, apart from the
render's bound.
The caller's thread waits for the reply (a server renders on threads of its own, never on its event loop nor on
the threads that its other requests need: serve/rendering.py).
A worker renders one conversation at a time; `ChatRenderer` keeps up to `workers` of them and starts a new one
for each it had to kill. A worker reads its requests on stdin and ends when its parent closes it (exits)."""

from __future__ import annotations

import importlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

RENDER_SECONDS = 2.0  # a conversation's render (a long real one takes milliseconds)
READ_SECONDS = 10.0  # a request body's parse before its render (16 MB of JSON: about a second)
RENDER_MEMORY_MB = 512  # what a render may allocate in its worker
MAX_PROMPT_CHARS = 2**22  # a rendered conversation's characters (4 Mi: 32 per token of a 128k context)
WORKERS = 4  # renders at once; more wait for a worker
START_SECONDS = 60.0  # a worker's start (it imports transformers' renderer)


class ChatTemplateRefused(ValueError):
    """The template refused the conversation (its `raise_exception`, or a Jinja error about the messages), or the
    render went past a bound: the request's fault, as far as the server can tell."""


class ChatTemplateFailed(RuntimeError):
    """The template failed otherwise (an exception in its code): the model's template's fault."""


class ChatRenderer:
    """`render(messages)`: the conversation through `template` (with `variables`, the tokenizer's special tokens),
    the assistant's turn opened; a one-line ChatTemplateRefused or ChatTemplateFailed otherwise. Thread-safe."""

    def __init__(
        self,
        template: str,
        variables: dict,
        *,
        seconds: float = RENDER_SECONDS,
        memory_mb: int = RENDER_MEMORY_MB,
        max_chars: int = MAX_PROMPT_CHARS,
        workers: int = WORKERS,
    ):
        self.template, self.variables = template, variables
        self.seconds, self.memory_mb, self.max_chars = seconds, memory_mb, max_chars
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.slots = threading.BoundedSemaphore(workers)
        self.started: set[_Worker] = set()  # every worker alive, stopped when the renderer goes
        weakref.finalize(self, _stop, self.started)

    def render(self, messages: list[dict[str, str]]) -> str:
        return self._ask({"messages": messages})["prompt"]

    def read(self, body: bytes, reader: str) -> dict:
        """`body` read in a worker by the module named `reader` (imported there), whose `read(body, render)` returns
        a JSON object and calls `render(messages)` at most once (it returns `_render`'s reply): that object, or a
        one-line ChatTemplateRefused or ChatTemplateFailed for a failed render or read."""
        return self._ask({"reader": reader, "body": len(body)}, body)

    def _ask(self, fields: dict, body: bytes = b"") -> dict:
        """The worker's reply to a request of `fields` (then `body`'s bytes), its errors raised."""
        request = {
            "template": self.template,
            "variables": self.variables,
            "max_chars": self.max_chars,
            "seconds": self.seconds,
            **fields,
        }
        line = json.dumps(request).encode() + b"\n"  # ASCII: a lone surrogate travels escaped
        with self.slots:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                worker = _Worker(self.memory_mb)
                self.started.add(worker)
            reply = worker.ask(line, body, self.seconds, reading="reader" in fields)
            if reply is None:  # past its time, or dead: it goes
                ended = worker.process.poll()
                worker.stop()
                self.started.discard(worker)
                if ended is not None and ended != -signal.SIGALRM:  # its own timer ends it past the bound
                    raise ChatTemplateFailed(f"the chat template's worker process ended (exit code {ended})")
                if worker.reading:
                    raise ChatTemplateRefused(f"the request's body took more than {READ_SECONDS:g} s to read")
                raise ChatTemplateRefused(
                    f"the chat template took more than {self.seconds:g} s to render these messages (its bound)"
                )
            self.idle.put(worker)
        if "error" in reply:
            kind = ChatTemplateRefused if reply["refused"] else ChatTemplateFailed
            raise kind(" ".join(reply["error"].split()))
        return reply


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, memory_mb: int):
        package = str(Path(__file__).resolve().parents[2])  # where this `free_transformer` is: the worker's
        self.process = subprocess.Popen(
            [sys.executable, "-c", _START, package, str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
        )
        self.pending = b""  # bytes read past the last reply
        self.ready = False
        self.reading = False  # waiting for a request's body to be read (not yet rendered)

    def ask(self, line: bytes, body: bytes, seconds: float, reading: bool = False) -> dict | None:
        """The reply to `line` and `body`, or None when none came within `seconds` (after the body's read, within
        READ_SECONDS, when `reading`), or the worker died; `reading` stays true when the read took too long."""
        if not self.ready:  # its start (imports) is not the render's time
            self.ready = self._reply(time.monotonic() + START_SECONDS) == {"ready": True}
            if not self.ready:
                return None
        assert self.process.stdin is not None, "the worker is started with pipes"
        try:
            self.process.stdin.write(line)
            self.process.stdin.write(body)  # apart from the line: no copy of a body of megabytes
            self.process.stdin.flush()
        except OSError:  # it died
            return None
        self.reading = reading
        reply = self._reply(time.monotonic() + (READ_SECONDS if reading else seconds))
        if reading and reply == {"read": True}:  # the body is read: the render's own bound starts
            self.reading = False
            reply = self._reply(time.monotonic() + seconds)
        return reply

    def _reply(self, deadline: float) -> dict | None:
        assert self.process.stdout is not None, "the worker is started with pipes"
        out = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out, 1 << 20)
            if not chunk:  # it died
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def _stop(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.stop()


# ---- the worker ---------------------------------------------------------------------------------------------

# A worker's start: its parent's `free_transformer` found first (in place of the working directory, which
# `python -c` puts first on the path), then `_serve`.
_START = """
import sys
package = sys.argv[1]
sys.path[:1] = [] if package in sys.path[1:] else [package]
from free_transformer.data.chat_template import _serve
_serve(int(sys.argv[2]))
"""


def _limit_memory(megabytes: int) -> None:
    """Further allocations of this process: at most `megabytes` (Linux; elsewhere no bound is set)."""
    import resource

    try:
        with open("/proc/self/statm") as statm:
            held = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (held + megabytes * 2**20, resource.RLIM_INFINITY))
    except (OSError, ValueError):
        pass


def _render(request: dict, megabytes: int) -> dict:
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        # (texts, generation indices), one text per conversation (transformers annotates it `-> str`)
        rendered = render_jinja_template(
            conversations=[request["messages"]],
            chat_template=request["template"],
            add_generation_prompt=True,
            **request["variables"],
        )[0]
    except TemplateError as error:  # a template may refuse a conversation (roles that do not alternate, ...)
        return {"refused": True, "error": f"the chat template refused these messages: {error}"}
    except MemoryError:
        return {"refused": True, "error": f"the chat template needed more than {megabytes} MiB for these messages"}
    except Exception as error:
        return {"refused": False, "error": f"the chat template failed: {type(error).__name__}: {error}"}
    prompt = rendered[0]
    if len(prompt) > request["max_chars"]:
        return {
            "refused": True,
            "error": f"the chat template made {len(prompt)} characters of these messages; at most "
            f"{request['max_chars']} are taken",
        }
    return {"prompt": prompt}


def _read(reader: str, body: bytes, request: dict, megabytes: int, out) -> dict:
    """`body` read by the module `reader`'s `read(body, render)`: its reply, or a failed read's error reply."""

    def render(messages: list[dict[str, str]]) -> dict:
        out.write(b'{"read": true}\n')  # the caller's wait for the render starts now
        out.flush()
        signal.setitimer(signal.ITIMER_REAL, request["seconds"] + 1.0)
        return _render({**request, "messages": messages}, megabytes)

    try:
        return importlib.import_module(reader).read(body, render)
    except MemoryError:
        return {"refused": True, "error": f"reading the request's body needed more than {megabytes} MiB"}
    except Exception as error:
        return {"refused": False, "error": f"reading the request's body failed: {type(error).__name__}: {error}"}


def _serve(megabytes: int) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401 (imported before the limit)

    _limit_memory(megabytes)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the replies' pipe; anything printed goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    out.write(b'{"ready": true}\n')
    out.flush()
    requests = sys.stdin.buffer
    while line := requests.readline():
        request = json.loads(line)
        # past its bound (and a second more), the kernel ends this process: SIGALRM's default action
        if "reader" in request:  # a body's read, then its render (which sets the render's bound)
            body = requests.read(request["body"])
            signal.setitimer(signal.ITIMER_REAL, READ_SECONDS + 1.0)
            reply = _read(request["reader"], body, request, megabytes, out)
        else:
            signal.setitimer(signal.ITIMER_REAL, request["seconds"] + 1.0)
            reply = _render(request, megabytes)
        signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
