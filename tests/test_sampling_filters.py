"""The sampling filters as declared (free_transformer.inference.sampling.FILTERS): docs/sampling.md's table lists
exactly them, and a filter declared and registered as the page shows ("Adding a filter") is applied by the
decoding engine to the rows that set it, each row as it is decoded alone, eager and compiled."""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from free_transformer import GenerationConfig, generate
from free_transformer.inference import sampling
from free_transformer.inference.engine import Row, run_rows
from free_transformer.inference.kept_engines import decoding_engine
from free_transformer.inference.params import Sampling
from free_transformer.inference.sampling import (
    FILTERS,
    RowSettings,
    SamplingFilter,
    SamplingVariant,
    next_tokens,
    register_filter,
)

runner_module = importlib.import_module("free_transformer.inference.step_runner")
PAGE = Path(__file__).parents[1] / "docs" / "sampling.md"


def _section(heading: str) -> str:
    return PAGE.read_text(encoding="utf-8").split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_docs_table_lists_exactly_the_declared_filters_in_their_order():
    rows = re.findall(r"^\| `(\w+)` \|", _section("The filters"), re.M)
    assert rows == [declared.name for declared in FILTERS] == ["top_k", "top_p", "min_p"]
    fields = Sampling.__dataclass_fields__
    assert all(declared.name in fields for declared in FILTERS)  # each set by a field of the one definition


def _register_documented(monkeypatch) -> types.ModuleType:
    """The page's block run as a reader's module: it registers `top_two`; FILTERS is restored after the test."""
    monkeypatch.setattr(sampling, "FILTERS", sampling.FILTERS)
    module = types.ModuleType("top_two_filter")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # where its dataclass's annotations resolve
    block = _section("Adding a filter").split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(block, "top_two_filter.py (docs/sampling.md)", "exec"), module.__dict__)
    return module


@pytest.fixture
def documented(monkeypatch):
    return _register_documented(monkeypatch)


def test_a_registered_filter_is_appended_and_its_name_is_declared_once(documented):
    assert (*FILTERS, documented.TOP_TWO) == sampling.FILTERS
    with pytest.raises(ValueError, match="'top_two' is already declared"):
        register_filter(SamplingFilter("top_two", torch.float32, 0.0, documented.keep_two, ordered=True))
    rule = documented.TopTwoConfig(top_two=True)
    assert sampling.filters(rule) and not sampling.filters(documented.TopTwoConfig(top_two=False))
    assert not sampling.filters(GenerationConfig())  # a rule without the field: off


def test_a_registered_filter_applies_to_its_rows_only(documented):
    """Three rows of one step, the far end of every CDF (in token order) drawn: the top-two row gets the later of
    its two likeliest tokens, the row without it and the row of a rule that lacks the field the last token."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]]).repeat(3, 1)
    rules = [documented.TopTwoConfig(top_two=True), documented.TopTwoConfig(), GenerationConfig()]
    settings = RowSettings(3, "cpu")
    settings.set(slice(0, 3), rules)
    uniforms = torch.full((3,), 0.999999, dtype=torch.float64)
    tokens, _ = next_tokens(logits, settings.view(slice(0, 3)), uniforms, SamplingVariant.of(rules))
    assert tokens.tolist() == [2, 3, 3]


@pytest.mark.parametrize("compile", [False, True])
def test_the_engine_applies_a_registered_filter_per_row_each_as_alone(documented, compile, monkeypatch):
    """One batch: a top-two row, the same rule without it, and top-two with min-p (the filter after an unordered
    one: a second sort). The top-two rows draw what top_k=2 draws (the tiny model's logits have no ties), the
    other what the rule without a filter draws, each as it does alone (`generate`). Compiled: the step traced
    whole by Dynamo (fullgraph), with a backend that runs the traced graph (Inductor's compile is slow here)."""
    traced = []
    monkeypatch.setattr(runner_module, "COMPILE_BACKEND", lambda graph, inputs: traced.append(graph) or graph.forward)
    monkeypatch.setattr(runner_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})
    model = tiny_model(latent_units=4, dtype=torch.float32)
    base = dict(max_new_tokens=6, temperature=3.0)  # hot: the filter changes what is drawn
    on, off = documented.TopTwoConfig(top_two=True, **base), documented.TopTwoConfig(**base)
    both = documented.TopTwoConfig(top_two=True, min_p=0.2, **base)
    twin = [GenerationConfig(top_k=2, **base), GenerationConfig(**base), GenerationConfig(top_k=2, min_p=0.2, **base)]
    ids = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 5, 4)]
    engine = decoding_engine(model, 3, 16, compile=compile)
    rows = [Row(prompt, config, seed, "prior") for seed, (prompt, config) in enumerate(zip(ids, (on, off, both)))]
    list(run_rows(engine, rows))
    for seed, (row, config, same) in enumerate(zip(rows, (on, off, both), twin)):
        alone = generate(model, [row.ids], config, seeds=[seed], latents="prior").tokens[0]
        assert row.tokens == alone == generate(model, [row.ids], same, seeds=[seed], latents="prior").tokens[0], seed
    unfiltered = generate(model, [ids[0]], off, seeds=[0], latents="prior").tokens[0]
    assert rows[0].tokens != unfiltered  # the filter bit
    assert bool(traced) == compile


def test_a_compiled_engine_kept_from_before_a_registration_is_not_reused(monkeypatch):
    """generate(compile=True) keeps its engine, whose row settings hold the filters of when it was made: after a
    registration, the next call makes a new one, which applies the new filter."""
    model = tiny_model(latent_units=0, dtype=torch.float32)
    base = dict(max_new_tokens=5, temperature=3.0)
    generate(model, [[1, 2, 3]], GenerationConfig(**base), seeds=[0], compile=True)
    documented = _register_documented(monkeypatch)
    tokens = generate(model, [[1, 2, 3]], documented.TopTwoConfig(top_two=True, **base), seeds=[0], compile=True)
    assert tokens.tokens == generate(model, [[1, 2, 3]], GenerationConfig(top_k=2, **base), seeds=[0]).tokens
