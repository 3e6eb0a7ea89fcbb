"""Argument parsers shared by several commands (not a command itself)."""

from __future__ import annotations


def parse_seeds(text: str | None, default: int) -> tuple[int, ...]:
    if text is None:
        return tuple(range(default))
    try:
        seeds = tuple(range(int(text))) if "," not in text else tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--seeds takes a count or a comma-separated list of integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must name at least one seed, each once, got {text!r}")
    return seeds
