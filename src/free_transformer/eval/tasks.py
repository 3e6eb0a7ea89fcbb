"""Benchmarks as prompts: the document types every benchmark turns its rows into, few-shot prompt
assembly, and the registry of benchmarks (filled by catalog.py, which defines them).

A multiple-choice document is scored by the log-probability of each choice's continuation; a
generation document by what the model writes after its prompt (exact match or, for code, running
tests in the sandbox)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Kind = Literal["mc", "em", "code"]


@dataclass
class MultipleChoiceDoc:
    doc_id: str
    contexts: list[str]  # one per choice; the same string except for partial scoring (WinoGrande)
    continuations: list[str]  # each choice's text, with its leading separator (" Paris")
    gold: int
    group: str | None = None  # sub-category (MMLU subject) for macro averages


@dataclass
class GenerationDoc:
    doc_id: str
    prompt: str
    answers: list[str] = field(default_factory=list)  # references for exact match
    test: dict | None = None  # code tasks: what the checker needs (see code.py)
    group: str | None = None


Doc = MultipleChoiceDoc | GenerationDoc


class BadAnswer(ValueError):
    """A row whose answer names no choice of its own (1.5, 7 of 2 choices, -1, 1e999)."""


def whole_number(value) -> int:
    """An answer given as a number: an int, a string of digits, or a float that is a whole number."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit() and len(value) < 100:
        return int(value)
    if type(value) is int or (type(value) is float and value.is_integer()):
        return int(value)
    raise BadAnswer(f"its answer {value!r} is not a whole number")


class Benchmark:
    """One benchmark of the paper: where its rows come from and how a row becomes a prompt.

    Subclasses set the class attributes and implement `rows`, `query`, `shot` and either
    `choices`/`gold` (multiple choice) or `answers`/`test` (generation)."""

    name: str  # CLI name
    paper_name: str  # row label in the paper's tables
    category: str  # section of the paper's tables
    kind: Kind
    metric: str  # the paper's measure: acc_char, acc_completion, macro_avg/acc_char, em, pass@1
    default_shots: int = 0
    fixed_shots: bool = False  # few-shot examples are a fixed, ordered list (take the first n)
    max_new_tokens: int = 0  # generation budget (tokens of the model's tokenizer)
    stop: tuple[str, ...] = ()  # generation stops at the first of these strings
    source: str = ""  # human-readable origin of the data and split
    needs_file: str | None = None  # not shipped by any package: why, and the expected format
    stands_in_for: str | None = None  # the paper's row it replaces where that row's data are missing (listed after it)

    # ---- data ---------------------------------------------------------------------------------------
    def rows(self, data_file: Path | None) -> tuple[list[dict], list[dict] | None]:
        """(documents to evaluate, few-shot pool); pool None means "the other documents"."""
        raise NotImplementedError

    def group(self, row: dict) -> str | None:
        return None

    def header(self, row: dict) -> str:
        return ""

    def query(self, row: dict) -> str:
        raise NotImplementedError

    def shot(self, row: dict) -> str:
        """A few-shot example: the query and its answer (for multiple choice, the gold choice)."""
        if self.kind == "mc":
            return self.query(row) + self.choices(row)[self.gold_index(row)]
        raise NotImplementedError

    # ---- multiple choice --------------------------------------------------------------------------
    def choices(self, row: dict) -> list[str]:
        raise NotImplementedError

    def gold(self, row: dict) -> int:
        raise NotImplementedError

    def gold_index(self, row: dict) -> int:
        """gold(row), checked to be the index of one of the row's choices (BadAnswer otherwise)."""
        gold, count = self.gold(row), len(self.choices(row))
        if not 0 <= gold < count:
            raise BadAnswer(f"its answer is choice {gold} (counted from 0), and it has {count} choices")
        return gold

    def contexts(self, row: dict, prefix: str) -> list[str]:
        return [prefix + self.query(row)] * len(self.choices(row))

    # ---- generation ---------------------------------------------------------------------------------
    def answers(self, row: dict) -> list[str]:
        return []

    def test(self, row: dict) -> dict | None:
        return None

    def is_correct(self, generation: str, doc: GenerationDoc) -> bool:
        """Exact match of a generation with a reference (em tasks; code tasks run tests instead)."""
        from .task_metrics import exact_match

        return exact_match(generation, doc.answers)

    def answer(self, generation: str) -> str | None:
        """The answer a generation gives, as maj@k's vote counts it: two generations vote together when their
        answers are equal (em tasks: the normalised text; None, no vote, when it is empty)."""
        from .task_metrics import normalize_answer

        return normalize_answer(generation) or None

    # ---- assembly -----------------------------------------------------------------------------------
    def doc_id(self, row: dict, index: int) -> str:
        return str(index)

    def build(self, row: dict, doc_id: str, shots: Sequence[dict]) -> Doc:
        prefix = self.header(row) + "".join(self.shot(s) + "\n\n" for s in shots)
        group = self.group(row)
        if self.kind == "mc":
            return MultipleChoiceDoc(doc_id, self.contexts(row, prefix), self.choices(row), self.gold_index(row), group)
        return GenerationDoc(doc_id, prefix + self.query(row), self.answers(row), self.test(row), group)


REGISTRY: dict[str, Benchmark] = {}


def register(cls: type[Benchmark]) -> type[Benchmark]:
    """Add the benchmark `cls` under its name; a one-line ValueError when another class has that name (a plugin's
    benchmark named like a built-in silently replaced it)."""
    known = REGISTRY.get(cls.name)
    if known is not None and (type(known).__module__, type(known).__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"a benchmark named {cls.name!r} is registered already ({type(known).__module__}."
            f"{type(known).__qualname__}): give {cls.__module__}.{cls.__qualname__} another name"
        )
    REGISTRY[cls.name] = cls()
    return cls


def choose_shots(
    pool: Sequence[dict], candidates: Sequence[int], n: int, *, fixed: bool, exclude: int | None, seed
) -> list[dict]:
    """n few-shot rows of `pool` among the indices `candidates`: the first n of a fixed list, or a
    seeded sample that never contains the evaluated row itself (`exclude`, its index in the pool
    when the pool is the evaluated split)."""
    if n <= 0:
        return []
    if fixed:
        if n > len(candidates):
            raise ValueError(f"only {len(candidates)} fixed few-shot examples exist, asked for {n}")
        return [pool[i] for i in candidates if i != exclude][:n]
    available = len(candidates) - (exclude in candidates if exclude is not None else 0)
    if n > available:
        raise ValueError(f"only {available} few-shot candidates exist, asked for {n}")
    drawn = random.Random(seed).sample(candidates, min(n + 1, len(candidates)))
    return [pool[i] for i in drawn if i != exclude][:n]
