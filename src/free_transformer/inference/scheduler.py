"""Scheduling the decoding engine's rows: which waiting rows take its free slots (`Scheduler`, by the admission
rule of free_transformer.inference.admission: the same object for `generate`'s rows and the server's requests),
and what the rows in flight ask of their next step (`StepSchedule`: which sampling variant runs, whether every row
is at one position, how far the cache is attended, which rows draw their Z from the policy head, and the step after
which no row is left to feed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .admission import Admission, Request
from .params import GenerationConfig
from .row_draws import PolicyRows
from .sampling import SamplingVariant

T = TypeVar("T")  # a row, as its caller describes it


class Scheduler(Generic[T]):
    """The requests waiting for an engine's slots, admitted by the one rule (`add` a request as it arrives, `take`
    the rows that join at the next step, at most the free slots, `drop` a request that ended before all its rows
    joined); `StepSchedule.of` says which step its rows in flight take. Each engine has one
    (`DecodeEngine.scheduler`), which `run_rows` and the server's loop submit to."""

    def __init__(self, share: int | None = None):
        self.admission: Admission[T] = Admission(share)

    @property
    def waiting(self) -> list[Request[T]]:
        """The requests with rows not yet admitted, in arrival order."""
        return self.admission.waiting

    def add(self, request: Request[T], *, now: int = 0) -> Request[T]:
        return self.admission.add(request, now=now)

    def drop(self, request: Request[T]) -> None:
        self.admission.drop(request)

    def take(self, free: int) -> list[tuple[Request[T], T]]:
        return self.admission.take(free)


@dataclass
class StepSchedule:
    """What the rows in flight ask of their next step, set as rows join and leave (`of`)."""

    variant: SamplingVariant  # what their step samples
    longest: int  # the furthest position a row feeds next (an eager step attends the cache up to it)
    aligned: bool  # every row feeds that position (the step then continues the cache as a prefill)
    keeps_logits: bool  # a row keeps its logits
    stopping: bool  # a row has stop ids (an eager step compares them only then)
    last_step: int  # the step by which every row in flight has reached its length (no later one runs)
    policy: PolicyRows = PolicyRows.NONE  # which rows draw their Z from the policy head, in the step

    @classmethod
    def idle(cls) -> StepSchedule:
        return cls(SamplingVariant(sampled=False, filtered=False), 0, True, False, False, 0)

    @classmethod
    def of(
        cls,
        configs: Sequence[GenerationConfig],
        positions: Sequence[int],
        ends: Sequence[int],
        *,
        steps: int,
        compiled: bool,
        keeps_logits: bool,
        policy: Sequence[bool] = (),
    ) -> StepSchedule:
        """The schedule of rows with these settings, next positions to feed and ends (the positions they feed,
        [0, end)), `steps` steps taken so far. A compiled engine keeps one graph for sampled batches with and
        without greedy rows (the one `warm_up` captures): a server compiles nothing when a greedy request joins
        sampled ones. policy: each row's Z from the policy head (none by default)."""
        variant = SamplingVariant.of(list(configs))
        if compiled and variant.sampled:
            variant = dataclasses.replace(variant, mixed=True)
        # a row at its last position stays there (the step's `active`)
        clamped = [min(position, end - 1) for position, end in zip(positions, ends)]
        longest = max(clamped, default=0)
        return cls(
            variant=variant,
            longest=longest,
            aligned=min(clamped, default=0) == longest,
            keeps_logits=keeps_logits,
            stopping=any(config.stop_tokens for config in configs),
            last_step=steps + max((end - position for position, end in zip(positions, ends)), default=0),
            policy=PolicyRows.of(policy, compiled=compiled),
        )
