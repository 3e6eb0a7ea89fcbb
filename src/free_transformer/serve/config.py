"""The server's settings, `free-transformer serve`'s options: each field's type, default and docstring are
its option's (base/settings.add_option). In a module of their own, without torch or the server's
dependencies, so that `serve --help` reads them without loading either."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..base import settings
from ..base.devices import Placement
from ..base.latent_choice import LatentChoice, RowChoice

DEFAULT_MAX_BATCH = 16  # completions decoded together (`serve --max-batch`)
DEFAULT_MAX_REQUEST_MB = 16  # the largest body read (`serve --max-request-mb`)
DEFAULT_CHAT_QUEUE = 32  # chat requests waiting for a render thread (`serve --chat-queue`)
MAX_PORT = 2**16 - 1


@dataclass(frozen=True, kw_only=True)
class ServeConfig(Placement):
    """Where the server listens, the model it decodes and how (device and dtype: Placement's), who may ask it
    and how much it takes."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port to listen on."""
    model_name: str | None = None
    """The model's id in the API."""
    api_key: str | None = None
    """Clients must send 'Authorization: Bearer KEY'; unset here and in the environment: no key asked."""
    max_batch: int = DEFAULT_MAX_BATCH
    """Completions decoded together, each step (each holds a KV cache of the model's context)."""
    latents: RowChoice = LatentChoice.ENCODER
    """Z of a request that names none: the prompt's from the encoder, or every Z from the prior (what a
    log-likelihood through echo should use: docs/serving.md), or, for a run of free-transformer rl, every Z from
    its learned prior or policy over Z."""
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB
    """Largest request body read, in MiB."""
    chat_queue: int = DEFAULT_CHAT_QUEUE
    """Chat requests that may wait for one of the chat template's render workers; past them a request is a 429
    with Retry-After at once (docs/serving.md)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Decode with the compiled step, captured as a CUDA graph per batch-size bucket on a GPU (compiled and
    captured at start-up: a few minutes at paper sizes); auto: on for CUDA, off elsewhere."""

    def compiles(self, device_type: str) -> bool:
        """Whether the server decodes with the compiled step on a device of this type."""
        return self.compile == "on" or (self.compile == "auto" and device_type == "cuda")

    def check(self) -> ServeConfig:
        """A one-line ValueError, naming the field, for a value the server cannot start with."""
        settings.check_choices(self)
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be in [0, {MAX_PORT}], got {self.port}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.chat_queue < 0:
            raise ValueError(f"chat_queue must be >= 0, got {self.chat_queue}")
        if not 0 < self.max_request_mb < math.inf:
            raise ValueError(f"max_request_mb must be > 0 MiB, got {self.max_request_mb}")
        return self

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 2**20)
