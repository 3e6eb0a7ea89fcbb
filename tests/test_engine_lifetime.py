"""How long the compiled engines kept per model (free_transformer.inference.engine.decoding_engine) live: at most
ENGINES_PER_MODEL per model, the least recently used dropped; never past their model; until `release_engines`;
an eager call keeps none. Each kept engine holds a KV cache and, on a GPU, its graphs' memory pool."""

import dataclasses
import gc
import importlib
import weakref

import pytest
import torch
from conftest import tiny_model

from free_transformer import GenerationConfig, LatentChoice, generate, release_engines
from free_transformer.inference import kept_engines
from free_transformer.inference.batches import Prompt, sample_prompts
from free_transformer.inference.kept_engines import ENGINES_PER_MODEL, decoding_engine

runner_module = importlib.import_module("free_transformer.inference.step_runner")

CONFIG = GenerationConfig(max_new_tokens=3, temperature=0.7)


@pytest.fixture
def traced(monkeypatch):
    """The step compiled on a CPU too, by Dynamo's tracing only (no Inductor: fast), as a GPU compiles it: the
    compiled code is among what a kept engine holds."""
    monkeypatch.setattr(runner_module, "COMPILE_BACKEND", lambda graph_module, example_inputs: graph_module.forward)
    monkeypatch.setattr(runner_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})


def _prompts(B: int) -> torch.Tensor:
    return torch.randint(0, 50, (B, 4), generator=torch.Generator().manual_seed(B))


def _dead(*refs: weakref.ref) -> list[bool]:
    gc.collect()
    return [ref() is None for ref in refs]


def test_a_kept_engine_goes_with_its_model(traced):
    """The engine a compiled generate keeps, with its compiled step, neither keeps its model alive nor outlives
    it."""
    model = tiny_model(latent_units=4, dtype=torch.float32)
    generate(model, _prompts(2), CONFIG, seed=1, compile=True)
    engine = weakref.ref(decoding_engine(model, 2, 4 + 3 - 1, compile=True))
    assert engine() is not None and engine().runner.cores  # kept, compiled
    alive = weakref.ref(model)
    del model
    assert _dead(alive, engine) == [True, True]


def test_past_engines_per_model_the_least_recently_used_is_dropped():
    """ENGINES_PER_MODEL engines (batch sizes 1, 2, ...) are kept; using the first again makes the second the
    least recently used, which one more engine drops, and only it."""
    model = tiny_model(dtype=torch.float32)
    engines = [weakref.ref(decoding_engine(model, slots, 8, compile=True)) for slots in range(1, ENGINES_PER_MODEL + 1)]
    assert _dead(*engines) == [False] * ENGINES_PER_MODEL
    assert decoding_engine(model, 1, 8, compile=True) is engines[0]()  # the first, used again
    decoding_engine(model, ENGINES_PER_MODEL + 1, 8, compile=True)
    assert _dead(*engines) == [False, True] + [False] * (ENGINES_PER_MODEL - 2)
    assert decoding_engine(model, 2, 8, compile=True) is not None  # made anew


def test_release_engines_frees_a_models_kept_engines_only():
    """release_engines(model) drops every engine kept for it (the next compiled call makes a new one), not
    another model's; a model without kept engines is fine."""
    model, other = tiny_model(dtype=torch.float32), tiny_model(dtype=torch.float32)
    kept = [weakref.ref(decoding_engine(model, slots, 8, compile=True)) for slots in (1, 2)]
    others = weakref.ref(decoding_engine(other, 1, 8, compile=True))
    release_engines(model)
    assert _dead(*kept, others) == [True, True, False]
    assert decoding_engine(model, 1, 8, compile=True) is not None
    release_engines(model)
    release_engines(model)
    assert _dead(others) == [False]


def test_a_released_engine_in_use_finishes_its_call():
    """Released while a compiled call decodes with it: the call ends with the tokens it gives otherwise, and the
    engine is freed once the call is."""
    model = tiny_model(dtype=torch.float32)
    longer = dataclasses.replace(CONFIG, max_new_tokens=6)
    prompts = [
        Prompt([1, 2, 3], config, 3 + config.max_new_tokens - 1, LatentChoice.ENCODER) for config in (CONFIG, longer)
    ]
    expected = [sample.tokens for sample in sample_prompts(model, prompts, 1, seed=4)]
    engine = weakref.ref(decoding_engine(model, 2, 3 + 6 - 1, compile=True))  # the one the call below takes
    running = sample_prompts(model, prompts, 1, seed=4, compile=True)
    first = next(running)
    assert engine().rows  # in use: the longer row decodes on
    release_engines(model)
    assert [first.tokens] + [sample.tokens for sample in running] == expected
    del running
    assert _dead(engine) == [True]


def test_an_eager_call_keeps_no_engine():
    model = tiny_model(dtype=torch.float32)
    generate(model, _prompts(2), CONFIG, seed=1)
    engine = weakref.ref(decoding_engine(model, 2, 8))
    assert _dead(engine) == [True] and model not in kept_engines._engines
