"""The form of Z, as one abstraction: a `LatentSpace` says what a value of Z_t is, how the prior draws
it, how it is sampled from the encoder's read-out with its KL per token, and how it becomes the
residual R added to the keys/values of the injection block. The model, generation, scoring and
analysis ask it and nothing else; each form is one small class registered by name and chosen with
`model.latent.kind` (docs/latent-variants.md shows how to write one).

    binary kinds (`binary.BinaryLatentSpace`)   Z_t an index of H independent bits, uniform prior
                                                (`binary_mapper`, the paper's; `bit_linear`)
    gaussian                                    Z_t in R^H, prior N(0, I), reparameterised posterior
    categorical                                 Z_t H groups of K classes, uniform prior, Gumbel-max sample

Shapes: the encoder's read-out is (..., H * params_per_unit) (`posterior`); a value of Z is
(..., *value_shape) of `value_dtype` (an int64 index for the binary kinds, H floats for the Gaussian);
R is (..., D). KLs are in nats, per token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .draws import Generators

LATENT_KINDS: dict[str, type[LatentSpace]] = {}


def normal_init_(weight: Tensor, std: float) -> None:
    """nn.init.normal_ for a kind's weight, skipped on the meta device (`ModelConfig.latent_space_on_meta`): a meta
    tensor holds no values, and its normal_ goes through torch._refs, whose first call imports torch._dynamo (a
    second, and the heap of every process that builds a model grows by half)."""
    if not weight.is_meta:
        nn.init.normal_(weight, std=std)


# model.latent's own fields: not a kind's section name
RESERVED_NAMES = ("kind", "encoder_layers", "policy", "settings")


def register_latent_kind(name: str):
    """Class decorator: make a LatentSpace available as `model.latent.kind=name`, with the settings dataclass
    its class declares (`settings_type`) as `model.latent.<name>.*`. A kind outside the package registers when
    its module is imported (for the command line: FREE_TRANSFORMER_PLUGINS, base/plugins.py)."""
    if not name.isidentifier() or name in RESERVED_NAMES:
        raise ValueError(f"a latent kind's name must be an identifier other than {', '.join(RESERVED_NAMES)}: {name!r}")

    def register(cls: type[LatentSpace]) -> type[LatentSpace]:
        if name in LATENT_KINDS:
            raise ValueError(f"latent kind {name!r} is already registered ({LATENT_KINDS[name].__name__})")
        if cls.settings_type is not None and not dataclasses.is_dataclass(cls.settings_type):
            raise ValueError(f"latent kind {name!r}: settings_type must be a dataclass, got {cls.settings_type!r}")
        cls.kind = name
        LATENT_KINDS[name] = cls
        return cls

    return register


def latent_kind(name: str) -> type[LatentSpace]:
    if name not in LATENT_KINDS:
        raise KeyError(
            f"unknown latent kind {name!r}; registered: {', '.join(sorted(LATENT_KINDS))} (a kind of your own "
            "registers when its module is imported: FREE_TRANSFORMER_PLUGINS=MODULE for the command line)"
        )
    return LATENT_KINDS[name]


class LatentSpace(nn.Module):
    """Base of the latent kinds: Z_t of H units (`units`, the config's latent_units) mapped to R of size
    `dim`, with the kind's own settings (`settings_type`, `model.latent.<kind>.*`).
    Subclasses set the class attributes and implement the methods that raise here; `compile_backward`
    only where their backward runs an eager chunk loop."""

    kind: ClassVar[str]
    max_units: ClassVar[int]
    """Largest H the kind supports."""
    params_per_unit: int = 1
    """Read-out outputs per unit of Z_t: the posterior is (..., H * params_per_unit). A class attribute, or
    set in __init__ where the kind's settings decide it."""
    value_dtype: ClassVar[torch.dtype]
    """dtype of a value of Z."""
    unit: ClassVar[str] = "bit"
    """What one of the H units of Z_t is called in messages and reports: "bit", "dimension", "group"."""
    unit_plural: ClassVar[str | None] = None
    """Its plural where it is not unit + "s"."""
    independent_units: ClassVar[bool] = True
    """Whether the H units are independent under the posterior and the prior, so that the token's KL is the sum
    of kl_per_unit and each unit's KL means something on its own (the per-unit KL and dead-unit reports).
    A kind with dependent units sets False, overrides `kl`, and gets no per-unit report."""
    has_learned_prior: ClassVar[bool] = False
    """Whether the kind implements the methods of a learned prior or policy (prior_params, policy_words,
    sample_from_words, log_prob, kl_between): model.latent.policy needs them."""
    settings_type: ClassVar[type | None] = None
    """The dataclass of the kind's own settings, declared beside the class: `model.latent.<kind>.<field>` in
    the config (ModelConfig's latent section holds the chosen kind's), or None for a kind without."""

    def __init__(self, units: int, dim: int, settings=None):
        super().__init__()
        self.units, self.dim = units, dim
        if self.settings_type is not None and settings is None:
            settings = self.settings_type()
        self.settings = settings

    @classmethod
    def plural(cls) -> str:
        """The unit's name for several: "bits", "dimensions", "groups"."""
        return cls.unit_plural or cls.unit + "s"

    @classmethod
    def count(cls, n: int) -> str:
        """n units named: "8 bits", "1 dimension", "4 groups"."""
        return f"{n} {cls.unit if n == 1 else cls.plural()}"

    @property
    def posterior_size(self) -> int:
        """Read-out outputs per token: H * params_per_unit."""
        return self.units * self.params_per_unit

    @property
    def value_shape(self) -> tuple[int, ...]:
        """Shape of one Z_t: () for an index, (H,) for a vector."""
        raise NotImplementedError

    # ---- the prior ----------------------------------------------------------------------------

    def prior_(self, out: Tensor, generator: Generators = None) -> Tensor:
        """Fill `out` (B, ..., *value_shape) in place with independent prior draws, row i from
        generator i when given one per row (`sampling.fill_rows_`). The one place prior Z is drawn."""
        raise NotImplementedError

    def prior(self, shape: tuple[int, ...], generator: Generators = None, device=None) -> Tensor:
        """(*shape, *value_shape) prior draws: `prior_` on a new tensor."""
        out = torch.empty(*shape, *self.value_shape, dtype=self.value_dtype, device=device)
        return self.prior_(out, generator)

    @property
    def prior_words(self) -> int:
        """How many random 64-bit words one prior draw takes (`prior_from_words`)."""
        raise NotImplementedError

    def prior_from_words(self, words: Tensor) -> Tensor:
        """(..., prior_words) random int64 words (free_transformer.base.counter_random) -> (..., *value_shape)
        prior draws, a pure function of the words: how the decoding engine draws every row's Z at once, each
        from its own counter-based stream."""
        raise NotImplementedError

    # ---- the posterior ------------------------------------------------------------------------

    def kl_per_unit(self, posterior: Tensor) -> Tensor:
        """(..., H) KL(Q(Z_t | S) || prior) of each unit, in nats, where the units are independent
        (`independent_units`: the sum is the token's KL)."""
        raise NotImplementedError

    def kl(self, posterior: Tensor) -> Tensor:
        """(...,) KL(Q(Z_t | S) || prior) per token, in nats: the exact E_q[log q(z) - log p(z)], of which
        `log_ratio` at `sample`'s values is the Monte Carlo estimate."""
        return self.kl_per_unit(posterior).sum(-1)

    def log_ratio(self, posterior: Tensor, value: Tensor) -> Tensor:
        """(...,) log q(z_t | S) - log p(z_t) of given values, in nats: importance weights (IWAE)."""
        raise NotImplementedError

    def value_log_probs(self, posterior: Tensor) -> tuple[Tensor, Tensor] | None:
        """(log Q(Z_t = z) (..., N), log p(z) (N,)) over every one of the space's N values, in float64, where
        they are few enough to list (the measures then sum over them exactly: `kl_split`); None (the
        default) where they are not, and the measures estimate by Monte Carlo from `sample` and `log_ratio`."""
        return None

    def sample(self, posterior: Tensor, generator: Generators = None) -> tuple[Tensor, Tensor]:
        """Draw Z from the posterior (..., H * params_per_unit) and map it: (R (..., D), Z (..., *value_shape)).
        R carries the kind's gradient to the posterior."""
        raise NotImplementedError

    # ---- a learned prior or policy (free_transformer.model.latent.policy) ---------------------
    # A head that reads the decoder's first half gives, at each position, params of the posterior's form
    # (posterior_size of them); these draw, score and compare such distributions. A kind that does not give
    # them cannot have a learned prior: the defaults refuse in one line.

    def _no_learned_prior(self) -> ValueError:
        return ValueError(
            f"latent kind {self.kind} cannot have a learned prior: it does not implement prior_params, "
            "policy_words, sample_from_words, log_prob and kl_between (docs/latent-variants.md)"
        )

    def prior_params(self) -> Tensor:
        """(posterior_size,) float32 params, in the posterior's terms, of the kind's own prior: where a learned
        prior starts (its head's last layer is zero, its bias these)."""
        raise self._no_learned_prior()

    @property
    def policy_words(self) -> int:
        """How many random 64-bit words one draw from params takes (`sample_from_words`)."""
        raise self._no_learned_prior()

    def sample_from_words(self, params: Tensor, words: Tensor) -> Tensor:
        """(..., posterior_size) params and (..., policy_words) random int64 words -> (..., *value_shape) a draw
        of Z from the distribution the params say, a pure function of both (compiled, on any device). A kind gives
        either this or the two parts below, which this composes."""
        if type(self).sample_from_noise is LatentSpace.sample_from_noise:
            raise self._no_learned_prior()
        return self.sample_from_noise(params, self.policy_noise(words))

    # A draw split in two, as the decoding engine makes it: the part that depends on the words alone
    # (`policy_noise`, made for every position as a row joins) and the rest (`sample_from_noise`, in the step, from
    # the head's params there); sample_from_noise(params, policy_noise(words)) == sample_from_words(params, words).
    # By default the noise is the words themselves: a kind that gives sample_from_words alone needs nothing more;
    # a kind that gives the two parts gets sample_from_words from them.

    def policy_noise(self, words: Tensor) -> Tensor:
        """(..., policy_words) int64 words -> (..., ...) what of a draw from params they fix alone (the package's
        kinds: the uniforms or normals the words stand for)."""
        return words

    def sample_from_noise(self, params: Tensor, noise: Tensor) -> Tensor:
        """(..., posterior_size) params and `policy_noise` of a draw's words -> (..., *value_shape) the draw
        sample_from_words makes from them."""
        return self.sample_from_words(params, noise)

    def log_prob(self, params: Tensor, value: Tensor) -> Tensor:
        """(...,) log-probability (a density for a continuous kind) of values (..., *value_shape) under params
        (..., posterior_size), in nats, differentiable in the params."""
        raise self._no_learned_prior()

    def kl_between(self, q_params: Tensor, p_params: Tensor) -> Tensor:
        """(...,) KL(q || p) of two distributions given by params (..., posterior_size), in nats, in closed
        form; `kl(q)` is kl_between(q, prior_params())."""
        raise self._no_learned_prior()

    # ---- values -------------------------------------------------------------------------------

    def embed(self, value: Tensor) -> Tensor:
        """R (..., D) for given values (..., *value_shape): prior or explicit latents, no gradient to any
        posterior."""
        raise NotImplementedError

    def check_values(self, values: Tensor) -> Tensor:
        """Explicit values as this kind's dtype, or a one-line ValueError: the trailing dims are
        value_shape, and each value lies in the space. Reads them on the host: for entry points."""
        raise NotImplementedError

    def outside_values(self, values: Tensor) -> list[Tensor]:
        """Copies of `values` (of the space, (..., *value_shape)) each with one entry of the right dtype moved
        outside the space, at each of its ends: what `check_values` must refuse (the contract test asks each
        kind, whose space only it knows)."""
        raise NotImplementedError

    # ---- parameters ---------------------------------------------------------------------------

    def reset_parameters(self, std: float) -> None:
        """Initialise so that R of a prior draw has about this standard deviation per coordinate."""
        raise NotImplementedError

    def compile_backward(self) -> None:
        """Use compiled bodies for the eager chunk loop of the kind's backward, if it has one
        (compile=true); a kind whose gradient is plain autograd has nothing to change."""

    def training_flops_per_token(self) -> float:
        """Forward + backward FLOPs per token of the matmuls the kind needs (its parameter count is that of
        the module: ModelConfig counts it on the meta device)."""
        raise NotImplementedError


def with_first_entry(values: Tensor, *entries: float) -> list[Tensor]:
    """Copies of `values`, each with its first entry replaced by one of `entries` (for `outside_values`)."""
    out = []
    for entry in entries:
        copy = values.clone()
        copy.view(-1)[0] = entry
        out.append(copy)
    return out


def build_latent_space(kind: str, units: int, dim: int, settings=None) -> LatentSpace:
    """The registered kind's space: with its settings (`model.latent.<kind>`) when it has any; a kind without
    settings is built from (units, dim) alone."""
    space = latent_kind(kind)
    return space(units, dim) if space.settings_type is None else space(units, dim, settings)


class LinearMap(LatentSpace):
    """Base of the kinds whose R is a linear map of H real numbers per token, R = W v with W (D, H)
    (`bit_linear`: the ±1 bits; `gaussian`: z itself): the weight, its initialisation and its costs."""

    def __init__(self, units: int, dim: int, settings=None):
        super().__init__(units, dim, settings)
        self.weight = nn.Parameter(torch.empty(dim, units))  # (D, H): column h is what unit h adds
        self.reset_parameters(1.0)  # the model's init_weights sets the scale it wants

    def linear(self, units: Tensor) -> Tensor:
        """(..., H) -> R (..., D) in the weight's dtype."""
        return F.linear(units.to(self.weight.dtype), self.weight)

    def reset_parameters(self, std: float) -> None:
        normal_init_(self.weight, std=std / math.sqrt(self.units))  # R sums H terms of unit scale

    def training_flops_per_token(self) -> float:
        return 6.0 * self.dim * self.units  # an ordinary (D, H) linear map, forward and backward
