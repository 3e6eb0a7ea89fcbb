"""Test-time search over Z (free_transformer.inference.search): best-of-N against naive references, the
variation of its candidates read from the Z the engine recorded, and one engine batch for all candidates."""

import pytest
import torch
from conftest import tiny_model

from free_transformer import GenerationConfig, best_of
from free_transformer.inference import engine as engine_module
from free_transformer.inference.engine import Row
from free_transformer.inference.search import highest, ranking

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
SAMPLED = GenerationConfig(max_new_tokens=6, temperature=1.0)


@torch.no_grad()
def _naive_mean_logprob(model, prompt, tokens, latents):
    """The mean log-probability of `tokens` after `prompt`, one forward of this row alone with its Z."""
    ids = torch.tensor([prompt + tokens[:-1]])
    z = None if latents is None else latents[None, : ids.shape[1]]
    logp = torch.log_softmax(model(ids, latents=z if z is not None else "prior").logits[0].double(), -1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)) / len(tokens)


@pytest.mark.parametrize("latent_units", [0, 4])
def test_the_default_choice_is_the_candidate_of_highest_mean_log_probability_under_its_own_z(latent_units):
    model = tiny_model(latent_units=latent_units)
    found = best_of(model, PROMPTS, 4, SAMPLED, seed=3)
    for i, prompt in enumerate(PROMPTS):
        naive = [
            _naive_mean_logprob(model, prompt, found.tokens[i][k], found.latents[i][k] if found.latents else None)
            for k in range(4)
        ]
        assert found.scores[i] == pytest.approx(naive, abs=1e-9)
        assert found.chosen[i] == max(range(4), key=lambda k, n=naive: n[k])
        assert found.best[i] == found.tokens[i][found.chosen[i]]
    again = best_of(model, PROMPTS, 4, SAMPLED, seed=3)
    assert again.tokens == found.tokens and again.chosen == found.chosen  # the seed fixes the candidates


def test_a_custom_scorer_is_called_once_per_candidate_and_decides():
    model = tiny_model(latent_units=4)
    calls = []

    def shortest_wins(prompt, tokens):
        calls.append((tuple(prompt), tuple(tokens)))
        return -float(sum(tokens))

    found = best_of(model, PROMPTS, 3, SAMPLED, scorer=shortest_wins)
    assert len(calls) == 6 and {c[0] for c in calls} == {tuple(p) for p in PROMPTS}
    for i in range(2):
        assert found.scores[i] == [-float(sum(t)) for t in found.tokens[i]]
        assert found.chosen[i] == highest(found.scores[i])


def test_ties_go_to_the_earlier_candidate():
    assert highest([1.0, 3.0, 3.0, 2.0]) == 1 and highest([0.0, 0.0]) == 0
    assert ranking([1.0, 3.0, 3.0, 2.0]) == [1, 2, 3, 0]


def test_candidates_run_as_rows_of_one_engine_batch(monkeypatch):
    """Every candidate of every prompt decodes in the same steps: 6 tokens take 5 steps after the prefill
    (one call of N candidates, never N calls)."""
    model = tiny_model(latent_units=4)
    steps = []
    step = engine_module.DecodeEngine.step

    def counted(self):
        steps.append(len(self.rows) if hasattr(self, "rows") else None)
        return step(self)

    monkeypatch.setattr(engine_module.DecodeEngine, "step", counted)
    config = GenerationConfig(max_new_tokens=6, temperature=1.0, stop_tokens=())
    best_of(model, PROMPTS, 8, config)
    assert len(steps) == 5


@pytest.mark.parametrize("context", ["encoder", "prior"])
def test_what_differs_between_candidates_is_what_vary_says(context):
    model = tiny_model(latent_units=4)
    for vary, own_z in (("both", True), ("latent", True), ("tokens", False)):
        found = best_of(model, PROMPTS, 4, SAMPLED, vary=vary, latents=context, seed=1)
        for i in range(2):
            z = found.latents[i]
            different = [not torch.equal(z[0], z[k]) for k in range(1, 4)]
            assert all(different) if own_z else not any(different), vary


def test_latent_candidates_share_token_noise_and_token_candidates_do_not():
    """With a decoder Z cannot reach, vary=latent's candidates are one sample and vary=tokens's are several."""
    model = tiny_model(latent_units=4)
    with torch.no_grad():
        for parameter in model.latent.mapper.parameters():
            parameter.zero_()  # R = 0
    latent = best_of(model, PROMPTS, 4, SAMPLED, vary="latent")
    tokens = best_of(model, PROMPTS, 4, SAMPLED, vary="tokens")
    for i in range(2):
        assert len({tuple(t) for t in latent.tokens[i]}) == 1
        assert len({tuple(t) for t in tokens.tokens[i]}) > 1


def test_bad_requests_are_one_line():
    model = tiny_model(latent_units=4)
    with pytest.raises(ValueError, match=r"n must be an integer from 1 to 128 \(MAX_CANDIDATES per prompt\), got 0"):
        best_of(model, PROMPTS, 0)
    with pytest.raises(ValueError, match="vary must be one of both, latent, tokens, got 'z'"):
        best_of(model, PROMPTS, 2, vary="z")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="greedy ones are all alike"):
        best_of(model, PROMPTS, 2, GenerationConfig(max_new_tokens=4, temperature=0.0), vary="tokens")
    with pytest.raises(ValueError, match="latents must be one of 'encoder', 'prior'"):
        best_of(model, PROMPTS, 2, latents="shared")


def test_an_empty_continuation_scores_minus_infinity():
    row = Row([1, 2], GenerationConfig(max_new_tokens=1), 0, scored=True)
    assert row.score == float("-inf")


@pytest.mark.slow  # a research script's runs, each its own process: 5-15 s
def test_the_synthetic_search_script_measures_both_tasks(tmp_path):
    """scripts/search_synthetic.py, which docs/results.md's figures come from, at a tiny size on random runs."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import tiny_checkpoint

    from free_transformer.runs.checkpoint import save_checkpoint

    letters = tiny_checkpoint(tmp_path, "letters", 4, max_seq_len=72)
    coins = tiny_checkpoint(tmp_path, "coins", 4)
    model, _ = __import__("free_transformer").load_model(coins)
    save_checkpoint(
        coins, 1, model, {"tokenizer": "byte", "train": {"data": {"coinflip": {"length": 8, "epsilon": 0.3}}}}
    )
    script = Path(__file__).parents[1] / "scripts" / "search_synthetic.py"
    for args, expected in (
        (["letters", str(letters), "--prompts", "3", "--sizes", "1,2"], "N=2: "),
        (["coins", str(coins), "--prompts", "4", "--samples", "4", "--prefix", "2"], "maj@4: "),
    ):
        out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True).stdout
        lines = out.strip().splitlines()
        assert [line.split()[1] for line in lines] == ["both", "latent", "tokens"] and all(expected in x for x in lines)


@pytest.mark.slow  # a research script's runs, each its own process: 5-15 s
def test_the_rl_synthetic_script_measures_every_source_of_z(tmp_path):
    """scripts/rl_synthetic.py, which docs/results.md's policy tables come from, at a tiny size on random runs: the
    prior with best-of, a head's Z with its KL, the coins with the ceiling of their shown values, and the figure."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import tiny_checkpoint

    from free_transformer.model.config import LatentConfig
    from free_transformer.runs.checkpoint import save_checkpoint

    letters = tiny_checkpoint(tmp_path, "letters", 4, max_seq_len=72, latent=LatentConfig(policy=True))
    headed, _ = __import__("free_transformer").load_model(letters)
    with torch.no_grad():
        headed.latent.policy.out.bias += 2.0  # a head away from its start, the uniform prior
    save_checkpoint(letters, 1, headed, {"tokenizer": "byte"})
    coins = tiny_checkpoint(tmp_path, "coins", 4)
    model, _ = __import__("free_transformer").load_model(coins)
    save_checkpoint(
        coins, 1, model, {"tokenizer": "byte", "train": {"data": {"coinflip": {"length": 8, "epsilon": 0.3}}}}
    )
    (tmp_path / "letters-latent-seed0").mkdir()
    (tmp_path / "letters-latent-seed0" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": s / 4, "reward_calls": 8 * s}) + "\n" for s in (1, 2))
    )
    script = Path(__file__).parents[1] / "scripts" / "rl_synthetic.py"

    def run(*args: str) -> str:
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, check=True).stdout

    prior = run("letters", str(letters), "--prompts", "2", "--samples", "2", "--best-of")
    assert "valid@1 " in prior and "KL 0.000 bits/token" in prior and "best-of-16 over Z " in prior
    assert "CE encoder " in prior and " policy " in prior  # the run has a head: its Z's cross-entropy too
    policy = run("letters", str(letters), "--prompts", "2", "--samples", "2", "--latents", "policy")
    assert "valid@1 " in policy and "KL 0.000" not in policy
    shown = run("coins", str(coins), "--prompts", "8", "--samples", "2", "--best-of")
    assert all(f"{cell} " in shown for cell in ("maj@1", "maj@2", "best-of-16 over Z, shown values", "from 4 values"))
    run("figure", str(tmp_path / "curves.png"), str(tmp_path / "letters-latent-seed0"))
    assert (tmp_path / "curves.png").stat().st_size > 0
