"""The coin flips of the paper's Motivation section: does Z carry the hidden coin?

Each training sequence is a start byte and X_1..X_T, all equal to one hidden fair coin flipped with
probability epsilon. A decoder without latents must infer the coin from the values it has generated;
a Free Transformer can draw it up front, in Z. Three measures tell which it does:
- groups, as in the letters figure: the blue group draws every Z_t per sequence, each green group
  shares one Z sequence; both draw all of Z from the prior (the one-byte prompt gives the encoder
  nothing to read). The coin a generated sequence shows is its majority value. Two sequences of the
  blue group show the same coin half of the time; if Z carries the coin, those of a green group
  agree more often.
- the coin of the Z's source: generations given the encoder's Z of a fresh sequence, and how often
  they show that sequence's coin (0.5 if Z says nothing of it).
- bits Z saves over a whole fresh sequence (cross-entropy with prior Z minus with encoder Z, summed
  over the T values): 1 bit if Z holds exactly the coin, more if it also copies individual flips.
Free bits are per token, so a code that costs nothing is spread thinly over the tokens: green groups
agree on the coin more often than blue ones, not always (docs/demo.md).
"""

from __future__ import annotations

import torch

from ...analysis.measures import bits_saved
from ...base.latent_choice import LatentChoice
from ...data.synthetic import COIN_START, coinflip_batch, majority_coin
from ...inference.generate import GenerationConfig
from ...inference.latents import infer_latents
from ...model.transformer import FreeTransformer
from .groups import Groups, blue_and_greens, generate_strings, mean_of_present, pair_mean


def coin_groups(
    model: FreeTransformer, length: int, *, blue_size: int, green_groups: int, green_size: int, seed: int
) -> Groups:
    """Generated values ('0'/'1' strings of `length`) of a blue group and of green groups, every Z from the prior."""
    prompt = torch.full((1, 1), COIN_START)
    config = GenerationConfig(max_new_tokens=length, temperature=1.0)
    return Groups(
        "",
        *blue_and_greens(
            model,
            prompt,
            config,
            blue_size=blue_size,
            green_groups=green_groups,
            green_size=green_size,
            seed=seed,
            prompt_latents=LatentChoice.PRIOR,
        ),
    )


def posterior_coin_match(
    model: FreeTransformer, length: int, epsilon: float, *, references: int = 16, group_size: int = 8, seed: int = 0
) -> float | None:
    """Share of generations showing the coin of the reference sequence whose encoder Z they were given
    (`references` fresh sequences, `group_size` generations each; 0.5 when Z says nothing of the coin)."""
    if not model.config.is_free:
        return None
    device = model.rope_cos.device
    reference = coinflip_batch(references, length, epsilon, torch.Generator().manual_seed(seed)).to(device)
    latents = infer_latents(model, reference[:, :-1], torch.Generator(device=device).manual_seed(seed))  # (R, T)
    config = GenerationConfig(max_new_tokens=length, temperature=1.0)
    shown = generate_strings(
        model, reference[:, :1].repeat_interleave(group_size, 0), config, seed, latents.repeat_interleave(group_size, 0)
    )
    wanted = [majority_coin(bytes(row[1:].tolist()).decode("latin-1")) for row in reference.cpu()]
    pairs = [(majority_coin(values), wanted[i // group_size]) for i, values in enumerate(shown)]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _same_coin(values: list[int | None]) -> float | None:
    return pair_mean([v for v in values if v is not None], lambda a, b: float(a == b))


def coin_measures(groups: Groups) -> dict:
    """Pairwise agreement on the coin within the blue group and within green groups (chance 0.5), and
    the share of sequences showing 1 (0.5 for a fair coin)."""
    blue = [majority_coin(values) for values in groups.blue]
    greens = [[majority_coin(values) for values in green] for green in groups.greens]
    shown = [c for c in blue + [c for green in greens for c in green] if c is not None]
    return {
        "blue_coin_agreement": _same_coin(blue),
        "green_coin_agreement": mean_of_present([_same_coin(g) for g in greens]),
        "ones_share": sum(shown) / len(shown) if shown else None,
    }


def coin_bits_saved(
    model: FreeTransformer, length: int, epsilon: float, *, sequences: int = 256, seed: int = 0
) -> float | None:
    """Bits per sequence the decoder takes from Z on fresh coin-flip sequences (None for a baseline)."""
    if not model.config.is_free:
        return None
    tokens = coinflip_batch(sequences, length, epsilon, torch.Generator().manual_seed(seed))  # (B, 1 + T)
    return bits_saved(model, tokens.to(model.rope_cos.device), seed=seed).sum(1).mean().item()
