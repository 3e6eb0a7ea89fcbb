"""The decoding engine's memory: `SlotCache`, the slots of one KV cache and the rows in flight in them.

Rows in flight always fill slots [0, n): a row that leaves is replaced in its slot by the last one (compaction,
`release`), its cache positions and its per-slot state moved, and the keys and values a row leaves are zeroed
(`clear`), so that nothing of it (a failed row's NaN) reaches the next row there. The per-slot state lives with
the parts that own it (the step runner's buffers, the rows' draws): each is a `SlotState` the cache moves with
its rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from ..model.layers import KVCache


class SlotState(Protocol):
    """Per-slot state that moves with a row (`SlotCache.release`)."""

    def move(self, source: int, slot: int, end: int) -> None:
        """Copy slot `source`'s state to `slot`; `end`: the positions the row feeds, [0, end)."""


class Slotted(Protocol):
    """What the cache knows of a row in flight."""

    slot: int | None

    @property
    def done(self) -> bool: ...


R = TypeVar("R", bound=Slotted)


class SlotCache(Generic[R]):
    """`slots` rows of one KV cache, the rows in flight (row i in slot i) and the per-slot states that move with
    them."""

    def __init__(self, cache: KVCache, states: Sequence[SlotState] = ()):
        self.cache = cache
        self.slots, self.capacity = cache.keys.shape[1], cache.capacity
        self.states = list(states)
        self.rows: list[R] = []  # in flight, row i in slot i
        self.views: dict[int, object] = {}  # size -> the cache view of slots [0, size), every position

    @property
    def free(self) -> int:
        return self.slots - len(self.rows)

    def join(self, rows: Sequence[R]) -> slice:
        """Give `rows` the next free slots (a new list: a step's list stays what it fed); returns them."""
        if len(rows) > self.free:
            raise ValueError(f"{len(rows)} rows do not fit: {self.free} of {self.slots} slots are free")
        start = len(self.rows)
        for j, row in enumerate(rows):
            row.slot = start + j
        self.rows = self.rows + list(rows)
        return slice(start, start + len(rows))

    def view(self, size: int):
        """The cache view of slots [0, size), every position: one per size, so that a graph reads fixed storages
        and an aligned step makes none."""
        if size not in self.views:
            self.views[size] = self.cache.view(slice(0, size), self.capacity)
        return self.views[size]

    def release(
        self, written: Callable[[R], int], end: Callable[[R], int], leaving: Callable[[R, int], None]
    ) -> int | None:
        """Rows that are done leave: `leaving(row, slot)` for each (what it keeps of its slot), its positions
        [0, written(row)) zeroed, and each hole is filled by the last row in flight (its cache up to written(row)
        and its states up to end(row) moved), so that the rows in flight keep slots [0, n). Returns n, or None
        when no row was done."""
        rows = self.rows
        if not any(row.done for row in rows):
            return None
        for slot, row in enumerate(rows):
            if row.done:
                leaving(row, slot)
                row.slot = None
                self.clear(slot, written(row))
        n = sum(not row.done for row in rows)  # the rows that stay, in slots [0, n) once moved
        holes = (slot for slot in range(n) if rows[slot].done)  # ascending
        kept = rows[:n]
        for source in range(len(rows) - 1, n - 1, -1):  # the rows of slots [n, len(rows)), the last first
            row = rows[source]
            if not row.done:
                slot = next(holes)
                self._move(source, slot, written(row))
                for state in self.states:
                    state.move(source, slot, end(row))
                row.slot = slot
                self.clear(source, written(row))
                kept[slot] = row
        self.rows = kept
        return n

    def clear(self, slot: int, length: int) -> None:
        """Zero the keys and values a row left in `slot`, positions [0, length): a later row there attends the
        positions past its own under a mask, and a masked NaN or inf (a failed row's) would still reach it
        (0 x NaN is NaN). Once per row, the cost of writing its cache once."""
        self.cache.keys[:, slot, :, :length] = 0
        self.cache.values[:, slot, :, :length] = 0

    def _move(self, source: int, slot: int, length: int) -> None:
        self.cache.keys[:, slot, :, :length] = self.cache.keys[:, source, :, :length]
        self.cache.values[:, slot, :, :length] = self.cache.values[:, source, :, :length]
