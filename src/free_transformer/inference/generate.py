"""`generate()`: sample continuations of prompts of any lengths, every row a client of the decoding engine
(free_transformer.inference.engine). For a Free Transformer the prompt is prefilled with latents from the
encoder's posterior (as the paper prescribes for KV-cache prefill) unless the caller gives them, and every new
token's Z_t is drawn from the prior, per row (free_transformer.inference.latents says where Z comes from)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base.latent_choice import LatentChoice
from ..model.transformer import FreeTransformer
from .engine import Row, run_rows
from .kept_engines import decoding_engine
from .latents import parse_latents, resolve_latents
from .params import GenerationConfig, check_room, check_seed
from .seeds import row_seeds


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each row, stop token included
    latents: list[Tensor] | None  # per row, (positions fed, *value_shape) the Z_t fed at every position it fed
    # (its prompt and every new token but the last); None for a baseline
    scores: list[float] | None = None  # with score=True: per row, its tokens' mean log-probability


def prompt_lists(prompts: Tensor | Sequence[Sequence[int]]) -> list[list[int]]:
    """Prompts as lists of token ids: a (B, P) tensor's rows, or lists of any lengths; a one-line ValueError
    unless there is at least one prompt and every prompt has a token."""
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2:
            raise ValueError(f"prompts must be a (B, P) tensor or lists of token ids, got shape {tuple(prompts.shape)}")
        prompts = prompts.tolist()
    lists = [[int(token) for token in ids] for ids in prompts]
    if not lists or not all(lists):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    return lists


@torch.no_grad()
def generate(
    model: FreeTransformer,
    prompts: Tensor | Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    seeds: Sequence[int] | None = None,
    seed: int | None = None,
    latents: LatentChoice | str | Tensor | None = None,
    reference: Tensor | Sequence[Sequence[int]] | None = None,
    latent_seed: int | None = None,
    should_stop: Callable[[list[int]], bool] | None = None,
    compile: bool = False,
    batch_size: int | None = None,
    score: bool = False,
) -> GenerationResult:
    """Sample a continuation of every prompt with a KV cache, the rows decoded together by the engine.

    prompts: (B, P) token ids, or B lists of token ids of any lengths. seeds: one per row, so that each row's
    sample depends only on its prompt, the settings, its seed and its Z, never on the other rows. seed: one for
    the call instead, row k's seed then `sample_seed(seed, k, 0)` (free_transformer.base.seeding): every row its
    own stream, a row's sample that of the same prompt at the same index alone (unset, with seeds unset: a fresh
    seed from torch's global RNG). latents:
    where Z comes from (a LatentChoice or its name, free_transformer.inference.latents; None: "encoder"):
    "encoder" or "prior" for the
    prompt's Z; "shared", one prior sequence for every row (the paper's green groups); "reference", the
    encoder's posterior on `reference`, (B or 1, T >= P) token ids; or (B or 1, N, *value_shape) explicit
    values for positions [0, N), N >= P (indices (B or 1, N) for the binary kinds). Positions past the
    explicit ones draw Z_t from the prior, per row. latent_seed seeds the one-off draw of "shared" and
    "reference" (default: the global RNG). should_stop: called with a row's new tokens after each one; True
    ends that row (for stop strings, which token ids cannot express). batch_size: rows decoded at once, the
    engine's slots (default: all); the others join as rows end.
    compile: the engine's step compiled (free_transformer.inference.engine): on a GPU by Inductor (the first
    call of a batch bucket and sampling setting compiles: a minute at paper sizes, logged by the
    `free_transformer.inference.engine` logger at INFO) and captured as a CUDA graph; elsewhere the same step
    eagerly. The same tokens and latents as without it, up to float rounding. The engine, its compiled code
    and its graphs are kept for the next call with the same batch size and a similar length. The KV cache is
    in the model's dtype: cast the model (`model.to(torch.bfloat16)`) to decode in bf16. score: set `scores`, each
    row's mean token log-probability under the model's softmax (temperature 1, no filter) at the logits its
    tokens were sampled from, summed as it decodes (best-of's score: free_transformer.inference.search).
    """
    config = config or GenerationConfig()
    device = model.rope_cos.device
    ids = prompt_lists(prompts)
    B, context = len(ids), model.config.max_seq_len
    for prompt in ids:
        model.check_tokens(torch.tensor(prompt))
    new = [config.new_tokens(len(row), context) for row in ids]
    for prompt, n in zip(ids, new):
        check_room(len(prompt), n, context)
    fed = max(len(prompt) + n - 1 for prompt, n in zip(ids, new))  # positions the longest row feeds
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"the batch size must be >= 1, got {batch_size}")
    row_seed = row_seeds(seeds, B, seed)
    one_off = (
        None
        if latent_seed is None
        else torch.Generator(device=device).manual_seed(check_seed(latent_seed, "latent_seed"))
    )
    resolved = resolve_latents(
        model,
        None if latents is None else parse_latents(latents),  # the Python entry point's one parse
        length=fed,
        reference=reference,
        generator=one_off,
        batch_size=B,
        prompt_length=max(map(len, ids)),
    )
    explicit = resolved.explicit  # (B or 1, N, ...) or None
    explicit = None if explicit is None else explicit.expand(B, *explicit.shape[1:])
    rows = [
        Row(
            row,
            dataclasses.replace(config, max_new_tokens=n),
            row_seed[k],
            resolved.prompt_source if explicit is None else explicit[k][None],
            scored=score,
        )
        for k, (row, n) in enumerate(zip(ids, new))
    ]
    engine = decoding_engine(model, min(B, batch_size or B), fed, compile=compile)
    for row in run_rows(engine, rows, should_stop):
        if row.error is not None:
            raise row.error
    # the latents are copied outside inference mode, so that the caller gets ordinary tensors (usable in a
    # later training forward)
    latents_fed = None
    if model.config.is_free:
        latents_fed = []
        for row in rows:  # every row has ended
            assert row.fed is not None, "the engine keeps the Z fed to each row of a Free Transformer as it ends"
            latents_fed.append(row.fed.clone())
    scores = [row.score for row in rows] if score else None
    return GenerationResult([row.tokens for row in rows], latents_fed, scores)
