"""The static decoding step of generate(compile=True) with its draws and sampling inside: the same tokens
and latents as eager decoding (eager and compiled by Inductor), compiled once per shape and variant."""

import dataclasses
import gc
import importlib
import weakref

import pytest
import torch
from conftest import tiny_model

from free_transformer import GenerationConfig, generate
from free_transformer.inference.generate import static_decode_step
from free_transformer.model.latent import latent_kind

generate_module = importlib.import_module("free_transformer.inference.generate")  # the package's `generate` is the function

GREEDY = GenerationConfig(max_new_tokens=7, temperature=0)
SAMPLED = GenerationConfig(max_new_tokens=7, temperature=0.7, top_k=30, top_p=0.95)
MIN_P = GenerationConfig(max_new_tokens=7, temperature=0.5, min_p=0.5)  # the tiny model's flat logits: it bites


def _prompts(B, P=4, seed=3):
    return torch.randint(0, 50, (B, P), generator=torch.Generator().manual_seed(seed))


def _explicit(B, N, kind="binary_mapper"):
    """Explicit latents for the prompt and the first fed tokens only: the step then switches from
    latents handed over to latents it draws itself. H = 4: indices in [0, 16), or 4 reals per position."""
    generator = torch.Generator().manual_seed(5)
    if kind == "gaussian":
        return torch.randn(B, N, 4, generator=generator)
    return torch.randint(0, 16, (B, N), generator=generator)


@pytest.mark.parametrize("kind", ["binary_mapper", "gaussian"])
def test_prior_in_place_draws_what_prior_draws(kind):
    """The static step's in-place prior draw (a buffer of fixed address) is the eager loop's draw."""
    space = latent_kind(kind)(4, 8)
    seeds = [4, 5, 6]
    expected = space.prior((3, 1), [torch.Generator().manual_seed(s) for s in seeds])
    out = torch.full((3, 1, *space.value_shape), -1, dtype=space.value_dtype)
    space.prior_(out, [torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("latent_bits, B, kind", [(0, 1, "binary_mapper"), (0, 3, "binary_mapper"),
                                                  (4, 1, "binary_mapper"), (4, 3, "binary_mapper"),
                                                  (4, 3, "gaussian")])
@pytest.mark.parametrize("config", [GREEDY, SAMPLED, MIN_P], ids=["greedy", "sampled", "min_p"])
def test_static_step_samples_as_eager_decoding(latent_bits, B, kind, config):
    """Eagerly (the CPU's default): the step's own draws of Z and of the sampling noise are the eager
    loop's, in its order, so a seeded row gives the same tokens and latents, with explicit latents for
    the first positions and prior draws after them; for every form of Z."""
    model = tiny_model(latent_bits=latent_bits, dtype=torch.float32, latent={"kind": kind})
    prompts, seeds = _prompts(B), list(range(10, 10 + B))
    latents = _explicit(B, 6, kind) if latent_bits else None
    eager = generate(model, prompts, config, seeds=seeds, latents=latents)
    static = generate(model, prompts, config, seeds=seeds, latents=latents, compile=True)
    assert static.tokens == eager.tokens
    if latent_bits:
        assert torch.equal(static.latents, eager.latents)
        assert static.latents.shape == (B, 4 + 7 - 1, *model.latent_space.value_shape)
        assert torch.equal(static.latents[:, :6], latents.to(static.latents.dtype))


@pytest.fixture
def counted_compiles(monkeypatch) -> list:
    """The static step compiled on every device with a backend of our own (Dynamo's tracing, no Inductor, so
    a test is fast), which lists each graph it is given."""
    compiled = []

    def counting_backend(graph_module, example_inputs):
        compiled.append(len(example_inputs))
        return graph_module.forward

    monkeypatch.setattr(generate_module, "COMPILE_BACKEND", counting_backend)
    monkeypatch.setattr(generate_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})
    return compiled


def test_compiled_step_is_compiled_once_per_shape_and_variant(counted_compiles):
    """Counted with a backend of our own (Dynamo's tracing, no Inductor, so the test is fast): a second
    generate call of the same batch size and similar length, other prompts and seeds, compiles
    nothing; a new sampling setting or batch size compiles once more. The kept step, with its compiled
    code, does not keep the model alive."""
    compiled = counted_compiles
    model = tiny_model(latent_bits=4, dtype=torch.float32)
    for seed in (3, 4):
        prompts = _prompts(2, seed=seed)
        static = generate(model, prompts, SAMPLED, seeds=[seed, 7], compile=True)
        assert static.tokens == generate(model, prompts, SAMPLED, seeds=[seed, 7]).tokens
        assert len(compiled) == 1
    assert static_decode_step(model, 2, 4 + 7 - 1).compile_seconds  # the compile was timed (and logged)
    generate(model, _prompts(2), GREEDY, compile=True)
    assert len(compiled) == 2
    generate(model, _prompts(1), GREEDY, compile=True)
    assert len(compiled) == 3
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_min_p_is_traced_into_the_compiled_step_and_samples_as_eager(counted_compiles):
    """Min-p is part of the step's rule: Dynamo traces it into the one graph (fullgraph) of a variant of its
    own, and the step samples what eager decoding samples, which min-p changes."""
    compiled = counted_compiles
    model = tiny_model(latent_bits=4, dtype=torch.float32)
    prompts, seeds = _prompts(3), [4, 5, 6]
    eager = generate(model, prompts, MIN_P, seeds=seeds)
    static = generate(model, prompts, MIN_P, seeds=seeds, compile=True)
    assert compiled and static.tokens == eager.tokens and torch.equal(static.latents, eager.latents)
    unfiltered = dataclasses.replace(MIN_P, min_p=None)
    assert generate(model, prompts, unfiltered, seeds=seeds, compile=True).tokens != static.tokens
    assert len(compiled) == 2  # one variant each


def test_inductor_compiles_the_step_with_coordinate_descent_tuning(monkeypatch):
    """Inductor gets INDUCTOR_OPTIONS (coordinate-descent tuning: its own tuned GEMVs at one row on a GPU);
    another backend gets no Inductor options."""
    calls = []
    monkeypatch.setattr(generate_module.torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    model = tiny_model(latent_bits=4, dtype=torch.float32)
    generate_module.StaticDecodeStep(model, 1, 16, inductor=True)
    assert calls[-1]["backend"] == "inductor" and calls[-1]["options"] == {"coordinate_descent_tuning": True}
    monkeypatch.setattr(generate_module, "COMPILE_BACKEND", lambda graph_module, example_inputs: graph_module.forward)
    generate_module.StaticDecodeStep(model, 1, 16, inductor=True)
    assert calls[-1]["options"] is None


def _inductor_cases():
    return pytest.mark.parametrize("latent_bits, B", [(0, 1), (4, 3)])


@pytest.mark.slow  # Inductor's compilation on a CPU: 10-60 s a variant
@_inductor_cases()
def test_inductor_step_gives_the_eager_logits_and_tokens(latent_bits, B, monkeypatch):
    """The step compiled by Inductor (as a GPU compiles it before capture) against the same step run
    eagerly: its logits at float32 rounding, and generate's greedy and sampled tokens and latents."""
    monkeypatch.setattr(generate_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})
    model = tiny_model(latent_bits=latent_bits, dtype=torch.float32, n_layers=2)
    prompts, seeds = _prompts(B), list(range(B))
    # the model alone: one step of each after the same prefill
    steps = {inductor: static_decode_step(model, B, 12, inductor=inductor) for inductor in (True, False)}
    latent = torch.randint(0, 16, (B, 1)) if latent_bits else None
    logits = {}
    with torch.inference_mode():
        for inductor, step in steps.items():
            model(prompts, latents="prior" if latent_bits == 0 else _explicit(B, 4), cache=step.restart())
            logits[inductor] = step(prompts[:, -1], latent).clone()
            assert int(step.cache.position) == 5
    assert steps[True].compile_seconds and not steps[False].compile_seconds
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
    for config in (GREEDY, SAMPLED, MIN_P):
        eager = generate(model, prompts, config, seeds=seeds)
        compiled = generate(model, prompts, config, seeds=seeds, compile=True)
        assert compiled.tokens == eager.tokens
        if latent_bits:
            assert torch.equal(compiled.latents, eager.latents)


def test_generate_compile_says_the_compile_time_on_first_use(tmp_path, monkeypatch, capsys):
    """`generate --compile` on a device that compiles the step (here the CPU, with a tracing-only backend):
    the first call of a batch size says how long compiling took, on stderr; the samples are on stdout."""
    from conftest import tiny_checkpoint

    from free_transformer.cli import main

    monkeypatch.setattr(generate_module, "COMPILE_BACKEND", lambda graph_module, example_inputs: graph_module.forward)
    monkeypatch.setattr(generate_module, "INDUCTOR_DEVICES", {"cuda", "cpu"})
    run = tiny_checkpoint(tmp_path, "free", 4)
    assert main(["generate", str(run), "--prompt", "K>", "-n", "2", "--max-new-tokens", "3", "--compile",
                 "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and "compiled the static decoding step (batch 2, " in err
