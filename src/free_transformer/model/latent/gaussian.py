"""A continuous Z (`model.latent.kind=gaussian`): Z_t in R^H with the prior N(0, I), the encoder's
posterior N(mu, diag(sigma^2)) read out as H means and H log-variances, sampled by reparameterisation,
and R = W z with W (D, H).

    z = mu + sigma * eps,  eps ~ N(0, I)                 (the gradient reaches mu and log sigma^2)
    KL(N(mu, sigma^2) || N(0, 1)) = (mu^2 + sigma^2 - 1 - log sigma^2) / 2   per unit, in nats

The free-bits hinge applies to the token's KL exactly as for the binary kinds. H is `latent_units`
(dimensions here, not bits).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from ...base.counter_random import shift_right, uniform
from .draws import Generators, at_least_float32, fill_rows_
from .space import LinearMap, register_latent_kind, with_first_entry


def normal_from_words(words: Tensor) -> Tensor:
    """(...,) int64 words -> (...,) float32 N(0, 1) draws: Box-Muller on two 24-bit uniforms of each word (bits
    40-63 and 16-39)."""
    radius = (-2 * uniform(words).log()).sqrt()
    angle = (shift_right(words, 16) & 0xFFFFFF).float() * (2 * math.pi * 2.0**-24)
    return radius * angle.cos()


@register_latent_kind("gaussian")
class GaussianLatent(LinearMap):
    """R = W z with W (D, H): LinearMap's weight, initialisation and costs."""

    max_units: ClassVar[int] = 4096
    params_per_unit: int = 2  # mean, log-variance
    value_dtype: ClassVar[torch.dtype] = torch.float32
    unit: ClassVar[str] = "dimension"
    has_learned_prior: ClassVar[bool] = True

    @property
    def value_shape(self) -> tuple[int, ...]:
        return (self.units,)

    def _moments(self, posterior: Tensor) -> tuple[Tensor, Tensor]:
        """(..., 2H) read-out -> mean (..., H), log-variance (..., H), at least float32."""
        mean, log_var = at_least_float32(posterior).split(self.units, dim=-1)
        return mean, log_var

    def prior_(self, out: Tensor, generator: Generators = None) -> Tensor:
        return fill_rows_(out, lambda rows, g: rows.normal_(generator=g), generator)

    @property
    def prior_words(self) -> int:
        return self.units

    def prior_from_words(self, words: Tensor) -> Tensor:
        return normal_from_words(words).to(self.value_dtype)

    def standard_normal(self, shape: tuple[int, ...], generator: Generators = None, device=None) -> Tensor:
        """(*shape, H) N(0, I) draws of value_dtype, row by row: the reparameterisation's noise, the prior's
        draws here, and still N(0, I) in a subclass that changes the prior."""
        out = torch.empty(*shape, self.units, dtype=self.value_dtype, device=device)
        return fill_rows_(out, lambda rows, g: rows.normal_(generator=g), generator)

    def kl_per_unit(self, posterior: Tensor) -> Tensor:
        mean, log_var = self._moments(posterior)
        return 0.5 * (mean.square() + log_var.exp() - 1 - log_var)

    def log_ratio(self, posterior: Tensor, value: Tensor) -> Tensor:
        """log N(z; mu, sigma^2) - log N(z; 0, 1), summed over the H units (the 2 pi terms cancel)."""
        mean, log_var = (x.double() for x in self._moments(posterior))
        z = value.double()
        return (0.5 * (z.square() - (z - mean).square() / log_var.exp() - log_var)).sum(-1)

    def sample(self, posterior: Tensor, generator: Generators = None) -> tuple[Tensor, Tensor]:
        mean, log_var = self._moments(posterior)
        noise = self.standard_normal(tuple(mean.shape[:-1]), generator, mean.device)  # (..., H) ~ N(0, I)
        # (..., H) in value_dtype, whatever the posterior's: the value recorded is the one R was made of, so
        # that feeding it back as explicit latents gives the same R
        z = (mean + (0.5 * log_var).exp() * noise).to(self.value_dtype)
        return self.embed(z), z.detach()

    def embed(self, value: Tensor) -> Tensor:
        return self.linear(value)

    def prior_params(self) -> Tensor:
        return torch.zeros(2 * self.units)  # means 0, log-variances 0: N(0, I)

    @property
    def policy_words(self) -> int:
        return self.units

    def policy_noise(self, words: Tensor) -> Tensor:
        return normal_from_words(words)  # (..., H) float32 N(0, 1)

    def sample_from_noise(self, params: Tensor, noise: Tensor) -> Tensor:
        mean, log_var = self._moments(params)
        return (mean + (0.5 * log_var).exp() * noise).to(self.value_dtype)

    def log_prob(self, params: Tensor, value: Tensor) -> Tensor:
        mean, log_var = self._moments(params)
        z = value.to(mean.dtype)
        return (-0.5 * ((z - mean).square() / log_var.exp() + log_var + math.log(2 * math.pi))).sum(-1)

    def kl_between(self, q_params: Tensor, p_params: Tensor) -> Tensor:
        """sum_h [log sigma_p/sigma_q + (sigma_q^2 + (mu_q - mu_p)^2) / (2 sigma_p^2) - 1/2]."""
        q_mean, q_log_var = self._moments(q_params)
        p_mean, p_log_var = self._moments(p_params)
        ratio = (q_log_var.exp() + (q_mean - p_mean).square()) / p_log_var.exp()
        return (0.5 * (p_log_var - q_log_var + ratio - 1)).sum(-1)

    def check_values(self, values: Tensor) -> Tensor:
        if not values.is_floating_point():
            raise ValueError(f"latents of kind gaussian must be real vectors (..., {self.units}), got {values.dtype}")
        if values.shape[-1:] != (self.units,):
            raise ValueError(
                f"latents of kind gaussian must end in H = {self.units} values, got shape {tuple(values.shape)}"
            )
        if not bool(values.isfinite().all()):
            raise ValueError("latents of kind gaussian must be finite")
        return values.to(self.value_dtype)

    def outside_values(self, values: Tensor) -> list[Tensor]:
        return with_first_entry(values, math.nan, math.inf, -math.inf)
