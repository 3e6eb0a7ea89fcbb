"""Many prompts, n samples each, prompts of any lengths: the one rule of `free-transformer generate`
and of the server (free_transformer.serve).

A sample depends only on its prompt, its settings, its seed and the choice of Z, never on the other
prompts of the call nor on how rows are batched:
- sample i of every prompt samples with seed + i (a generator per row, `generate`'s `seeds`);
- a prompt's "shared" or "reference" Z is resolved with a generator of its own seeded `latent_seed`
  (`prepare_prompts`), as a call with that prompt alone resolves it;
- rows are decoded in rectangular batches of prompts of one length and one setting (`sample_prompts`):
  exact, with no padding, since `generate` samples each row of a batch as it would alone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..model.transformer import FreeTransformer
from .generate import GenerationConfig, generate
from .latents import LatentChoice, resolve_latents
from .params import DEFAULT_BATCH_SIZE


@dataclass(frozen=True)
class Prompt:
    """A prompt ready to sample: nothing about it can still be refused."""
    ids: list[int]
    config: GenerationConfig
    latents: str | Tensor  # resolved: "encoder" or "prior", or (1, N) explicit Z ("shared", "reference")


@dataclass(frozen=True)
class PromptSample:
    prompt: int  # the prompt's index in the call
    sample: int  # i: the sample's index among its prompt's n
    seed: int  # seed + i, the row's generator
    tokens: list[int]  # the new tokens, stop token included


def prepare_prompts(model: FreeTransformer, prompts: Sequence[Sequence[int]], configs: Sequence[GenerationConfig],
                    choice: LatentChoice | None, *, reference=None, latent_seed: int,
                    where: str = "latents") -> list[Prompt]:
    """Each prompt (token ids) with its settings and its Z resolved (`resolve_latents`) with a generator of
    its own seeded `latent_seed`: a prompt's "shared" or "reference" draw is the one a call with that prompt
    alone makes. Prompts of one length and one max_new_tokens share their resolution (the same draw).
    Every refusal (a one-line ValueError) comes here, before any sampling."""
    if len(configs) != len(prompts):
        raise ValueError(f"got {len(configs)} generation settings for {len(prompts)} prompts")
    resolved: dict[tuple[int, int], str | Tensor] = {}
    ready = []
    for ids, config in zip(prompts, configs):
        key = (len(ids), config.max_new_tokens)
        if key not in resolved:
            generator = torch.Generator(device=model.rope_cos.device).manual_seed(latent_seed)
            found = resolve_latents(model, choice, length=len(ids) + config.max_new_tokens - 1, reference=reference,
                                    generator=generator, batch_size=1, prompt_length=len(ids), where=where)
            resolved[key] = found.prompt_source if found.explicit is None else found.explicit
        ready.append(Prompt(list(ids), config, resolved[key]))
    return ready


def sample_prompts(model: FreeTransformer, prompts: Sequence[Prompt], n: int, seed: int, *,
                   batch_size: int = DEFAULT_BATCH_SIZE, should_stop: Callable[[list[int]], bool] | None = None,
                   compile: bool = False) -> Iterator[PromptSample]:
    """Every prompt's n samples, yielded in order (prompt 0's samples 0..n-1, then prompt 1's, ...) as soon
    as they and every earlier one are decoded. Rows go in batches of at most `batch_size`, each of prompts
    with one length, one GenerationConfig and one kind of Z, in the order of their first row: rows decoded
    ahead of an earlier one wait in memory (at most a batch per group). should_stop and compile: `generate`'s."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"the number of samples and the batch size must be >= 1, got {n} and {batch_size}")
    done: dict[tuple[int, int], list[int]] = {}
    order = ((p, i) for p in range(len(prompts)) for i in range(n))
    wanted = next(order, None)
    for rows in _batches(prompts, n, batch_size):
        first = prompts[rows[0][0]]
        explicit = isinstance(first.latents, Tensor)
        latents = torch.cat([prompts[p].latents for p, _ in rows]) if explicit else first.latents  # (B, N) or a name
        result = generate(model, [prompts[p].ids for p, _ in rows], first.config, seeds=[seed + i for _, i in rows],
                          latents=latents, should_stop=should_stop, compile=compile)
        done.update(zip(rows, result.tokens))
        while wanted in done:
            yield PromptSample(wanted[0], wanted[1], seed + wanted[1], done.pop(wanted))
            wanted = next(order, None)


def _batches(prompts: Sequence[Prompt], n: int, batch_size: int) -> Iterator[list[tuple[int, int]]]:
    """Lists of at most batch_size (prompt, sample) rows that one `generate` call can decode (prompts of one
    group: `_group_key`), in the order of their first row. Made lazily: n may be large."""
    groups: list[tuple[tuple, list[int]]] = []  # (key, the prompts' indices); keys compared with ==
    for p, prompt in enumerate(prompts):
        key = _group_key(prompt)
        group = next((members for known, members in groups if known == key), None)
        if group is None:
            groups.append((key, [p]))
        else:
            group.append(p)
    chunks = [_chunks(((p, i) for p in members for i in range(n)), batch_size) for _, members in groups]
    return heapq.merge(*chunks, key=lambda rows: rows[0])


def _group_key(prompt: Prompt) -> tuple:
    """What rows of one batch share: the prompt's length (a batch is rectangular), the settings, and the
    kind of Z (a name, or explicit indices of one length)."""
    kind = ("indices", prompt.latents.shape[1]) if isinstance(prompt.latents, Tensor) else prompt.latents
    return len(prompt.ids), prompt.config, kind


def _chunks(rows: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(rows, size)):
        yield chunk
