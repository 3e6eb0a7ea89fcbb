"""The learned prior: the policy head trained, with the decoder and the encoder frozen, to match the encoder's
posterior on the run's own training data,

    min KL(Q(Z_t | S) || p(Z_t | X<=t, Z_{t-1}))   per token, Q the encoder's read-out on the whole sequence S,
                                                   p the head's on the first half's output at t and the Z
                                                   sampled from Q at t - 1

so that Z drawn from it, position by position, looks like the Z the decoder was trained with. Where the encoder's
Z carries what the prefix already says, p can match it; what only the future holds, p guesses once and then
continues from the Z it drew (Z_{t-1} carries the guess), as the encoder's Z of one sequence agree with each
other."""

from __future__ import annotations

import torch
from torch import Tensor

from ...model.transformer import FreeTransformer


def prior_kl(model: FreeTransformer, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(KL(Q || p) (B, T), KL(Q || uniform prior) (B, T)) in nats for training inputs (B, T): the head's loss, with
    its gradient, and what the kind's own prior pays for the same posterior. The Z_{t-1} the head reads are one
    sample of Q (the global RNG's)."""
    assert model.latent is not None and model.latent.policy is not None and model.latent_space is not None
    T = tokens.shape[1]
    with torch.no_grad():  # the decoder and the encoder are frozen: only the head learns
        x_half = model.first_half(tokens)  # (B, T, D)
        posterior = model.latent.encode(x_half, model.rope_cos[:T], model.rope_sin[:T])  # (B, T, P)
        _, sampled = model.latent_space.sample(posterior)  # (B, T, *value_shape)
    space = model.latent_space
    return space.kl_between(posterior, model.latent.policy_params(x_half, sampled)), space.kl(posterior).detach()
