"""The OpenAI API as this server reads and writes it: the request and response bodies of
/v1/models and /v1/completions, and the error body, as pydantic models.

Requests are strict (a number must be a JSON number, a flag true or false) and closed: a field this
server does not read (logprobs, echo, suffix, best_of, logit_bias, stream_options, a misspelt one)
is a 400, not silently ignored. The Free Transformer's own fields (`latents`, `reference`,
`latent_seed`) are what OpenAI clients send with `extra_body`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 128  # OpenAI's own limit on completions per prompt


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[str]
    """One prompt or several; each is continued n times."""
    max_tokens: int | None = Field(None, ge=1)
    """New tokens per completion (default: 16, fewer if the model's context is shorter)."""
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    """0 is greedy decoding."""
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    """A completion ends where one of these strings first appears in its text (not included)."""
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Completion i of each prompt samples with seed + i (default: a fresh random seed)."""
    stream: bool = False
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    # OpenAI clients send these two at 0 by default; anything else asks for what this server lacks.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    latents: str | None = None
    """Free Transformer: where Z comes from, as `free-transformer generate --latents` (default encoder)."""
    reference: str | None = None
    """The text whose encoder latents condition every completion (latents="reference")."""
    latent_seed: int | None = Field(None, ge=0, lt=2**63)
    """The seed of the one draw of latents "shared" and "reference" (default: seed)."""

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
