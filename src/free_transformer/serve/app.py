"""The HTTP server: OpenAI's /v1/models and /v1/completions over an `Engine`, as a FastAPI app.

Every error is OpenAI's error body with a one-line message: a request the engine refuses is a 4xx,
an exception while sampling a 500 that leaves the server serving. A streamed completion is a series
of server-sent events, one `Completion` chunk per piece of text, then `data: [DONE]`; an exception
after its first chunk ends it with an error event (the status line is already sent)."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .engine import Delta, Engine, Plan, RequestError
from .protocol import (Completion, CompletionChoice, CompletionRequest, ErrorBody, ErrorDetail, ModelCard,
                       ModelList, Usage)

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               500: "server_error"}
UNION_FIELDS = {"prompt": "a string or a list of strings", "stop": "a string or a list of strings"}
END = object()  # the last item a stream's queue holds


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    detail = ErrorDetail(message=" ".join(message.split()), type=ERROR_TYPES.get(status, "invalid_request_error"),
                         param=param, code=code)
    return ErrorBody(error=detail).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def failure(error: Exception) -> str:
    """The one line a client reads for an exception while serving it (the log gets the traceback)."""
    logger.error("request failed", exc_info=error)
    return f"the server failed on this request: {type(error).__name__}: {error}"


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """One line and the field at fault for pydantic's list of errors (the first one; a field of two
    types reports each type's error: it is named once, with the types it takes)."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return "the request body is not valid JSON", None
    location = [str(part) for part in first["loc"] if part != "body"]
    param = location[0] if location else None
    if first["type"] == "extra_forbidden":
        return f"unknown or unsupported field {param!r}", param
    if param in UNION_FIELDS:
        return f"{param} must be {UNION_FIELDS[param]}", param
    if param is None:
        return f"the request body must be a JSON object: {first['msg']}", None
    return f"{'.'.join(location)}: {first['msg']}", param


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="free-transformer", summary=f"OpenAI-compatible completions from {engine.name}")
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return error_response(error.status_code, f"{request.method} {request.url.path}: {error.detail}")

    @app.get("/v1/models")
    def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.name, created=created)])

    @app.post("/v1/chat/completions")
    def chat_completions() -> JSONResponse:
        # The Tokenizer protocol carries no chat template, so no message list can be turned into a prompt.
        return error_response(404, f"this model's tokenizer ({engine.tokenizer.name}) has no chat template; "
                                   "send text to /v1/completions", code="no_chat_template")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        try:
            plan = await run_in_threadpool(engine.plan, request)
        except RequestError as error:
            return error_response(error.status, str(error), error.param, error.code)
        except Exception as error:
            return error_response(500, failure(error))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.name}
        if request.stream:
            return await stream(engine, plan, head)
        try:
            samples = await run_in_threadpool(engine.complete, plan)
        except Exception as error:
            return error_response(500, failure(error))
        prompt_tokens = sum(len(prompt.ids) for prompt in plan.prompts)
        completion_tokens = sum(sample.tokens for sample in samples)
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
        choices = [CompletionChoice(index=s.index, text=s.text, finish_reason=s.finish_reason) for s in samples]
        return Completion(**head, choices=choices, usage=usage)

    return app


async def stream(engine: Engine, plan: Plan, head: dict):
    """Sample on a thread of its own, which queues each Delta (then END, or the exception that stopped
    it); answer once the first is there, so that a failure before any text is still a 500."""
    events: queue.Queue = queue.Queue()
    listening = threading.Event()
    listening.set()

    def send(delta: Delta) -> bool:
        events.put(delta)
        return listening.is_set()

    def produce() -> None:
        try:
            engine.stream(plan, send)
            events.put(END)
        except Exception as error:
            events.put(error)

    threading.Thread(target=produce, name="free-transformer-stream", daemon=True).start()
    first = await run_in_threadpool(events.get)
    if isinstance(first, Exception):
        return error_response(500, failure(first))

    async def chunks():
        item = first
        try:
            while item is not END:
                if isinstance(item, Exception):
                    yield f"data: {json.dumps(error_body(500, failure(item)))}\n\n"
                    return
                choice = CompletionChoice(index=item.index, text=item.text, finish_reason=item.finish_reason)
                yield f"data: {Completion(**head, choices=[choice]).model_dump_json()}\n\n"
                item = await run_in_threadpool(events.get)
            yield "data: [DONE]\n\n"
        finally:  # the client may have left: the sampler stops at its next token
            listening.clear()

    return StreamingResponse(chunks(), media_type="text/event-stream")
