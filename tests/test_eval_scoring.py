"""Scoring against naive references: log-probabilities recomputed by hand with the same latents."""

import math

import pytest
import torch
from conftest import tiny_model

from free_transformer.base.counter_random import row_keys
from free_transformer.base.seeding import benchmark_seed
from free_transformer.eval.scoring import (
    _generators,
    continuation_logprobs,
    cut_at_stop,
    fit_window,
    generate_texts,
    log_mean_exp,
    sample_sources,
)
from free_transformer.eval.settings import EvalConfig, EvalSettingsError
from free_transformer.inference.generate import GenerationConfig, generate
from free_transformer.model.latent import PolicyDraw, counter_policy_noise
from free_transformer.train.rl.trainer import with_policy_head

REQUESTS = [
    [([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4], [7]), ([1, 2, 3, 4], [8, 9, 10])],
    [([11, 12], [13, 14, 15]), ([11, 12, 16], [13, 14, 15])],  # different contexts (WinoGrande-like)
]
KEYS = ["doc/a", "doc/b"]


def latent_settings(**options):
    """Settings that choose the latent draws only (scoring needs no task)."""
    return EvalConfig(tasks="none", **options).settings()


@torch.no_grad()
def _naive(model, ctx, cont, latents):
    tokens = torch.tensor([ctx + cont[:-1]])
    logp = torch.log_softmax(model(tokens, latents=latents).logits[0].double(), -1)
    return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))


def test_baseline_scores_are_exact_log_probabilities():
    model = tiny_model(latent_units=0)
    scores = continuation_logprobs(model, REQUESTS, KEYS, latent_settings(latent_samples=3))
    for pairs, got in zip(REQUESTS, scores):
        assert got.shape == (len(pairs), 1)  # a baseline has no latent to average over
        for c, (ctx, cont) in enumerate(pairs):
            assert got[c, 0].item() == pytest.approx(_naive(model, ctx, cont, "prior"), abs=1e-9)


def test_prior_scores_average_prior_draws_shared_by_the_choices():
    model = tiny_model(latent_units=4)
    settings = latent_settings(latent_samples=3, seed=5)
    scores = continuation_logprobs(model, REQUESTS, KEYS, settings, batch_tokens=7)  # many small batches
    for pairs, key, got in zip(REQUESTS, KEYS, scores):
        longest = max(len(c) + len(t) - 1 for c, t in pairs)
        z = model.latent_space.prior((3, longest), _generators(5, key, 3))  # one draw of the longest, per row
        for c, (ctx, cont) in enumerate(pairs):
            for k in range(3):
                expected = _naive(model, ctx, cont, z[k : k + 1, : len(ctx) + len(cont) - 1])
                assert got[c, k].item() == pytest.approx(expected, abs=1e-9)
    # the estimator: log of the mean probability over draws, not the mean log-probability
    marginal = log_mean_exp(scores[0])
    assert torch.allclose(marginal, torch.log(scores[0].exp().mean(-1)))
    assert (marginal >= scores[0].mean(-1) - 1e-12).all()
    # per-document seeding: the same document scores the same whatever the batch around it
    alone = continuation_logprobs(model, REQUESTS[1:], KEYS[1:], settings)
    torch.testing.assert_close(alone[0], scores[1])


def test_encoder_prefill_sees_the_context_only():
    model = tiny_model(latent_units=4)
    seen = []
    original = model.forward

    def spy(tokens, *args, latents="encoder", **kwargs):
        if isinstance(latents, str) and latents == "encoder":
            seen.append(tokens[0].tolist())
        return original(tokens, *args, latents=latents, **kwargs)

    model.forward = spy
    continuation_logprobs(model, REQUESTS, KEYS, latent_settings(latents="encoder", latent_samples=2))
    contexts = sorted({tuple(c) for pairs in REQUESTS for c, _ in pairs})
    assert sorted(tuple(s) for s in seen) == contexts  # once per distinct context, never with a choice


def test_encoder_prefill_uses_encoder_latents_on_context_positions():
    model = tiny_model(latent_units=4)
    settings = latent_settings(latents="encoder", latent_samples=2, seed=1)
    got = continuation_logprobs(model, REQUESTS[:1], KEYS[:1], settings)[0]
    ctx = REQUESTS[0][0][0]
    # generation's rule: the rows' generators sample the context's Z from the encoder, then draw the prior's
    rows = _generators(1, "doc/a", 2)
    enc = model(torch.tensor([ctx] * 2), latents="encoder", generator=rows).latents
    prior = torch.cat([enc, model.latent_space.prior((2, 6 - len(ctx)), rows)], dim=1)
    for c, (_, cont) in enumerate(REQUESTS[0]):
        for k in range(2):
            z = prior[k : k + 1, : len(ctx) + len(cont) - 1]
            assert got[c, k].item() == pytest.approx(_naive(model, ctx, cont, z), abs=1e-9)


def test_fit_window_keeps_the_end_and_one_context_token():
    assert fit_window([1, 2, 3], [4, 5], 10) == ([1, 2, 3], [4, 5])
    assert fit_window([1, 2, 3], [4, 5], 3) == ([2, 3], [4, 5])
    assert fit_window([1], [2, 3, 4, 5], 2) == ([3], [4, 5])
    with pytest.raises(ValueError):
        fit_window([1], [], 4)


def test_long_contexts_are_truncated_not_rejected():
    model = tiny_model(latent_units=4)  # max_seq_len 40
    long = [([i % 50 for i in range(100)], [1, 2, 3])]
    out = continuation_logprobs(model, [long], ["long"], latent_settings(latent_samples=2))
    assert torch.isfinite(out[0]).all()


class _Bytes:
    def encode(self, text):
        return [b % 50 for b in text.encode()]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("latent_units", [0, 4])
def test_generation_stops_at_stop_strings(latent_units):
    model = tiny_model(latent_units=latent_units)
    tok = _Bytes()
    settings = latent_settings(generation_samples=2)
    full, _ = generate_texts(model, tok, "hello", "g", settings, max_new_tokens=12)
    assert len(full) == (2 if latent_units else 1) and all(len(t) == 12 for t in full)
    stop = full[0][3:5]
    cut, truncated = generate_texts(model, tok, "hello", "g", settings, max_new_tokens=12, stop=[stop])
    assert cut[0] == cut_at_stop(full[0], [stop]) and len(cut[0]) <= 3 and not truncated
    _, truncated = generate_texts(model, tok, "x" * 200, "g", settings, max_new_tokens=12)
    assert truncated


def test_latent_settings_validation_and_description():
    with pytest.raises(EvalSettingsError, match="latents must be one of 'encoder', 'prior', 'policy', got 'shared'"):
        latent_settings(latents="shared")
    with pytest.raises(EvalSettingsError, match=r"\('posterior' is now called 'encoder'\), got 'posterior'"):
        latent_settings(latents="posterior")
    for name in ("latent_samples", "generation_samples"):
        with pytest.raises(EvalSettingsError, match=f"{name.replace('_', '-')} must be >= 1, got 0"):
            latent_settings(**{name: 0})
    described = latent_settings(latent_samples=8).describe_latents(tiny_model(latent_units=4))
    assert "context Z: prior" in described["latents"] and "K=8" in described["mc_estimator"]
    assert described["latent_kind"] == "binary_mapper"
    assert latent_settings().describe_latents(tiny_model(latent_units=0))["model"] == "baseline"
    assert math.isclose(float(log_mean_exp(torch.tensor([0.0, 0.0]))), 0.0)


def _policy_model():
    """A Free Transformer with a policy head far from the prior (its Z are not the prior's)."""
    model = with_policy_head(tiny_model(latent_units=4), seed=0)
    with torch.no_grad():
        model.latent.policy.out.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    return model.eval()


def test_policy_scores_draw_every_z_from_the_head_with_noise_the_choices_share():
    """latents policy: draw k of a document is the forward of context + choice with Z from the head and the
    noise of the document's k-th stream (the same for every choice, so choices that share a context share its Z),
    whatever the batches around it."""
    model = _policy_model()
    settings = latent_settings(latent_samples=3, seed=5, latents="policy")
    scores = continuation_logprobs(model, REQUESTS, KEYS, settings, batch_tokens=7)
    space = model.latent_space
    for pairs, key, got in zip(REQUESTS, KEYS, scores):
        longest = max(len(c) + len(t) - 1 for c, t in pairs)
        keys = row_keys(torch.tensor([benchmark_seed(5, key, k) for k in range(3)]))
        noise = counter_policy_noise(space, keys[:, None], torch.arange(longest)[None, :])  # (3, longest, ...)
        contexts = {}
        for c, (ctx, cont) in enumerate(pairs):
            T = len(ctx) + len(cont) - 1
            for k in range(3):
                expected = _naive(model, ctx, cont, PolicyDraw(noise[k : k + 1, :T]))
                assert got[c, k].item() == pytest.approx(expected, abs=1e-9)
            with torch.no_grad():
                z = model(torch.tensor([ctx + cont[:-1]]), latents=PolicyDraw(noise[:1, :T])).latents[0, : len(ctx)]
            assert torch.equal(contexts.setdefault(tuple(ctx), z), z)
    prior = continuation_logprobs(model, REQUESTS, KEYS, latent_settings(latent_samples=3, seed=5))
    assert not torch.allclose(prior[0], scores[0])
    alone = continuation_logprobs(model, REQUESTS[1:], KEYS[1:], settings)
    torch.testing.assert_close(alone[0], scores[1])


def test_policy_generations_draw_from_the_head_and_a_baseline_ignores_it():
    model = _policy_model()
    settings = latent_settings(generation_samples=3, temperature=1.0, latents="policy")
    seeds, latents = sample_sources(model, [1, 2, 3], 6, "doc/v", settings)
    assert latents == "policy" and len(set(seeds)) == 3
    baseline = tiny_model(latent_units=0)
    assert sample_sources(baseline, [1, 2, 3], 6, "doc/v", settings)[1] == "prior"
    settings.check_model(baseline)  # a baseline ignores the latents
    scores = continuation_logprobs(baseline, REQUESTS, KEYS, settings)
    assert scores[0][0, 0].item() == pytest.approx(_naive(baseline, *REQUESTS[0][0], "prior"), abs=1e-9)


def test_policy_latents_without_a_head_or_with_z_drawn_beforehand_are_one_line():
    settings = latent_settings(latents="policy")
    with pytest.raises(EvalSettingsError, match="--latents policy needs a run with a learned prior or policy over Z"):
        settings.check_model(tiny_model(latent_units=4))
    for vary in ("latent", "tokens"):
        with pytest.raises(EvalSettingsError, match="--vary must be both with latents policy"):
            latent_settings(latents="policy", vary=vary, temperature=1.0)
    described = settings.describe_latents(_policy_model())
    assert described["context"] == "policy" and "policy head" in described["latents"]


def _recorded(model, settings, ids=(1, 2, 3), steps=6):
    """The sources sample_sources gives one prompt's generations, and the Z the engine recorded for each."""
    seeds, latents = sample_sources(model, list(ids), steps, "doc/v", settings)
    config = GenerationConfig(max_new_tokens=steps, temperature=settings.temperature)
    result = generate(model, torch.tensor([list(ids)] * len(seeds)), config, seeds=seeds, latents=latents)
    return seeds, result


@pytest.mark.parametrize("context", ["prior", "encoder"])
def test_what_varies_between_a_prompts_generations_is_what_vary_says(context):
    model = tiny_model(latent_units=4)
    for vary, own_z, own_noise in (("both", True, True), ("latent", True, False), ("tokens", False, True)):
        settings = latent_settings(generation_samples=4, vary=vary, temperature=1.0, latents=context)
        seeds, result = _recorded(model, settings)
        z = torch.stack(result.latents)  # (4, positions fed, *value_shape): what the engine fed each row
        assert len(seeds) == 4
        assert (len(set(seeds)) == 4) == own_noise and (len(set(seeds)) == 1) == (not own_noise), vary
        different_z = [not torch.equal(z[0], z[k]) for k in range(1, 4)]
        assert all(different_z) if own_z else not any(different_z), vary


def test_latent_mode_shares_token_noise_so_only_z_can_tell_samples_apart():
    """With a decoder that ignores Z, vary=latent's generations are one sample (their token noise is shared)
    and vary=tokens's are as many as its seeds."""
    model = tiny_model(latent_units=4)
    with torch.no_grad():
        for parameter in model.latent.mapper.parameters():
            parameter.zero_()  # R = 0: Z reaches nothing
    latent = _recorded(model, latent_settings(generation_samples=4, vary="latent", temperature=1.0))[1]
    tokens = _recorded(model, latent_settings(generation_samples=4, vary="tokens", temperature=1.0))[1]
    assert len({tuple(t) for t in latent.tokens}) == 1
    assert len({tuple(t) for t in tokens.tokens}) > 1


def test_vary_tokens_at_temperature_zero_is_refused_in_one_line():
    with pytest.raises(EvalSettingsError, match="--vary must not be tokens at temperature 0 .*all alike"):
        latent_settings(vary="tokens")
    with pytest.raises(EvalSettingsError, match="temperature must be a finite number >= 0, got -1"):
        latent_settings(temperature=-1.0)


def test_the_record_key_of_the_default_sampling_is_the_key_records_had_before_it_was_a_setting():
    settings = latent_settings(generation_samples=2)
    assert "vary" not in settings.to_dict() and "temperature" not in settings.to_dict()
    assert settings.key != latent_settings(generation_samples=2, temperature=0.5).key
    assert settings.key != latent_settings(generation_samples=2, vary="latent").key
