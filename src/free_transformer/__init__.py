"""The Free Transformer (Fleuret, 2025): a decoder conditioned on latent random decisions."""

from .config import NAMED_CONFIGS, ConfigError, ModelConfig, named_config
from .units import bits_to_nats, nats_to_bits
from .generate import GenerationConfig, GenerationResult, generate, infer_latents, shared_prior_latents
from .latent import binary_mapper_project, kl_to_uniform
from .model import FreeTransformer, ModelOutput

__all__ = [
    "NAMED_CONFIGS",
    "ConfigError",
    "FreeTransformer",
    "GenerationConfig",
    "GenerationResult",
    "ModelConfig",
    "ModelOutput",
    "binary_mapper_project",
    "bits_to_nats",
    "generate",
    "infer_latents",
    "kl_to_uniform",
    "named_config",
    "nats_to_bits",
    "shared_prior_latents",
]
__version__ = "0.2.0"  # CHANGELOG.md; pyproject.toml reads it from here
