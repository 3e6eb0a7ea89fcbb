"""Presets of one kind (model sizes, the demo's recipes, the study's): a named, read-only mapping from a
preset's name to its value, each with a one-line description. The commands read their choices and help
from it, and `free-transformer info --presets` lists every kind."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

from .checks import ConfigError

T = TypeVar("T")


class Presets(Mapping[str, T]):
    """`presets[name]` is a preset's value; an unknown name is one ConfigError that names the known ones.
    `kind` names a preset in messages and listings ("model size", "demo preset")."""

    def __init__(self, kind: str, entries: Mapping[str, tuple[T, str]]):
        for name, (_, about) in entries.items():
            if not about.strip() or "\n" in about:  # the listings give each preset one line
                raise ValueError(f"{kind} {name!r}: the description must be one non-empty line, got {about!r}")
        self.kind = kind
        self._values = {name: value for name, (value, _) in entries.items()}
        self._about = {name: about for name, (_, about) in entries.items()}

    def _known(self, name: str) -> str:
        if name not in self._values:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self._values)}")
        return name

    def __getitem__(self, name: str) -> T:
        return self._values[self._known(name)]

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def get(self, name: str, default=None):
        return self._values.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Presets({self.kind!r}: {', '.join(self._values)})"

    def about(self, name: str) -> str:
        """The preset's one-line description."""
        return self._about[self._known(name)]

    def help(self) -> str:
        """Every preset with its description on one line, for an option's --help: "a: ...; b: ..."."""
        return "; ".join(f"{name}: {about}" for name, about in self._about.items())
