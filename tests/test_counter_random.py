"""The counter-based generator (free_transformer.base.counter_random) that every decoded row draws its token noise
and prior Z from: the SplitMix64 words against the same hash on Python integers, then statistical tests with fixed
keys (integer arithmetic: the same numbers on every machine, so a verdict cannot flake). Each chi-square threshold
is the 1 - 1e-6 quantile of its distribution (scipy.stats.chi2.ppf)."""

import math

import pytest
import torch

from free_transformer.base import counter_random as cr
from free_transformer.inference.sampling import RowSettings, SamplingVariant, next_tokens, token_uniforms

CHI2_63, CHI2_255, CHI2_48 = 131.37, 377.08, 109.66  # chi2.ppf(1 - 1e-6, df) for df 63, 255, 48


def _reference_words(seed: int, position: int, stream: int, n: int) -> list[int]:
    """What `words(row_keys(seed), position, stream, n)` computes, on Python integers modulo 2^64."""
    key = cr.mix_int(seed)
    state = cr.mix_int(key + (position + 1) * cr.POSITION_GAMMA)
    return [cr.mix_int(state + (stream * cr.STREAM_STRIDE + j + 1) * cr.GAMMA) for j in range(n)]


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**62 + 17, 2**63 - 1])
def test_words_are_splitmix64_on_integers(seed):
    """int64 tensor arithmetic (products wrapping modulo 2^64, logical shifts) gives the hash's exact words."""
    keys = cr.row_keys(torch.tensor([seed, seed]))
    got = cr.words(keys, torch.tensor([0, 1000]), cr.LATENT, 5)
    for row, position in enumerate((0, 1000)):
        want = _reference_words(seed, position, cr.LATENT, 5)
        assert [w & cr.MASK64 for w in got[row].tolist()] == want


def test_uniforms_are_in_the_open_interval_and_uniform():
    """65,536 uniforms of one stream, in 64 bins: chi-square under its 1e-6 quantile; never 0 nor 1."""
    u = cr.uniform(cr.words(cr.row_keys(torch.tensor(7)), torch.tensor(3), cr.TOKEN, 2**16))
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    expected = u.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_63


def test_the_extreme_words_give_uniforms_inside_the_interval():
    """The top 24 bits all 0 or all 1: (k + 1/2) / 2^24 is 2^-25 at the bottom; at the top float32 rounds it to 1,
    which `uniform` keeps below."""
    extremes = torch.tensor([0, -1, (1 << 40) - 1, cr._signed(((1 << 24) - 2) << 40)], dtype=torch.int64)
    u = cr.uniform(extremes)
    # k = 2^24 - 2: k + 1/2 ties to the even k
    assert u.tolist() == [2.0**-25, cr.BELOW_ONE, 2.0**-25, 1 - 2.0**-23] and float(u.max()) < 1


def _pairs_chi2(a, b, bins=16) -> float:
    """Chi-square of the (bins x bins) table of uniform pairs (a, b): independence and uniformity at once."""
    cells = (a * bins).long() * bins + (b * bins).long()
    counts = torch.bincount(cells, minlength=bins * bins).double()
    expected = a.numel() / bins**2
    return float(((counts - expected) ** 2 / expected).sum())


def test_neighbouring_counters_and_seeds_are_independent():
    """Pairs of uniforms from neighbouring indices, positions, streams and seeds (the counters and keys the engine
    uses side by side) fill a 16 x 16 table evenly, and their correlation is within 5 standard errors of 0."""
    n = 2**15
    seeds = torch.arange(n)  # n rows, seeds 0, 1, 2, ...
    keys = cr.row_keys(seeds)
    at = cr.uniform(cr.words(keys, torch.full((n,), 10), cr.TOKEN, 2))  # (n, 2)
    pairs = {
        "adjacent index": (at[:, 0], at[:, 1]),
        "adjacent position": (at[:, 0], cr.uniform(cr.words(keys, torch.full((n,), 11), cr.TOKEN, 1))[:, 0]),
        "other stream": (at[:, 0], cr.uniform(cr.words(keys, torch.full((n,), 10), cr.LATENT, 1))[:, 0]),
        "adjacent seed": (at[:-1, 0], at[1:, 0]),
    }
    for name, (a, b) in pairs.items():
        assert _pairs_chi2(a, b) < CHI2_255, name
        correlation = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert abs(correlation) < 5 / math.sqrt(a.numel()), name


def test_every_bit_of_a_word_is_a_fair_coin():
    """Each of the 64 bits of 2^16 words is 1 in half of them within 5 standard errors (the binary prior reads the
    top bits, the uniforms the top 24, the Gaussian's angle bits 16-39)."""
    w = cr.words(cr.row_keys(torch.arange(256)), torch.zeros(256, dtype=torch.int64), cr.LATENT, 256).flatten()
    ones = torch.stack([cr.shift_right(w, bit) & 1 for bit in range(64)]).double().mean(1)
    assert float((ones - 0.5).abs().max()) < 5 * 0.5 / math.sqrt(w.numel())


def test_the_cdf_inversion_draws_the_categorical_distribution():
    """`next_tokens` at temperature 1 over 40,000 rows (distinct seeds, one position, a token of probability 0
    among them) draws token k with probability p_k: chi-square of the 49 other counts (48 degrees of freedom) under
    its 1e-6 quantile,
    and the impossible token never."""
    n, V = 40000, 50
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    logits[7] = float("-inf")
    probs = torch.softmax(logits, -1).double()
    uniforms = token_uniforms(cr.row_keys(torch.arange(n)), torch.full((n,), 5))  # (n,)
    settings = RowSettings(n, "cpu")
    variant = SamplingVariant(sampled=True, filtered=False)
    tokens, non_finite = next_tokens(logits.expand(n, V), settings.view(slice(0, n)), uniforms, variant)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[7] == 0 and not non_finite.any()
    kept = probs > 0
    expected = n * probs[kept]
    assert float(((counts[kept] - expected) ** 2 / expected).sum()) < CHI2_48
