"""The Free Transformer (Fleuret, 2025): a decoder conditioned on latent random decisions."""

from .base.checks import ConfigError
from .base.units import bits_to_nats, nats_to_bits
from .base.version import __version__
from .inference.generate import GenerationConfig, GenerationResult, generate
from .inference.latents import infer_latents, shared_prior_latents
from .model.config import NAMED_CONFIGS, ModelConfig, named_config
from .model.latent import binary_mapper_project, kl_to_uniform
from .model.transformer import FreeTransformer, ModelOutput
from .runs.checkpoint import load_model

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
    "load_model",
    "named_config",
    "nats_to_bits",
    "shared_prior_latents",
]
