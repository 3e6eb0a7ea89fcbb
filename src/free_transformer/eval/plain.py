"""Plain values across the sandbox's boundary: what a call of generated code may take and give back.

A plain value is None, a bool, int, float, complex, str or bytes, or a list, tuple, set, frozenset or
dict of plain values (subclasses are sent as their base type: a namedtuple as a tuple, a Counter as a
dict). It travels as one line of JSON in which every value that JSON lacks is tagged
(`{"tuple": [...]}`), and `decode` builds it again from built-in types only, so what comes back
from the sandbox holds no code: its `==`, `hash` and `repr` are Python's own.

Rebuilding is bounded, so that no answer can stall the evaluator: at most MAX_VALUES values, and sets
and dicts filled one member at a time under a deadline (members whose hashes all collide, such as
multiples of 2**61 - 1, make each insertion cost as much as the set's size).

Standard library only: the sandbox's guard loads this file before the program runs.
"""

from __future__ import annotations

import json
import time

MAX_DEPTH = 100
"""Deepest nesting of containers accepted either way."""
MAX_VALUES = 1 << 22
"""Most values one line may hold (counted as its `[`, `,` and `:`, which precede every value but the first)."""

_TAGS = ("tuple", "set", "frozenset", "dict", "int", "bytes", "complex")
_SMALL_INT = 10**4000  # str(int) refuses more than 4300 digits: larger ones travel in hex


class NotPlain(ValueError):
    """A value that is not plain, or nested deeper than MAX_DEPTH, or with more than MAX_VALUES values."""


class Overdue(NotPlain):
    """Rebuilding the value ran past its deadline."""


def _encode(value, depth: int):
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        value = int.__index__(value)
        return value if -_SMALL_INT < value < _SMALL_INT else {"int": format(value, "x")}
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list):
        return [_encode(v, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, frozenset):
        return {"frozenset": [_encode(v, depth + 1) for v in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"set": [_encode(v, depth + 1) for v in set.__iter__(value)]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in dict.items(value)]}
    raise NotPlain(
        f"{type(value).__name__} is not a plain value (None, bool, int, float, complex, str, bytes, "
        "list, tuple, set, frozenset, dict)"
    )


def encode(value) -> str:
    """One line of JSON; NotPlain for anything else."""
    return json.dumps(_encode(value, 0))


def _filled(container, pairs, deadline: float | None):
    """`container` (an empty set or dict) with `pairs` added one at a time, the clock read every 64."""
    add = container.add if isinstance(container, set) else (lambda pair: container.__setitem__(*pair))
    for i, item in enumerate(pairs):
        if deadline is not None and not i & 63 and time.monotonic() > deadline:
            raise Overdue("rebuilding it ran past the time limit")
        add(item)
    return container


def _decode(node, depth: int, deadline: float | None):
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    kind = type(node)
    if node is None or kind in (bool, int, float, str):
        return node
    if kind is list:
        return [_decode(v, depth + 1, deadline) for v in node]
    if kind is not dict or len(node) != 1:
        raise NotPlain(f"not an encoded plain value: {kind.__name__}")
    ((tag, body),) = node.items()
    if tag == "int" and type(body) is str:
        return int(body, 16)
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2 and all(type(x) is float for x in body):
        return complex(body[0], body[1])
    if tag not in _TAGS or type(body) is not list:
        raise NotPlain(f"not an encoded plain value: tag {tag!r}")
    items = [_decode(v, depth + 1, deadline) for v in body]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return _filled(set(), items, deadline)
    if tag == "frozenset":
        return frozenset(_filled(set(), items, deadline))
    if not all(type(pair) is list and len(pair) == 2 for pair in items):
        raise NotPlain("not an encoded plain value: a dict entry that is not a pair")
    return _filled({}, items, deadline)


def decode(line: str | bytes, deadline: float | None = None):
    """The plain value `encode` wrote; NotPlain (or ValueError for text that is not JSON) otherwise, and
    Overdue once `deadline` (a time.monotonic() value) has passed while sets and dicts are rebuilt."""
    if isinstance(line, bytes):
        separators = sum(line.count(c.encode()) for c in "[,:")
    else:
        separators = sum(line.count(c) for c in "[,:")
    if separators > MAX_VALUES:
        raise NotPlain(f"more than {MAX_VALUES:,} values")
    try:
        return _decode(json.loads(line), 0, deadline)
    except RecursionError:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}") from None
    except TypeError as error:  # an unhashable member of a set or key of a dict
        raise NotPlain(f"not an encoded plain value: {error}") from None
