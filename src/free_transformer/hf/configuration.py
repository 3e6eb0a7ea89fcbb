"""`FreeTransformerConfig`: our `ModelConfig` in Hugging Face's configuration format.

Field names follow Hugging Face's Llama (`hidden_size`, `num_hidden_layers`, ...) so that the library's
generic code (caches, generation, device maps) reads them; `to_model_config` / `from_model_config`
map them one to one onto `free_transformer.ModelConfig`, which stays the single source of truth for
what a valid model is (its checks run when this config is built).
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from ..model.config import ModelConfig
from ..runs.migrations import upgrade_saved_model_config

# HF field name -> ModelConfig field name
FIELD_MAP = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "intermediate_size": "ffn_hidden",
    "max_position_embeddings": "max_seq_len",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "latent_units": "latent_units",
    "latent_layer": "latent_layer",
}
# HF field name -> LatentConfig field name (ModelConfig.latent, flat here as Hugging Face configs are)
LATENT_FIELD_MAP = {"latent_kind": "kind", "latent_encoder_layers": "encoder_layers"}


class FreeTransformerConfig(PretrainedConfig):
    """Defaults equal `ModelConfig()`'s. latent_units = 0 describes the plain baseline decoder."""

    model_type = "free_transformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the KV cache, named as transformers >= 5.24 and before

    vocab_size: int = 256
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    latent_units: int = 0
    """H, the number of units of the latent Z_t (bits, dimensions or groups: the kind's unit); 0 gives the
    baseline decoder. An export written before reads its latent_bits here."""
    latent_layer: int | None = None
    """Decoder blocks before Z is injected; None means num_hidden_layers // 2 (the paper's middle)."""
    latent_kind: str = "binary_mapper"
    """The form of Z and its map to the residual R (ModelConfig.latent.kind)."""
    latent_encoder_layers: int = 1
    """Non-causal encoder blocks (ModelConfig.latent.encoder_layers; the paper: 1)."""
    latent_settings: dict | None = None
    """The latent kind's own settings (ModelConfig.latent.<kind>, e.g. classes and temperature of the
    categorical kind) as a mapping; None for a kind without settings."""
    tokenizer_name: str | None = None
    """Name of the free_transformer tokenizer the model was trained with (informational)."""
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.to_model_config()  # the model config's checks, at construction time

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Refuses other model types (Hugging Face only warns, then builds a wrong model)."""
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            hint = " (convert it: free-transformer convert DIR OUT --to hf)" if model_type == "llama" else ""
            raise ValueError(f"expected a {cls.model_type!r} config, got model_type {model_type!r}{hint}")
        return super().from_dict(upgrade_saved_model_config(config_dict), **kwargs)

    def to_model_config(self) -> ModelConfig:
        latent = {ours: getattr(self, hf) for hf, ours in LATENT_FIELD_MAP.items()}
        if self.latent_settings is not None:
            latent[self.latent_kind] = dict(self.latent_settings)
        return ModelConfig(**{ours: getattr(self, hf) for hf, ours in FIELD_MAP.items()}, latent=latent)

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> FreeTransformerConfig:
        values = {hf: getattr(config, ours) for hf, ours in FIELD_MAP.items()}
        values |= {hf: getattr(config.latent, ours) for hf, ours in LATENT_FIELD_MAP.items()}
        section = config.latent.section()
        values["latent_settings"] = None if section is None else dataclasses.asdict(section)
        return cls(**values, **kwargs)
