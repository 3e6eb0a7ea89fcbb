"""What the model's forward takes as `latents`, already resolved (a user's choice is parsed where it enters and
resolved once, in free_transformer.inference.latents):

    LatentChoice.ENCODER  Z_t sampled from the encoder's posterior Q(Z | S): training and KV-cache prefill.
                          Needs the whole sequence (the encoder is non-causal).
    LatentChoice.PRIOR    every Z_t drawn independently from the prior (LatentSpace.prior_).
    values                a (B or 1, T, *value_shape) tensor of explicit Z_t, one per fed position, checked by
                          LatentSpace.check_values (an int64 index in [0, 2^H) for the binary kinds).
    PolicyDraw(noise)     each Z_t drawn from the model's learned prior or policy (model.latent.policy) at its
                          position, given the prefix and Z_{t-1}, with the given noise of random words
                          (LatentSpace.policy_noise and sample_from_noise).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...base.latent_choice import ContextChoice


@dataclass(frozen=True)
class PolicyDraw:
    """Z from the model's policy head (free_transformer.model.latent.policy): Z_t = sample_from_noise(params_t,
    noise[:, t]), params_t the head's output at position t, which reads the prefix and Z_{t-1}. noise: (B, T, ...)
    the kind's `policy_noise` of row i's LATENT stream at t (`draws.counter_policy_noise`), so a row's Z depends on
    its key, its prefix and t."""

    noise: Tensor  # (B, T, ...) space.policy_noise of (B, T, space.policy_words) int64 words
    # (B, *value_shape) the Z fed at the position before the first this draw covers; None: it covers position 0
    previous: Tensor | None = None
    # rows that do not draw from the policy (the decoding engine's rows of another kind of Z in one step): their
    # Z is `given` (B, T, *value_shape) where `use` (B,) bool is False; None: every row draws from the policy
    given: Tensor | None = None
    use: Tensor | None = None


LatentSource = ContextChoice | Tensor | PolicyDraw
