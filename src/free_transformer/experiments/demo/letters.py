"""What the decoder takes from Z on the letters, read off fresh sequences rather than off generations:
the bits Z saves (measures.bits_saved) at the target's first letter (the position decision) and at each
'!' (a noise decision). A model that ignores Z scores 0 on both; the baseline has no Z and no score.
Beside them, the encoder's KL split into what Z tells about the sequence and its prior mismatch
(measures.kl_split): the codes that prior draws give the decoder in other proportions than training did.
"""

from __future__ import annotations

import torch

from ...analysis.measures import bits_saved, kl_split
from ...base.latent_choice import LatentChoice
from ...data.synthetic import TARGET_LENGTH, letters_batch
from ...model.transformer import FreeTransformer

PROMPT_LENGTH = 2  # "<letter>>"


def target_starts(tokens: torch.Tensor) -> torch.Tensor:
    """(B, 66) letters sequences -> (B,) body index of the target's first letter, or -1 where noise
    hides the block's first or last letter (about 12% of sequences; their start is ambiguous)."""
    body = tokens[:, PROMPT_LENGTH:]
    is_letter = body == tokens[:, :1]  # (B, 64)
    index = torch.arange(body.shape[1], device=tokens.device)
    first = torch.where(is_letter, index, body.shape[1]).min(1).values
    last = torch.where(is_letter, index, -1).max(1).values
    return torch.where(last - first == TARGET_LENGTH - 1, first, -1)


def fresh_sequences(model: FreeTransformer, sequences: int, seed: int) -> torch.Tensor:
    """The (sequences, 66) letters sequences of `seed` that Z's measures read, on the model's device."""
    return letters_batch(sequences, torch.Generator().manual_seed(seed)).to(model.rope_cos.device)


def latent_units(model: FreeTransformer, *, sequences: int = 256, samples: int = 2, seed: int = 0) -> dict:
    """Bits the decoder takes from Z at the target's first letter and per '!' (means over `sequences`
    fresh sequences and `samples` draws of Z each)."""
    if not model.config.is_free:
        return {}
    tokens = fresh_sequences(model, sequences, seed)  # (B, 66)
    saved = bits_saved(model, tokens, samples=samples, seed=seed)  # (B, 65); column i + 1 is body character i
    starts = target_starts(tokens)
    known = starts >= 0
    at_start = saved[known, starts[known] + PROMPT_LENGTH - 1]
    at_noise = saved[tokens[:, 1:] == ord("!")]
    return {"latent_bits_position": at_start.mean().item(), "latent_bits_noise": at_noise.mean().item()}


@torch.no_grad()
def latent_kl_split(model: FreeTransformer, *, sequences: int = 256, seed: int = 0) -> dict:
    """The encoder's KL on `sequences` fresh sequences, bits per token: information about the sequence and
    prior mismatch (measures.kl_split)."""
    space = model.latent_space
    if space is None:  # a baseline
        return {}
    model.eval()
    tokens = fresh_sequences(model, sequences, seed)  # (B, 66)
    generator = torch.Generator(device=tokens.device).manual_seed(seed)
    posterior = model(tokens[:, :-1], latents=LatentChoice.ENCODER, generator=generator).posterior  # (B, 65, P)
    split = kl_split(space, posterior, generator=generator)
    return {"kl_information_bits": split["information"], "kl_prior_mismatch_bits": split["prior_mismatch"]}
