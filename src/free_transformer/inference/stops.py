"""Stop strings, one rule for every sampler (`free-transformer generate --stop`, benchmark scoring, the
server's `stop`): a stop string is matched in the decoded text, not by token id, since it may span tokens
or sit inside one, and the text ends where it first appears, the stop string excluded. An empty stop
string stops nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def stop_check(decode: Callable[[list[int]], str], stops: Sequence[str]) -> Callable[[list[int]], bool] | None:
    """`generate`'s should_stop for `stops`: True once a row's new tokens, decoded, hold one of them.
    None without a stop string (generate then need not read every token back)."""
    stops = [stop for stop in stops if stop]
    if not stops:
        return None
    return lambda new: any(stop in decode(new) for stop in stops)


def stop_at(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the first stop string found from `start` on begins in `text`; None if there is none."""
    return min((found for found in (text.find(stop, start) for stop in stops if stop) if found >= 0), default=None)


def cut_at_stop(text: str, stops: Sequence[str], start: int = 0) -> str:
    """`text` up to the first stop string found from `start` on (the characters before `start`, a
    prompt's, are not searched)."""
    end = stop_at(text, stops, start)
    return text if end is None else text[:end]
