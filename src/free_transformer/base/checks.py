"""The checks every config section shares: one error type and one range check."""

from __future__ import annotations

import math

from .errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration that cannot describe a valid model or run."""


def check_range(
    name: str, value, low: float = 0, high: float = math.inf, *, low_open: bool = False, high_closed: bool = False
) -> None:
    """A one-line ConfigError unless `value` is a number with low <= value < high (low < value when low_open,
    value <= high when high_closed). Every comparison with NaN is false, so NaN is refused too."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (
        number and (low < value if low_open else low <= value) and (value <= high if high_closed else value < high)
    ):
        bound = (
            f"a finite number {'>' if low_open else '>='} {low}"
            if high == math.inf
            else f"in {'(' if low_open else '['}{low}, {high}{']' if high_closed else ')'}"
        )
        raise ConfigError(f"{name} must be {bound}, got {value!r}")
