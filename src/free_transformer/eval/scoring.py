"""Log-probabilities of continuations and greedy generations, with an explicit choice of latents.

A Free Transformer's predictions depend on Z. The paper generates with Z_t drawn from the prior,
so scoring does the same by default, and never uses the encoder's posterior on a sequence
that contains the answer: the encoder is non-causal, Q(Z | context + answer) has seen the answer,
and a choice's probability under it is not a prediction (it rewards the choice the encoder copies
into Z). Two sources of Z for the context positions are offered:

- "prior": every Z_t from the prior, context and continuation alike (what generation from scratch does);
- "encoder": Z for the context positions sampled from the encoder run on the context alone (the
  paper's KV-cache prefill), prior Z for the continuation positions.

Either is generation's rule, so the Z of each draw comes from a `LatentPlan` (one per context, its
first call the context), as in `free_transformer.inference.generate`. A run with a learned prior or policy over
Z offers a third, "policy": every Z_t from the head, which reads the tokens up to t and the Z before it, drawn in
the forward from each draw's own noise (the decoding engine's rule too).

With K draws Z^(1..K), a continuation's log-probability is estimated as

    log P(cont | ctx) ~= log (1/K) sum_k P(cont | ctx, Z^(k))     (log-mean-exp over draws)

the Monte Carlo estimate of the probability that sampling with these latents produces exactly this
continuation, E_Z[P(cont | ctx, Z)]. It is consistent as K grows, and its expectation is below the
true log-probability by less than the mean of log-probabilities (Jensen), which would instead score
E_Z[log P], penalising continuations whose probability depends on the latent decision: exactly
the ones a latent variable model exists to represent. All choices of one question share the same
draws (common random numbers: one plan per context, its rows seeded by the document and the draw), so
their comparison is not blurred by independent noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base.counter_random import row_keys
from ..base.latent_choice import LatentChoice
from ..base.seeding import benchmark_seed, generators
from ..inference.generate import GenerationConfig, generate
from ..inference.search import candidate_sources, prompt_and_prior_latents
from ..inference.stops import cut_at_stop, stop_check
from ..model.latent import PolicyDraw, counter_policy_noise
from ..model.transformer import FreeTransformer
from .settings import EvalSettings


def _generators(seed: int, key: str, count: int, device=None) -> list[torch.Generator]:
    """One generator per draw, on the device whose random numbers it will make."""
    return generators([benchmark_seed(seed, key, k) for k in range(count)], device or "cpu")


def fit_window(context: Sequence[int], continuation: Sequence[int], max_len: int) -> tuple[list[int], list[int]]:
    """Keep the last max_len + 1 tokens of context + continuation (dropping context first), with at
    least one context token so that every kept continuation token is predicted."""
    if not continuation:
        raise ValueError("empty continuation")
    seq = (list(context) + list(continuation))[-(max_len + 1) :]
    n_cont = min(len(continuation), len(seq) - 1)
    return seq[: len(seq) - n_cont], seq[len(seq) - n_cont :]


@dataclass
class _Row:
    doc: int
    choice: int
    draw: int
    tokens: list[int]  # context + continuation[:-1]
    latents: Tensor | None  # (T, *value_shape) the Z of each position, None for a baseline or a policy's Z
    n_context: int
    targets: list[int]  # the continuation
    noise: Tensor | None = None  # (T, ...) with latents policy: the noise the head draws each position's Z with


@torch.no_grad()
def continuation_logprobs(
    model: FreeTransformer,
    requests: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]],
    keys: Sequence[str],
    settings: EvalSettings,
    *,
    batch_tokens: int | None = None,
    progress: Callable[[int], object] | None = None,  # e.g. a tqdm bar's update: what it returns is ignored
    greedy: list[Tensor] | None = None,
) -> list[Tensor]:
    """Per document a (choices, K) float64 tensor of log P(continuation | context, Z^(k)) in nats.

    requests[i] lists (context ids, continuation ids) per choice of document i; keys[i] names the
    document (it seeds its latent draws). Use `log_mean_exp` to combine the K draws. batch_tokens
    bounds the tokens of one forward; by default the logits of a batch stay near 128 MiB. Given a
    list, `greedy` receives per document a (choices, K) bool tensor: is the continuation the argmax
    at every position."""
    model.eval()
    if batch_tokens is None:
        batch_tokens = min(16384, max(256, 2**25 // model.config.vocab_size))
    device = model.rope_cos.device
    max_len = model.config.max_seq_len
    rows: list[_Row] = []
    for i, (pairs, key) in enumerate(zip(requests, keys)):
        rows.extend(_document_rows(model, i, [fit_window(c, t, max_len) for c, t in pairs], key, settings))
    out = [torch.zeros(len(pairs), settings.latent_draws(model), dtype=torch.float64) for pairs in requests]
    is_greedy = [torch.zeros(len(pairs), settings.latent_draws(model), dtype=torch.bool) for pairs in requests]
    rows.sort(key=lambda r: -len(r.tokens))
    start = 0
    while start < len(rows):
        width = len(rows[start].tokens)
        stop = min(len(rows), start + max(1, batch_tokens // width))
        batch = rows[start:stop]
        tokens = torch.zeros(len(batch), width, dtype=torch.int64)
        space = model.latent_space
        latents = torch.zeros(
            len(batch), width, *(space.value_shape if space else ()), dtype=space.value_dtype if space else torch.int64
        )
        for b, row in enumerate(batch):  # right padding: a causal decoder never looks at it
            tokens[b, : len(row.tokens)] = torch.tensor(row.tokens)
            if row.latents is not None:
                latents[b, : len(row.tokens)] = row.latents
        source: Tensor | PolicyDraw = latents.to(device)  # a baseline ignores latents
        if batch[0].noise is not None:  # Z from the policy head, drawn in the forward from each row's noise
            noise = torch.zeros(len(batch), width, *batch[0].noise.shape[1:], dtype=batch[0].noise.dtype)
            for b, row in enumerate(batch):
                assert row.noise is not None, "every row of a policy's evaluation has its noise"
                noise[b, : len(row.tokens)] = row.noise
            source = PolicyDraw(noise.to(device))
        logits = model(tokens.to(device), latents=source).logits
        for b, row in enumerate(batch):
            positions = slice(row.n_context - 1, row.n_context - 1 + len(row.targets))
            logp = torch.log_softmax(logits[b, positions].double(), dim=-1)
            target = torch.tensor(row.targets, device=logp.device)
            out[row.doc][row.choice, row.draw] = logp.gather(-1, target[:, None]).sum().cpu()
            is_greedy[row.doc][row.choice, row.draw] = bool((logp.argmax(-1) == target).all())
        if progress is not None:
            progress(len(batch))
        start = stop
    if greedy is not None:
        greedy.extend(is_greedy)
    return out


def _document_rows(model, doc: int, windows, key: str, settings: EvalSettings) -> list[_Row]:
    """The rows (choice x draw) of one document. The K draws of Z come from one LatentPlan per context
    (K rows, row k seeded by the document and k): its first call is the context (the encoder on it, or
    the prior), and the rest of the longest choice is drawn at once, so choices that share a context
    share every Z (common random numbers)."""
    if not model.config.is_free:
        return [_Row(doc, c, 0, ctx + cont[:-1], None, len(ctx), cont) for c, (ctx, cont) in enumerate(windows)]
    K, device = settings.latent_samples, model.rope_cos.device
    longest = max(len(ctx) + len(cont) - 1 for ctx, cont in windows)
    if settings.latents == LatentChoice.POLICY:  # draw k's noise at every position, shared by the choices
        keys = row_keys(torch.tensor([benchmark_seed(settings.seed, key, k) for k in range(K)]))
        noise = counter_policy_noise(model.latent_space, keys[:, None], torch.arange(longest)[None, :])
        return [
            _Row(doc, c, k, ctx + cont[:-1], None, len(ctx), cont, noise[k, : len(ctx) + len(cont) - 1])
            for c, (ctx, cont) in enumerate(windows)
            for k in range(K)
        ]
    latents: dict[tuple[int, ...], Tensor] = {}  # context -> (K, longest, *value_shape)
    for ctx, _ in windows:
        if tuple(ctx) in latents:
            continue
        # the encoder, when chosen, sees the context only, never a choice
        draws = _generators(settings.seed, key, K, device)
        latents[tuple(ctx)] = prompt_and_prior_latents(model, ctx, longest, draws, settings.latents).cpu()
    rows = []
    for c, (ctx, cont) in enumerate(windows):
        tokens = ctx + cont[:-1]
        for k in range(K):
            rows.append(_Row(doc, c, k, tokens, latents[tuple(ctx)][k, : len(tokens)], len(ctx), cont))
    return rows


def log_mean_exp(draws: Tensor) -> Tensor:
    """(..., K) log-probabilities -> (...,) log of their mean probability."""
    return torch.logsumexp(draws, dim=-1) - math.log(draws.shape[-1])


@torch.no_grad()
def generate_texts(
    model: FreeTransformer,
    tokenizer,
    prompt: str,
    key: str,
    settings: EvalSettings,
    *,
    max_new_tokens: int,
    stop: Sequence[str] = (),
) -> tuple[list[str], bool]:
    """The continuations of a prompt, one per generation (settings.generation_samples; one for a greedy
    baseline), each cut at the first stop string, sampled at settings.temperature (0: greedy) with what
    settings.vary says differs between them. Returns (texts, prompt_truncated): a prompt longer than the model's
    context window loses its beginning.

    vary: "both", each generation its own stream for Z and tokens (Z drawn as it decodes); "latent", each
    its own Z, drawn beforehand for every position, and one token-noise stream shared by all; "tokens", one Z
    drawn beforehand and shared, each its own token noise."""
    max_len = model.config.max_seq_len
    steps = generation_steps(max_new_tokens, max_len)
    ids, truncated = fit_prompt(tokenizer.encode(prompt), max_len - steps + 1)
    config = GenerationConfig(max_new_tokens=steps, temperature=settings.temperature)
    seeds, latents = sample_sources(model, ids, steps, key, settings)
    prompts = torch.tensor([ids] * len(seeds), dtype=torch.int64)
    result = generate(
        model, prompts, config, seeds=seeds, latents=latents, should_stop=stop_check(tokenizer.decode, stop)
    )
    return [cut_at_stop(tokenizer.decode(t), stop) for t in result.tokens], truncated


def generation_steps(max_new_tokens: int, max_len: int) -> int:
    """The tokens a generation of a task may write in a context window of `max_len`: its budget, at most half the
    window (the prompt keeps the rest), at least one."""
    return max(1, min(max_new_tokens, max_len // 2))


def fit_prompt(ids: list[int], room: int) -> tuple[list[int], bool]:
    """(the prompt's last `room` (>= 1) tokens, whether it lost its beginning): a prompt longer than the room the
    window leaves it is cut from the start, so that the end it is continued from stays."""
    if room < 1:
        raise ValueError(f"a prompt needs room for at least one token, got {room}")
    return (ids[-room:], True) if len(ids) > room else (list(ids), False)


def sample_sources(
    model: FreeTransformer, ids: list[int], steps: int, key: str, settings: EvalSettings
) -> tuple[list[int], LatentChoice | Tensor]:
    """What each generation of the prompt `ids` (document `key`) draws from, as `generate` takes it: its seed,
    one per generation, and where its Z comes from, settings.vary deciding what they share (generate_texts;
    free_transformer.inference.search draws the streams). A greedy baseline generates once; a baseline has no
    Z, so its generations differ by their seeds only."""
    n = settings.generation_samples if model.config.is_free or settings.temperature > 0 else 1
    if settings.vary == "both":  # each its own stream, as the records before `vary` were scored
        latents = settings.latents if model.config.is_free else LatentChoice.PRIOR  # a baseline has no Z
        return [benchmark_seed(settings.seed, key, "generate", k) for k in range(n)], latents
    fed = len(ids) + steps - 1
    seed = benchmark_seed(settings.seed, key, "generate")
    return candidate_sources(model, [ids], n, fed, seed=seed, vary=settings.vary, context=settings.latents)
