"""What `free-transformer generate` prints for its prompts, with or without --interactive: the settings
a sample depends on and the printer of samples (text or JSON lines)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

import torch

from ..data.tokenizer import Tokenizer
from ..inference.batches import DEFAULT_BATCH_SIZE, Prompt, new_token_room, prepare_prompts, sample_prompts
from ..inference.generate import GenerationConfig
from ..inference.stops import cut_at_stop, stop_check
from ..model.transformer import FreeTransformer

DEFAULT_NEW_TOKENS = 64
FORMATS = ("text", "jsonl")
# The backslash escapes --stop, --prompts-file and the interactive prompts read (a shell passes "\n" as a
# backslash and an n; a line of a file cannot hold a newline).
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\"}


@dataclass
class Settings:
    """What a prompt's samples depend on besides the prompt and the model: the options, which the
    interactive commands change."""
    n: int
    seed: int
    latents: str  # a name of CHOICES
    reference: str | None
    temperature: float
    top_k: int | None
    top_p: float | None
    max_new_tokens: int | None  # None: DEFAULT_NEW_TOKENS, or fewer where the model's context is shorter
    stops: list[str]

    def check(self) -> None:
        """A one-line ValueError for a value sampling would refuse, before any model work."""
        if self.n < 1:
            raise ValueError(f"the number of samples (--num-samples) must be >= 1, got {self.n}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        GenerationConfig(max_new_tokens=1, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def options(self) -> str:
        """The command-line options that give these settings, quoted for a POSIX shell."""
        words = [f"-n {self.n}", f"--seed {self.seed}", f"--latents {self.latents}"]
        words += [f"--reference {shlex.quote(self.reference)}"] if self.reference is not None else []
        words += [f"--temperature {self.temperature:g}"]
        words += [f"--top-k {self.top_k}"] if self.top_k is not None else []
        words += [f"--top-p {self.top_p:g}"] if self.top_p is not None else []
        words += [f"--max-new-tokens {self.max_new_tokens}"] if self.max_new_tokens is not None else []
        words += [f"--stop {shlex.quote(escape(stop))}" for stop in self.stops]
        return " ".join(words)


@dataclass(frozen=True)
class Sampler:
    """A loaded model with the options that do not change what it samples: how samples are batched,
    compiled and printed."""
    model: FreeTransformer
    tokenizer: Tokenizer
    format: str = "text"  # one of FORMATS
    batch_size: int = DEFAULT_BATCH_SIZE
    compile: bool = False

    def sample(self, texts: list[str], settings: Settings, labels: list[str] | None = None,
               first_index: int = 0) -> None:
        """Print every prompt's settings.n samples, in order, as they are decoded (JSON lines number the
        prompts from first_index). Every refusal comes before the first sample."""
        prompts = self.prepare(texts, settings, labels)
        decode, stops = self.tokenizer.decode, settings.stops
        prompt_chars = [len(decode(prompt.ids)) for prompt in prompts]
        rows = sample_prompts(self.model, prompts, settings.n, settings.seed, batch_size=self.batch_size,
                              should_stop=stop_check(decode, stops), compile=self.compile)
        for row in rows:
            start = prompt_chars[row.prompt]
            text = cut_at_stop(decode(prompts[row.prompt].ids + row.tokens), stops, start)  # prompt and sample
            if self.format == "text":
                print(escape(text), flush=True)  # one line, read back by unescape
            else:
                print(json.dumps({"prompt": texts[row.prompt], "sample": text[start:], "index": first_index + row.prompt,
                                  "seed": row.seed, "latents": settings.latents}, ensure_ascii=False), flush=True)

    def prepare(self, texts: list[str], settings: Settings, labels: list[str] | None = None) -> list[Prompt]:
        """The prompts tokenized, checked against the model's context and given their Z (`prepare_prompts`);
        a one-line ValueError names the prompt at fault by its label when there are several."""
        context = self.model.config.max_seq_len
        labels = labels or [f"prompt {k + 1}" for k in range(len(texts))]
        ids, configs = [], []
        for text, label in zip(texts, labels):
            where = f"{label}: " if len(texts) > 1 else ""
            prompt = self.tokenizer.encode(text)
            if not prompt:
                raise ValueError(f"{label if where else '--prompt'} must not be empty (give at least one character)")
            try:
                room = new_token_room(len(prompt), context)
            except ValueError as error:
                raise ValueError(f"{where}{error}") from None
            new = settings.max_new_tokens if settings.max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, room)
            if new > room:
                raise ValueError(f"{where}prompt ({len(prompt)}) + max_new_tokens ({new}) - 1 exceeds max_seq_len "
                                 f"{context}")
            ids.append(prompt)
            configs.append(GenerationConfig(max_new_tokens=new, temperature=settings.temperature,
                                            top_k=settings.top_k, top_p=settings.top_p))
        reference = None if settings.reference is None else torch.tensor([self.tokenizer.encode(settings.reference)])
        return prepare_prompts(self.model, ids, configs, settings.latents, reference=reference,
                               latent_seed=settings.seed, where="--latents")


def unescape(text: str) -> str:
    """`text` with the backslash escapes of ESCAPES read; any other backslash is kept as typed."""
    return re.sub(r"\\(.)", lambda match: ESCAPES.get(match[1], match[0]), text)


def escape(text: str) -> str:
    """What `unescape` reads back as `text`."""
    inverse = {value: key for key, value in ESCAPES.items()}
    return "".join("\\" + inverse[char] if char in inverse else char for char in text)
