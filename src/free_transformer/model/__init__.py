"""The Free Transformer (Fleuret, 2025): a decoder conditioned on latent random decisions.
`from free_transformer.model import FreeTransformer` reads the model from here, as before the layout."""

from .transformer import FreeTransformer, ModelOutput

__all__ = ["FreeTransformer", "ModelOutput"]
