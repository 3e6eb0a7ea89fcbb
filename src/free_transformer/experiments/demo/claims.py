"""The paper's claims on the synthetic letters (four) and the coin flips (one), each a test of the
demo's measures: their thresholds, the verdict per seed, and the count over seeds."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Chance for the data itself: two independent valid samples share their target position with probability
# 1/57 (0.018) and their noise patterns have Jaccard similarity 0.03.
CHANCE_LIKE = 0.12  # no more agreement than a few times chance
# The paper's figure: at 1/64, 1/8 and 1 bit every generation from prior Z is valid; at 8 bits most are not.
VALID, BROKEN = 0.7, 0.5
# Green groups agree on a decision Z holds at least OVER_BLUE times as often as the blue group (the figure's green
# boxes against its blue one). The target position is judged within ±2, as coarse as the paper's 1/8-bit panel.
OVER_BLUE = 2.0
# Bits the decoder takes from Z (letters.py), shown beside the generations: at least USED where Z carries a
# decision (a whole bit of it), at most IGNORED where it carries none of the noise. Why these values: docs/demo.md.
USED, IGNORED = 1.0, 0.1

# The coin claim: generations given the encoder's Z of a sequence show that sequence's coin at least COIN_MATCH of
# the time (chance 0.5), green groups agree on the coin COIN_OVER_BLUE more than the blue group does, and Z saves
# at most COPYING_BITS per sequence (the coin is 1 bit, the flips of T values many more). Why: docs/demo.md.
COIN_MATCH, COIN_OVER_BLUE, COPYING_BITS = 0.75, 0.1, 4.0


@dataclass(frozen=True)
class Condition:
    """One condition of a claim's test, as read on one seed's measures."""

    test: str  # what it requires, e.g. "valid ≥ 0.7"
    measured: str  # the values it read, e.g. "0.91" or "green 0.31, blue 0.12"
    holds: bool


def shown(value: float | None, pattern: str = "{:.3f}") -> str:
    """A measure as the report shows it: n/a where there is none (None, or NaN for a test), -0.00 as 0.00."""
    if value is None or math.isnan(value):
        return "n/a"
    text = pattern.format(value)
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def claim_conditions(results: list) -> list[tuple[str, str, list[Condition]]]:
    """(model slug, claim, its conditions) for each claim, read from one seed's results (each with
    `.variant.slug` and `.measures`); a claim holds when every condition does."""
    by_slug = {r.variant.slug: r.measures for r in results}

    def m(slug, key):  # a missing measure (e.g. no valid sequence to compare) fails every test
        value = by_slug.get(slug, {}).get(key)
        return value if value is not None else float("nan")

    def at_least(slug, key, name, threshold):
        return Condition(f"{name} ≥ {threshold:g}", shown(m(slug, key)), m(slug, key) >= threshold)

    def below(slug, key, name, threshold):
        return Condition(f"{name} < {threshold:g}", shown(m(slug, key)), m(slug, key) < threshold)

    def green_over_blue(slug, decision, name):  # at least OVER_BLUE x blue's agreement, and above it (blue may be 0)
        green, blue = m(slug, f"green_{decision}"), m(slug, f"blue_{decision}")
        return Condition(
            f"green groups agree on {name} ≥ {OVER_BLUE:g}× as often as the blue group, and more",
            f"green {shown(green)}, blue {shown(blue)}",
            green >= OVER_BLUE * blue and green > blue,
        )

    position, noise = "the position within ±2", "the noise (Jaccard)"
    at_start, per_noise = "bits Z saves at the target start", "bits Z saves per '!'"
    kl_ce, base_ce = m("kappa-8", "val_cross_entropy_bits"), m("baseline", "val_cross_entropy_bits")
    green_coin, blue_coin = m("coins", "green_coin_agreement"), m("coins", "blue_coin_agreement")
    coin_bits = m("coins", "coin_bits_saved")
    return [
        (
            "kappa-1-64",
            "1/64 bit: behaves as a vanilla model",
            [
                at_least("kappa-1-64", "valid", "valid", VALID),
                below("kappa-1-64", "green_position_agreement", "green position agreement", CHANCE_LIKE),
                below("kappa-1-64", "green_noise_jaccard", "green noise Jaccard", CHANCE_LIKE),
                below("kappa-1-64", "latent_bits_position", at_start, USED),
                below("kappa-1-64", "latent_bits_noise", per_noise, USED),
            ],
        ),
        (
            "kappa-1-8",
            "1/8 bit: Z encodes the target position",
            [
                at_least("kappa-1-8", "valid", "valid", VALID),
                green_over_blue("kappa-1-8", "position_near", position),
                below("kappa-1-8", "green_noise_jaccard", "green noise Jaccard", CHANCE_LIKE),
                at_least("kappa-1-8", "latent_bits_position", at_start, USED),
                below("kappa-1-8", "latent_bits_noise", per_noise, IGNORED),
            ],
        ),
        (
            "kappa-1",
            "1 bit: Z encodes the position and the noise",
            [
                at_least("kappa-1", "valid", "valid", VALID),
                green_over_blue("kappa-1", "position_near", position),
                green_over_blue("kappa-1", "noise_jaccard", noise),
                at_least("kappa-1", "latent_bits_position", at_start, USED),
                at_least("kappa-1", "latent_bits_noise", per_noise, USED),
            ],
        ),
        (
            "kappa-8",
            "8 bits: the encoder copies the sequence, generation breaks",
            [
                below("kappa-8", "valid", "valid", BROKEN),
                Condition(
                    "posterior cross-entropy below the baseline's",
                    f"{shown(kl_ce)}, baseline {shown(base_ce)}",
                    kl_ce < base_ce,
                ),
            ],
        ),
        (
            "coins",
            "coin flips (Motivation section): Z carries the hidden coin",
            [
                Condition(
                    f"generations given a sequence's encoder Z show its coin ≥ {COIN_MATCH} of the time (chance 0.5)",
                    shown(m("coins", "posterior_coin_match")),
                    m("coins", "posterior_coin_match") >= COIN_MATCH,
                ),
                Condition(
                    f"green groups agree on the coin ≥ {COIN_OVER_BLUE} more often than the blue group",
                    f"green {shown(green_coin)}, blue {shown(blue_coin)}",
                    green_coin >= blue_coin + COIN_OVER_BLUE,
                ),
                Condition(
                    f"Z saves ≤ {COPYING_BITS:g} bits per sequence (more: it copies flips)",
                    shown(coin_bits),
                    coin_bits <= COPYING_BITS,
                ),
            ],
        ),
    ]


# Models a claim reads besides its own (the 8-bit claim compares with the baseline).
ALSO_NEEDS = {"kappa-8": ("baseline",)}


def judge_claims(results: list) -> list[dict]:
    """The verdict on each claim from one seed's results, with its test and each condition's values; only the
    claims whose models ran (`demo --models`)."""
    ran = {r.variant.slug for r in results}
    return [
        {
            "model": slug,
            "claim": claim,
            "test": "; ".join(c.test for c in conditions),
            "conditions": [dataclasses.asdict(c) for c in conditions],
            "reproduced": all(c.holds for c in conditions),
        }
        for slug, claim, conditions in claim_conditions(results)
        if slug in ran and ran.issuperset(ALSO_NEEDS.get(slug, ()))
    ]


def claims_over_seeds(claims_by_seed: dict[int, list[dict]]) -> list[dict]:
    """Per claim: on how many seeds it was reproduced, which, and each seed's conditions."""
    first = next(iter(claims_by_seed.values()))
    return [
        {
            **{k: claim[k] for k in ("model", "claim", "test")},
            "per_seed": {seed: claims[index]["reproduced"] for seed, claims in claims_by_seed.items()},
            "conditions": {seed: claims[index]["conditions"] for seed, claims in claims_by_seed.items()},
            "reproduced": sum(claims[index]["reproduced"] for claims in claims_by_seed.values()),
            "seeds": len(claims_by_seed),
        }
        for index, claim in enumerate(first)
    ]
