"""How H sampled bits become the residual R added to the keys/values of the injection block: the
swappable part of the latent path. Each variant is one small class registered by name and chosen
with `model.latent.kind`; README ("Adding a latent variant") shows how to write one.

A mapper is given the encoder's bit-logits (B, T, H) during training and prefill, or latent indices
(B, T) in [0, 2^H) for prior and explicit latents. Every variant uses the same H independent bits and
the same index d = sum_h 2^h B_h, so the uniform prior, the KL and the latent vocabulary (indices)
are shared; variants differ in how the bits map to R and in the gradient that reaches the bit-logits.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from .sampling import Generators

LATENT_KINDS: dict[str, type[LatentMapper]] = {}


def register_latent_kind(name: str):
    """Class decorator: make a LatentMapper available as `model.latent.kind=name`."""

    def register(cls: type[LatentMapper]) -> type[LatentMapper]:
        if name in LATENT_KINDS:
            raise ValueError(f"latent kind {name!r} is already registered ({LATENT_KINDS[name].__name__})")
        cls.kind = name
        LATENT_KINDS[name] = cls
        return cls

    return register


def latent_kind(name: str) -> type[LatentMapper]:
    if name not in LATENT_KINDS:
        raise KeyError(f"unknown latent kind {name!r}; registered: {', '.join(sorted(LATENT_KINDS))}")
    return LATENT_KINDS[name]


class LatentMapper(nn.Module):
    """Base of the variants. Subclasses set `max_bits` and implement the five methods below;
    `compile_backward` only where their backward runs an eager chunk loop."""

    kind: ClassVar[str]
    max_bits: ClassVar[int]
    """Largest H the variant supports (indices are int64, so never more than 62)."""

    def __init__(self, bits: int, dim: int):
        super().__init__()
        self.bits, self.dim = bits, dim

    def sample(self, bit_logits: Tensor, generator: Generators = None) -> tuple[Tensor, Tensor]:
        """Draw Z from the bit-logits (..., H) and map it: (R (..., D), index (...,)). R carries the
        variant's gradient to the bit-logits."""
        raise NotImplementedError

    def lookup(self, index: Tensor) -> Tensor:
        """R (..., D) for given indices (...,): prior or explicit latents, no gradient to any logits."""
        raise NotImplementedError

    def reset_parameters(self, std: float) -> None:
        """Initialise so that R has about this standard deviation per coordinate."""
        raise NotImplementedError

    def compile_backward(self) -> None:
        """Use compiled bodies for the eager chunk loop of the variant's backward, if it has one
        (compile=true); a variant whose gradient is plain autograd has nothing to change."""

    @classmethod
    def num_params(cls, bits: int, dim: int) -> int:
        raise NotImplementedError

    @classmethod
    def training_flops_per_token(cls, bits: int, dim: int) -> float:
        """Forward + backward FLOPs per token of the matmuls the variant needs."""
        raise NotImplementedError
