"""The OpenAI API as this server reads and writes it: the request and response bodies of
/v1/models, /v1/completions and /v1/chat/completions, the tokenizer endpoints, and the error body, as
pydantic models. A chat request is a completion request whose prompt is its messages through the
tokenizer's chat template: its other fields are read by CompletionRequest, so both check them alike.

Requests are strict (a number must be a JSON number, a flag true or false) and closed: every field of
OpenAI's completions API is accepted at its default, a value this server cannot honour (a non-null
`suffix`, a `logit_bias`, non-zero penalties) is a 400, and an unknown or misspelt field is a 400, never
silently ignored. `best_of` above n has OpenAI's meaning (the n candidates of the highest mean token
log-probability). The Free Transformer's own fields (`latents`, `reference`, `latent_seed`, `vary`) are
what OpenAI clients send with `extra_body`. The sampling fields are
derived from SamplingParams (free_transformer.inference.params), the one definition of sampling.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from ..base.settings import field_docs
from ..inference.params import MAX_CANDIDATES, MAX_INT, SamplingError, SamplingParams, spelt_fields

MAX_N = MAX_CANDIDATES  # OpenAI's own limit on completions per prompt, best_of's everywhere
MAX_LOGPROBS = 20  # alternatives per token (OpenAI allows 5, vLLM 20)
# request fields whose JSON type is not their setting's: stop takes one string too; latents is a name, parsed
# into a LatentChoice by SamplingParams
REQUEST_TYPES = {"stop": str | list[str] | None, "latents": str | None}


def _check_sampling(value, info):
    """A sampling field checked as SamplingParams checks it, the error on that field."""
    name = SAMPLING_FIELDS[info.field_name]
    if name == "max_new_tokens" and value == 0:  # the prompt alone, scored: with echo only (ServeEngine._max_tokens)
        return value
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
    # (type, FieldInfo) per request name, as create_model's **field_definitions take them; Any, since a checker
    # matches unpacked values against create_model's named parameters too
    fields: dict[str, Any] = {
        request: (
            REQUEST_TYPES.get(name, hints[name]),
            Field(None if name in REQUEST_TYPES else defaults[name], description=docs.get(name)),
        )
        for name, request in SAMPLING_NAMES.items()
    }
    return create_model(
        "SamplingRequest",
        __config__=ConfigDict(extra="forbid", strict=True),
        __validators__={"check": field_validator(*fields)(_check_sampling)},
        **fields,
    )


SAMPLING_NAMES = spelt_fields(SamplingParams, "request")  # {"max_new_tokens": "max_tokens", ...}
SAMPLING_FIELDS = {request: name for name, request in SAMPLING_NAMES.items()}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """A last chunk, with no choices, carries the request's usage."""


class CompletionRequest(_sampling_request()):  # type: ignore[misc]  # built at import: a checker cannot follow it
    """The sampling fields (max_tokens, temperature, top_p, n, stop, seed, latents, best_of, ...: SamplingParams),
    then what a completions request adds. `latents`, `reference`, `latent_seed` and `vary` are the Free
    Transformer's own."""

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    """One prompt or several, as text or as token ids; each is continued n times."""
    stream: bool = False
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    # OpenAI clients send these two at 0 by default; anything else asks for what this server lacks.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("n", "best_of")
    @classmethod
    def _at_most_max_n(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_N:
            raise ValueError(f"at most {MAX_N} completions per prompt")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("this server does not apply penalties; give 0 or leave it out")
        return value

    # ---- OpenAI's other fields: what the response holds (none of them changes sampling) ----------
    stream_options: StreamOptions | None = None
    """With stream: include_usage adds a last chunk with the usage."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Each token's log-probability and those of the `logprobs` most likely tokens at its position."""
    echo: bool = False
    """The prompt comes back before the completion, with its tokens' log-probabilities (given logprobs)."""
    suffix: str | None = None
    """Text after the completion (insertion): not supported, only null."""
    logit_bias: dict[str, float] | None = None
    """Not supported: only null or {}."""

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("this server does not insert text before a suffix; leave suffix out or null")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("this server does not bias logits; leave logit_bias out, null or {}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options go with stream true")
        return value

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value):
        """JSON can carry a lone surrogate (\\ud800), which no text encoding accepts: a 400, not a 500."""
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as error:
                    raise ValueError(
                        f"holds a lone surrogate ({text[error.start]!r} at character {error.start}), "
                        "which is not valid Unicode"
                    ) from None
        return value


class ChatMessage(TypedDict):
    """One message of a chat, read as a plain dict: a conversation of 100,000 messages is read in a third of the
    time that as many models take, and is handed to the chat template as it is."""

    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[misc]

    role: Literal["system", "user", "assistant"]
    content: str


# completion fields that mean something else in OpenAI's chat API, or nothing there: refused in a chat request
NOT_IN_CHAT = ("prompt", "echo", "logprobs", "top_logprobs", "suffix", "best_of", "logit_bias")


class ChatCompletionRequest(BaseModel):
    """The messages, then any field of CompletionRequest but those of NOT_IN_CHAT (max_completion_tokens is
    OpenAI's newer name of max_tokens)."""

    model_config = ConfigDict(extra="allow", strict=True)

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)

    def completion(self, prompt: str) -> CompletionRequest:
        """The completion request that continues `prompt` (the messages through the chat template) with this
        request's other fields; a ValueError naming a field that chat does not take, pydantic's ValidationError
        for a field CompletionRequest refuses."""
        fields = dict(self.model_extra or {})  # extra="allow": a dict, never None
        if refused := [name for name in NOT_IN_CHAT if name in fields]:
            raise ValueError(
                f"unknown or unsupported field {refused[0]!r} in a chat request (/v1/completions takes it)"
            )
        given = self.max_completion_tokens
        if given is not None and fields.setdefault("max_tokens", given) != given:
            raise ValueError("max_tokens and max_completion_tokens disagree; give one of them")
        return CompletionRequest.model_validate({**fields, "prompt": prompt})


class Logprobs(BaseModel):
    """OpenAI's legacy completion logprobs: per token of the choice's text (the prompt's first with echo)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None for the first token of an echoed prompt
    top_logprobs: list[dict[str, float] | None] = []  # the most likely tokens and the chosen one
    text_offset: list[int] = []  # where each token starts in the choice's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None  # None: a streamed chunk before the completion's last
    logprobs: Logprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    """A whole response, or one chunk of a stream (a text delta per choice; usage in the last chunk
    when stream_options asks for it)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatReply
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None

    @classmethod
    def of(cls, completion: Completion) -> ChatCompletion:
        choices = [
            ChatChoice(index=c.index, message=ChatReply(content=c.text), finish_reason=c.finish_reason)
            for c in completion.choices
        ]
        return cls(**completion.model_dump(include={"id", "created", "model", "usage"}), choices=choices)


class ChatDelta(BaseModel):
    index: int
    delta: ChatReply
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    """One chunk of a streamed chat completion: a text delta per choice, or the usage (no choices)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatDelta]
    usage: Usage | None = None

    @classmethod
    def of(cls, chunk: Completion) -> ChatCompletionChunk:
        choices = [
            ChatDelta(index=c.index, delta=ChatReply(content=c.text), finish_reason=c.finish_reason)
            for c in chunk.choices
        ]
        return cls(**chunk.model_dump(include={"id", "created", "model", "usage"}), choices=choices)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "free-transformer"
    max_model_len: int  # the context, in tokens (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize, which lm-eval's `local-completions` uses to count a context's tokens."""

    model_config = ConfigDict(extra="ignore", strict=True)

    prompt: str
    add_special_tokens: bool = False  # the tokenizers add none


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    tokens: list[int]


class ErrorDetail(BaseModel):
    message: str  # one line
    type: str  # invalid_request_error (4xx), server_error (5xx)
    param: str | None = None  # the request field at fault
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
