"""Sampling with a KV cache. For a Free Transformer the prompt is prefilled with latents from the
encoder's posterior (as the paper prescribes for KV-cache prefill) unless the caller gives them, and
every new token's Z_t is drawn uniformly once and then kept in the cache with its keys/values: the
rule of `LatentPlan` (free_transformer.latent.sources), which the Hugging Face wrapper follows too."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .latent import ENCODER, PRIOR, LatentPlan, check_latent_indices, latent_source, uniform_latents
from .model import FreeTransformer
from .seeding import generators


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    """Tokens to generate after the prompt (fewer if every row hits a stop token)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_k: int | None = None
    """Keep only the k most likely tokens before sampling."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    stop_tokens: Sequence[int] = field(default_factory=tuple)
    """A row stops after emitting any of these (the stop token is kept in its output)."""
    prompt_latents: str = ENCODER
    """Free Transformer: Z for prompt positions from the encoder (the paper's prefill) or the prior."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.prompt_latents = latent_source(self.prompt_latents, where="prompt_latents")
        if self.prompt_latents not in (ENCODER, PRIOR):
            raise ValueError(f"prompt_latents must be 'encoder' or 'prior', got {self.prompt_latents!r}")


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each row, stop token included
    latents: Tensor | None  # (B, P + steps - 1) the Z_t fed at every position; None for a baseline


def filter_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """(B, V) logits with the tokens outside top-k / top-p set to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens strictly more likely already reach top_p
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def sample_next(logits: Tensor, config: GenerationConfig, generators: Sequence[torch.Generator],
                validate: bool = True) -> Tensor:
    """(B, V) logits -> (B,) token ids, row i drawn with generators[i].

    The draw is torch.multinomial(probs[i], 1, generator=generators[i]) for every row, computed as
    multinomial computes one sample, argmax(p / q) with q ~ Exp(1) drawn from the row's generator
    (the exponential race), but with the division and argmax done once for the batch and without
    multinomial's per-row validity check, which synchronises (one check covers the batch here;
    validate=False leaves it to the caller)."""
    if config.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(filter_logits(logits.float() / config.temperature, config.top_k, config.top_p), -1)
    if validate and bool(probs.isnan().any()):
        raise ValueError(NON_FINITE)
    race = torch.empty_like(probs)  # (B, V)
    for row, generator in zip(race, generators):
        row.exponential_(generator=generator)
    return (probs / race).argmax(-1)


NON_FINITE = "the next-token probabilities contain NaN (non-finite logits)"


class StaticDecodeStep:
    """One decoding step whose inputs live in fixed device buffers (the token, the latent index, and a
    KV cache of its own with its device position): on CUDA it is captured once as a CUDA graph and
    replayed, one launch instead of the ~600 kernels of a step; elsewhere the same step runs eagerly.
    The first call is a warm-up (run on a side stream, as graph capture requires), the second captures
    and replays. `static_decode_step` keeps one per model and shape, so that a graph is captured once
    and replayed by every later `generate(compile=True)` call: each starts with `restart()`."""

    def __init__(self, model: FreeTransformer, batch_size: int, capacity: int):
        # a weak reference: the steps kept per model (`static_decode_step`) must not keep the model alive
        self.model, self.cache = weakref.ref(model), model.new_cache(batch_size, capacity=capacity)
        device = self.cache.keys.device
        self.token = torch.zeros(batch_size, 1, dtype=torch.int64, device=device)  # (B, 1)
        self.latent = torch.zeros(batch_size, 1, dtype=torch.int64, device=device)  # (B, 1), ignored by a baseline
        self.use_graph = device.type == "cuda"
        self.graph, self.logits, self.warm = None, None, False

    def restart(self):
        """The cache, emptied for a new prompt (stale keys past the position are masked, not cleared)."""
        self.cache.length = 0
        self.cache.position.zero_()
        return self.cache

    def _run(self) -> Tensor:
        model = self.model()
        return model(self.token, latents=self.latent, cache=self.cache, start=self.cache.position).logits[:, -1]

    def __call__(self, token: Tensor, latent: Tensor | None) -> Tensor:
        """(B, V) logits of the next position given token (B,) and latent (B, 1); the cache advances."""
        self.token.copy_(token[:, None])
        if latent is not None:
            self.latent.copy_(latent)
        if not self.use_graph:
            return self._run()
        if not self.warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._run()
            torch.cuda.current_stream().wait_stream(side)
            self.warm = True
            return logits
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._run()
        self.graph.replay()
        return self.logits


# Decoding caches of compile=True are sized to the positions a call feeds, rounded up to this many (so
# that calls of similar lengths share one captured graph), and at most max_seq_len.
STATIC_CACHE_ROUNDING = 64
# Captured steps kept per model (each holds a KV cache and, on a GPU, a graph's memory pool).
STATIC_STEPS_PER_MODEL = 4
_static_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> OrderedDict(key -> step)


def static_decode_step(model: FreeTransformer, batch_size: int, positions: int) -> StaticDecodeStep:
    """The model's StaticDecodeStep for `batch_size` rows and at least `positions` cached positions,
    made (and later captured) on first use and kept: the least recently used beyond
    STATIC_STEPS_PER_MODEL is dropped. Steps are keyed by the parameters' storage too, so a model moved
    to another device or dtype gets a new one; weights updated in place are seen by a captured graph."""
    rounded = -(-positions // STATIC_CACHE_ROUNDING) * STATIC_CACHE_ROUNDING
    capacity = min(model.config.max_seq_len, rounded)
    key = (batch_size, capacity, tuple(p.data_ptr() for p in model.parameters()))
    steps = _static_steps.setdefault(model, OrderedDict())
    if key not in steps:
        steps[key] = StaticDecodeStep(model, batch_size, capacity)
        while len(steps) > STATIC_STEPS_PER_MODEL:
            steps.popitem(last=False)
    steps.move_to_end(key)
    return steps[key]


def row_generators(seeds: Sequence[int] | None, batch_size: int, device) -> list[torch.Generator]:
    if seeds is None:
        seeds = torch.randint(0, 2**62, (batch_size,)).tolist()  # follows torch.manual_seed
    if len(seeds) != batch_size:
        raise ValueError(f"got {len(seeds)} seeds for {batch_size} prompts")
    return generators(seeds, device)


@torch.no_grad()
def generate(
    model: FreeTransformer,
    prompts: Tensor | Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    seeds: Sequence[int] | None = None,
    latents: Tensor | None = None,
    should_stop: Callable[[list[int]], bool] | None = None,
    compile: bool = False,
) -> GenerationResult:
    """Sample continuations of a batch of equal-length prompts with a KV cache.

    prompts: (B, P) token ids. seeds: one per row, so each row's sample does not depend on the
    others. latents (Free Transformer only): (B or 1, N) explicit Z indices for positions [0, N),
    N >= P; positions from N on draw Z_t from the uniform prior. A (1, N) tensor shares one latent
    sequence across the batch (the paper's green groups); see `shared_prior_latents` and
    `infer_latents` to make one. should_stop: called with a row's new tokens after each step; True
    finishes that row (for stop strings, which token ids cannot express). compile: decode with
    `StaticDecodeStep` (a CUDA graph on a GPU; the same static step eagerly elsewhere): the same
    tokens and latents as without it, up to float rounding. Its graph and cache are kept for the next
    call with the same batch size and a similar length (`static_decode_step`). The KV cache is in the
    model's dtype: cast the model (`model.to(torch.bfloat16)`) to decode in bf16.
    """
    config = config or GenerationConfig()
    device = model.rope_cos.device
    prompts = torch.as_tensor(prompts, dtype=torch.int64, device=device)
    if prompts.dim() != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be a non-empty (B, P) batch of equal-length token lists, got {tuple(prompts.shape)}")
    B, P = prompts.shape
    model.check_tokens(prompts)
    fed_positions = P + config.max_new_tokens - 1
    if fed_positions > model.config.max_seq_len:
        raise ValueError(
            f"prompt ({P}) + max_new_tokens ({config.max_new_tokens}) - 1 exceeds max_seq_len {model.config.max_seq_len}"
        )
    generators = row_generators(seeds, B, device)
    if latents is not None:
        latents = check_latent_indices(latents, model.config.latent_bits, B, min_length=P, device=device)
    plan = LatentPlan(B, model.config.latent_bits, explicit=latents, prompt_source=config.prompt_latents,
                      generators=generators)

    # inference_mode rather than no_grad alone: no version counters or view tracking on the ~400 small
    # operations of each step (7% faster decoding at B=1 on 2 CPU cores). The latents are concatenated
    # outside it, so the caller gets an ordinary tensor (usable in a later training forward).
    with torch.inference_mode():
        step_fn = static_decode_step(model, B, fed_positions) if compile else None
        cache = step_fn.restart() if compile else model.new_cache(B, capacity=fed_positions)
        out = model(prompts, latents=plan.source(0, P), generator=generators, cache=cache)
        plan.record(0, out.latent_index)
        new_tokens = _decode(model, cache, plan, out.logits[:, -1], config, generators, should_stop, step_fn)
        used = plan.used
    return GenerationResult(new_tokens, None if model.latent is None else torch.cat(used, dim=1))


# Static decoding on a GPU reads its stop flags back every this many steps (eager decoding: every step).
STOP_CHECK_EVERY = 16


def _decode(model, cache, plan: LatentPlan, logits: Tensor, config: GenerationConfig, generators,
            should_stop, step_fn: StaticDecodeStep | None) -> list[list[int]]:
    """The new tokens of each row, cut after its first stop token. Tokens and stop flags stay on the
    device; they are read back every step when eager or given should_stop (which needs the tokens),
    else every STOP_CHECK_EVERY steps (then a few steps may be computed after every row stopped)."""
    B, device = logits.shape[0], logits.device
    stop_ids = torch.tensor(sorted(set(config.stop_tokens)), dtype=torch.int64, device=device)
    tokens = torch.zeros(B, config.max_new_tokens, dtype=torch.int64, device=device)  # (B, N)
    lengths = torch.full((B,), config.max_new_tokens, dtype=torch.int64, device=device)  # tokens kept per row
    non_finite = torch.zeros((), dtype=torch.bool, device=device)
    host_rows: list[list[int]] = [[] for _ in range(B)]  # should_stop's view of each row
    check_every = 1 if step_fn is None or not step_fn.use_graph or should_stop is not None else STOP_CHECK_EVERY
    position = cache.length  # the next position to feed
    for step in range(config.max_new_tokens):
        non_finite |= logits.isnan().any()
        token = sample_next(logits, config, generators, validate=False)  # (B,)
        tokens[:, step] = token
        stopped = torch.isin(token, stop_ids) if len(stop_ids) else torch.zeros_like(token, dtype=torch.bool)
        if should_stop is not None:
            for row, value in enumerate(token.tolist()):
                host_rows[row].append(value)
                if should_stop(host_rows[row]):
                    stopped[row] = True
        lengths = torch.where(stopped & (lengths > step), step + 1, lengths)
        last = step == config.max_new_tokens - 1
        if last or (step + 1) % check_every == 0:
            if bool(non_finite):
                raise ValueError(NON_FINITE)
            if last or bool((lengths <= step + 1).all()):
                break
        latent = plan.source(position, 1, device)  # (B, 1) a prior draw or an explicit index; a baseline: "prior"
        explicit = latent if isinstance(latent, Tensor) else None
        if step_fn is None:
            logits = model(token[:, None], latents=latent, cache=cache, start=position).logits[:, -1]
        else:
            logits = step_fn(token, explicit)
        plan.record(position, explicit)
        position += 1
    kept = lengths.tolist()
    return [row[:n] for row, n in zip(tokens[:, : step + 1].tolist(), kept)]


@torch.no_grad()
def shared_prior_latents(model: FreeTransformer, length: int, generator: torch.Generator | None = None) -> Tensor:
    """(1, length) indices drawn once from the uniform prior, to share across a batch."""
    return uniform_latents((1, length), model.config.latent_bits, generator=generator, device=model.rope_cos.device)


@torch.no_grad()
def infer_latents(model: FreeTransformer, reference: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(B, T) indices sampled from the encoder's posterior Q(Z | reference) for a (B, T) reference text."""
    if model.latent is None:
        raise ValueError("latents exist only in a Free Transformer (latent_bits > 0)")
    reference = torch.as_tensor(reference, dtype=torch.int64, device=model.rope_cos.device)
    model.check_tokens(reference)
    return model(reference, latents=ENCODER, generator=generator).latent_index
