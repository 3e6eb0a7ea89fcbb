"""What the decoder takes from Z, read off fresh letters sequences rather than off generations.

For a token, the cross-entropy with Z drawn from the prior minus the cross-entropy with Z drawn from
the encoder's posterior is how many bits knowing the sequence's own Z saves the decoder there. At the
target's first letter it measures the position decision; at each '!' the noise decision. A model
that ignores Z scores 0 on both; the baseline has no Z and no score.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.synthetic import TARGET_LENGTH, letters_batch
from ..model import FreeTransformer
from ..units import LN2

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


@torch.no_grad()
def bits_saved(model: FreeTransformer, tokens: torch.Tensor, *, samples: int = 2, seed: int = 0) -> torch.Tensor:
    """(B, T) sequences -> (B, T - 1) bits knowing the sequence's own Z saves at each predicted token:
    cross-entropy with Z from the prior minus with Z from the encoder, averaged over `samples` draws."""
    model.eval()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    saved = torch.zeros(targets.shape, dtype=torch.float64, device=tokens.device)
    for k in range(samples):
        for source, sign in (("prior", 1.0), ("encoder", -1.0)):
            generator = torch.Generator(device=tokens.device).manual_seed(seed + k)
            logits = model(inputs, latents=source, generator=generator).logits  # (B, T - 1, V)
            nats = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # (B, T - 1)
            saved += sign * nats.double() / (samples * LN2)
    return saved


def latent_bits(model: FreeTransformer, *, sequences: int = 256, samples: int = 2, seed: int = 0) -> dict:
    """Bits the decoder takes from Z at the target's first letter and per '!' (means over `sequences`
    fresh sequences and `samples` draws of Z each)."""
    if not model.config.is_free:
        return {}
    tokens = letters_batch(sequences, torch.Generator().manual_seed(seed)).to(model.rope_cos.device)  # (B, 66)
    saved = bits_saved(model, tokens, samples=samples, seed=seed)  # (B, 65); column i + 1 is body character i
    starts = target_starts(tokens)
    known = starts >= 0
    at_start = saved[known, starts[known] + PROMPT_LENGTH - 1]
    at_noise = saved[tokens[:, 1:] == ord("!")]
    return {"latent_bits_position": at_start.mean().item(), "latent_bits_noise": at_noise.mean().item()}
