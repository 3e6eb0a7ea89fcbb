"""The ±1 bits through a linear map (`model.latent.kind=bit_linear`), as one public reproduction does:
no 2^H table, so H may go far beyond 16.

    s_h = 2 B_h - 1 in {-1, +1},   R = W s with W (D, H),
    gradient: per-bit straight-through, s + (2 p - 1) - detach(2 p - 1), p_h = sigmoid(L_h)

The value is exactly W s; the bit-logits get d(2 p_h - 1)/dL_h times dR . W_h, each bit on its own
(the Binary Mapper instead weights all 2^H values by their joint probability).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .binary import BinaryLatentSpace
from .draws import Generators, at_least_float32, bits_to_index, index_to_bits, sample_bit_values
from .space import LinearMap, register_latent_kind


@register_latent_kind("bit_linear")
class BitLinear(LinearMap, BinaryLatentSpace):
    """The weight W (D, H), its initialisation and costs: LinearMap's; column h is what bit h adds or removes."""

    def sample(self, bit_logits: Tensor, generator: Generators = None) -> tuple[Tensor, Tensor]:
        bits = sample_bit_values(bit_logits, generator)  # (..., H), the same draws as the Binary Mapper's
        soft = 2 * torch.sigmoid(at_least_float32(bit_logits)) - 1  # (..., H) E[s]
        signs = (2 * bits.to(soft.dtype) - 1) + soft - soft.detach()  # value: exactly the ±1 bits
        return self.linear(signs), bits_to_index(bits)

    def embed(self, value: Tensor) -> Tensor:
        return self.linear(2 * index_to_bits(value, self.units) - 1)  # the ±1 signs (..., H)
