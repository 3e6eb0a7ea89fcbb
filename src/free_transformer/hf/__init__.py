"""Hugging Face integration (needs the `hf` extra: docs/install.md).

Importing this package registers `FreeTransformerConfig` and `FreeTransformerForCausalLM` with
`AutoConfig` and `AutoModelForCausalLM` (model_type "free_transformer"), so that
`AutoModelForCausalLM.from_pretrained(directory)` works on a directory written by `save_pretrained`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from ..inference.latents import LatentPlan  # the decoding plan, shared with free_transformer.inference.generate
from .configuration import FreeTransformerConfig
from .generation import RowSeededSampler
from .modeling import FreeTransformerCausalLMOutput, FreeTransformerForCausalLM, FreeTransformerPreTrainedModel

AutoConfig.register(FreeTransformerConfig.model_type, FreeTransformerConfig, exist_ok=True)
AutoModelForCausalLM.register(FreeTransformerConfig, FreeTransformerForCausalLM, exist_ok=True)

__all__ = [
    "FreeTransformerCausalLMOutput",
    "FreeTransformerConfig",
    "FreeTransformerForCausalLM",
    "FreeTransformerPreTrainedModel",
    "LatentPlan",
    "RowSeededSampler",
]
