"""Where Z comes from is one choice, a LatentChoice: each entry point (the `generate` command, its
--interactive /latents, the Python `generate`, the Hugging Face `generate`, evaluation's settings) parses what
the user wrote once into the same value, refuses a bad one with one line naming the allowed values before any
model work, and resolves it once."""

import importlib

import pytest
import torch
from conftest import tiny_model

from free_transformer import FreeTransformer, GenerationConfig, generate
from free_transformer.base.latent_choice import LatentChoice
from free_transformer.cli import build_parser, main
from free_transformer.commands.interactive import SPECIAL_SETTERS
from free_transformer.commands.samples import params_from
from free_transformer.eval.settings import EvalConfig
from free_transformer.inference import latents as latent_choice
from free_transformer.inference.params import SamplingParams

P = 4
SPELLINGS = ("encoder", "prior", "shared", "reference")  # every name a user may write
RENAMED = {"posterior": "encoder", "independent": "encoder"}  # 0.1's names, refused since 0.3


def _prompts():
    return torch.randint(0, 50, (2, P), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model():
    return tiny_model(latent_units=4)


@pytest.fixture(scope="module")
def hf_model(model):
    pytest.importorskip("transformers")
    from free_transformer.hf import FreeTransformerForCausalLM

    return FreeTransformerForCausalLM.from_free_transformer(model)


@pytest.fixture
def parsed(monkeypatch):
    """Every choice parsed (LatentChoice.parse, the one parse every entry point calls), as it returned it."""
    seen, real = [], LatentChoice.parse.__func__

    def spy(cls, *args, **kwargs):
        seen.append(real(cls, *args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(LatentChoice, "parse", classmethod(spy))
    return seen


def _cli(spelling, request):
    args = build_parser().parse_args(["generate", "run", "--latents", spelling])
    request.getfixturevalue("parsed").clear()
    return params_from(args).latents


def _interactive(spelling, request):
    settings = SamplingParams(reference="K>")
    request.getfixturevalue("parsed").clear()
    return SPECIAL_SETTERS["latents"](settings, "latents", spelling, True).latents


def _python(spelling, request):
    model, parsed = request.getfixturevalue("model"), request.getfixturevalue("parsed")
    reference = _prompts() if spelling == "reference" else None
    generate(model, _prompts(), GenerationConfig(max_new_tokens=2), latents=spelling, reference=reference, seeds=[0, 1])
    return parsed[-1]


def _hugging_face(spelling, request):
    hf_model, parsed = request.getfixturevalue("hf_model"), request.getfixturevalue("parsed")
    kwargs = {"latent_reference": _prompts()} if spelling == "reference" else {"latents": spelling}
    hf_model.generate(_prompts(), max_new_tokens=2, seeds=[0, 1], **kwargs)
    return parsed[-1]


def _eval_settings(spelling, request):
    config = EvalConfig(tasks="none", heldout="held.txt", latents=spelling)
    request.getfixturevalue("parsed").clear()
    return config.settings().latents


ENTRY_POINTS = {
    "cli": _cli,
    "interactive": _interactive,
    "python": _python,
    "hugging_face": _hugging_face,
    "eval_settings": _eval_settings,
}
ROW_ONLY = {"eval_settings"}  # what a row draws its Z from: encoder, prior or policy


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_parses_every_name_once_into_the_same_choice(entry, spelling, request):
    parsed = request.getfixturevalue("parsed")
    if entry in ROW_ONLY and spelling not in ("encoder", "prior", "policy"):
        with pytest.raises(ValueError, match=f"must be one of 'encoder', 'prior', 'policy', got '{spelling}'"):
            ENTRY_POINTS[entry](spelling, request)
        return
    choice = ENTRY_POINTS[entry](spelling, request)
    assert choice is LatentChoice(spelling) and parsed == [choice]  # parsed once, where it entered


@pytest.mark.parametrize("old", RENAMED)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_name_of_0_1_is_refused_with_todays_name(entry, old, request):
    with pytest.raises(ValueError) as error:
        ENTRY_POINTS[entry](old, request)
    message = str(error.value)
    assert "\n" not in message and f"({old!r} is now called {RENAMED[old]!r})" in message


@pytest.fixture
def no_model_work(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model ran before the latents were checked")

    monkeypatch.setattr(FreeTransformer, "forward", refuse)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_bad_choice_is_one_line_naming_the_choices_before_any_model_work(entry, request, no_model_work):
    with pytest.raises(ValueError) as error:
        ENTRY_POINTS[entry]("posteriour", request)
    message = str(error.value)
    assert "\n" not in message and "'encoder', 'prior'" in message and "got 'posteriour'" in message


def test_bad_indices_and_references_are_refused_before_any_model_work(model, no_model_work):
    config = GenerationConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"latent indices must lie in \[0, 2\^4\)"):
        generate(model, _prompts(), config, latents=torch.full((1, P + 1), 16))
    with pytest.raises(ValueError, match="a reference text goes with latents='reference', not latents='shared'"):
        generate(model, _prompts(), config, latents="shared", reference=_prompts())
    with pytest.raises(ValueError, match="at least as long as the prompt"):
        generate(model, _prompts(), config, latents="reference", reference=_prompts()[:, :2])
    with pytest.raises(ValueError, match="latents='shared' needs a Free Transformer"):
        generate(tiny_model(latent_units=0), _prompts(), config, latents="shared")


def test_the_command_refuses_a_bad_choice_before_reading_the_checkpoint(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "K>", "--latents", "sharde"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --latents must be one of 'encoder', 'prior', 'shared', 'reference', 'policy', got 'sharde'"
    ]


def test_the_old_option_is_gone(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path / "missing"), "--prompt", "K>", "--prompt-latents", "prior"])
    assert "unrecognized arguments: --prompt-latents prior" in capsys.readouterr().err


def test_a_generation_resolves_its_choice_once_and_the_model_gets_resolved_sources(model, hf_model, monkeypatch):
    """However many steps are decoded, the choice is parsed and resolved (and explicit indices range-checked)
    once per generate; every forward receives ENCODER, PRIOR or a tensor of values, never a user's spelling."""
    counts = {"parse": 0, "resolve": 0, "check": 0}
    real_parse, real_resolve = latent_choice.parse_latents, latent_choice.resolve_latents
    real_check = latent_choice.check_latent_values

    def parse(*args, **kwargs):
        counts["parse"] += 1
        return real_parse(*args, **kwargs)

    def resolve(*args, **kwargs):
        counts["resolve"] += 1
        return real_resolve(*args, **kwargs)

    def check(*args, **kwargs):
        counts["check"] += 1
        return real_check(*args, **kwargs)

    sources, forward = [], FreeTransformer.forward

    def spy(self, tokens, *args, latents="encoder", **kwargs):
        sources.append(latents if isinstance(latents, str) else "indices")
        return forward(self, tokens, *args, latents=latents, **kwargs)

    monkeypatch.setattr(latent_choice, "parse_latents", parse)
    monkeypatch.setattr(importlib.import_module("free_transformer.inference.generate"), "parse_latents", parse)
    monkeypatch.setattr(importlib.import_module("free_transformer.hf.modeling"), "parse_latents", parse)
    monkeypatch.setattr(latent_choice, "resolve_latents", resolve)
    monkeypatch.setattr(importlib.import_module("free_transformer.inference.generate"), "resolve_latents", resolve)
    monkeypatch.setattr(latent_choice, "check_latent_values", check)
    monkeypatch.setattr(FreeTransformer, "forward", spy)
    explicit = torch.randint(0, 16, (1, P + 1))
    for steps in (2, 9):
        for choice in ("encoder", "prior", "shared", explicit):
            counts.update(parse=0, resolve=0, check=0)
            sources.clear()
            generate(model, _prompts(), GenerationConfig(max_new_tokens=steps), latents=choice, seeds=[0, 1])
            assert counts == {"parse": 1, "resolve": 1, "check": int(isinstance(choice, torch.Tensor))}, (steps, choice)
            assert len(sources) == steps and set(sources) <= {"encoder", "prior", "indices"}
            assert sources[0] == {"encoder": "encoder"}.get(choice, "indices")  # the plan draws a prior prompt's Z
        counts.update(parse=0, resolve=0, check=0)
        hf_model.generate(_prompts(), max_new_tokens=steps, seeds=[0, 1], latents="shared", latent_seed=3)
        assert counts == {"parse": 1, "resolve": 1, "check": 0}


def test_named_choices_resolve_to_the_documented_indices(model):
    """generate(latents="shared" / "reference", latent_seed=s) samples as the indices that shared_prior_latents
    and infer_latents draw with torch.Generator().manual_seed(s)."""
    config, prompts, seed = GenerationConfig(max_new_tokens=5), _prompts(), 7
    fed = P + config.max_new_tokens - 1
    by_name = generate(model, prompts, config, latents="shared", latent_seed=seed, seeds=[0, 1])
    by_indices = generate(
        model,
        prompts,
        config,
        seeds=[0, 1],
        latents=latent_choice.shared_prior_latents(model, fed, torch.Generator().manual_seed(seed)),
    )
    assert by_name.tokens == by_indices.tokens and torch.equal(
        torch.stack(by_name.latents), torch.stack(by_indices.latents)
    )
    reference = torch.randint(0, 50, (2, fed), generator=torch.Generator().manual_seed(2))
    by_name = generate(model, prompts, config, latents="reference", reference=reference, latent_seed=seed, seeds=[0, 1])
    inferred = latent_choice.infer_latents(model, reference, torch.Generator().manual_seed(seed))
    assert torch.equal(torch.stack(by_name.latents), inferred)


def test_the_models_prior_draws_are_a_plans_and_both_import_paths_name_it(model):
    from free_transformer.model.latent import LatentPlan

    assert latent_choice.LatentPlan is LatentPlan
    tokens = _prompts()
    forward = model(tokens, latents=LatentChoice.PRIOR, generator=torch.Generator().manual_seed(3)).latents  # (2, P)
    plan = LatentPlan(
        2, model.latent_space, prompt_source=LatentChoice.PRIOR, generators=torch.Generator().manual_seed(3)
    )
    assert torch.equal(forward, plan.source(0, P))
    assert not torch.equal(forward, plan.draw(P))  # a plan draws anew for each new position
