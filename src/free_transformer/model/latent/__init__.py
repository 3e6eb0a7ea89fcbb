"""The latent Z of the Free Transformer: sampling and KL (`sampling`), the swappable mappers from bits
to the residual R (`mappers`, with `binary_mapper` and `bit_linear` registered), the resolved
sources the model's forward takes (`sources`). It imports nothing of the package but `units`; the module
that holds them together in a model, `LatentPath`, is `free_transformer.model.latent_path`."""

from .binary_mapper import BinaryMapper, binary_mapper_project, project_latents
from .bit_linear import BitLinear
from .mappers import LATENT_KINDS, LatentMapper, latent_kind, register_latent_kind
from .sampling import (Generators, at_least_float32, bits_to_index, free_bits_kl, index_to_bits, kl_per_bit,
                       kl_to_uniform, rand_rows, sample_bit_values, sample_bits, uniform_latents)
from .sources import ENCODER, PRIOR, LatentSource

__all__ = [
    "ENCODER", "LATENT_KINDS", "PRIOR", "BinaryMapper", "BitLinear", "Generators", "LatentMapper", "LatentSource",
    "at_least_float32", "binary_mapper_project", "bits_to_index", "free_bits_kl", "index_to_bits", "kl_per_bit",
    "kl_to_uniform", "latent_kind",
    "project_latents", "rand_rows", "register_latent_kind", "sample_bit_values", "sample_bits", "uniform_latents",
]
