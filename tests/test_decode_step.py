"""The decoding engine (free_transformer.inference.engine): rows of any lengths, settings and choices of Z
decoded together, each as it is decoded alone; its compiled step (buckets of batch sizes, the draws outside
it) the same tokens and latents as the eager one, compiled once per variant; the sampler's edge values."""

import dataclasses
import gc
import importlib
import re
import weakref

import pytest
import torch
from conftest import tiny_model

from free_transformer import GenerationConfig, generate
from free_transformer.inference.engine import DecodeEngine, Row, run_rows
from free_transformer.inference.kept_engines import decoding_engine
from free_transformer.inference.sampling import RowSettings, SamplingVariant, next_tokens
from free_transformer.inference.step_runner import bucket_sizes
from free_transformer.model.latent import LATENT_KINDS, latent_kind

runner_module = importlib.import_module("free_transformer.inference.step_runner")

GREEDY = GenerationConfig(max_new_tokens=7, temperature=0)
SAMPLED = GenerationConfig(max_new_tokens=7, temperature=0.7, top_k=30, top_p=0.95)
MIN_P = GenerationConfig(max_new_tokens=7, temperature=0.5, min_p=0.5)  # the tiny model's flat logits: it bites


def _prompts(B, P=4, seed=3):
    return torch.randint(0, 50, (B, P), generator=torch.Generator().manual_seed(seed))


def _explicit(model, B, N):
    """Explicit latents for the prompt and the first fed tokens only: rows then switch from latents handed
    over to prior draws."""
    return model.latent_space.prior((B, N), torch.Generator().manual_seed(5))


@pytest.mark.parametrize("kind", sorted(LATENT_KINDS))
def test_prior_in_place_draws_what_prior_draws(kind):
    """The engine's in-place prior draw (into its latent buffer) is the draw of `prior`."""
    space = latent_kind(kind)(4, 8)
    seeds = [4, 5, 6]
    expected = space.prior((3, 1), [torch.Generator().manual_seed(s) for s in seeds])
    out = torch.full((3, 1, *space.value_shape), -1, dtype=space.value_dtype)
    space.prior_(out, [torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(out, expected)


def _kinds():
    return [(0, 1, "binary_mapper"), (0, 3, "binary_mapper")] + [(4, 3, kind) for kind in sorted(LATENT_KINDS)]


@pytest.mark.parametrize("latent_units, B, kind", _kinds())
@pytest.mark.parametrize("config", [GREEDY, SAMPLED, MIN_P], ids=["greedy", "sampled", "min_p"])
def test_compiled_engine_samples_as_the_eager_one(latent_units, B, kind, config):
    """compile=True on a CPU: the bucketed step (whole cache under a mask, padded rows) gives the eager
    step's tokens and latents, with explicit latents for the first positions and prior draws after them."""
    model = tiny_model(latent_units=latent_units, dtype=torch.float32, latent={"kind": kind})
    prompts, seeds = _prompts(B), list(range(10, 10 + B))
    latents = _explicit(model, B, 6) if latent_units else None
    eager = generate(model, prompts, config, seeds=seeds, latents=latents)
    static = generate(model, prompts, config, seeds=seeds, latents=latents, compile=True)
    assert static.tokens == eager.tokens
    if latent_units:
        for row in range(B):
            assert torch.equal(static.latents[row], eager.latents[row])
            assert static.latents[row].shape == (4 + len(eager.tokens[row]) - 1, *model.latent_space.value_shape)
            assert torch.equal(static.latents[row][:6], latents[row].to(static.latents[row].dtype))


@pytest.mark.parametrize("deferred", [False, True], ids=["read-each-step", "deferred"])
@pytest.mark.parametrize("compile", [False, True])
def test_rows_of_any_lengths_settings_and_latents_decode_as_each_alone(compile, deferred):
    """One engine of 3 slots, 7 rows: prompts of 2 to 9 tokens, greedy, sampled, top-k/top-p and min-p rows,
    encoder, prior and explicit Z, a stop token; rows join as others end, in any slot. Each row's tokens and
    latents are those of `generate` on that row alone."""
    model = tiny_model(latent_units=4, dtype=torch.float32)
    configs = [
        GREEDY,
        SAMPLED,
        MIN_P,
        dataclasses.replace(SAMPLED, max_new_tokens=3),
        GREEDY,
        dataclasses.replace(MIN_P, max_new_tokens=5),
        SAMPLED,
    ]
    lengths = [2, 9, 4, 4, 6, 3, 5]
    choices = ["encoder", "prior", "explicit", "encoder", "prior", "encoder", "explicit"]
    ids = [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    alone = []
    for k, (prompt, config, choice) in enumerate(zip(ids, configs, choices)):
        latents = _explicit(model, 1, len(prompt) + 2) if choice == "explicit" else choice
        alone.append((generate(model, [prompt], config, seeds=[k], latents=latents), latents))
    stop = alone[1][0].tokens[0][2]  # row 1 stops at its third token
    configs[1] = dataclasses.replace(SAMPLED, stop_tokens=(stop,))
    engine = decoding_engine(model, 3, 16, compile=compile)
    engine.runner.deferred = deferred  # as on CUDA: a step's tokens are read after the next step is launched
    rows = [
        Row(prompt, config, k, latents) for k, (prompt, config, (_, latents)) in enumerate(zip(ids, configs, alone))
    ]
    ended = list(run_rows(engine, rows))
    assert sorted(map(id, ended)) == sorted(map(id, rows)) and not engine.rows
    for k, (row, (result, _)) in enumerate(zip(rows, alone)):
        expected = result.tokens[0][: result.tokens[0].index(stop) + 1] if k == 1 else result.tokens[0]
        assert row.tokens == expected, k
        assert torch.equal(row.fed, result.latents[0][: len(row.fed)]), k
    assert rows[1].finish_reason == "stop" and rows[0].finish_reason == "length"
    assert engine.steps < sum(len(row.tokens) for row in rows)  # rows shared steps


@pytest.mark.parametrize("deferred", [False, True], ids=["read-each-step", "deferred"])
def test_a_row_whose_logits_are_not_finite_ends_alone(deferred, monkeypatch):
    """A NaN in one row's logits ends that row with an error; the others decode as they would alone."""
    model = tiny_model(latent_units=4, dtype=torch.float32)
    real, calls = runner_module.next_tokens, []

    def poisoned(logits, settings, uniforms, variant):
        calls.append(1)
        if len(calls) == 2:  # the first step after the prefill: row 1's logits are NaN
            logits = logits.clone()
            logits[1] = float("nan")
        return real(logits, settings, uniforms, variant)

    expected = generate(model, _prompts(3), SAMPLED, seeds=[1, 2, 3]).tokens
    monkeypatch.setattr(runner_module, "next_tokens", poisoned)
    engine = decoding_engine(model, 3, 16)
    engine.runner.deferred = deferred
    rows = [Row(prompt, SAMPLED, seed) for prompt, seed in zip(_prompts(3).tolist(), [1, 2, 3])]
    list(run_rows(engine, rows))
    assert rows[1].finish_reason == "error" and "NaN" in str(rows[1].error) and len(rows[1].tokens) == 1
    assert [rows[0].tokens, rows[2].tokens] == [expected[0], expected[2]]
    calls.clear()
    with pytest.raises(ValueError, match="NaN"):  # generate() says a row failed
        generate(model, _prompts(3), SAMPLED, seeds=[1, 2, 3])


POISON = 49  # a token that embeds to NaN in a prompt of `_poisoned_model`


def _poisoned_model(latent_units: int):
    """A tiny model whose token POISON embeds to NaN in a prompt (a call of more than one token): a row whose
    prompt holds it gets non-finite keys, values and logits; a sampled POISON is harmless."""
    model = tiny_model(latent_units=latent_units, dtype=torch.float32)

    def poison(module, inputs, out):
        (tokens,) = inputs
        return out.masked_fill((tokens == POISON)[..., None], float("nan")) if tokens.shape[1] > 1 else out

    model.embed_tokens.register_forward_hook(poison)
    return model


@pytest.mark.parametrize("deferred", [False, True], ids=["read-each-step", "deferred"])
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("latent_units", [0, 4])
def test_a_failed_row_leaves_nothing_in_its_slot(latent_units, compile, deferred):
    """A row whose keys and values are NaN ends with an error; the next row in its slot, with a shorter prompt (so
    that it attends, under its mask, positions the failed row filled), decodes as it does alone."""
    model = _poisoned_model(latent_units)
    short, poisoned, long = [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, POISON, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    expected = generate(model, [short], SAMPLED, seeds=[4]).tokens[0]
    engine = decoding_engine(model, 2, 18, compile=compile)
    engine.runner.deferred = deferred
    failed = Row(poisoned, SAMPLED, 3)
    list(run_rows(engine, [failed]))
    assert failed.finish_reason == "error" and "NaN" in str(failed.error)
    # the short row takes the failed row's slot; the long one makes an eager step read its stale positions too
    after = Row(short, SAMPLED, 4)
    list(run_rows(engine, [after, Row(long, SAMPLED, 5)]))
    assert after.finish_reason == "length" and after.tokens == expected


def test_tiny_temperatures_and_top_p_sample_the_likeliest_token():
    """Valid settings never give NaN: a temperature below 1e-5 is greedy, top_p 1e-300 keeps the likeliest."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.2, 0.1], [2.0, 2.5, 9.0]])
    settings = RowSettings(3, "cpu")
    rules = [GenerationConfig(temperature=1e-40), GenerationConfig(top_p=1e-300), GenerationConfig(min_p=1.0)]
    settings.set(slice(0, 3), rules)
    uniforms = torch.tensor([0.999999, 0.999999, 0.999999], dtype=torch.float64)  # the far end of every CDF
    tokens, non_finite = next_tokens(logits, settings.view(slice(0, 3)), uniforms, SamplingVariant.of(rules))
    assert tokens.tolist() == [1, 0, 2] and not non_finite.any()
    model = tiny_model(latent_units=0, dtype=torch.float32)  # a baseline: no Z draws for the noise to shift
    greedy = generate(model, _prompts(2), GREEDY, seeds=[1, 2]).tokens
    for config in (
        GenerationConfig(max_new_tokens=7, temperature=1e-39),
        GenerationConfig(max_new_tokens=7, top_p=1e-300),
    ):
        assert generate(model, _prompts(2), config, seeds=[1, 2]).tokens == greedy


def test_a_row_beyond_the_engines_cache_is_refused_by_the_one_room_check():
    """The engine's check of a row's room is params.check_room's, with its one-line message; nothing is added."""
    engine = decoding_engine(tiny_model(latent_units=0, dtype=torch.float32), 2, 18)
    too_long = Row(list(range(10)), dataclasses.replace(GREEDY, max_new_tokens=10), 1)
    message = "prompt (10) + max_new_tokens (10) - 1 exceeds max_seq_len 18: max_new_tokens can be at most 9"
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add([too_long])
    with pytest.raises(ValueError, match="the prompt has 19 tokens; this model reads at most 18"):
        engine.check(Row(list(range(19)), GREEDY, 1))
    assert not engine.rows
    engine.check(Row(list(range(10)), dataclasses.replace(GREEDY, max_new_tokens=9), 1))  # fits exactly


def test_buckets_and_the_step_padded_up_to_its_bucket():
    assert bucket_sizes(1) == (1,) and bucket_sizes(16) == (1, 2, 4, 8, 16) and bucket_sizes(20)[-2:] == (16, 20)
    model = tiny_model(latent_units=4, dtype=torch.float32)
    engine = DecodeEngine(model, 8, capacity=32, compile=True)
    engine.add([Row(prompt, SAMPLED, 0) for prompt in _prompts(3).tolist()])
    engine.step()
    assert {size for size, *_ in engine.runner.warm} == {4}  # 3 rows run in the bucket of 4


@pytest.fixture
def counted_compiles(monkeypatch) -> list:
    """The step compiled on every device with a backend of our own (Dynamo's tracing, no Inductor, so a test
    is fast), which lists each graph it is given."""
    compiled = []

    def counting_backend(graph_module, example_inputs):
        compiled.append(len(example_inputs))
        return graph_module.forward

    monkeypatch.setattr(runner_module, "COMPILE_BACKEND", counting_backend)
    monkeypatch.setattr(runner_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})
    return compiled


def test_compiled_engine_is_kept_and_compiles_once_per_variant(counted_compiles):
    """A second generate call of the same batch size and similar length, other prompts and seeds, compiles
    nothing: the engine is kept. A new sampling variant compiles once more. The kept engine, with its compiled
    code, does not keep the model alive."""
    compiled = counted_compiles
    model = tiny_model(latent_units=4, dtype=torch.float32)
    for seed in (3, 4):
        prompts = _prompts(2, seed=seed)
        static = generate(model, prompts, SAMPLED, seeds=[seed, 7], compile=True)
        assert static.tokens == generate(model, prompts, SAMPLED, seeds=[seed, 7]).tokens
        assert len(compiled) == 1
    engine = decoding_engine(model, 2, 4 + 7 - 1, compile=True)
    assert engine.runner.compile_seconds and engine.capacity == model.config.max_seq_len == 40  # under 64: capped
    generate(model, _prompts(2), GREEDY, compile=True)
    assert len(compiled) == 2
    alive = weakref.ref(model)
    del model, engine
    gc.collect()
    assert alive() is None


def test_a_warmed_compiled_engine_compiles_nothing_when_greedy_and_sampled_rows_mix(counted_compiles):
    """A server warms its engine up for sampled batches; a greedy request beside sampled ones reuses that step
    (an eager step skips the greedy rows' work when there are none, a compiled one always does it), and each
    row still samples as alone."""
    compiled = counted_compiles
    model = tiny_model(latent_units=4, dtype=torch.float32)
    engine = DecodeEngine(model, 2, capacity=16, compile=True)
    engine.warm_up()
    warmed = len(compiled)
    unfiltered = GenerationConfig(max_new_tokens=7, temperature=0.7)  # the variant a server warms up
    list(run_rows(engine, [Row([7, 8], unfiltered, 3), Row([9], unfiltered, 4)]))  # sampled rows only
    rows = [Row([1, 2, 3], GREEDY, 1), Row([4, 5, 6], unfiltered, 2)]  # a greedy row beside a sampled one
    list(run_rows(engine, rows))
    assert len(compiled) == warmed > 0
    alone = [Row([1, 2, 3], GREEDY, 1), Row([4, 5, 6], unfiltered, 2)]
    for row in alone:
        list(run_rows(DecodeEngine(model, 1, capacity=16), [row]))
    assert [row.tokens for row in rows] == [row.tokens for row in alone]


def test_min_p_is_traced_into_the_compiled_step_and_samples_as_eager(counted_compiles):
    """Min-p is part of the step's filters: Dynamo traces it into the one graph (fullgraph) of the filtered
    variant, and the step samples what eager decoding samples, which min-p changes."""
    compiled = counted_compiles
    model = tiny_model(latent_units=4, dtype=torch.float32)
    prompts, seeds = _prompts(3), [4, 5, 6]
    eager = generate(model, prompts, MIN_P, seeds=seeds)
    static = generate(model, prompts, MIN_P, seeds=seeds, compile=True)
    assert compiled and static.tokens == eager.tokens
    unfiltered = dataclasses.replace(MIN_P, min_p=None)
    assert generate(model, prompts, unfiltered, seeds=seeds, compile=True).tokens != static.tokens
    assert len(compiled) == 2  # one variant each


def test_inductor_compiles_the_step_with_coordinate_descent_tuning(monkeypatch):
    """Inductor gets INDUCTOR_OPTIONS (coordinate-descent tuning: its own tuned GEMVs at one row on a GPU);
    another backend gets no Inductor options."""
    calls = []
    monkeypatch.setattr(runner_module.torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    model = tiny_model(latent_units=4, dtype=torch.float32)
    DecodeEngine(model, 1, capacity=16, compile=True, inductor=True).warm_up()
    assert calls[-1]["backend"] == "inductor" and calls[-1]["options"] == {"coordinate_descent_tuning": True}
    monkeypatch.setattr(runner_module, "COMPILE_BACKEND", lambda graph_module, example_inputs: graph_module.forward)
    DecodeEngine(model, 1, capacity=16, compile=True, inductor=True).warm_up()
    assert calls[-1]["options"] is None


@pytest.mark.slow  # Inductor's compilation on a CPU: 10-60 s a variant
@pytest.mark.parametrize("latent_units, B", [(0, 1), (4, 3)])
def test_inductor_step_gives_the_eager_tokens(latent_units, B, monkeypatch):
    """The step compiled by Inductor (as a GPU compiles it before capture) against the eager step: generate's
    greedy and sampled tokens and latents."""
    monkeypatch.setattr(runner_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})
    model = tiny_model(latent_units=latent_units, dtype=torch.float32, n_layers=2)
    prompts, seeds = _prompts(B), list(range(B))
    for config in (GREEDY, SAMPLED, MIN_P):
        eager = generate(model, prompts, config, seeds=seeds)
        compiled = generate(model, prompts, config, seeds=seeds, compile=True)
        assert compiled.tokens == eager.tokens
        if latent_units:
            assert all(torch.equal(a, b) for a, b in zip(compiled.latents, eager.latents))
    assert decoding_engine(model, B, 4 + 7 - 1, compile=True).runner.compile_seconds


def test_generate_compile_says_the_compile_time_on_first_use(tmp_path, monkeypatch, capsys):
    """`generate --compile` on a device that compiles the step (here the CPU, with a tracing-only backend):
    the first use of a bucket says how long compiling took, on stderr; the samples are on stdout."""
    from conftest import tiny_checkpoint

    from free_transformer.cli import main

    monkeypatch.setattr(runner_module, "COMPILE_BACKEND", lambda graph_module, example_inputs: graph_module.forward)
    monkeypatch.setattr(runner_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})
    run = tiny_checkpoint(tmp_path, "free", 4)
    assert (
        main(
            ["generate", str(run), "--prompt", "K>", "-n", "2", "--max-new-tokens", "3", "--compile", "--device", "cpu"]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and "compiled the decoding step (batch 2, " in err


@pytest.mark.parametrize("deferred", [False, True], ids=["read-each-step", "deferred"])
def test_should_stop_ends_a_row_at_the_token_it_saw(deferred):
    """The caller's should_stop (stop strings) sees each new token as it arrives; the row it ends keeps no
    later token, even when a deferred engine has already fed it the next step."""
    model = tiny_model(latent_units=4, dtype=torch.float32)
    engine = decoding_engine(model, 2, 16)
    engine.runner.deferred = deferred
    rows = [Row([1, 2, 3], SAMPLED, 1), Row([4, 5], SAMPLED, 2)]
    expected = generate(model, [[1, 2, 3]], SAMPLED, seeds=[1]).tokens[0]
    list(run_rows(engine, rows, should_stop=lambda tokens: len(tokens) == 3))
    assert [row.finish_reason for row in rows] == ["stop", "stop"]
    assert rows[0].tokens == expected[:3] and len(rows[1].tokens) == 3 and not engine.rows
