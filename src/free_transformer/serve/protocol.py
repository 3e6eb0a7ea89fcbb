"""The OpenAI API as this server reads and writes it: the request and response bodies of
/v1/models and /v1/completions, and the error body, as pydantic models.

Requests are strict (a number must be a JSON number, a flag true or false) and closed: a field this
server does not read (logprobs, echo, suffix, best_of, logit_bias, stream_options, a misspelt one)
is a 400, not silently ignored. The Free Transformer's own fields (`latents`, `reference`,
`latent_seed`) are what OpenAI clients send with `extra_body`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator
from pydantic_core import PydanticCustomError

from ..base.settings import field_docs
from ..inference.params import SamplingError, SamplingParams, spelt_fields

MAX_N = 128  # OpenAI's own limit on completions per prompt
# request fields whose JSON type is not their setting's: stop takes one string too; latents is read by
# free_transformer.inference.latents.parse_latents (which also reads old spellings)
REQUEST_TYPES = {"stop": str | list[str] | None, "latents": str | None}


def _check_sampling(value, info):
    """A sampling field checked as SamplingParams checks it, the error on that field."""
    name = SAMPLING_FIELDS[info.field_name]
    if value is not None and name not in REQUEST_TYPES:
        try:
            SamplingParams(**{name: value})
        except SamplingError as error:
            raise PydanticCustomError("sampling", error.spelt("").strip()) from None
    return value


def _sampling_request() -> type[BaseModel]:
    """The request's sampling fields, one per field of SamplingParams (inference/params.py) under its request
    name (`max_tokens`), with its type, default and docstring; checked as SamplingParams checks them."""
    hints, docs = typing.get_type_hints(SamplingParams), field_docs(SamplingParams)
    defaults = {item.name: item.default for item in dataclasses.fields(SamplingParams)}
    fields = {request: (REQUEST_TYPES.get(name, hints[name]),
                        Field(None if name in REQUEST_TYPES else defaults[name], description=docs.get(name)))
              for name, request in SAMPLING_NAMES.items()}
    return create_model("SamplingRequest", __config__=ConfigDict(extra="forbid", strict=True),
                        __validators__={"check": field_validator(*fields)(_check_sampling)}, **fields)


SAMPLING_NAMES = spelt_fields(SamplingParams, "request")  # {"max_new_tokens": "max_tokens", ...}
SAMPLING_FIELDS = {request: name for name, request in SAMPLING_NAMES.items()}


class CompletionRequest(_sampling_request()):
    """The sampling fields (max_tokens, temperature, top_p, n, stop, seed, latents, ...: SamplingParams), then
    what a completions request adds. `latents`, `reference` and `latent_seed` are the Free Transformer's own."""

    model: str
    prompt: str | list[str]
    """One prompt or several; each is continued n times."""
    stream: bool = False
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    # OpenAI clients send these two at 0 by default; anything else asks for what this server lacks.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("n")
    @classmethod
    def _at_most_max_n(cls, value: int) -> int:
        if value > MAX_N:
            raise ValueError(f"at most {MAX_N} completions per prompt")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("this server does not apply penalties; give 0 or leave it out")
        return value


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None  # None: a streamed chunk before the completion's last
    logprobs: None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    """A whole response, or one chunk of a stream (a text delta per choice, no usage)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "free-transformer"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str  # one line
    type: str  # invalid_request_error, not_found_error, server_error
    param: str | None = None  # the request field at fault
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
