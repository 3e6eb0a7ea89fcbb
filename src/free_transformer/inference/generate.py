"""Sampling with a KV cache. For a Free Transformer the prompt is prefilled with latents from the
encoder's posterior (as the paper prescribes for KV-cache prefill) unless the caller gives them, and
every new token's Z_t is drawn from the prior once and then kept in the cache with its keys/values: the
rule of `LatentPlan` (free_transformer.inference.latents), which the Hugging Face wrapper follows too."""

from __future__ import annotations

import dataclasses
import logging
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base.seeding import generators
from ..model.latent import ENCODER
from ..model.transformer import FreeTransformer
from .latents import LatentChoice, LatentPlan, plan_latents
from .latents import infer_latents, shared_prior_latents  # noqa: F401 (also importable from this module)
from .params import GenerationConfig, Sampling

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each row, stop token included
    latents: Tensor | None  # (B, P + steps - 1, *value_shape) the Z_t fed at every position; None for a baseline


def filter_logits(logits: Tensor, rule: Sampling) -> Tensor:
    """(B, V) logits (already divided by the temperature) with the tokens the rule's filters drop set to -inf."""
    top_k, top_p = rule.top_k, rule.top_p
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens strictly more likely already reach top_p
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if rule.min_p is not None:  # p_i >= min_p * max_j p_j, with p the softmax of what top-k and top-p kept
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < rule.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def sample_next(logits: Tensor, config: Sampling, generators: Sequence[torch.Generator],
                validate: bool = True) -> Tensor:
    """(B, V) logits -> (B,) token ids, row i drawn with generators[i].

    The draw is torch.multinomial(probs[i], 1, generator=generators[i]) for every row, computed as
    multinomial computes one sample, argmax(p / q) with q ~ Exp(1) drawn from the row's generator
    (the exponential race), but with the division and argmax done once for the batch and without
    multinomial's per-row validity check, which synchronises (one check covers the batch here;
    validate=False leaves it to the caller)."""
    if config.temperature == 0:
        return logits.argmax(-1)
    probs = next_token_probs(logits, config.temperature, config)
    if validate and bool(probs.isnan().any()):
        raise ValueError(NON_FINITE)
    return (probs / exponential_race_(torch.empty_like(probs), generators)).argmax(-1)


def next_token_probs(logits: Tensor, temperature: float | Tensor, rule: Sampling) -> Tensor:
    """(B, V) float32 probabilities of the next token: softmax of the logits / temperature, filtered by the
    rule (whose own temperature is not read: a compiled step is fed it as a device value)."""
    return torch.softmax(filter_logits(logits.float() / temperature, rule), -1)


def exponential_race_(race: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """Fill `race` (B, V) in place with Exp(1) draws, row i from generators[i]: the noise of sample_next."""
    for row, generator in zip(race, generators):
        row.exponential_(generator=generator)
    return race


NON_FINITE = "the next-token probabilities contain NaN (non-finite logits)"


# Device types on which generate(compile=True) compiles its static step with Inductor before capturing it.
# On a CPU the step runs eagerly by default: Inductor's compilation costs more than a short generation
# saves (bench/README.md, generate.py part (d)); add "cpu" here to compile there too (tests, benches).
INDUCTOR_DEVICES = {"cuda"}
# torch.compile's backend for those steps ("inductor"; tests count compilations with a backend of their own).
COMPILE_BACKEND = "inductor"
# Inductor's options for them. coordinate_descent_tuning: on a GPU, Inductor then writes a one-row step's
# matrix-vector products as reductions of its own and tunes their launch configurations, which is how
# its decompositions say a GEMV reaches the memory bandwidth (without it they stay cuBLAS GEMVs, well
# below it: docs/gpu.md); the tuned configurations are cached on disk with the compiled code. No
# effect on a CPU.
INDUCTOR_OPTIONS = {"coordinate_descent_tuning": True}


@dataclass(frozen=True)
class SamplingVariant:
    """What a static step computes after the logits, fixed when it is compiled and captured: the sampling
    rule (`Sampling.rule()`: greedy or sampled and the filters; the temperature itself is a device value),
    and whether the step draws the fed token's Z from the prior itself (else the caller wrote it)."""
    rule: Sampling
    draw_latent: bool


def _step_core(model: FreeTransformer, token: Tensor, latent: Tensor, race: Tensor | None, temperature: Tensor,
               cache, variant: SamplingVariant | None) -> tuple[Tensor, Tensor]:
    """One static decoding step after its random draws: the model on token (B, 1) with latent (B, 1, ...) at
    the cache's device position, then the next token (B,) as sample_next picks it from the noise `race`
    (B, V) (argmax when greedy), and whether the logits hold a NaN (()). The function Inductor compiles.
    variant None: the logits (B, V) instead of a token (the model alone)."""
    logits = model(token, latents=latent, cache=cache, start=cache.position).logits[:, -1]  # (B, V)
    if variant is None:
        return logits, logits.isnan().any()
    if variant.rule.greedy:
        return logits.argmax(-1), logits.isnan().any()
    probs = next_token_probs(logits, temperature, variant.rule)
    return (probs / race).argmax(-1), probs.isnan().any()


def _fresh_function(function: Callable) -> Callable:
    """A copy of `function` with a code object of its own. Dynamo keeps compiled graphs per code object,
    at most recompile_limit of them: each static step compiling its own copy keeps its variants apart
    from every other step's (other models and shapes), so none evicts or counts against another."""
    code = function.__code__.replace()
    return types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)


class StaticDecodeStep:
    """One decoding step whose inputs live in fixed device buffers (the token, the latent value, the
    sampling noise, and a KV cache of its own with its device position), fed its own output: each call
    draws the new token's Z from the prior (unless the caller gives it) and the sampling noise with the
    rows' generators, runs the model, picks the next token (sampling inside the step) and keeps it as the
    next call's input. On CUDA it is compiled by Inductor (INDUCTOR_DEVICES) and then captured as a CUDA
    graph with the rows' generators registered to it: a step is one replay and no host work. Elsewhere
    the same step runs eagerly (or compiled, where INDUCTOR_DEVICES says).

    Per variant (SamplingVariant) the first call is a warm-up, which compiles (timed, logged once) and
    runs on a side stream as capture requires; the second captures and replays. `static_decode_step`
    keeps one per model and shape, so that compilation and capture happen once and every later
    `generate(compile=True)` call replays them: each starts with `restart()` and `bind()`.

    Random streams: the draws are those of eager decoding (the latent space's prior_ and sample_next's
    race, row by row, in the same order), so a seeded row gives eager decoding's tokens up to float rounding."""

    def __init__(self, model: FreeTransformer, batch_size: int, capacity: int, inductor: bool | None = None):
        # a weak reference: the steps kept per model (`static_decode_step`) must not keep the model alive
        self.model, self.cache = weakref.ref(model), model.new_cache(batch_size, capacity=capacity)
        device = self.cache.keys.device
        self.is_free, self.vocab_size = model.config.is_free, model.config.vocab_size
        space = model.latent_space
        value_shape, value_dtype = (space.value_shape, space.value_dtype) if space is not None else ((), torch.int64)
        self.token = torch.zeros(batch_size, 1, dtype=torch.int64, device=device)  # (B, 1) fed, then the next one
        # (B, 1, *value_shape) the fed position's Z, ignored by a baseline; (B, C, *value_shape) Z per position
        self.latent = torch.zeros(batch_size, 1, *value_shape, dtype=value_dtype, device=device)
        self.fed_latents = torch.zeros(batch_size, capacity, *value_shape, dtype=value_dtype, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.non_finite = torch.zeros((), dtype=torch.bool, device=device)  # any NaN logits since bind()
        self.race: Tensor | None = None  # (B, V) float32 sampling noise, made by the first sampled call
        self.use_graph = device.type == "cuda"
        self.inductor = device.type in INDUCTOR_DEVICES if inductor is None else inductor
        # one graph per variant, shapes fixed (batch, capacity, vocabulary): what a CUDA graph captures
        options = dict(INDUCTOR_OPTIONS) if COMPILE_BACKEND == "inductor" else None
        self.core = torch.compile(_fresh_function(_step_core), backend=COMPILE_BACKEND, dynamic=False,
                                  fullgraph=True, options=options) if self.inductor else _step_core
        self.compile_seconds: dict[SamplingVariant, float] = {}  # the first (compiling) call of each variant
        # per variant (None: the model alone, `__call__`): its graph, the output buffer the graph writes
        self.graphs: dict[SamplingVariant | None, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[SamplingVariant | None, Tensor] = {}
        self.warm: set[SamplingVariant | None] = set()
        self.pool = None  # one memory pool shared by the graphs of every variant
        # On CUDA the graphs draw with generators of their own, registered at capture; bind() copies the
        # rows' generator states into them. Elsewhere the rows' generators are used directly.
        self.own_generators = [torch.Generator(device) for _ in range(batch_size)] if self.use_graph else None
        self.generators: Sequence[torch.Generator] = []

    def restart(self):
        """The cache, emptied for a new prompt (stale keys past the position are masked, not cleared)."""
        self.cache.length = 0
        self.cache.position.zero_()
        return self.cache

    def bind(self, token: Tensor, config: GenerationConfig, generators: Sequence[torch.Generator]) -> None:
        """Start decoding from `token` (B,), the one sampled from the prefill's logits, with the rows'
        generators (their states from here on) and config's temperature."""
        self.token.copy_(token[:, None])
        self.temperature.fill_(config.temperature or 1.0)
        self.non_finite.zero_()
        if self.own_generators is None:
            self.generators = generators
        else:
            for own, row in zip(self.own_generators, generators):
                own.set_state(row.get_state())
            self.generators = self.own_generators
        if config.temperature and self.race is None:
            self.race = torch.empty(self.token.shape[0], self.vocab_size, dtype=torch.float32, device=self.token.device)

    def _run(self) -> Tensor:
        """The model's logits (B, V) for the buffers, eagerly: the forward the step is made of."""
        model = self.model()
        return model(self.token, latents=self.latent, cache=self.cache, start=self.cache.position).logits[:, -1]

    def _step(self, variant: SamplingVariant) -> Tensor:
        """Draws, model, next token: everything a replay does. Returns the next token (B,)."""
        if variant.draw_latent:
            self.model().latent_space.prior_(self.latent, self.generators)
        if not variant.rule.greedy:
            exponential_race_(self.race, self.generators)
        if self.is_free:  # Z of the fed position, kept for the caller
            self.fed_latents.index_copy_(1, self.cache.position.view(1), self.latent)
        token, non_finite = self.core(self.model(), self.token, self.latent, self.race, self.temperature,
                                      self.cache, variant)
        self.non_finite.logical_or_(non_finite)
        self.token.copy_(token[:, None])
        return token

    def advance(self, config: GenerationConfig, latent: Tensor | None) -> Tensor:
        """Feed the kept token with latent (B, 1, *value_shape) (None: drawn from the prior inside the step;
        ignored by a baseline) and return the next token (B,), also kept as the next call's input; the cache
        advances one position. bind() first."""
        variant = SamplingVariant(config.rule(), latent is None and self.is_free)
        if latent is not None:
            self.latent.copy_(latent)
        return self._replay(variant, lambda: self._step(variant))

    def __call__(self, token: Tensor, latent: Tensor | None) -> Tensor:
        """The model alone: (B, V) logits of the next position given token (B,) and latent (B, 1, ...); the
        cache advances. Nothing is drawn or sampled (the caller samples)."""
        self.token.copy_(token[:, None])
        if latent is not None:
            self.latent.copy_(latent)
        return self._replay(None, lambda: self.core(self.model(), self.token, self.latent, None, self.temperature,
                                                     self.cache, None)[0])

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured graph of the model alone (`__call__`), once captured."""
        return self.graphs.get(None)

    def _replay(self, variant: SamplingVariant | None, body: Callable[[], Tensor]) -> Tensor:
        """body() run as the variant's step: the first time as a warm-up (compiling, timed), then captured
        once and replayed on CUDA, or run again elsewhere."""
        if variant not in self.warm:  # compile and run once, on a side stream as a later capture requires
            started = time.perf_counter()
            if self.use_graph:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    out = body()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
            else:
                out = body()
            self.warm.add(variant)
            if self.inductor:
                self.compile_seconds[variant] = seconds = time.perf_counter() - started
                logger.info("compiled the static decoding step (batch %d, %d positions, %s) in %.1f s",
                            self.token.shape[0], self.cache.capacity, variant or "logits", seconds)
            return out
        if not self.use_graph:
            return body()
        if variant not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            if variant is not None:
                for generator in self.own_generators:
                    graph.register_generator_state(generator)
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[variant] = body()
            self.pool = graph.pool()
            self.graphs[variant] = graph
        self.graphs[variant].replay()
        return self.outputs[variant]


# Decoding caches of compile=True are sized to the positions a call feeds, rounded up to this many (so
# that calls of similar lengths share one captured graph), and at most max_seq_len.
STATIC_CACHE_ROUNDING = 64
# Captured steps kept per model (each holds a KV cache and, on a GPU, a graph's memory pool).
STATIC_STEPS_PER_MODEL = 4
_static_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> OrderedDict(key -> step)


def static_decode_step(model: FreeTransformer, batch_size: int, positions: int,
                       inductor: bool | None = None) -> StaticDecodeStep:
    """The model's StaticDecodeStep for `batch_size` rows and at least `positions` cached positions,
    made (and later compiled and captured) on first use and kept: the least recently used beyond
    STATIC_STEPS_PER_MODEL is dropped. Steps are keyed by the parameters' storage too, so a model moved
    to another device or dtype gets a new one; weights updated in place are seen by a captured graph.
    inductor: compile the step with Inductor (default: on the device types of INDUCTOR_DEVICES)."""
    rounded = -(-positions // STATIC_CACHE_ROUNDING) * STATIC_CACHE_ROUNDING
    capacity = min(model.config.max_seq_len, rounded)
    if inductor is None:
        inductor = model.rope_cos.device.type in INDUCTOR_DEVICES
    key = (batch_size, capacity, inductor, tuple(p.data_ptr() for p in model.parameters()))
    steps = _static_steps.setdefault(model, OrderedDict())
    if key not in steps:
        steps[key] = StaticDecodeStep(model, batch_size, capacity, inductor)
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
    latents: LatentChoice | None = None,
    reference: Tensor | Sequence[Sequence[int]] | None = None,
    latent_seed: int | None = None,
    should_stop: Callable[[list[int]], bool] | None = None,
    compile: bool = False,
) -> GenerationResult:
    """Sample continuations of a batch of equal-length prompts with a KV cache.

    prompts: (B, P) token ids. seeds: one per row, so each row's sample does not depend on the
    others. latents: where Z comes from (free_transformer.inference.latents; None: "encoder"):
    "encoder" or "prior" for the prompt's Z; "shared", one prior sequence for every row (the paper's
    green groups); "reference", the encoder's posterior on `reference`, (B or 1, T >= P) token ids; or
    (B or 1, N, *value_shape) explicit values for positions [0, N), N >= P (indices (B or 1, N) for the
    binary kinds). Positions past the explicit ones draw Z_t from the prior, per row. latent_seed seeds the
    one-off draw of "shared" and "reference"
    (default: the global RNG). should_stop: called with a row's new tokens after each step; True
    finishes that row (for stop strings, which token ids cannot express). compile: decode with
    `StaticDecodeStep`, which draws Z and samples inside the step: on a GPU compiled by Inductor
    (the first call of a shape and sampling setting compiles: a minute at paper sizes, logged by the
    `free_transformer.inference.generate` logger at INFO) and captured as a CUDA graph; elsewhere the same step
    eagerly (INDUCTOR_DEVICES). The same tokens and latents as without it, up to float rounding. Its
    compiled code, graph and cache are kept for the next call with the same batch size and a similar
    length (`static_decode_step`). The KV cache is in the model's dtype: cast the model
    (`model.to(torch.bfloat16)`) to decode in bf16.
    """
    config = config or GenerationConfig()
    device = model.rope_cos.device
    prompts = torch.as_tensor(prompts, dtype=torch.int64, device=device)
    if prompts.dim() != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be a non-empty (B, P) batch of equal-length token lists, got {tuple(prompts.shape)}")
    B, P = prompts.shape
    model.check_tokens(prompts)
    config = dataclasses.replace(config, max_new_tokens=config.new_tokens(P, model.config.max_seq_len))
    fed_positions = P + config.max_new_tokens - 1
    if fed_positions > model.config.max_seq_len:
        raise ValueError(
            f"prompt ({P}) + max_new_tokens ({config.max_new_tokens}) - 1 exceeds max_seq_len {model.config.max_seq_len}"
        )
    generators = row_generators(seeds, B, device)
    one_off = torch.Generator(device=device).manual_seed(latent_seed) if latent_seed is not None else None
    plan = plan_latents(model, latents, B, P, length=fed_positions,
                        reference=reference, generator=one_off, generators=generators)

    # inference_mode rather than no_grad alone: no version counters or view tracking on the ~400 small
    # operations of each step (its gain: bench/README.md, generate.py). The latents are concatenated
    # outside it, so the caller gets an ordinary tensor (usable in a later training forward).
    with torch.inference_mode():
        step_fn = static_decode_step(model, B, fed_positions) if compile else None
        cache = step_fn.restart() if compile else model.new_cache(B, capacity=fed_positions)
        out = model(prompts, latents=plan.source(0, P, device), generator=generators, cache=cache)
        plan.record(0, out.latents)
        new_tokens = _decode(model, cache, plan, out.logits[:, -1], config, generators, should_stop, step_fn)
        used = plan.used
    return GenerationResult(new_tokens, torch.cat(used, dim=1) if model.config.is_free else None)


# Static decoding on a GPU reads its stop flags back every this many steps (eager decoding: every step).
STOP_CHECK_EVERY = 16


def _decode(model, cache, plan: LatentPlan, logits: Tensor, config: GenerationConfig, generators,
            should_stop, step_fn: StaticDecodeStep | None) -> list[list[int]]:
    """The new tokens of each row, cut after its first stop token. Tokens and stop flags stay on the
    device; they are read back every step when eager or given should_stop (which needs the tokens),
    else every STOP_CHECK_EVERY steps (then a few steps may be computed after every row stopped).

    The first token is sampled here from the prefill's logits; with step_fn every later one comes out
    of the static step, which feeds the previous one, draws its Z and samples."""
    B, device = logits.shape[0], logits.device
    stop_ids = torch.tensor(sorted(set(config.stop_tokens)), dtype=torch.int64, device=device)
    tokens = torch.zeros(B, config.max_new_tokens, dtype=torch.int64, device=device)  # (B, N)
    lengths = torch.full((B,), config.max_new_tokens, dtype=torch.int64, device=device)  # tokens kept per row
    non_finite = logits.isnan().any()
    host_rows: list[list[int]] = [[] for _ in range(B)]  # should_stop's view of each row
    check_every = 1 if step_fn is None or not step_fn.use_graph or should_stop is not None else STOP_CHECK_EVERY
    first_fed = position = cache.length  # the next position to feed
    token = sample_next(logits, config, generators, validate=False)  # (B,)
    if step_fn is not None:
        step_fn.bind(token, config, generators)
    for step in range(config.max_new_tokens):
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
            if bool(non_finite) or (step_fn is not None and bool(step_fn.non_finite)):
                raise ValueError(NON_FINITE)
            if last or bool((lengths <= step + 1).all()):
                break
        if step_fn is None:
            latent = plan.source(position, 1, device)  # (B, 1, ...) a prior or explicit Z; a baseline: "prior"
            logits = model(token[:, None], latents=latent, cache=cache, start=position).logits[:, -1]
            plan.record(position, latent if isinstance(latent, Tensor) else None)
            non_finite |= logits.isnan().any()
            token = sample_next(logits, config, generators, validate=False)
        else:  # explicit Z is handed over; a prior Z is drawn inside the step
            token = step_fn.advance(config, plan.explicit_at(position))
        position += 1
    if step_fn is not None and step_fn.is_free:
        plan.record(first_fed, step_fn.fed_latents[:, first_fed:position].clone())
    kept = lengths.tolist()
    return [row[:n] for row, n in zip(tokens[:, : step + 1].tolist(), kept)]
