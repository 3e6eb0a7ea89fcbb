"""The Free Transformer (Fleuret, 2025): a decoder conditioned on latent random decisions.
`from free_transformer.model import FreeTransformer` reads the model from here, as before the layout. The
names load on first use, so that importing `free_transformer.model.config` (the command line's help)
does not import torch."""

import importlib

__all__ = ["FreeTransformer", "ModelOutput"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'free_transformer.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(".transformer", __name__), name)
    globals()[name] = value
    return value
