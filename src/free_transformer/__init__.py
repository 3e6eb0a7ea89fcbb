"""The Free Transformer (Fleuret, 2025): a decoder conditioned on latent random decisions.

The names below are imported on first use (PEP 562), so that `import free_transformer` and the command
line's `--help` do not load torch."""

import importlib

from .base.version import __version__  # noqa: F401 (free_transformer.__version__)

# public name -> the module that defines it
_EXPORTS = {
    "ConfigError": "base.checks",
    "LatentChoice": "base.latent_choice",
    "bits_to_nats": "base.units",
    "nats_to_bits": "base.units",
    "GenerationConfig": "inference.params",
    "Sampling": "inference.params",
    "SamplingParams": "inference.params",
    "GenerationResult": "inference.generate",
    "generate": "inference.generate",
    "release_engines": "inference.kept_engines",
    "Candidates": "inference.search",
    "best_of": "inference.search",
    "infer_latents": "inference.latents",
    "shared_prior_latents": "inference.latents",
    "NAMED_CONFIGS": "model.config",
    "ModelConfig": "model.config",
    "named_config": "model.config",
    "binary_mapper_project": "model.latent",
    "kl_to_uniform": "model.latent",
    "FreeTransformer": "model.transformer",
    "ModelOutput": "model.transformer",
    "load_model": "runs.checkpoint",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (the names below are imported on first use)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'free_transformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
