"""What the model's forward takes as `latents`, already resolved (a user's choice is parsed where it enters and
resolved once, in free_transformer.inference.latents):

    LatentChoice.ENCODER  Z_t sampled from the encoder's posterior Q(Z | S): training and KV-cache prefill.
                          Needs the whole sequence (the encoder is non-causal).
    LatentChoice.PRIOR    every Z_t drawn independently from the prior (LatentSpace.prior_).
    values                a (B or 1, T, *value_shape) tensor of explicit Z_t, one per fed position, checked by
                          LatentSpace.check_values (an int64 index in [0, 2^H) for the binary kinds).
"""

from __future__ import annotations

from torch import Tensor

from ...base.latent_choice import ContextChoice

LatentSource = ContextChoice | Tensor
