"""The decoding engine: the one loop that decodes every sequence, for `generate()`, `free-transformer generate`
(with --interactive) and the server (free_transformer.serve).

The engine has `slots` rows of one KV cache. A `Row` (a prompt, its sampling settings, its seed and where
its Z comes from) is prefilled into a free slot (`add`: rows of one prompt length are prefilled together, the
prompt's Z from the encoder's posterior, the prior or explicit values), its first token sampled from the
prefill's logits. Each `step` then feeds every row its last token at its own position, a (rows,) position
tensor: the row's Z for that position (explicit, or a prior draw), the model, and the next token, each row
sampled with its own settings given as tensors (free_transformer.inference.sampling).
A row ends at a stop token, at its max_new_tokens, when the caller ends it (`finish`), or alone, with an
error, when its logits are not finite: the step finds the first three on the device, as two flags a row over the
batch (`_step_ends`: whether it ended, by the token among the slot's stop ids, padded with -1, by the row's last
position or by the sampler's non-finite flag; and that flag), and its tokens and flags come back to the host in
one read a step. Deferred (on CUDA), that
read is of a pinned host buffer filled by a non-blocking copy and waited for by an event after the next step is
launched, so that the host prepares step n + 1 while the device runs step n: a row that ended at step n stays
at its position on the device and is fed step n + 1 too, whose token for it is dropped when it arrives.
Rows join and leave between steps; a row that leaves is replaced in its slot by the last one, so that the rows
in flight always fill slots [0, n), and the keys and values it leaves are zeroed, so that nothing of it (a
failed row's NaN) reaches the next row there.

Random streams: a row's draws are counter-based (free_transformer.base.counter_random), functions of its key
(of its seed) and a position: the prior Z fed at position t is the row's LATENT stream at t, the noise of the
token sampled from position t's logits its TOKEN stream at t, every row's drawn in one operation on the batch
(`counter_prior`, `token_uniforms`), all of a row's as it joins (`_draw`), so that a step only reads them at its
rows' positions. Only the encoder's posterior sample of the prompt's Z, once at admission,
takes a torch.Generator seeded with the row's seed. A sample therefore depends only on its prompt, settings,
seed and Z, never on the other rows in flight nor on the order of the draws.

Compiled (`compile=True`): the step (model and sampling) is compiled by Inductor on the device types of
INDUCTOR_DEVICES and, on CUDA, captured as a CUDA graph per batch-size bucket (BUCKETS; the rows in flight are
padded up to their bucket) and sampling variant, once for the engine's life: a step is then one replay, which
reads its rows' draws from the engine's buffers at their positions. A compiled step attends the whole cache
under a mask; an eager one the positions up to the longest row's."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..base.counter_random import row_keys
from ..base.latent_choice import LatentChoice
from ..base.seeding import generators
from ..model.latent import LatentSource
from ..model.latent.sampling import counter_prior
from ..model.transformer import FreeTransformer
from .admission import Admission, Request
from .params import MAX_SEED, GenerationConfig, check_room
from .sampling import NON_FINITE, RowSettings, SamplingVariant, declared_filters, next_tokens, token_uniforms

logger = logging.getLogger(__name__)

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
# A compiled engine's cache holds the positions asked for rounded up to this many (so that calls of similar
# lengths share one engine and its graphs), and at most max_seq_len.
CACHE_ROUNDING = 64
# Compiled engines kept per model (each holds a KV cache and, on a GPU, its graphs' memory pool).
ENGINES_PER_MODEL = 4
# Stop ids a slot holds at first (`DecodeEngine.stops`); a row with more widens the table (and drops the graphs).
STOP_SLOTS = 8


@dataclass(eq=False)
class Row:
    """One sequence to decode, and what it has become: what `DecodeEngine.add` takes, filled as it decodes."""

    ids: list[int]  # the prompt's token ids, at least one
    config: GenerationConfig  # temperature, filters, stop tokens, and max_new_tokens (set)
    seed: int | None  # keys every random draw of the row, in [0, 2^63) (None: one drawn from torch's global RNG)
    # the prompt's Z (ENCODER or PRIOR), or (1, N, *value_shape) explicit Z of positions [0, N), N >= len(ids)
    latents: LatentSource = LatentChoice.ENCODER
    keep_logits: bool = False  # set `logits` at every token (the server's logprobs)
    keep_prompt_logits: bool = False  # set `prompt_logits` (the server's echo with logprobs)
    tag: object = None  # the caller's
    tokens: list[int] = field(default_factory=list)  # the new tokens so far
    finish_reason: str | None = None  # "stop", "length", "error" or the caller's (`DecodeEngine.finish`)
    error: Exception | None = None  # why it ended, when its logits were not finite
    logits: Tensor | None = None  # (V,) what its last token was sampled from; valid until the next step
    prompt_logits: Tensor | None = None  # (P, V) the prefill's logits
    fed: Tensor | None = None  # (positions fed, *value_shape) the Z it was fed, once ended (Free Transformer)
    slot: int | None = None  # its row of the engine's cache while in flight

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """The next position to feed, the tokens in the cache: the prompt and every new token but the last (and
        the last too when the step that fed it failed)."""
        return len(self.ids) + len(self.tokens) - (0 if self.error is not None else 1)


def bucket_sizes(slots: int) -> tuple[int, ...]:
    """The captured batch sizes of an engine of `slots` rows: BUCKETS below it, and itself."""
    return tuple(size for size in BUCKETS if size < slots) + (slots,)


class DecodeEngine:
    """Slots of one KV cache that rows join (`add`) and leave; `step` decodes every row in flight one token."""

    def __init__(
        self,
        model: FreeTransformer,
        slots: int,
        *,
        capacity: int | None = None,
        compile: bool = False,
        inductor: bool | None = None,
        deferred: bool | None = None,
    ):
        if slots < 1:
            raise ValueError(f"the engine must hold at least 1 row, got {slots}")
        # a weak reference: the engines kept per model (`decoding_engine`) must not keep the model alive
        self._model = weakref.ref(model)
        self.cache = model.new_cache(slots, capacity=capacity)
        self.slots, self.capacity = slots, self.cache.capacity
        device = self.device = self.cache.keys.device
        self.is_free, self.vocab_size = model.config.is_free, model.config.vocab_size
        space = self.space = model.latent_space
        shape, dtype = (space.value_shape, space.value_dtype) if space is not None else ((), torch.int64)
        with torch.inference_mode():
            self.token = torch.zeros(slots, 1, dtype=torch.int64, device=device)  # (S, 1) the token to feed
            self.position = torch.zeros(slots, dtype=torch.int64, device=device)  # (S,) where it goes
            self.active = torch.zeros(slots, dtype=torch.int64, device=device)  # (S,) 1 for a slot in flight
            self.key = torch.zeros(slots, dtype=torch.int64, device=device)  # (S,) its counter-based key
            self.index = torch.arange(slots, device=device)  # (S,) each slot's index
            # (S, capacity, ...) the Z of every position a row feeds (`_draw`); (S, capacity) the uniform of the
            # token sampled from each position's logits, float64
            self.fed = torch.zeros(slots, self.capacity, *shape, dtype=dtype, device=device)
            self.uniforms = torch.full((slots, self.capacity), 0.5, dtype=torch.float64, device=device)
            self.settings = RowSettings(slots, device)
            # (S, STOP_SLOTS) each row's stop ids, padded with -1; (S,) the last position it feeds, whose
            # logits give its last token: what the step's `ended` compares with (`_step_ends`)
            self.stops = torch.full((slots, STOP_SLOTS), -1, dtype=torch.int64, device=device)
            self.last = torch.zeros(slots, dtype=torch.int64, device=device)
        # deferred (CUDA by default): a step's tokens and `ended` come back through host memory (pinned on CUDA)
        # after the next step is launched, so that the host prepares step n + 1 while the device runs step n
        self.deferred = device.type == "cuda" if deferred is None else deferred
        pinned = device.type == "cuda"
        # two host buffers of 3S: a step's copy lands in one, (3, rows) contiguous (a non-contiguous destination
        # would make the copy synchronous), while the host reads the previous step's in the other
        self.host = [torch.zeros(3 * slots, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        # the step launched but not read yet: its rows, host buffer, CUDA event (None on a CPU) and logits
        self.pending: tuple[list[Row], Tensor, torch.cuda.Event | None, Tensor] | None = None
        self.last_step = 0  # the step by which every row in flight has reached its length (no later one runs)
        self.rows: list[Row] = []  # in flight, row i in slot i
        # of the rows in flight, set as rows join and leave: what their step samples, and the furthest position fed
        # (and whether every one is at that position)
        self.variant, self.longest, self.aligned = SamplingVariant(sampled=False, filtered=False), 0, True
        self.keeps_logits = False  # whether a row in flight keeps its logits
        self.stopping = False  # whether a row in flight has stop ids (an eager step compares only then)
        self.steps = 0  # steps taken (tests and logs)
        self.compile = compile
        self.use_graph = compile and device.type == "cuda"
        self.inductor = compile and (device.type in INDUCTOR_DEVICES if inductor is None else inductor)
        self.buckets = bucket_sizes(slots) if compile else ()
        self.cores: dict[SamplingVariant, Callable] = {}  # compiled step per variant
        self.compile_seconds: dict[tuple[int, SamplingVariant], float] = {}  # first (compiling) run per bucket
        self.graphs: dict[tuple[int, SamplingVariant], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.warm: set[tuple[int, SamplingVariant]] = set()
        self.pool: torch.cuda._POOL_HANDLE | None = None  # one memory pool shared by every graph (the first's)
        self.views: dict[int, object] = {}  # size -> the cache view of slots [0, size) (`_view`)
        self.slot_views: dict[int, SlotViews] = {}  # size -> the views of slots [0, size) of the step's buffers

    @property
    def model(self) -> FreeTransformer:
        model = self._model()
        if model is None:
            raise RuntimeError("the decoding engine's model no longer exists")
        return model

    @property
    def free(self) -> int:
        return self.slots - len(self.rows)

    # ---- rows join ------------------------------------------------------------------------------

    def add(self, rows: Sequence[Row]) -> list[Row]:
        """Prefill `rows` into free slots and sample each one's first token; rows of one prompt length and one
        kind of prompt Z are prefilled together. Returns them (a row may already be done)."""
        if len(rows) > self.free:
            raise ValueError(f"{len(rows)} rows do not fit: {self.free} of {self.slots} slots are free")
        for row in rows:
            self.check(row)
            if row.seed is None:  # follows torch.manual_seed
                row.seed = int(torch.randint(0, MAX_SEED, ()))
        groups: dict[tuple, list[Row]] = {}
        for row in rows:
            kind = "explicit" if isinstance(row.latents, Tensor) else row.latents
            groups.setdefault((len(row.ids), kind), []).append(row)
        with torch.inference_mode():
            for group in groups.values():
                self._prefill(group)
            self._release()
            self._in_flight()
        return list(rows)

    def check(self, row: Row) -> None:
        """A one-line ValueError for a row this engine cannot decode."""
        P, new = len(row.ids), row.config.max_new_tokens
        if P < 1 or new is None:
            raise ValueError(f"a row needs a prompt and its max_new_tokens, got {P} tokens and {new}")
        if row.seed is not None and not 0 <= row.seed <= MAX_SEED:
            raise ValueError(f"a row's seed must be in [0, 2**63), got {row.seed}")
        check_room(P, new, self.capacity)

    def _prefill(self, rows: list[Row]) -> None:
        model, start, k, P = self.model, len(self.rows), len(rows), len(rows[0].ids)
        slots = slice(start, start + k)
        ids = torch.tensor([row.ids for row in rows], dtype=torch.int64, device=self.device)  # (k, P)
        seeds = [_seed(row) for row in rows]
        self.key[slots] = row_keys(torch.tensor(seeds, dtype=torch.int64, device=self.device))
        self._draw(rows, slots)
        latents = self._prompt_latents(rows, slots, P)
        # the encoder's posterior sample of the prompt's Z: the one draw with a generator, once per row
        encoder = self.is_free and isinstance(latents, str) and latents == LatentChoice.ENCODER
        out = model(
            ids,
            latents=latents,
            generator=generators(seeds, self.device) if encoder else None,
            cache=self.cache.view(slots, P),
        )
        if self.is_free:
            self.fed[slots, :P] = out.latents
        for j, row in enumerate(rows):
            row.slot = start + j
            if row.keep_prompt_logits:
                row.prompt_logits = out.logits[j]
        self.rows = self.rows + rows  # a new list: a step's list stays what it fed
        self.position[slots] = P
        self.active[slots] = 1
        self._set_ends(rows, slots)
        self.settings.set(slots, [row.config for row in rows])
        logits = out.logits[:, -1]  # (k, V)
        variant = SamplingVariant.of([row.config for row in rows])
        uniforms = self.uniforms[slots, P - 1] if variant.sampled else None
        tokens, non_finite = next_tokens(logits, self.settings.view(slots), uniforms, variant)
        self.token[slots, 0] = tokens
        ended = _step_ends(tokens, non_finite, self.position[slots] - 1, self.last[slots], self.stops[slots])
        host = _outcomes(tokens, ended, non_finite).cpu()  # once per group joining: the first tokens, read now
        self._take(rows, host, None, logits)

    def _set_ends(self, rows: list[Row], slots: slice) -> None:
        """Write the stop ids and last position of the rows joining `slots`, which the step's `ended` reads. A
        row with more stop ids than the table holds widens it, and the captured graphs, which read the old
        one, are dropped."""
        width = max(len(row.config.stop_tokens) for row in rows)
        if width > self.stops.shape[1]:
            wider = torch.full((self.slots, width), -1, dtype=torch.int64, device=self.device)
            wider[:, : self.stops.shape[1]] = self.stops
            self.stops = wider
            self.graphs.clear()
            self.warm.clear()
            self.slot_views.clear()
        width = self.stops.shape[1]
        stops = [list(row.config.stop_tokens) + [-1] * (width - len(row.config.stop_tokens)) for row in rows]
        self.stops[slots] = torch.tensor(stops, dtype=torch.int64, device=self.device)
        self.last[slots] = torch.tensor([_end(row) - 1 for row in rows], dtype=torch.int64, device=self.device)

    def _prompt_latents(self, rows: list[Row], slots: slice, P: int) -> LatentSource:
        """What the prefill of `rows` in `slots` (one group of `add`: one kind of prompt Z) takes as latents:
        the explicit values, the rows' prior streams at positions [0, P), or LatentChoice.ENCODER."""
        if not self.is_free:
            return LatentChoice.PRIOR
        if isinstance(rows[0].latents, Tensor) or rows[0].latents == LatentChoice.PRIOR:
            return self.fed[slots, :P]  # (k, P, ...) the explicit values, or the prior's, written by `_draw`
        return LatentChoice.ENCODER

    def _draw(self, rows: list[Row], slots: slice) -> None:
        """Every draw the rows joining `slots` will read, made now in one operation for the group: at each
        position t they will feed, their prior Z (LATENT stream at t, into `fed`, under explicit Z where given)
        and the uniform of the token sampled from t's logits (TOKEN stream at t, into `uniforms`). A step then
        reads its rows' draws at their positions: no random number is made in it."""
        end = max(_end(row) for row in rows)
        positions = torch.arange(end, device=self.device)[None, :]  # (1, end)
        keys = self.key[slots, None]  # (k, 1)
        self.uniforms[slots, :end] = token_uniforms(keys, positions)
        if self.space is None:
            return
        self.fed[slots, :end] = counter_prior(self.space, keys, positions)  # (k, end, ...)
        for slot, row in zip(range(slots.start, slots.stop), rows):
            if isinstance(row.latents, Tensor):
                given = min(row.latents.shape[1], end)
                self.fed[slot, :given] = row.latents[0, :given]

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[Row]:
        """Feed every row in flight its last token and sample its next one. Returns the rows that got one.
        Deferred: the rows whose tokens of the step before arrived (this step's arrive at the next call).
        A row is fed until the host reads that it ended: its tokens from steps after the one whose `ended`
        recorded it are dropped (`_take`)."""
        rows = self.rows  # `_release` makes a new list: this one stays what the step fed
        with torch.inference_mode():
            launched = None
            if rows and self.steps < self.last_step:
                launched = self._launch(rows)
            arrived, self.pending = (self.pending, launched) if self.deferred else (launched, None)
            if arrived is None:
                return []
            taken, ended = self._take(*arrived)
            if ended:
                self._release()
        return taken

    def _launch(self, rows: list[Row]) -> tuple[list[Row], Tensor, torch.cuda.Event | None, Tensor]:
        """Launch one step of `rows` and the copy of its tokens and `ended` to a host buffer (without waiting
        for it when deferred)."""
        n = size = len(rows)
        if self.compile:
            size = self.buckets[bisect.bisect_left(self.buckets, n)]
            tokens, ended, non_finite, logits = self._replay(size, self.variant)
            if self.deferred and self.keeps_logits:  # a replay overwrites its outputs: keep this step's
                logits = logits.clone()
        elif self.aligned:  # rows all at one position (equal prompts, one row) feed it as an int: the model writes
            # and attends the cache as a prefill continued, no mask, no scatter
            tokens, ended, non_finite, logits = self._body(n, self._view(n), self.variant, _step_core, self.longest)
        else:  # each row at its own position, the cache attended up to the longest row's
            cache = self.cache.view(slice(0, n), min(self.longest + 1, self.capacity))
            tokens, ended, non_finite, logits = self._body(n, cache, self.variant, _step_core)
        self.longest = min(self.longest + 1, self.capacity - 1)  # every row fed one position
        self.steps += 1
        if size > n:  # a compiled step's bucket: its rows past n are padding
            tokens, ended, non_finite = tokens[:n], ended[:n], non_finite[:n]
        host = _outcomes(tokens, ended, non_finite)
        if self.device.type != "cpu" or self.deferred:  # one copy a step, into the host buffer not being read
            host = self.host[self.steps % 2][: 3 * n].view(3, n).copy_(host, non_blocking=self.deferred)
        event = None
        if self.deferred and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return rows, host, event, logits

    def _body(
        self, size: int, cache, variant: SamplingVariant, core: Callable, start: int | None = None
    ) -> tuple[Tensor, ...]:
        """The step of slots [0, size) over `cache`, a view of their rows: everything a captured graph replays.
        start: the one position of every row, when the host knows they share it (the model then writes and
        attends the cache as a prefill continued; None: each row at its own, a (size,) tensor). Returns the next
        tokens (size,), whether each row ended (size,), whether its logits were not finite (size,) and the
        logits (size, V)."""
        slots = self._slots(size)
        # each row's draws at its position (`_draw`): its Z (explicit where given, else its prior stream's), (size,
        # 1, ...), and its token's uniform, (size,); at one position `start`, a column of each buffer (a view: no
        # gather)
        latent: LatentSource = LatentChoice.PRIOR
        uniforms = None
        if start is None:
            if self.is_free:
                latent = self.fed[slots.index, slots.position][:, None]
            if variant.sampled:
                uniforms = self.uniforms[slots.index, slots.position]
        else:
            if self.is_free:
                latent = self.fed[slots.rows, start : start + 1]
            if variant.sampled:
                uniforms = self.uniforms[slots.rows, start]
        tokens, non_finite, logits = core(
            self.model,
            slots.token,
            latent,
            slots.position if start is None else start,
            cache,
            slots.settings,
            uniforms,
            variant,
        )
        # a captured graph compares whatever the rows: it serves later rows too
        stops = slots.stops if self.stopping or self.use_graph else None
        ended = _step_ends(tokens, non_finite, slots.position, slots.last, stops)
        slots.next_token[:] = tokens
        if self.deferred:  # a row that ended stays at its position: fed again until the host reads that it
            # ended, its cache and draws stay within its own positions (read at once, it leaves before)
            slots.active.masked_fill_(ended, 0)
        slots.position.add_(slots.active)
        return tokens, ended, non_finite, logits

    def _slots(self, size: int) -> SlotViews:
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

    def _view(self, size: int):
        """The cache view of slots [0, size), every position: one per size, so that a graph reads fixed storages
        and an aligned step makes none."""
        if size not in self.views:
            self.views[size] = self.cache.view(slice(0, size), self.capacity)
        return self.views[size]

    def _replay(self, size: int, variant: SamplingVariant) -> tuple[Tensor, ...]:
        """The compiled step of bucket `size`: its first run compiles (timed, logged) on a side stream, as a later
        capture requires; on CUDA the second captures it and every run replays it."""
        key = (size, variant)
        core = self.cores.get(variant)
        if core is None:
            options = dict(INDUCTOR_OPTIONS) if COMPILE_BACKEND == "inductor" else None
            core = self.cores[variant] = (
                torch.compile(_fresh_function(_step_core), backend=COMPILE_BACKEND, fullgraph=True, options=options)
                if self.inductor
                else _step_core
            )

        def body():
            return self._body(size, self._view(size), variant, core)

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
                    "compiled the decoding step (batch %d, %d positions, %s) in %.1f s",
                    size,
                    self.capacity,
                    variant,
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

    def warm_up(
        self, variants: Sequence[SamplingVariant] = (SamplingVariant(sampled=True, filtered=False, mixed=True),)
    ) -> None:
        """Compile and capture the step of every bucket for these variants now (a server, before its first
        request), on empty slots: nothing in flight changes."""
        if self.rows:
            raise RuntimeError("warm_up needs an engine with no row in flight")
        with torch.inference_mode():
            for variant in variants:
                for size in self.buckets:
                    for _ in range(2):  # the compiling run, then the capture
                        self._replay(size, variant)

    # ---- tokens, and rows leave ------------------------------------------------------------------

    def _take(
        self, rows: list[Row], host: Tensor, event: torch.cuda.Event | None, logits: Tensor
    ) -> tuple[list[Row], bool]:
        """Give each row its new token and end from `host` (3, rows: tokens, `ended`, non-finite), the step's
        copy, once it arrived (`event`). A row already done (it ended at an earlier step, or the caller ended it) gets
        nothing: what a deferred step fed it after its end is dropped. Returns the rows given something, and whether a
        row ended (at this step or before)."""
        if event is not None:
            event.synchronize()  # the one wait of a deferred step, on a step launched before the current one
        tokens, ended, errors = host.tolist()  # (3, rows) in host memory: no device read
        taken = []
        for i, (row, token, end, error) in enumerate(zip(rows, tokens, ended, errors)):
            if row.done:
                continue
            taken.append(row)
            if error:
                row.finish_reason, row.error = "error", ValueError(NON_FINITE)
                continue
            row.tokens.append(token)
            if row.keep_logits:
                row.logits = logits[i]
            if end:  # found on the device; named here, once a row
                row.finish_reason = "stop" if token in row.config.stop_tokens else "length"
        return taken, any(ended)

    def finish(self, row: Row, reason: str = "stop") -> None:
        """End a row in flight (a stop string, a client gone): it leaves its slot now."""
        if row.done or row.slot is None:
            return
        row.finish_reason = reason
        with torch.inference_mode():
            self._release()

    def _release(self) -> None:
        """Rows that are done leave: each hole is filled by the last row in flight (its cache, token, position,
        Z and settings moved), so that the rows in flight keep slots [0, n)."""
        rows = self.rows  # row i in slot i
        if not any(row.done for row in rows):
            return
        for slot, row in enumerate(rows):
            if row.done:
                row.fed = self.fed[slot, : row.position].clone() if self.is_free else None
                row.slot = None
                self._clear(slot, self._written(row))
        n = sum(not row.done for row in rows)  # the rows that stay, in slots [0, n) once moved
        holes = (slot for slot in range(n) if rows[slot].done)  # ascending
        kept = rows[:n]
        for source in range(len(rows) - 1, n - 1, -1):  # the rows of slots [n, len(rows)), the last first
            if not rows[source].done:
                slot = next(holes)
                self._move(rows[source], source, slot)
                self._clear(source, self._written(rows[source]))
                kept[slot] = rows[source]
        self.rows = kept
        self._in_flight()
        freed = slice(n, self.slots)
        self.active[freed] = 0
        self.position[freed] = 0

    def _in_flight(self) -> None:
        """What the rows in flight set for their steps, once they have joined or left."""
        self.variant = SamplingVariant.of([row.config for row in self.rows])
        if self.compile and self.variant.sampled:  # one graph for sampled batches with and without greedy rows
            # (the one `warm_up` captures): a server compiles nothing when a greedy request joins sampled ones
            self.variant = dataclasses.replace(self.variant, mixed=True)
        pending = {id(row) for row in self.pending[0]} if self.pending is not None else set()
        # the next position each row feeds: one past what it has read when the step in flight fed it too, and
        # a row at its last position stays there (`_body`)
        fed = [row.position + (id(row) in pending) for row in self.rows]
        positions = [min(position, _end(row) - 1) for row, position in zip(self.rows, fed)]
        self.longest = max(positions, default=0)
        self.aligned = min(positions, default=0) == self.longest
        self.keeps_logits = any(row.keep_logits for row in self.rows)
        self.stopping = any(row.config.stop_tokens for row in self.rows)
        # the step at which the last row reaches its length: no step runs past it
        self.last_step = self.steps + max((_end(row) - position for row, position in zip(self.rows, fed)), default=0)

    def _written(self, row: Row) -> int:
        """The positions of a row in flight that the cache may hold, the step in flight's included."""
        return min(row.position + 2, self.capacity)

    def _clear(self, slot: int, length: int) -> None:
        """Zero the keys and values a row left in `slot`, positions [0, length): a later row there attends the
        positions past its own under a mask, and a masked NaN or inf (a failed row's) would still reach it
        (0 x NaN is NaN). Once per row, the cost of writing its cache once."""
        self.cache.keys[:, slot, :, :length] = 0
        self.cache.values[:, slot, :, :length] = 0

    def _move(self, row: Row, source: int, slot: int) -> None:
        length = self._written(row)
        self.cache.keys[:, slot, :, :length] = self.cache.keys[:, source, :, :length]
        self.cache.values[:, slot, :, :length] = self.cache.values[:, source, :, :length]
        for buffer in (self.token, self.position, self.active, self.key, self.last):
            buffer[slot] = buffer[source]
        end = _end(row)  # the draws of every position it feeds
        self.stops[slot] = self.stops[source]
        self.fed[slot, :end] = self.fed[source, :end]
        self.uniforms[slot, :end] = self.uniforms[source, :end]
        self.settings.move(source, slot)
        row.slot = slot


@dataclass(frozen=True)
class SlotViews:
    """Views of slots [0, size) of a DecodeEngine's step buffers (`DecodeEngine._slots`)."""

    rows: slice
    token: Tensor  # (size, 1)
    next_token: Tensor  # (size,) its column: where the step writes the next token
    position: Tensor  # (size,)
    active: Tensor  # (size,)
    index: Tensor  # (size,)
    last: Tensor  # (size,)
    stops: Tensor  # (size, stop ids)
    settings: tuple[Tensor, ...]  # RowSettings.view


def _step_ends(tokens: Tensor, non_finite: Tensor, position: Tensor, last: Tensor, stops: Tensor | None) -> Tensor:
    """(n,) whether each row ends with its new token (n,) from `position`'s logits (n,): its logits not finite
    (`non_finite`), the token among its stop ids (`stops`, (n, width) padded with -1; None when no row has any),
    or `position` its last position fed (`last`, its length)."""
    ended = (position >= last) | non_finite  # (n,)
    if stops is not None:
        ended |= (tokens[:, None] == stops).any(1)
    return ended


def _outcomes(tokens: Tensor, ended: Tensor, non_finite: Tensor) -> Tensor:
    """(3, n) int64: each row's new token, whether it ended and whether its logits were not finite, what `_take`
    reads (the flags cast first: stack's own type promotion costs more than the two casts)."""
    return torch.stack([tokens, ended.long(), non_finite.long()])


def _end(row: Row) -> int:
    """The positions a row feeds, [0, end): its prompt and every new token but the last."""
    assert row.config.max_new_tokens is not None, "add refuses a row without max_new_tokens (check)"
    return len(row.ids) + row.config.max_new_tokens - 1


def _seed(row: Row) -> int:
    """A row's seed, which `add` sets when the caller left it None."""
    assert row.seed is not None, "add draws a seed for every row without one"
    return row.seed


def _step_core(
    model: FreeTransformer,
    token: Tensor,
    latent: LatentSource,
    position: int | Tensor,
    cache,
    settings,
    uniforms,
    variant: SamplingVariant,
) -> tuple[Tensor, Tensor, Tensor]:
    """One step after its random draws: the model on token (B, 1) with latent (B, 1, ...) at each row's
    position (B,) (or at the rows' one position, an int), then each row's next token (B,), its non-finite flag
    (B,) and the logits (B, V). The function Inductor compiles."""
    logits = model(token, latents=latent, cache=cache, start=position).logits[:, -1]  # (B, V)
    tokens, non_finite = next_tokens(logits, settings, uniforms, variant)
    return tokens, non_finite, logits


def _fresh_function(function: Callable) -> Callable:
    """A copy of `function` with a code object of its own. Dynamo keeps compiled graphs per code object, at
    most recompile_limit of them: each engine's variant compiling its own copy keeps its buckets apart from
    every other engine's (other models and shapes), so that none evicts or counts against another."""
    code = function.__code__.replace()
    return types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )


# the compiled engines kept per model (`decoding_engine`), most recently used last: model -> OrderedDict(key ->
# engine). Weak in the model: a model's engines go with it.
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoding_engine(
    model: FreeTransformer, slots: int, positions: int, *, compile: bool = False, inductor: bool | None = None
) -> DecodeEngine:
    """An engine of `slots` rows whose cache holds at least `positions` positions. Eager: a new one, its cache
    exactly that long. Compiled: the model's kept engine for these slots and the positions rounded up to
    CACHE_ROUNDING (made on first use, so that its compiled step and graphs serve every later call); the least
    recently used beyond ENGINES_PER_MODEL is dropped. Kept engines are keyed by the parameters' storage too,
    so a model moved to another device or dtype gets a new one (weights updated in place are seen by a graph),
    and by the declared sampling filters, so a filter registered later is applied.

    A kept engine (its KV cache, compiled step and, on a GPU, its graphs' memory pool) lives until it is the
    least recently used past ENGINES_PER_MODEL, its model is deleted (an engine refers to its model weakly, so
    it never keeps the model alive), or `release_engines(model)`; then its memory is freed as soon as no call
    still decodes with it (on a GPU, `torch.cuda.empty_cache()` gives it back to the driver)."""
    if not compile:
        return DecodeEngine(model, slots, capacity=positions)
    capacity = min(model.config.max_seq_len, -(-positions // CACHE_ROUNDING) * CACHE_ROUNDING)
    if inductor is None:
        inductor = model.rope_cos.device.type in INDUCTOR_DEVICES
    key = (slots, capacity, inductor, tuple(p.data_ptr() for p in model.parameters()), declared_filters())
    engines = _engines.setdefault(model, OrderedDict())
    if key not in engines:
        engines[key] = DecodeEngine(model, slots, capacity=capacity, compile=True, inductor=inductor)
        while len(engines) > ENGINES_PER_MODEL:
            engines.popitem(last=False)
    engines.move_to_end(key)
    engine = engines[key]
    if engine.rows:
        raise RuntimeError("the kept decoding engine is in use (one generate(compile=True) call at a time per model)")
    return engine


def release_engines(model: FreeTransformer) -> None:
    """Drop the compiled engines kept for `model` (`decoding_engine`), so that their KV caches, compiled steps
    and graphs' memory can be freed; the next compiled call makes (and compiles) a new one."""
    _engines.pop(model, None)


def run_rows(
    engine: DecodeEngine, rows: Iterable[Row], should_stop: Callable[[list[int]], bool] | None = None
) -> Iterator[Row]:
    """Decode `rows`, admitted in their order as slots free (one request of the admission rule with a share of
    every slot: free_transformer.inference.admission), and yield each one as it ends. should_stop: called with a
    row's new tokens after each one; True ends the row there (stop strings, which ids cannot express)."""
    queue: Admission[Row] = Admission()
    request = queue.add(Request(rows))
    try:
        while True:
            joining = [row for _, row in queue.take(engine.free)]
            if not joining and not engine.rows:
                return
            if joining:  # the new rows' first tokens are checked before they step
                yield from _ended(engine, engine.add(joining), should_stop, request)
            if engine.rows:
                yield from _ended(engine, engine.step(), should_stop, request)
    finally:
        for row in list(engine.rows):  # the caller stopped early (an error, a closed generator)
            engine.finish(row, "cancelled")


def _ended(engine: DecodeEngine, rows: list[Row], should_stop, request: Request[Row]) -> Iterator[Row]:
    for row in rows:
        if not row.done and should_stop is not None and should_stop(row.tokens):
            engine.finish(row, "stop")
        if row.done:
            request.left()
            yield row
