"""The OpenAI API as this server reads and writes it: the request and response bodies of
/v1/models and /v1/completions, the tokenizer endpoints, and the error body, as pydantic models.

Requests are strict (a number must be a JSON number, a flag true or false) and closed: every field of
OpenAI's completions API is accepted at its default, a value this server cannot honour (a non-null
`suffix`, `best_of` other than n, a `logit_bias`, non-zero penalties) is a 400, and an unknown or
misspelt field is a 400, never silently ignored. The Free Transformer's own fields (`latents`,
`reference`, `latent_seed`) are what OpenAI clients send with `extra_body`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_N = 128  # OpenAI's own limit on completions per prompt
MAX_LOGPROBS = 20  # alternatives per token (OpenAI allows 5, vLLM 20)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """A last chunk, with no choices, carries the request's usage."""


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    """One prompt or several, as text or as token ids; each is continued n times."""
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

    # ---- OpenAI's other fields: what the response holds (none of them changes sampling) ----------
    stream_options: StreamOptions | None = None
    """With stream: include_usage adds a last chunk with the usage."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Each token's log-probability and those of the `logprobs` most likely tokens at its position."""
    echo: bool = False
    """The prompt comes back before the completion, with its tokens' log-probabilities (given logprobs)."""
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    """Accepted when it equals n: every completion sampled is returned."""
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

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"this server returns every completion it samples, so best_of must equal n ({n}), "
                             f"got {value}")
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
                    raise ValueError(f"holds a lone surrogate ({text[error.start]!r} at character {error.start}), "
                                     "which is not valid Unicode") from None
        return value


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
