"""A categorical Z (`model.latent.kind=categorical`): Z_t is H independent groups of K classes (K in
`model.latent.categorical.classes`), with the uniform prior P(Z_t = z) = K^-H, the encoder's read-out K
logits per group, and R the sum of one learned embedding per group and class, E (H, K, D):

    z_h = argmax_k (l_hk + g_hk),  g ~ Gumbel(0, 1)           a Gumbel-max draw: exactly z_h ~ softmax(l_h)
    R = sum_h E[h, z_h] + sum_h (y_h - detach(y_h)) E[h]      y_h = softmax((l_h + g_h) / tau), tau the temperature
    KL(Q(Z_t | S) || uniform) = sum_h [log K + sum_k q_hk log q_hk]   exact, per group, in nats

R's value is the sum of the sampled embeddings; the logits get the straight-through Gumbel-softmax
gradient (Jang et al. 2017), tau in `model.latent.categorical.temperature`. At K = 2 with E[h, 1] =
-E[h, 0] = W_h this is bit_linear's R = W s, s_h = 2 z_h - 1 (tests/test_latent_categorical.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...base.checks import ConfigError, check_range
from ...base.counter_random import shift_right, uniform
from .draws import Generators, at_least_float32, fill_rows_, rand_rows
from .space import LatentSpace, normal_init_, register_latent_kind, with_first_entry


@dataclass(frozen=True)
class CategoricalSettings:
    """The categorical kind's own settings, model.latent.categorical.* (read when model.latent.kind=categorical)."""

    classes: int = 4
    """K, the classes of each of the H groups of Z_t (K^H values per token; K = 2 holds H bits)."""
    temperature: float = 1.0
    """The Gumbel-softmax temperature of the straight-through gradient (the sample itself is a Gumbel-max
    draw, whatever the temperature): lower is closer to the one-hot, with a noisier gradient."""

    def __post_init__(self) -> None:
        if not isinstance(self.classes, int) or isinstance(self.classes, bool) or self.classes < 2:
            raise ConfigError(f"model.latent.categorical.classes must be an integer >= 2, got {self.classes!r}")
        check_range("model.latent.categorical.temperature", self.temperature, low_open=True)


@register_latent_kind("categorical")
class CategoricalLatent(LatentSpace):
    """Values are (..., H) int64 classes in [0, K); the table E is kept flat, (H * K, D), row h * K + k."""

    max_units: ClassVar[int] = 4096
    value_dtype: ClassVar[torch.dtype] = torch.int64
    unit: ClassVar[str] = "group"
    has_learned_prior: ClassVar[bool] = True
    settings_type: ClassVar[type] = CategoricalSettings

    def __init__(self, units: int, dim: int, settings: CategoricalSettings | None = None):
        super().__init__(units, dim, settings)
        self.classes = self.params_per_unit = self.settings.classes  # K logits per group
        self.weight = nn.Parameter(torch.empty(units * self.classes, dim))  # (H * K, D), E[h, k] at row h * K + k
        self.reset_parameters(1.0)  # the model's init_weights sets the scale it wants

    @property
    def value_shape(self) -> tuple[int, ...]:
        return (self.units,)

    def _log_probs(self, posterior: Tensor) -> Tensor:
        """(..., H * K) logits -> (..., H, K) log q, at least float32."""
        return F.log_softmax(at_least_float32(posterior).unflatten(-1, (self.units, self.classes)), dim=-1)

    def prior_(self, out: Tensor, generator: Generators = None) -> Tensor:
        return fill_rows_(out, lambda rows, g: rows.random_(0, self.classes, generator=g), generator)

    @property
    def prior_words(self) -> int:
        return self.units

    def prior_from_words(self, words: Tensor) -> Tensor:
        # a word's top 32 bits times K, over 2^32 (Lemire's multiply-shift): a class in [0, K), off uniform by
        # at most K / 2^32
        return (shift_right(words, 32) * self.classes) >> 32

    def kl_per_unit(self, posterior: Tensor) -> Tensor:
        log_q = self._log_probs(posterior)
        return math.log(self.classes) + (log_q.exp() * log_q).sum(-1)  # (..., H)

    def log_ratio(self, posterior: Tensor, value: Tensor) -> Tensor:
        """sum_h log q_h(z_h) + H log K; the leading dims of posterior and value broadcast."""
        log_q = self._log_probs(posterior).double()  # (..., H, K)
        picked = torch.take_along_dim(log_q, value.unsqueeze(-1), dim=-1).squeeze(-1)  # (..., H)
        return picked.sum(-1) + self.units * math.log(self.classes)

    def sample(self, posterior: Tensor, generator: Generators = None) -> tuple[Tensor, Tensor]:
        logits = at_least_float32(posterior).unflatten(-1, (self.units, self.classes))  # (..., H, K)
        uniform = rand_rows(tuple(logits.shape), generator, logits.device).to(logits.dtype)  # [0, 1)
        perturbed = logits - torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny)))  # + Gumbel
        value = perturbed.detach().argmax(-1)  # (..., H)
        soft = torch.softmax(perturbed / self.settings.temperature, dim=-1)  # (..., H, K)
        # value: exactly the sampled embeddings; gradient: the soft sample's, through the whole table
        straight_through = (soft - soft.detach()).flatten(-2).to(self.weight.dtype) @ self.weight  # (..., D), zero
        return self.embed(value) + straight_through, value

    def embed(self, value: Tensor) -> Tensor:
        offsets = torch.arange(self.units, device=value.device) * self.classes  # (H,)
        return F.embedding(value + offsets, self.weight).sum(-2)  # (..., H, D) -> (..., D)

    def prior_params(self) -> Tensor:
        return torch.zeros(self.units * self.classes)  # equal logits: uniform classes

    @property
    def policy_words(self) -> int:
        return self.units  # one uniform per group: the class where the group's CDF passes it

    def policy_noise(self, words: Tensor) -> Tensor:
        return uniform(words)  # (..., H) float32: one uniform per group

    def sample_from_noise(self, params: Tensor, noise: Tensor) -> Tensor:
        cdf = self._log_probs(params).exp().cumsum(-1)  # (..., H, K)
        below = (cdf < noise.unsqueeze(-1)).sum(-1)  # (..., H) classes whose CDF stays under u
        return below.clamp(max=self.classes - 1)  # rounding of the last CDF below u

    def log_prob(self, params: Tensor, value: Tensor) -> Tensor:
        log_q = self._log_probs(params)  # (..., H, K); its leading dims and the value's broadcast
        lead = torch.broadcast_shapes(log_q.shape[:-2], value.shape[:-1])
        picked = torch.take_along_dim(log_q.expand(*lead, -1, -1), value.expand(*lead, -1).unsqueeze(-1), dim=-1)
        return picked.squeeze(-1).sum(-1)

    def kl_between(self, q_params: Tensor, p_params: Tensor) -> Tensor:
        log_q, log_p = self._log_probs(q_params), self._log_probs(p_params)
        return (log_q.exp() * (log_q - log_p)).sum((-2, -1))

    def check_values(self, values: Tensor) -> Tensor:
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise ValueError(
                f"latents of kind categorical must be integer classes (..., {self.units}), got {values.dtype}"
            )
        if values.shape[-1:] != (self.units,):
            raise ValueError(
                f"latents of kind categorical must end in H = {self.units} classes, got shape {tuple(values.shape)}"
            )
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= self.classes):
            raise ValueError(
                f"latent classes must lie in [0, {self.classes}), got min {int(values.min())} max {int(values.max())}"
            )
        return values.to(torch.int64)

    def outside_values(self, values: Tensor) -> list[Tensor]:
        return with_first_entry(values, -1, self.classes)

    def reset_parameters(self, std: float) -> None:
        normal_init_(self.weight, std=std / math.sqrt(self.units))  # R sums H embeddings of unit scale

    def training_flops_per_token(self) -> float:
        # The straight-through term is an (H * K) x D matmul, forward and backward; the lookups count nothing.
        return 6.0 * self.units * self.classes * self.dim
