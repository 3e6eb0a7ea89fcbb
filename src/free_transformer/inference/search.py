"""Test-time search over Z: best-of-N. Each prompt gets N candidates, decoded together as rows of one engine
batch (one `generate` call), and the candidate of the highest score is chosen.

What differs between a prompt's candidates (`Variation`):
- "both": each candidate its own stream, for its Z and its token noise (what `generate` does per row);
- "latent": each candidate its own Z, drawn beforehand for every position it will feed, and one token-noise
  stream shared by the prompt's candidates: they differ by Z alone (with greedy tokens, the only choice there is);
- "tokens": one Z drawn beforehand and shared by the prompt's candidates, each its own token noise.
Z from a run's policy head (latents "policy") depend on the tokens before them: they are drawn as the candidates
decode, each its own stream ("both" only).

The default score is OpenAI's `best_of` rule: the mean log-probability of the candidate's tokens, under the
model's softmax (temperature 1, no filter) at the logits they were sampled from (with the very Z the candidate was
decoded with), summed by the engine as it decodes: the server's best_of scores its candidates by the same sum.
A caller may give its own scorer, called once per candidate (a verifier, a test suite, a reward model). Ties go
to the earlier candidate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base.latent_choice import ROW_CHOICES, ContextChoice, LatentChoice, RowChoice, as_context, as_row_choice
from ..base.seeding import generators, seed_of
from ..model.latent import LatentPlan
from ..model.transformer import FreeTransformer
from .generate import GenerationConfig, generate, prompt_lists
from .params import VARIATIONS, Variation, check_candidates, check_policy_variation, check_seed, check_variation

# A scorer: (prompt ids, candidate's new tokens) -> score, higher is better.
Scorer = Callable[[list[int], list[int]], float]


@dataclass
class Candidates:
    """The N candidates of every prompt and the one chosen: per prompt, per candidate."""

    tokens: list[list[list[int]]]  # [prompt][candidate] the new tokens, stop token included
    scores: list[list[float]]  # [prompt][candidate]
    chosen: list[int]  # [prompt] the index of the candidate of the highest score (the earlier on a tie)
    seeds: list[list[int]]  # [prompt][candidate] the seed of the candidate's generator
    latents: list[list[Tensor]] | None  # [prompt][candidate] (positions fed, *value_shape); None for a baseline

    @property
    def best(self) -> list[list[int]]:
        """The chosen candidate's tokens, per prompt."""
        return [tokens[k] for tokens, k in zip(self.tokens, self.chosen)]


def prompt_and_prior_latents(
    model: FreeTransformer, ids: Sequence[int], length: int, draws: Sequence[torch.Generator], context: ContextChoice
) -> Tensor:
    """(len(draws), length, *value_shape) Z for every position a continuation of the prompt `ids` feeds, one row
    per generator: the prompt's from `context` (the encoder run on the prompt, or the prior), the rest from the
    prior."""
    device = model.rope_cos.device
    plan = LatentPlan(len(draws), model.latent_space, prompt_source=context, generators=list(draws))
    if context == LatentChoice.ENCODER:
        prompt = torch.tensor(list(ids), device=device).expand(len(draws), -1)
        plan.record(0, model(prompt, latents=LatentChoice.ENCODER, generator=plan.generators).latents)
    drawn = plan.source(0, length, device)
    assert isinstance(drawn, Tensor)  # a Free Transformer's plan, its prompt's Z known: values, not a name
    return drawn


@torch.no_grad()
def candidate_sources(
    model: FreeTransformer,
    prompts: Sequence[Sequence[int]],
    count: int,
    length: int,
    *,
    seed: int,
    vary: Variation,
    context: RowChoice = LatentChoice.ENCODER,
) -> tuple[list[int], RowChoice | Tensor]:
    """What the `count` candidates of each prompt draw from, as `generate` takes it for the rows (prompt-major:
    prompt i's candidate j is row i * count + j): one seed per row, and where the rows' Z comes from, `context`
    or explicit (rows, length, *value_shape) values, `length` the most positions a row feeds. Every stream is
    derived from (seed, prompt index, candidate index), so a prompt's candidates do not depend on the others.
    Z from the policy head (`context` POLICY) are drawn as the rows decode: with vary both only."""
    device = model.rope_cos.device
    if vary == "both" or not model.config.is_free:  # a baseline has no Z: its candidates differ by their seeds
        return [seed_of(seed, "candidate", i, j) for i in range(len(prompts)) for j in range(count)], context
    check_policy_variation(vary, context)
    context = as_context(context)
    if vary == "latent":
        seeds = [seed_of(seed, "tokens", i) for i in range(len(prompts)) for _ in range(count)]
        draws = [generators([seed_of(seed, "latent", i, j) for j in range(count)], device) for i in range(len(prompts))]
    else:
        seeds = [seed_of(seed, "candidate", i, j) for i in range(len(prompts)) for j in range(count)]
        draws = [generators([seed_of(seed, "latent", i)], device) for i in range(len(prompts))]
    latents = [prompt_and_prior_latents(model, ids, length, gens, context) for ids, gens in zip(prompts, draws)]
    return seeds, torch.cat([z.expand(count, *z.shape[1:]) for z in latents])


def ranking(scores: Sequence[float]) -> list[int]:
    """The indices of the scores, highest first, the earlier first on a tie."""
    return sorted(range(len(scores)), key=lambda k: (-scores[k], k))


def highest(scores: Sequence[float]) -> int:
    """The index of the highest score, the earliest on a tie."""
    return ranking(scores)[0]


@torch.no_grad()
def best_of(
    model: FreeTransformer,
    prompts: Tensor | Sequence[Sequence[int]],
    n: int,
    config: GenerationConfig | None = None,
    *,
    vary: Variation = "both",
    seed: int = 0,
    latents: RowChoice | str = LatentChoice.ENCODER,
    scorer: Scorer | None = None,
    should_stop: Callable[[list[int]], bool] | None = None,
    compile: bool = False,
    batch_size: int | None = None,
) -> Candidates:
    """Best-of-n: n candidates of every prompt, decoded as rows of one engine batch, and the one of the highest
    score: `scorer(prompt, tokens)` once per candidate, or by default the mean log-probability of its tokens
    under the Z it was decoded with (OpenAI's best_of). `vary` says what differs between a prompt's candidates
    (both, latent or tokens: this module's docstring); `latents` where the prompt's Z comes from (encoder or
    prior; a continuation's Z is then the prior's), or policy: every Z from the run's policy head, with vary both.
    The same seed gives the same candidates. should_stop, compile and batch_size: `generate`'s (every candidate is
    a row of its one engine)."""
    n, seed = check_candidates(n, "n"), check_seed(seed)
    if vary not in VARIATIONS:
        raise ValueError(f"vary must be one of {', '.join(VARIATIONS)}, got {vary!r}")
    context = as_row_choice(LatentChoice.parse(latents, allowed=ROW_CHOICES))  # the Python entry's one parse
    config = config or GenerationConfig()
    check_variation(vary, config.temperature)
    ids = prompt_lists(prompts)
    room = model.config.max_seq_len
    length = max(len(p) + config.new_tokens(len(p), room) - 1 for p in ids)
    seeds, sources = candidate_sources(model, ids, n, length, seed=seed, vary=vary, context=context)
    rows = [p for p in ids for _ in range(n)]
    result = generate(
        model,
        rows,
        config,
        seeds=seeds,
        latents=sources,
        should_stop=should_stop,
        compile=compile,
        batch_size=batch_size,
        score=scorer is None,
    )
    if scorer is None:
        assert result.scores is not None, "generate(score=True) scores every row"
        flat = result.scores
    else:
        flat = [float(scorer(list(prompt), list(tokens))) for prompt, tokens in zip(rows, result.tokens)]
    per_prompt = [flat[i * n : (i + 1) * n] for i in range(len(ids))]
    return Candidates(
        tokens=[result.tokens[i * n : (i + 1) * n] for i in range(len(ids))],
        scores=per_prompt,
        chosen=[highest(scores) for scores in per_prompt],
        seeds=[seeds[i * n : (i + 1) * n] for i in range(len(ids))],
        latents=None if result.latents is None else [result.latents[i * n : (i + 1) * n] for i in range(len(ids))],
    )
