"""Progress bars whose rate and time left come from the last minute of progress, once work has started.

tqdm's own estimate, for a bar whose count is set rather than stepped (a sweep reads its runs' metrics), is the
average since the bar was created: start-up (processes spawned, torch imported, data built) and the first slow
steps (compilation, warm-up) count as work time, and a 12-minute demo read 65 hours left before any run had
logged a step. Here the clock starts at the first progress seen, and the rate is measured over the last
`window_s` seconds of progress: a bar says "?" until it has two points of progress to measure between."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tqdm.auto import tqdm

WINDOW_S = 60.0  # long enough to smooth a sweep whose runs log every few seconds; short enough to follow a change


class RecentRate:
    """Units of work per second over the last `window_s` seconds, measured from the first progress observed (the
    warm-up: what came before, start-up and the first steps' extra cost included, is not part of any rate)."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.first: float | None = None  # the work done when first observed (reused work, a resumed run's steps)
        self.points: deque[tuple[float, float]] = deque()  # (time, work done) at each change, from the warm-up's end
        self.seen = 0.0  # the time of the last observation

    def observe(self, done: float) -> None:
        self.seen = now = self.clock()
        last = self.points[-1][1] if self.points else self.first
        if last is None:
            self.first = done
        elif done != last:
            self.points.append((now, done))
            # the oldest point kept is the newest one at least a window old: the rate spans the whole window
            while len(self.points) > 2 and self.points[1][0] <= now - self.window_s:
                self.points.popleft()

    def rate(self) -> float | None:
        """Work per second since the oldest point of the window, up to the last observation (so a stall lowers
        it); None until there are two points of progress (the first ends the warm-up)."""
        if len(self.points) < 2:
            return None
        since, done_then = self.points[0]
        return (self.points[-1][1] - done_then) / (self.seen - since) if self.seen > since else None


class Bar(tqdm):
    """A tqdm bar (the same arguments) whose rate and time left are RecentRate's: "?" until measured. The count may
    be stepped (`update`) or set (`bar.n = ...; bar.refresh()`). clock: for tests."""

    def __init__(self, *args, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S, **kwargs):
        self.recent = RecentRate(window_s, clock)  # before tqdm's __init__, which draws the bar
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        values = super().format_dict
        self.recent.observe(values["n"])
        values["rate"] = self.recent.rate() or 0.0  # 0, not None: tqdm then shows "?", not its own average
        return values
