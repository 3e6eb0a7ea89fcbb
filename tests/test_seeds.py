"""Seeds and candidate counts are checked by one function each (inference/params.py: check_seed,
check_candidates) wherever they enter: Python's generate() and best_of(), SamplingParams (the CLI's options and
the server's requests), eval's settings. A seed that is not an int in [0, 2**63) (a bool, a float, a string, a
number out of range) is one line; it used to sample, "5" as seed 5 and 5.0 as another."""

import pytest
import torch
from conftest import tiny_model

from free_transformer import GenerationConfig, best_of, generate
from free_transformer.cli import main
from free_transformer.inference.params import MAX_CANDIDATES, SamplingError, SamplingParams

BAD_SEEDS = [-1, 2**63, 2**64, 1.5, "x", True, "5", 5.0]
SHORT = GenerationConfig(max_new_tokens=2, temperature=1.0)
PROMPTS = torch.ones(1, 3, dtype=torch.long)


@pytest.fixture(scope="module")
def model():
    return tiny_model(latent_units=4)


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_a_bad_seed_is_one_line_everywhere(model, seed):
    with pytest.raises(SamplingError, match=r"^seed must be in \[0, 2\*\*63\) \(an int\), got "):
        generate(model, PROMPTS, SHORT, seed=seed)
    with pytest.raises(SamplingError, match=r"^seed must be in \[0, 2\*\*63\) \(an int\), got "):
        best_of(model, PROMPTS, 2, SHORT, seed=seed)
    with pytest.raises(SamplingError, match=r"^seed must be in \[0, 2\*\*63\) \(an int\), got "):
        SamplingParams(seed=seed)
    with pytest.raises(SamplingError, match=r"^latent_seed must be in \[0, 2\*\*63\)"):
        generate(model, PROMPTS, SHORT, seed=1, latents="shared", latent_seed=seed)
    with pytest.raises(SamplingError, match=r"^seeds\[0\] must be in \[0, 2\*\*63\)"):
        generate(model, PROMPTS, SHORT, seeds=[seed])
    with pytest.raises(SamplingError) as caught:
        SamplingParams(seed=seed)
    assert str(caught.value) == f"seed must be in [0, 2**63) (an int), got {seed!r}"  # the value as repr shows it


def test_a_good_seed_of_any_integer_type_samples_as_its_int(model):
    import numpy

    plain = generate(model, PROMPTS, SHORT, seed=5).tokens
    assert generate(model, PROMPTS, SHORT, seed=numpy.int64(5)).tokens == plain


@pytest.mark.parametrize("n", [0, MAX_CANDIDATES + 1, 10**12])
def test_best_of_is_bounded_by_max_candidates_as_the_server_is(model, n):
    with pytest.raises(SamplingError, match=rf"^n must be an integer from 1 to {MAX_CANDIDATES} \(MAX_CANDIDATES"):
        best_of(model, PROMPTS, n, SHORT)
    if n:
        with pytest.raises(SamplingError, match=rf"^best_of must be an integer from 1 to {MAX_CANDIDATES}"):
            SamplingParams(best_of=n)


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["generate", "ckpt", "--prompt", "a", "--best-of", "100000"],
            f"--best-of must be an integer from 1 to {MAX_CANDIDATES}",
        ),
        (["generate", "ckpt", "--prompt", "a", "--seed", "-1"], "--seed must be in [0, 2**63)"),
        (
            ["eval", "ckpt", "--generation-samples", "1000000"],
            f"--generation-samples must be an integer from 1 to {MAX_CANDIDATES}",
        ),
    ],
)
def test_the_command_line_refuses_them_in_one_line(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert words in error and error.count("\n") == 1, error
