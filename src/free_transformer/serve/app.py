"""The HTTP server: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over an `Engine`,
vLLM's /health and tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info, which lm-eval's
`local-completions` reads), as a FastAPI app. Chat is served where the tokenizer has a chat template
(a Hugging Face tokenizer that ships one): the messages go through it and are completed as a prompt;
for any other model it is a 404 that says so.

Every error is OpenAI's error body with a one-line message: a request refused is a 4xx (type
`invalid_request_error`), an exception while sampling a 500 (`server_error`) that leaves the server
serving. A body larger than the limit is refused (413) before it is read whole; with an API key, every
endpoint but /health and the API's documentation asks for `Authorization: Bearer KEY`.

A completion is decoded by the engine's one decoding loop, batched with the other requests in flight;
the handler waits for its pieces on a queue. A streamed completion is a series of server-sent
events, one `Completion` chunk per piece of text, then `data: [DONE]`; an exception after its first
chunk ends it with an error event (the status line is already sent). A client that leaves (a closed
connection) has its rows dropped from the batch at the next step."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..base.version import __version__
from ..data.chat_template import ChatTemplateRefused
from . import chat_body
from .batcher import Delta, Job, TokenLogprob
from .chat_body import InvalidChat
from .config import DEFAULT_CHAT_QUEUE, DEFAULT_MAX_REQUEST_MB
from .protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    DetokenizeRequest,
    ErrorBody,
    ErrorDetail,
    Logprobs,
    ModelCard,
    ModelList,
    TokenizeRequest,
    Usage,
)
from .rendering import Busy, ChatQueue
from .request_plan import Engine, Plan, RequestError

logger = logging.getLogger(__name__)

UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
}
# /v1/chat/completions reads its body itself (off the event loop): its schema, for /docs, is given here
CHAT_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ChatCompletionRequest.model_json_schema()}},
    }
}
OPEN_PATHS = {"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}  # no API key needed


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = "server_error" if status >= 500 else "invalid_request_error"  # OpenAI's two types
    detail = ErrorDetail(message=" ".join(message.split()), type=kind, param=param, code=code)
    return ErrorBody(error=detail).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def failure(error: Exception) -> str:
    """The one line a client reads for an exception while serving it (the log gets the traceback)."""
    return f"the server failed on this request: {type(error).__name__}: {error}"


def validation_message(first: dict) -> tuple[str, str | None, str | None]:
    """One line, the field at fault and a code for the first of pydantic's errors (a field of several types
    reports each type's error: it is named once, with the types it takes)."""
    if first["type"] in ("json_invalid", "model_attributes_type") or first["loc"] == ("body",):
        return "the request body must be a JSON object (UTF-8)", None, None
    location = [str(part) for part in first["loc"] if part != "body"]
    param = location[0] if location else None
    if first["type"] == "missing":
        return f"missing required field {'.'.join(location)!r}", param, "missing_required_parameter"
    if first["type"] == "extra_forbidden":
        return f"unknown or unsupported field {'.'.join(location)!r}", param, None
    message = first["msg"].removeprefix("Value error, ")
    if param in UNION_FIELDS and first["type"] != "value_error":
        return f"{param} must be {UNION_FIELDS[param]}", param, None
    return f"{'.'.join(location)}: {message}", param, None


class Guard:
    """ASGI middleware before the app: the API key (a constant-time comparison) and the body's size,
    counted as it arrives, so that an oversized body is refused without being held whole."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope, self.api_key):
            return await self._refuse(
                send, 401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'", "invalid_api_key"
            )
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._refuse(send, 413, self._too_large(int(declared)), "request_too_large")
        chunks, size = [], 0
        while True:  # the whole body, up to the limit, then handed to the app as one message
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body ended
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._refuse(send, 413, self._too_large(size, at_least=True), "request_too_large")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    def _authorized(scope, api_key: str) -> bool:
        """The header's bytes against the key's UTF-8 (a non-ASCII key, sent as UTF-8, used never to match)."""
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), api_key.encode())

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (
            f"the request body has {'more than ' if at_least else ''}{size - at_least} bytes; this server "
            f"reads at most {self.max_body_bytes} (serve --max-request-mb)"
        )

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str) -> None:
        body = json.dumps(error_body(status, message, code=code)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class Channel:
    """The pieces of one request, from the decoding loop's thread to the handler's event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:  # on any thread
        with contextlib.suppress(RuntimeError):  # the event loop has closed (the server is stopping): no one listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self):
        return await self.queue.get()


END = object()  # the last item of a channel when the request succeeded


def build_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_REQUEST_MB * 2**20,
    chat_queue: int = DEFAULT_CHAT_QUEUE,
):
    """The ASGI app (the FastAPI app inside the Guard); starts the engine's decoding loop. `chat_queue`: the chat
    requests that may wait for a render thread (serve/rendering.py)."""
    app = FastAPI(
        title="free-transformer", version=__version__, summary=f"OpenAI-compatible completions from {engine.name}"
    )
    created = int(time.time())
    app.state.chats = chats = ChatQueue(chat_queue)
    engine.start()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param, code = validation_message(error.errors()[0])
        return error_response(400, message, param, code)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, f"{request.method} {request.url.path}: {error.detail}")

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the decoding loop runs, 503 if it has stopped: on the event loop, so that no request's work
        (a render, a plan) delays it."""
        if engine.batcher.alive:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the decoding loop has stopped: restart the server")

    @app.get("/v1/models")
    def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.name, created=created, max_model_len=engine.context)])

    @app.get("/tokenizer_info")
    def tokenizer_info() -> dict:
        return {
            "tokenizer_class": engine.tokenizer.name,
            "model_max_length": engine.context,
            "eos_token": None,
            "bos_token": None,
            "pad_token": None,
        }

    @app.post("/tokenize")
    def tokenize(request: TokenizeRequest) -> dict:
        tokens = engine.tokenizer.encode(request.prompt)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.context}

    @app.post("/detokenize")
    def detokenize(request: DetokenizeRequest) -> JSONResponse:
        vocab = engine.model.config.vocab_size
        if any(not 0 <= token < vocab for token in request.tokens):
            return error_response(400, f"tokens must lie in [0, {vocab})", "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(request.tokens)})

    @app.post("/v1/chat/completions", openapi_extra=CHAT_BODY)
    async def chat_completions(raw: Request):
        """The body is read and rendered in a render worker, then planned, on the chat queue's threads
        (serve/rendering.py), never on the event loop nor on the pool that other requests plan on."""
        if engine.tokenizer.chat_template is None:  # no chat format is invented for a model that has none
            return error_response(
                404,
                f"this model's tokenizer ({engine.tokenizer.name}) has no chat template; send text to /v1/completions",
                code="no_chat_template",
            )
        body = await raw.body()  # already read whole by the Guard
        try:
            request, plan = await chats.run(lambda: chat_plan(body))
        except Busy as error:
            response = error_response(429, str(error), code="server_busy")
            response.headers["Retry-After"] = str(error.seconds)
            return response
        except InvalidChat as error:
            message, param, code = (str(error), None, None) if error.error is None else validation_message(error.error)
            return error_response(400, message, param, code)
        except RequestError as error:
            return error_response(error.status, str(error), error.param, error.code)
        except ValueError as error:  # the template refused the conversation, took it past a bound, or a field
            return error_response(400, str(error), "messages" if isinstance(error, ChatTemplateRefused) else None)
        except Exception as error:  # the template's code failed
            logger.error("chat request failed", exc_info=error)
            return error_response(500, failure(error))
        return await answer(request, raw, chat=True, plan=plan)

    def chat_plan(body: bytes) -> tuple[CompletionRequest, Plan]:
        """(On a thread of the chat queue.) The chat body as the completion request of its rendered messages, and
        its plan: the body is parsed, checked and rendered in a render worker (serve/chat_body.py), so that this
        process holds the GIL only for the reply's few fields, then the plan."""
        request = chat_body.completion(engine.tokenizer.read_chat(body, chat_body.__name__))
        return request, engine.plan(request)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        return await answer(request, raw)

    async def answer(request: CompletionRequest, raw: Request, chat: bool = False, plan: Plan | None = None):
        """Plan the request (unless its `plan` is given), submit its rows to the decoding loop and answer with what
        it decodes: a completion, or the same text as a chat completion."""
        try:
            if plan is None:
                plan = await run_in_threadpool(engine.plan, request)
        except RequestError as error:
            return error_response(error.status, str(error), error.param, error.code)
        except Exception as error:
            logger.error("request failed", exc_info=error)
            return error_response(500, failure(error))
        channel = Channel()
        job = Job(
            rows=plan.rows,
            stops=plan.stops,
            logprobs=request.logprobs,
            echo=request.echo,
            prompt_only=request.max_tokens == 0,
            stream=request.stream,
            scored=plan.ranked,
            emit=channel.put,
            finish=lambda error: channel.put(END if error is None else error),
        )
        engine.batcher.submit(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(raw, job, channel))
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": engine.name,
        }
        if request.stream:
            usage = request.stream_options is not None and request.stream_options.include_usage
            return await _stream(channel, job, watcher, plan, head, usage, ChatCompletionChunk.of if chat else None)
        try:
            answered = await _collect(channel, plan, head)
            return ChatCompletion.of(answered) if chat and isinstance(answered, Completion) else answered
        finally:
            job.cancelled = True  # nothing more is read: a row still in flight (a departed client's) stops
            watcher.cancel()

    return Guard(app, api_key, max_body_bytes)


async def _cancel_on_disconnect(raw: Request, job: Job, channel: Channel) -> None:
    """Wait for the client to leave; then drop the request's rows at the next decoding step."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    job.cancelled = True
    channel.put(ConnectionError("the client left"))


def _choice(delta: Delta, offset: int) -> CompletionChoice:
    return CompletionChoice(
        index=delta.index,
        text=delta.text,
        finish_reason=delta.finish_reason,
        logprobs=None if delta.logprobs is None else _logprobs(delta.logprobs, offset),
    )


def _logprobs(logprobs: list[TokenLogprob], offset: int) -> Logprobs:
    """OpenAI's logprobs of a piece whose text starts at `offset` of its choice's text."""
    out = Logprobs()
    for item in logprobs:
        out.tokens.append(item.token)
        out.token_logprobs.append(item.logprob)
        out.top_logprobs.append(item.top)
        out.text_offset.append(offset)
        offset += len(item.token)
    return out


def _usage(plan: Plan, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=plan.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=plan.prompt_tokens + completion_tokens,
    )


async def _collect(channel: Channel, plan: Plan, head: dict):
    pieces: dict[int, Delta] = {}
    while (item := await channel.get()) is not END:
        if isinstance(item, ConnectionError):
            return error_response(400, "the client left")  # never read
        if isinstance(item, Exception):
            return error_response(500, failure(item))
        pieces[item.index] = item
    choices = [_choice(piece, 0) for piece in plan.returned(pieces)]  # every candidate's tokens are billed
    return Completion(**head, choices=choices, usage=_usage(plan, sum(p.tokens for p in pieces.values())))


async def _stream(channel: Channel, job: Job, watcher: asyncio.Task, plan: Plan, head: dict, usage: bool, convert=None):
    """Answer once the first piece is there, so that a failure before any text is still a 500. `convert` turns
    each `Completion` chunk into what is sent instead (a chat chunk)."""
    convert = convert or (lambda chunk: chunk)
    first = await channel.get()
    if isinstance(first, Exception):
        job.cancelled = True
        watcher.cancel()
        return error_response(500, failure(first))

    async def chunks():
        item, offsets, tokens = first, [0] * plan.completions, [0] * plan.completions
        try:
            while item is not END:
                if isinstance(item, ConnectionError):
                    return
                if isinstance(item, Exception):
                    yield f"data: {json.dumps(error_body(500, failure(item)))}\n\n"
                    return
                choice = _choice(item, offsets[item.index])
                offsets[item.index] += len(item.text)
                tokens[item.index] = item.tokens
                yield f"data: {convert(Completion(**head, choices=[choice])).model_dump_json()}\n\n"
                item = await channel.get()
            if usage:
                last = Completion(**head, choices=[], usage=_usage(plan, sum(tokens)))
                yield f"data: {convert(last).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # ended, or the client left: the loop drops what is still in flight
            job.cancelled = True
            watcher.cancel()

    return StreamingResponse(chunks(), media_type="text/event-stream")
