"""Held-out likelihoods against the exact marginal, computed by brute force over every latent sequence."""

import itertools
import math

import pytest
import torch
from conftest import tiny_model

from free_transformer.eval.likelihood import heldout_likelihood, windows
from free_transformer.model.latent import BinaryMapper


class _Bytes:
    name = "bytes"

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "abcde"  # one window of T = 4 predicted tokens with max_seq_len 4


def _model(**overrides):
    model = tiny_model(**{"latent_units": 2, "max_seq_len": 4, "vocab_size": 256, **overrides})
    if model.config.is_free:
        with torch.no_grad():
            model.latent.readout.weight.mul_(0.1)  # a mild posterior: the IWAE converges with few samples
    return model


@torch.no_grad()
def _exact_nll(model) -> float:
    ids = torch.tensor(list(TEXT.encode()))
    zs = torch.tensor(list(itertools.product(range(4), repeat=4)))  # all 4^4 latent sequences
    logits = model(ids[:-1].expand(len(zs), -1), latents=zs).logits.double()
    nll = -torch.log_softmax(logits, -1).gather(-1, ids[1:].expand(len(zs), -1)[..., None]).squeeze(-1).sum(-1)
    return float(-(torch.logsumexp(-nll, 0) - math.log(len(zs))))


def test_bounds_bracket_the_exact_marginal():
    model = _model()
    exact = _exact_nll(model)
    few = heldout_likelihood(model, _Bytes(), TEXT, samples=2)
    many = heldout_likelihood(model, _Bytes(), TEXT, samples=4096)
    # IWAE -> -log p(x): with 4096 samples five seeds all landed within 0.003 nats (256 samples: 0.034)
    assert many["iwae"]["nats"] == pytest.approx(exact, abs=0.01)
    assert many["elbo"]["nats"] >= exact - 1e-6  # ELBO (analytic KL) is an upper bound in expectation
    assert many["elbo"]["nats"] >= many["iwae"]["nats"]
    assert many["prior_ce"]["nats"] >= exact - 0.01  # Jensen: E_prior[-log p(x|z)] >= -log p(x)
    assert few["tokens"] == 4 and few["bytes"] == 4
    assert few["iwae"]["bits_per_token"] == pytest.approx(few["iwae"]["nats"] / (4 * math.log(2)))
    assert few["kl"]["nats"] == pytest.approx(many["kl"]["nats"])  # exact, no sampling


def test_a_latent_the_decoder_ignores_gives_the_baseline_likelihood():
    model = _model()
    with torch.no_grad():
        model.latent.mapper.weight.zero_()  # Z has no effect on p(x | z)
        model.latent.readout.weight.zero_()
        model.latent.readout.bias.zero_()  # q(z | x) uniform = p(z)
    result = heldout_likelihood(model, _Bytes(), TEXT, samples=3)
    exact = _exact_nll(model)
    for measure in ("prior_ce", "elbo", "iwae", "posterior_ce"):
        assert result[measure]["nats"] == pytest.approx(exact, abs=1e-5)  # float32 logsumexp: ~1e-7 nats per token
    assert result["kl"]["nats"] == pytest.approx(0.0, abs=1e-12)


def test_baseline_reports_the_exact_cross_entropy():
    model = _model(latent_units=0)
    result = heldout_likelihood(model, _Bytes(), "abcdefghij")
    assert set(result) >= {"exact"} and "iwae" not in result
    ids = torch.tensor(list(b"abcdefghij"))
    with torch.no_grad():
        total = 0.0
        for w in windows(ids.tolist(), 4):
            w = torch.tensor(w)
            logp = torch.log_softmax(model(w[None, :-1]).logits[0].double(), -1)
            total -= float(logp.gather(-1, w[1:, None]).sum())
    assert result["exact"]["nats"] == pytest.approx(total, abs=1e-5)  # float32 logsumexp: ~1e-7 nats per token
    assert result["windows"] == 3 and result["tokens"] == 9


def test_windows_and_the_binary_log_ratio():
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]
    assert windows([1], 4) == []
    logits = torch.tensor([[[0.0, 2.0]]])
    got = BinaryMapper(2, 1).log_ratio(logits, torch.tensor([[2]]))  # bit 0 = 0, bit 1 = 1; log p(z) = -2 log 2
    assert float(got[0, 0]) == pytest.approx(math.log(0.5) + math.log(1 / (1 + math.exp(-2))) + 2 * math.log(2))
    with pytest.raises(ValueError):
        heldout_likelihood(_model(), _Bytes(), "a")
