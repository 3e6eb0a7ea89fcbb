"""The time left that the trainer's and the sweeps' bars show: from the rate of the last minute of progress,
counted from the first progress seen, on a fake clock."""

import io

import pytest

from free_transformer.base.progress import Bar, RecentRate


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_start_up_and_a_slow_first_step_do_not_count():
    """A 12-minute job that spends 5 minutes starting (spawn, import, compile) before its first step: tqdm's
    average since the bar's creation says 1:05:49 left at step 60; the last minute's rate says 11:00."""
    clock = Clock()
    bar = Bar(total=720, bar_format="{remaining}", file=io.StringIO(), clock=clock, mininterval=0)
    clock.now = 300.0
    assert str(bar) == "?"  # nothing done yet: no rate
    bar.update(1)  # the first step ends the warm-up
    assert str(bar) == "?"
    for _ in range(59):
        clock.now += 1.0
        bar.update(1)
    assert bar.n == 60 and str(bar) == "11:00"  # 660 steps left at 1 s each
    bar.close()


def test_a_bar_whose_count_is_set_as_a_sweep_sets_it():
    """A sweep sets the work done from its runs' metrics, in lumps, with start-up and reused work before."""
    clock = Clock()
    bar = Bar(total=1000.0, initial=400.0, bar_format="{remaining}", file=io.StringIO(), clock=clock)
    for now, done in ((90, 400), (120, 420), (130, 440), (140, 460)):  # reused 400; first lump at 120 s
        clock.now, bar.n = now, done
        bar.refresh()
    assert bar.recent.rate() == pytest.approx(2.0)  # 40 units in the 20 s since the first lump
    assert str(bar) == "04:30"  # 540 left at 2 a second
    bar.close()


def test_the_rate_follows_the_last_window_and_a_stall_lowers_it():
    clock = Clock()
    rate = RecentRate(window_s=60.0, clock=clock)
    rate.observe(0)
    assert rate.rate() is None
    for second in range(1, 121):  # 1 unit a second for two minutes
        clock.now = second
        rate.observe(second)
    assert rate.rate() == pytest.approx(1.0)
    for second in range(121, 241):  # then 3 a second: after a window, only the new rate counts
        clock.now = second
        rate.observe(120 + 3 * (second - 120))
    assert rate.rate() == pytest.approx(3.0)
    assert len(rate.points) <= 62  # what is older than the window is dropped
    clock.now = 300  # nothing for a minute: the rate falls instead of holding its last value
    rate.observe(480)
    assert rate.rate() == pytest.approx(180 / 120)


def test_a_disabled_bar_is_silent():
    bar = Bar(total=10, disable=True, file=io.StringIO())
    bar.update(3)
    bar.close()
