"""A chat request's body, parsed and validated where its messages are rendered: in a render worker process
(data/chat_template.py, `ChatRenderer.read`), not in the server's. Parsing and validating 100,000 messages (a
4.4 MB body) holds an interpreter's GIL for most of a second; in the server's process that stopped its event
loop (/health) and its decoding thread for as long.

`read(body, render)` runs in the worker: the body checked as ChatCompletionRequest, its messages rendered, its
other fields checked as the CompletionRequest of the rendered prompt; its reply is that prompt and those fields,
or the first error of a body the API refuses. `completion(reply)` runs in the server: the CompletionRequest of the
reply (a few fields, checked again at the cost of a string check), or InvalidChat."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from pydantic import ValidationError

from .protocol import ChatCompletionRequest, CompletionRequest


class InvalidChat(ValueError):
    """A chat body the API refuses (a 400): `error` is pydantic's first error (its type, loc and msg), or None
    where the message says it all."""

    def __init__(self, message: str, error: dict | None = None):
        super().__init__(message)
        self.error = error


def read(body: bytes, render: Callable[[list[dict[str, str]]], dict]) -> dict:
    """(In a render worker.) {"prompt", "fields"}: the rendered messages and the request's other fields as
    CompletionRequest read them (those the client gave); {"invalid": error} or {"rejected": message} for a body the
    API refuses; a failed render's reply as `render` gave it."""
    try:
        chat = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as error:  # the body's own fields: located in the body, as FastAPI locates them
        return {"invalid": _first(error, ("body",))}
    rendered = render(cast(list[dict[str, str]], chat.messages))  # each a ChatMessage: two str fields
    if "prompt" not in rendered:
        return rendered
    try:
        request = chat.completion(rendered["prompt"])
    except ValidationError as error:  # a field that CompletionRequest refuses, as /v1/completions says it
        return {"invalid": _first(error)}
    except ValueError as error:  # a field that chat does not take
        return {"rejected": str(error)}
    fields = request.model_dump(mode="json", exclude_unset=True, exclude={"prompt"})
    return {"prompt": rendered["prompt"], "fields": fields}


def completion(reply: dict) -> CompletionRequest:
    """(In the server.) The completion request of `read`'s reply; InvalidChat for a body it refused."""
    if "invalid" in reply:
        error = {**reply["invalid"], "loc": tuple(reply["invalid"]["loc"])}
        raise InvalidChat(error["msg"], error)
    if "rejected" in reply:
        raise InvalidChat(reply["rejected"])
    return CompletionRequest.model_validate({**reply["fields"], "prompt": reply["prompt"]})


def _first(error: ValidationError, within: tuple = ()) -> dict:
    """Pydantic's first error as JSON: what the server's message is made of (its input, maybe the whole body,
    stays here)."""
    first = error.errors(include_url=False)[0]
    return {"type": first["type"], "loc": [*within, *first["loc"]], "msg": first["msg"]}
