"""Many prompts, n samples each, prompts of any lengths: the one rule of `free-transformer generate`
and of the server (free_transformer.serve).

A sample depends only on its prompt, its index in the call, its settings, the call's seed and the choice of Z,
never on the other prompts of the call nor on how rows are batched:
- sample i of prompt p samples with its own seed, `sample_seed(seed, p, i)` (free_transformer.base.seeding):
  every sample of a call its own random stream, the same alone or in any batch (`generate`'s `seeds`);
- a prompt's "shared" or "reference" Z is resolved with a generator of its own seeded `latent_seed`
  (`prepare_prompts`), as a call with that prompt alone resolves it;
- every row is a row of the decoding engine (free_transformer.inference.engine), which decodes rows of any
  lengths and settings together, each as it would alone (`sample_prompts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..base.latent_choice import LatentChoice, RowChoice
from ..base.seeding import sample_seed
from ..model.transformer import FreeTransformer
from .engine import Row, run_rows
from .generate import GenerationConfig
from .kept_engines import decoding_engine
from .latents import resolve_latents
from .params import DEFAULT_BATCH_SIZE


@dataclass(frozen=True)
class Prompt:
    """A prompt ready to sample: nothing about it can still be refused."""

    ids: list[int]
    config: GenerationConfig  # its max_new_tokens is set
    positions: int  # the positions its rows feed: len(ids) + max_new_tokens - 1
    latents: (
        RowChoice | torch.Tensor
    )  # resolved: ENCODER, PRIOR or POLICY, or (1, N, ...) explicit Z ("shared", "reference")


@dataclass(frozen=True)
class PromptSample:
    prompt: int  # the prompt's index in the call
    sample: int  # i: the sample's index among its prompt's n
    seed: int  # the row's seed: sample_seed(the call's seed, prompt, sample)
    tokens: list[int]  # the new tokens, stop token included


def prepare_prompts(
    model: FreeTransformer,
    prompts: Sequence[Sequence[int]],
    configs: Sequence[GenerationConfig],
    choice: LatentChoice | None,
    *,
    reference=None,
    latent_seed: int,
    where: str = "latents",
) -> list[Prompt]:
    """Each prompt (token ids) with its settings and its Z resolved (`resolve_latents`) with a generator of
    its own seeded `latent_seed`: a prompt's "shared" or "reference" draw is the one a call with that prompt
    alone makes. Prompts of one length and one max_new_tokens share their resolution (the same draw).
    Every refusal (a one-line ValueError) comes here, before any sampling."""
    if len(configs) != len(prompts):
        raise ValueError(f"got {len(configs)} generation settings for {len(prompts)} prompts")
    resolved: dict[tuple[int, int], RowChoice | torch.Tensor] = {}
    ready = []
    for ids, config in zip(prompts, configs):
        new = config.max_new_tokens
        if new is None:
            raise ValueError("prepare_prompts needs each prompt's max_new_tokens set (Sampling.new_tokens)")
        key, positions = (len(ids), new), len(ids) + new - 1
        if key not in resolved:
            generator = torch.Generator(device=model.rope_cos.device).manual_seed(latent_seed)
            found = resolve_latents(
                model,
                choice,
                length=positions,
                reference=reference,
                generator=generator,
                batch_size=1,
                prompt_length=len(ids),
                where=where,
            )
            resolved[key] = found.prompt_source if found.explicit is None else found.explicit
        ready.append(Prompt(list(ids), config, positions, resolved[key]))
    return ready


def prompt_row(prompt: Prompt, seed: int, **options) -> Row:
    """The engine's row of one sample of `prompt`, its random streams keyed by `seed` (`sample_seed`)."""
    return Row(prompt.ids, prompt.config, seed, prompt.latents, **options)


def sample_prompts(
    model: FreeTransformer,
    prompts: Sequence[Prompt],
    n: int,
    seed: int,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    should_stop: Callable[[list[int]], bool] | None = None,
    compile: bool = False,
) -> Iterator[PromptSample]:
    """Every prompt's n samples, yielded in order (prompt 0's samples 0..n-1, then prompt 1's, ...) as soon as
    they and every earlier one are decoded. The rows join the engine's `batch_size` slots in that order, whatever
    their lengths and settings; rows decoded ahead of an earlier one wait in memory (at most the slots' worth).
    should_stop and compile: `generate`'s."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"the number of samples and the batch size must be >= 1, got {n} and {batch_size}")
    if not prompts:
        return
    positions = max(prompt.positions for prompt in prompts)
    engine = decoding_engine(model, min(batch_size, len(prompts) * n), positions, compile=compile)
    rows = (prompt_row(prompts[p], sample_seed(seed, p, i), tag=(p, i)) for p in range(len(prompts)) for i in range(n))
    done: dict[object, list[int]] = {}  # by the rows' tags, (p, i)
    order = ((p, i) for p in range(len(prompts)) for i in range(n))
    wanted = next(order, None)
    for row in run_rows(engine, rows, should_stop):
        if row.error is not None:
            raise row.error
        done[row.tag] = row.tokens
        while wanted is not None and wanted in done:
            yield PromptSample(wanted[0], wanted[1], sample_seed(seed, *wanted), done.pop(wanted))
            wanted = next(order, None)
