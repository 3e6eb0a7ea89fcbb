"""The decoding engine's step on the device: `StepRunner`, the one part that knows about compilation and graphs.

A step feeds every row in flight its last token at its own position (a (rows,) position tensor; one int when
every row is at one position), with the row's Z for that position and its token's uniform (the rows' draws,
free_transformer.inference.row_draws), and samples each row's next token with its own settings given as tensors
(free_transformer.inference.sampling). It finds a row's end on the device, as two flags a row over the batch
(`step_ends`: whether it ended, by the token among the slot's stop ids, padded with -1, by the row's last
position or by the sampler's non-finite flag; and that flag), and the tokens and flags come back to the host in
one read a step. Deferred (on CUDA), that read is of a pinned host buffer filled by a non-blocking copy and
waited for by an event after the next step is launched, so that the host prepares step n + 1 while the device
runs step n: a row that ended at step n stays at its position on the device and is fed step n + 1 too, whose
token for it is dropped when it arrives.

Compiled (`compile=True`): the step (model and sampling) is compiled by Inductor on the device types of
INDUCTOR_DEVICES and, on CUDA, captured as a CUDA graph per batch-size bucket (BUCKETS; the rows in flight are
padded up to their bucket) and sampling variant, once for the engine's life: a step is then one replay, which
reads its rows' draws from the engine's buffers at their positions. A compiled step attends the whole cache
under a mask; an eager one the positions up to the longest row's."""

from __future__ import annotations

import bisect
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..model.latent import LatentSource
from ..model.transformer import FreeTransformer
from .params import GenerationConfig
from .row_draws import PolicyRows, RowDraws
from .sampling import RowSettings, SamplingVariant, next_tokens

# the engine's logger, which generate --compile and users listen to for the compile times
logger = logging.getLogger("free_transformer.inference.engine")

# Device types on which a compiled engine compiles its step with Inductor before capturing it. On a CPU the
# step runs eagerly by default: Inductor's compilation costs more than a short generation saves (bench/README.md,
# generate.py part (d)); add "cpu" here to compile there too (tests, benches).
INDUCTOR_DEVICES = {"cuda"}
# torch.compile's backend for those steps ("inductor"; tests count compilations with a backend of their own).
COMPILE_BACKEND = "inductor"
# Inductor's options. coordinate_descent_tuning: on a GPU, Inductor then writes a few-row step's matrix-vector
# products as reductions of its own and tunes their launch configurations, which is how its decompositions say
# a GEMV reaches the memory bandwidth (without it they stay cuBLAS GEMVs, well below it: docs/gpu.md).
INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable] = {"coordinate_descent_tuning": True}
# The batch sizes a compiled step is captured for: the rows in flight are padded up to the next one.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Stop ids a slot holds at first (`StepRunner.stops`); a row with more widens the table (and drops the graphs).
STOP_SLOTS = 8

# A launched step: its rows, the host buffer its (3, rows) outcomes land in, its CUDA event (None on a CPU), and
# its logits (rows, V)
Launched = tuple[list, Tensor, torch.cuda.Event | None, Tensor]


def bucket_sizes(slots: int) -> tuple[int, ...]:
    """The captured batch sizes of an engine of `slots` rows: BUCKETS below it, and itself."""
    return tuple(size for size in BUCKETS if size < slots) + (slots,)


@dataclass(frozen=True)
class SlotViews:
    """Views of slots [0, size) of the step's buffers (`StepRunner.views`)."""

    rows: slice
    token: Tensor  # (size, 1)
    next_token: Tensor  # (size,) its column: where the step writes the next token
    position: Tensor  # (size,)
    active: Tensor  # (size,)
    index: Tensor  # (size,)
    last: Tensor  # (size,)
    stops: Tensor  # (size, stop ids)
    settings: tuple[Tensor, ...]  # RowSettings.view


class StepRunner:
    """The step's buffers, one row a slot (the token to feed, its position, whether the slot is in flight, its
    settings, stop ids and last position), the compiled steps and graphs, and the host buffers of the read-back.
    A `SlotState` of the engine's cache (free_transformer.inference.cache_manager)."""

    def __init__(self, slots: int, device, draws: RowDraws, *, compile: bool, inductor: bool | None, deferred):
        self.draws, self.device = draws, device
        with torch.inference_mode():
            self.token = torch.zeros(slots, 1, dtype=torch.int64, device=device)  # (S, 1) the token to feed
            self.position = torch.zeros(slots, dtype=torch.int64, device=device)  # (S,) where it goes
            self.active = torch.zeros(slots, dtype=torch.int64, device=device)  # (S,) 1 for a slot in flight
            self.index = torch.arange(slots, device=device)  # (S,) each slot's index
            self.settings = RowSettings(slots, device)
            # (S, STOP_SLOTS) each row's stop ids, padded with -1; (S,) the last position it feeds, whose
            # logits give its last token: what the step's `ended` compares with (`step_ends`)
            self.stops = torch.full((slots, STOP_SLOTS), -1, dtype=torch.int64, device=device)
            self.last = torch.zeros(slots, dtype=torch.int64, device=device)
        # deferred (CUDA by default): a step's tokens and `ended` come back through host memory (pinned on CUDA)
        # after the next step is launched
        self.deferred = device.type == "cuda" if deferred is None else deferred
        pinned = device.type == "cuda"
        # two host buffers of 3S: a step's copy lands in one, (3, rows) contiguous (a non-contiguous destination
        # would make the copy synchronous), while the host reads the previous step's in the other
        self.host = [torch.zeros(3 * slots, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.steps = 0  # steps launched (tests and logs)
        self.stopping = False  # whether a row in flight has stop ids (set by the engine as rows join and leave)
        self.compile = compile
        self.use_graph = compile and device.type == "cuda"
        self.inductor = compile and (device.type in INDUCTOR_DEVICES if inductor is None else inductor)
        self.buckets = bucket_sizes(slots) if compile else ()
        # keyed by the sampling variant and which rows draw their Z from the policy head (`Step`)
        self.cores: dict[tuple[SamplingVariant, PolicyRows], Callable] = {}  # compiled step per variant
        # first (compiling) run per bucket
        self.compile_seconds: dict[tuple[int, SamplingVariant, PolicyRows], float] = {}
        self.graphs: dict[tuple[int, SamplingVariant, PolicyRows], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.warm: set[tuple[int, SamplingVariant, PolicyRows]] = set()
        self.pool: torch.cuda._POOL_HANDLE | None = None  # one memory pool shared by every graph (the first's)
        self.slot_views: dict[int, SlotViews] = {}  # size -> the views of slots [0, size) of the step's buffers

    # ---- rows join ------------------------------------------------------------------------------

    def join(self, slots: slice, configs: Sequence[GenerationConfig], position: int, ends: Sequence[int]) -> None:
        """Set the step's buffers of the rows joining `slots` at `position` (their prompt's length), with these
        settings and ends (the positions they feed, [0, end)). A row with more stop ids than the table holds
        widens it, and the captured graphs, which read the old one, are dropped."""
        width = max(len(config.stop_tokens) for config in configs)
        if width > self.stops.shape[1]:
            wider = torch.full((self.stops.shape[0], width), -1, dtype=torch.int64, device=self.device)
            wider[:, : self.stops.shape[1]] = self.stops
            self.stops = wider
            self.graphs.clear()
            self.warm.clear()
            self.slot_views.clear()
        width = self.stops.shape[1]
        stops = [list(config.stop_tokens) + [-1] * (width - len(config.stop_tokens)) for config in configs]
        self.stops[slots] = torch.tensor(stops, dtype=torch.int64, device=self.device)
        self.last[slots] = torch.tensor([end - 1 for end in ends], dtype=torch.int64, device=self.device)
        self.position[slots] = position
        self.active[slots] = 1
        self.settings.set(slots, list(configs))

    def first_tokens(self, slots: slice, logits: Tensor, configs: Sequence[GenerationConfig], P: int) -> Tensor:
        """The first tokens of the rows joined in `slots`, sampled from their prefill's last logits (k, V), and
        their outcomes (3, k), read now."""
        variant = SamplingVariant.of(list(configs))
        uniforms = self.draws.uniforms[slots, P - 1] if variant.sampled else None
        tokens, non_finite = next_tokens(logits, self.settings.view(slots), uniforms, variant)
        self.token[slots, 0] = tokens
        ended = step_ends(tokens, non_finite, self.position[slots] - 1, self.last[slots], self.stops[slots])
        return outcomes(tokens, ended, non_finite).cpu()

    def move(self, source: int, slot: int, end: int) -> None:
        for buffer in (self.token, self.position, self.active, self.last, self.stops):
            buffer[slot] = buffer[source]
        self.settings.move(source, slot)

    def free(self, n: int) -> None:
        """Slots [n, S) are empty."""
        self.active[n:] = 0
        self.position[n:] = 0

    # ---- one step ------------------------------------------------------------------------------

    def launch(
        self,
        model: FreeTransformer,
        cache,
        rows: list,
        variant: SamplingVariant,
        longest: int,
        aligned: bool,
        logits: bool,
        policy: PolicyRows = PolicyRows.NONE,
    ) -> Launched:
        """Launch one step of `rows` (slots [0, n)) over `cache` (the engine's SlotCache) and the copy of its
        tokens and `ended` to a host buffer (without waiting for it when deferred). aligned: every row at position
        `longest`; logits: whether a row keeps them (a deferred replay's are copied before the next overwrites
        them); policy: which rows draw their Z from the policy head, in the step."""
        n = size = len(rows)
        if self.compile:
            size = self.buckets[bisect.bisect_left(self.buckets, n)]
            tokens, ended, non_finite, out = self.replay(model, cache, size, variant, policy)
            if self.deferred and logits:  # a replay overwrites its outputs: keep this step's
                out = out.clone()
        elif aligned:  # rows all at one position (equal prompts, one row) feed it as an int: the model writes
            # and attends the cache as a prefill continued, no mask, no scatter
            tokens, ended, non_finite, out = self.body(model, n, cache.view(n), variant, policy, step_core, longest)
        else:  # each row at its own position, the cache attended up to the longest row's
            view = cache.cache.view(slice(0, n), min(longest + 1, cache.capacity))
            tokens, ended, non_finite, out = self.body(model, n, view, variant, policy, step_core)
        self.steps += 1
        if size > n:  # a compiled step's bucket: its rows past n are padding
            tokens, ended, non_finite = tokens[:n], ended[:n], non_finite[:n]
        host = outcomes(tokens, ended, non_finite)
        if self.device.type != "cpu" or self.deferred:  # one copy a step, into the host buffer not being read
            host = self.host[self.steps % 2][: 3 * n].view(3, n).copy_(host, non_blocking=self.deferred)
        event = None
        if self.deferred and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return rows, host, event, out

    @staticmethod
    def read(host: Tensor, event: torch.cuda.Event | None) -> list[list[int]]:
        """A launched step's outcomes once they arrived (`event`): (3, rows) tokens, `ended` and non-finite flags, as
        lists from host memory (no device read)."""
        if event is not None:
            event.synchronize()  # the one wait of a deferred step, on a step launched before the current one
        return host.tolist()

    def body(
        self,
        model: FreeTransformer,
        size: int,
        cache,
        variant: SamplingVariant,
        policy: PolicyRows,
        core: Callable,
        start=None,
    ) -> tuple[Tensor, ...]:
        """The step of slots [0, size) over `cache`, a view of their rows: everything a captured graph replays.
        start: the one position of every row, when the host knows they share it (the model then writes and
        attends the cache as a prefill continued; None: each row at its own, a (size,) tensor). policy: the rows
        that draw their Z from the policy head, whose draws are kept in the rows' draws. Returns the next tokens
        (size,), whether each row ended (size,), whether its logits were not finite (size,) and the logits
        (size, V)."""
        slots = self.views(size)
        if start is None:  # each row's draws at its position: its Z (size, 1, ...) and its token's uniform (size,)
            latent, uniforms = self.draws.at(slots.index, slots.position, sampled=variant.sampled, policy=policy)
        else:
            latent, uniforms = self.draws.column(slots.rows, start, sampled=variant.sampled, policy=policy)
        position = slots.position if start is None else start
        tokens, non_finite, logits, latents = core(
            model, slots.token, latent, position, cache, slots.settings, uniforms, variant
        )
        if policy and start is None:
            self.draws.keep(slots.index, slots.position, latents)
        elif policy:
            self.draws.keep_column(slots.rows, start, latents)
        # a captured graph compares whatever the rows: it serves later rows too
        stops = slots.stops if self.stopping or self.use_graph else None
        ended = step_ends(tokens, non_finite, slots.position, slots.last, stops)
        slots.next_token[:] = tokens
        if self.deferred:  # a row that ended stays at its position: fed again until the host reads that it
            # ended, its cache and draws stay within its own positions (read at once, it leaves before)
            slots.active.masked_fill_(ended, 0)
        slots.position.add_(slots.active)
        return tokens, ended, non_finite, logits

    def views(self, size: int) -> SlotViews:
        """The views of slots [0, size) of the step's buffers: one per size (the buffers are written in place;
        `stops`, replaced when it widens, drops them)."""
        views = self.slot_views.get(size)
        if views is None:
            rows = slice(0, size)
            views = self.slot_views[size] = SlotViews(
                rows=rows,
                token=self.token[rows],
                next_token=self.token[rows, 0],
                position=self.position[rows],
                active=self.active[rows],
                index=self.index[rows],
                last=self.last[rows],
                stops=self.stops[rows],
                settings=self.settings.view(rows),
            )
        return views

    def replay(
        self, model: FreeTransformer, cache, size: int, variant: SamplingVariant, policy: PolicyRows = PolicyRows.NONE
    ) -> tuple[Tensor, ...]:
        """The compiled step of bucket `size`: its first run compiles (timed, logged) on a side stream, as a later
        capture requires; on CUDA the second captures it and every run replays it."""
        key = (size, variant, policy)
        core = self.cores.get((variant, policy))
        if core is None:
            options = dict(INDUCTOR_OPTIONS) if COMPILE_BACKEND == "inductor" else None
            core = self.cores[(variant, policy)] = (
                torch.compile(_fresh_function(step_core), backend=COMPILE_BACKEND, fullgraph=True, options=options)
                if self.inductor
                else step_core
            )

        def body():
            return self.body(model, size, cache.view(size), variant, policy, core)

        if key not in self.warm:
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
            self.warm.add(key)
            if self.inductor:
                self.compile_seconds[key] = seconds = time.perf_counter() - started
                logger.info(
                    "compiled the decoding step (batch %d, %d positions, %s%s) in %.1f s",
                    size,
                    cache.capacity,
                    variant,
                    ", Z from the policy" if policy else "",
                    seconds,
                )
            return out
        if not self.use_graph:
            return body()
        if key not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = body()
            self.pool = graph.pool()
            self.graphs[key] = (graph, outputs)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs


def step_ends(tokens: Tensor, non_finite: Tensor, position: Tensor, last: Tensor, stops: Tensor | None) -> Tensor:
    """(n,) whether each row ends with its new token (n,) from `position`'s logits (n,): its logits not finite
    (`non_finite`), the token among its stop ids (`stops`, (n, width) padded with -1; None when no row has any),
    or `position` its last position fed (`last`, its length)."""
    ended = (position >= last) | non_finite  # (n,)
    if stops is not None:
        ended |= (tokens[:, None] == stops).any(1)
    return ended


def outcomes(tokens: Tensor, ended: Tensor, non_finite: Tensor) -> Tensor:
    """(3, n) int64: each row's new token, whether it ended and whether its logits were not finite, what the
    engine reads back (the flags cast first: stack's own type promotion costs more than the two casts)."""
    return torch.stack([tokens, ended.long(), non_finite.long()])


def step_core(
    model: FreeTransformer,
    token: Tensor,
    latent: LatentSource,
    position: int | Tensor,
    cache,
    settings,
    uniforms,
    variant: SamplingVariant,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One step after its random draws: the model on token (B, 1) with latent (B, 1, ...) (or a PolicyDraw) at
    each row's position (B,) (or at the rows' one position, an int), then each row's next token (B,), its
    non-finite flag (B,), the logits (B, V) and the Z it was fed (B, 1, ...; None for a baseline). The function
    Inductor compiles."""
    out = model(token, latents=latent, cache=cache, start=position)
    logits = out.logits[:, -1]  # (B, V)
    tokens, non_finite = next_tokens(logits, settings, uniforms, variant)
    return tokens, non_finite, logits, out.latents


def _fresh_function(function: Callable) -> Callable:
    """A copy of `function` with a code object of its own. Dynamo keeps compiled graphs per code object, at
    most recompile_limit of them: each engine's variant compiling its own copy keeps its buckets apart from
    every other engine's (other models and shapes), so that none evicts or counts against another."""
    code = function.__code__.replace()
    return types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )
