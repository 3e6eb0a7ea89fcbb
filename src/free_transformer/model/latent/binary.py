"""The binary form of Z (the paper's): Z_t is H independent bits, kept as the index d = sum_h 2^h B_h
in [0, 2^H); the prior is uniform, P(Z_t = z) = 2^-H; the encoder's read-out is H bit-logits,
P(B_h = 1) = sigmoid(L_h), and the KL to the prior is H Bernoulli terms in closed form. The binary kinds
(`binary_mapper`, `bit_linear`) share all of this and differ only in how the bits become R and in the
gradient that reaches the bit-logits."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ...base.counter_random import shift_right, uniform
from ...base.units import LN2
from .draws import (
    Generators,
    at_least_float32,
    bits_to_index,
    code_log_probabilities,
    fill_rows_,
    index_to_bits,
    kl_per_bit,
)
from .space import LatentSpace, with_first_entry


class BinaryLatentSpace(LatentSpace):
    """Base of the binary kinds: values are int64 indices (...,); subclasses give sample, embed and the
    parameters."""

    value_dtype: ClassVar[torch.dtype] = torch.int64
    max_units: ClassVar[int] = 62  # indices stay int64
    has_learned_prior: ClassVar[bool] = True

    @property
    def value_shape(self) -> tuple[int, ...]:
        return ()

    def prior_(self, out: Tensor, generator: Generators = None) -> Tensor:
        # One randint per row (random_ is its kernel), not H bits: it is drawn at every decoded token.
        return fill_rows_(out, lambda rows, g: rows.random_(0, 2**self.units, generator=g), generator)

    @property
    def prior_words(self) -> int:
        return 1

    def prior_from_words(self, words: Tensor) -> Tensor:
        return shift_right(words[..., 0], 64 - self.units)  # the word's top H bits: a uniform index

    def kl_per_unit(self, posterior: Tensor) -> Tensor:
        return kl_per_bit(posterior)

    def log_ratio(self, posterior: Tensor, value: Tensor) -> Tensor:
        """log Q(Z_t = z) = sum_h log P(B_h = b_h) from the bit-logits; log p(z) = -H log 2."""
        bits = index_to_bits(value, posterior.shape[-1]).bool()
        logits = at_least_float32(posterior)
        log_q = torch.where(bits, F.logsigmoid(logits), F.logsigmoid(-logits)).double().sum(-1)
        return log_q + posterior.shape[-1] * LN2

    def value_log_probs(self, posterior: Tensor) -> tuple[Tensor, Tensor]:
        """The 2^H codes, each of prior probability 2^-H."""
        log_p = torch.full(
            (2 ** posterior.shape[-1],), -posterior.shape[-1] * LN2, dtype=torch.float64, device=posterior.device
        )
        return code_log_probabilities(posterior), log_p

    def prior_params(self) -> Tensor:
        return torch.zeros(self.units)  # bit-logits 0: fair coins

    @property
    def policy_words(self) -> int:
        return self.units  # one uniform per bit

    def policy_noise(self, words: Tensor) -> Tensor:
        return uniform(words)  # (..., H) float32: bit h is 1 where its uniform is below P(B_h = 1)

    def sample_from_noise(self, params: Tensor, noise: Tensor) -> Tensor:
        logits = params if params.dtype == torch.float32 else params.float()  # a no-op cast still costs a dispatch
        return bits_to_index(noise < torch.sigmoid(logits))

    def log_prob(self, params: Tensor, value: Tensor) -> Tensor:
        bits = index_to_bits(value, self.units).bool()
        logits = at_least_float32(params)
        return torch.where(bits, F.logsigmoid(logits), F.logsigmoid(-logits)).sum(-1)

    def kl_between(self, q_params: Tensor, p_params: Tensor) -> Tensor:
        """sum_h q_h (log q_h - log p_h) + (1 - q_h)(log(1 - q_h) - log(1 - p_h)), q_h = sigmoid of its logit."""
        q, p = at_least_float32(q_params), at_least_float32(p_params)
        q1 = torch.sigmoid(q)
        return (q1 * (F.logsigmoid(q) - F.logsigmoid(p)) + (1 - q1) * (F.logsigmoid(-q) - F.logsigmoid(-p))).sum(-1)

    def check_values(self, values: Tensor) -> Tensor:
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(f"latents of kind {self.kind} must be integer indices, got {values.dtype}")
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 2**self.units):
            raise ValueError(
                f"latent indices must lie in [0, 2^{self.units}), got min {int(values.min())} max {int(values.max())}"
            )
        return values.to(torch.int64)

    def outside_values(self, values: Tensor) -> list[Tensor]:
        return with_first_entry(values, -1, 2**self.units)
