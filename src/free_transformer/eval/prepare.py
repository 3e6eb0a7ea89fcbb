"""A benchmark's documents as prompts: its rows, the first `limit` of them, each with its few-shot examples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..base.seeding import benchmark_seed
from .catalog import get_benchmark
from .task_data import DataUnavailable
from .tasks import BadAnswer, Benchmark, Doc, choose_shots


@dataclass
class PreparedTask:
    benchmark: Benchmark
    docs: list[Doc]
    num_fewshot: int
    source: str


def prepare(
    name: str,
    *,
    num_fewshot: int | None = None,
    limit: int | None = None,
    data_file: str | Path | None = None,
    seed: int = 1234,
) -> PreparedTask:
    """Load a benchmark's rows and turn the first `limit` of them into prompts (for a benchmark with
    sub-categories, `limit` applies to each). Raises DataUnavailable when the data is absent."""
    bench = get_benchmark(name)
    if bench.needs_file and data_file is None:
        raise DataUnavailable(bench.needs_file)
    rows, pool = bench.rows(Path(data_file) if data_file else None)
    shots = bench.default_shots if num_fewshot is None else num_fewshot
    if shots < 0:
        raise ValueError(f"{name}: the few-shot count must be >= 0, got {shots}")
    source = f"user file {data_file}" if data_file else bench.source
    try:  # a user's file may lack the task's fields: one line, not a KeyError
        if data_file and bench.kind == "mc":  # every answer names one of its row's choices
            for index, row in enumerate(rows):
                try:
                    bench.gold_index(row)
                except BadAnswer as error:
                    raise ValueError(f"{name}: row {index} of {source}: {error}") from None
        selected = _limit(bench, list(enumerate(rows)), limit)
        base = rows if pool is None else pool
        by_group: dict = {}  # few-shot examples come from the row's own sub-category (MMLU subject)
        for i, r in enumerate(base):
            by_group.setdefault(bench.group(r), []).append(i)
        docs = []
        for index, row in selected:
            chosen = choose_shots(
                base,
                by_group.get(bench.group(row), []),
                shots,
                fixed=bench.fixed_shots,
                exclude=index if pool is None else None,
                seed=benchmark_seed(name, seed, index),
            )
            docs.append(bench.build(row, bench.doc_id(row, index), chosen))
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{name}: the rows of {source} lack the fields this task reads ({type(error).__name__}: {error})"
        ) from None
    return PreparedTask(bench, docs, shots, source)


def _limit(bench: Benchmark, indexed: list[tuple[int, dict]], limit: int | None) -> list[tuple[int, dict]]:
    if limit is None:
        return indexed
    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    counts: dict = {}
    kept = []
    for index, row in indexed:
        g = bench.group(row)
        if counts.get(g, 0) < limit:
            counts[g] = counts.get(g, 0) + 1
            kept.append((index, row))
    return kept
