"""One definition of sampling (free_transformer.inference.params): every entry point's sampling settings are
derived from SamplingParams' fields and checked by them, so a setting declared there (min-p) is an option
of `generate`, an --interactive command, a completion request field and a Hugging Face argument, with the
same check and the same samples everywhere."""

import dataclasses
import io
import json
import re

import pytest
import torch
from conftest import tiny_checkpoint

from free_transformer import GenerationConfig, SamplingParams, generate, load_model
from free_transformer.base.seeding import sample_seed
from free_transformer.cli import build_parser, main
from free_transformer.commands.interactive import interactive_help
from free_transformer.inference.params import Sampling

SETTINGS = [f.name for f in dataclasses.fields(SamplingParams)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("params"), "run", 4))


def test_every_setting_reaches_every_entry_point_that_offers_it():
    generate_options = {
        option
        for action in build_parser()._subparsers._group_actions[0].choices["generate"]._actions
        for option in action.option_strings
    }
    assert {f"--{name.replace('_', '-')}" for name in SETTINGS if name not in ("n", "latent_seed")} <= generate_options
    assert "--num-samples" in generate_options and "--min-p" in generate_options
    commands = {line.split()[0] for line in interactive_help().splitlines() if line.startswith("  /")}
    assert {f"/{name.replace('_', '-')}" for name in SETTINGS if name != "latent_seed"} <= commands
    pytest.importorskip("fastapi")
    from free_transformer.serve.protocol import CompletionRequest

    assert {"max_tokens", *(name for name in SETTINGS if name != "max_new_tokens")} <= set(
        CompletionRequest.model_fields
    )
    pytest.importorskip("transformers")
    from free_transformer.hf.modeling import SAMPLING_RULE

    assert SAMPLING_RULE == {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}


def test_generation_config_is_the_rule_plus_stop_tokens_and_has_no_second_latent_choice():
    assert [f.name for f in dataclasses.fields(GenerationConfig)] == [
        *(f.name for f in dataclasses.fields(Sampling)),
        "stop_tokens",
    ]
    with pytest.raises(TypeError, match="prompt_latents"):
        GenerationConfig(prompt_latents="prior")


def test_the_seeds_of_a_sample_are_read_once_the_entry_point_has_set_the_seed():
    """latent_seed unset is seed (generate and the server resolve it alike); an unset seed has no seeds yet."""
    assert SamplingParams(seed=5).seeds() == (5, 5)
    assert SamplingParams(seed=5, latent_seed=9).seeds() == (5, 9)
    with pytest.raises(ValueError, match="no seed yet"):
        SamplingParams(latent_seed=9).seeds()


@pytest.mark.parametrize(
    "setting, value, words",
    [
        ("min_p", 1.5, "must be in (0, 1], got 1.5"),
        ("top_k", 0, "must be >= 1, got 0"),
        ("temperature", -1.0, "must be a finite number >= 0, got -1.0"),
        ("n", 0, "must be >= 1, got 0"),
        # an int64 on the device: 2**63 overflowed there, a 500 that failed the server's other requests
        ("top_k", 2**63, f"must be at most 2**63 - 1 (any value above the vocabulary keeps every token), got {2**63}"),
        ("n", 2**63, f"must be at most 2**63 - 1, got {2**63}"),
        ("max_new_tokens", 2**63, f"must be at most 2**63 - 1, got {2**63}"),
        ("best_of", 0, "must be an integer from 1 to 128 (MAX_CANDIDATES per prompt), got 0"),
        ("best_of", 2**63, f"must be an integer from 1 to 128 (MAX_CANDIDATES per prompt), got {2**63}"),
    ],
)
def test_a_bad_setting_is_refused_in_each_entry_points_own_words(
    checkpoint, capsys, monkeypatch, setting, value, words
):
    with pytest.raises(ValueError, match=rf"^{setting} {re.escape(words)}$"):
        SamplingParams(**{setting: value})
    flag = "--num-samples" if setting == "n" else f"--{setting.replace('_', '-')}"
    assert main(["generate", checkpoint, "--prompt", "K>", flag, str(value)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {flag} {words}"]
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/{setting.replace('_', '-')} {value}\n"))
    assert main(["generate", checkpoint, "--interactive"]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")] == [
        f"error: /{setting.replace('_', '-')} {words}"
    ]


def test_a_top_k_above_the_vocabulary_keeps_every_token(checkpoint):
    """top_k 2**63 - 1 (the largest allowed) and the vocabulary's size sample what no top_k samples."""
    model, _ = load_model(checkpoint)
    ids = torch.tensor([[ord("K"), ord(">")]] * 3)

    def tokens(top_k):
        config = GenerationConfig(max_new_tokens=8, temperature=1.5, top_k=top_k)
        return generate(model, ids, config, seeds=[4, 5, 6]).tokens

    everything = tokens(None)
    assert tokens(2**63 - 1) == tokens(model.config.vocab_size) == everything != tokens(3)


def test_every_entry_point_checks_a_rows_room_with_one_rule(checkpoint, capsys):
    """generate(), `free-transformer generate` and the server refuse a prompt and max_new_tokens that overflow the
    context in the same words (inference.params.check_room), the server naming the field max_tokens."""
    pytest.importorskip("fastapi")
    from free_transformer.data.tokenizer import get_tokenizer
    from free_transformer.serve.protocol import CompletionRequest
    from free_transformer.serve.request_plan import Engine, RequestError

    model, config = load_model(checkpoint)
    context = model.config.max_seq_len
    words = (
        f"prompt (2) + max_new_tokens ({context}) - 1 exceeds max_seq_len {context}: "
        f"max_new_tokens can be at most {context - 1}"
    )
    with pytest.raises(ValueError) as library:
        generate(model, [[ord("K"), ord(">")]], GenerationConfig(max_new_tokens=context))
    assert str(library.value) == words
    assert main(["generate", checkpoint, "--prompt", "K>", "--max-new-tokens", str(context)]) == 2
    assert capsys.readouterr().err == f"error: {words}\n"
    engine = Engine(model, get_tokenizer(config["tokenizer"]), "run", max_batch=1)
    with pytest.raises(RequestError) as served:
        engine.plan(CompletionRequest(model="run", prompt="K>", max_tokens=context))
    assert (str(served.value), served.value.param) == (words.replace("max_new_tokens", "max_tokens"), "max_tokens")


def _samples(capsys, argv) -> list[str]:
    assert main(argv) == 0, capsys.readouterr().err
    return [json.loads(line)["sample"] for line in capsys.readouterr().out.splitlines()]


def test_min_p_samples_alike_as_an_option_a_command_and_in_the_library(checkpoint, capsys, monkeypatch):
    """--min-p, /min-p and GenerationConfig(min_p=...) give the same samples, and min-p changes them."""
    options = ["-n", "3", "--seed", "4", "--max-new-tokens", "8", "--temperature", "0.5", "--format", "jsonl"]
    command = ["generate", checkpoint, "--prompt", "K>", *options]
    filtered = _samples(capsys, [*command, "--min-p", "0.5"])
    assert filtered != _samples(capsys, command)
    monkeypatch.setattr("sys.stdin", io.StringIO("/min-p 0.5\n/seed 4\nK>\n"))
    assert _samples(capsys, ["generate", checkpoint, "--interactive", *options]) == filtered
    model, _ = load_model(checkpoint)
    ids = torch.tensor([[ord("K"), ord(">")]] * 3)
    tokens = generate(
        model,
        ids,
        GenerationConfig(max_new_tokens=8, temperature=0.5, min_p=0.5),
        seeds=[sample_seed(4, 0, i) for i in range(3)],  # the command's: prompt 0's three samples
    ).tokens
    assert [bytes(row).decode("utf-8", "replace") for row in tokens] == filtered
