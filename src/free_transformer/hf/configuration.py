"""`FreeTransformerConfig`: our `ModelConfig` in Hugging Face's configuration format.

Its model fields are derived from `free_transformer.ModelConfig`, field by field, never declared here:
the same type, default and docstring, under Hugging Face's Llama name where it has one (`hidden_size`,
`num_hidden_layers`, ...; `HF_NAMES`) so that the library's generic code (caches, generation, device
maps) reads them. The `latent` section is flat, as Hugging Face configs are: `latent_kind`,
`latent_encoder_layers`, and the chosen kind's own settings as one mapping, `latent_settings`.
`to_model_config` / `from_model_config` map them one to one, and `ModelConfig` stays the single source of
truth for what a valid model is (its checks run when this config is built).
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
import types
from typing import Any

from transformers import PretrainedConfig

from ..base.settings import field_default, field_docs, section_named_by, type_name
from ..model.config import ModelConfig
from ..runs.saved_config import upgrade_saved_model_config

# ModelConfig field -> its Hugging Face name, where Hugging Face's Llama spells it otherwise; every other
# field keeps its name (a field of a section, `latent.kind`, is `latent_kind`).
HF_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}


@dataclasses.dataclass(frozen=True)
class HFField:
    """One field of a model config dataclass as a field of the Hugging Face config."""

    name: str
    """Its name in the Hugging Face config: `hidden_size`, `latent_kind`."""
    path: tuple[str, ...]
    """Where it lies in the model config: ("dim",), ("latent", "kind")."""
    annotation: Any
    """Its type, as the dataclass declares it (a string under `from __future__ import annotations`)."""
    default: Any
    doc: str


def hf_fields(source: type = ModelConfig) -> tuple[HFField, ...]:
    """The fields of `source` (ModelConfig or a dataclass like it) as the Hugging Face config holds them. A field
    whose default is a dataclass (a section, `latent`) is flattened one level under its name; the chosen kind's
    own settings within it are not fields here: the config carries them as one mapping, `latent_settings`."""
    out, docs = [], field_docs(source)
    for item in dataclasses.fields(source):
        default = field_default(item)
        if not dataclasses.is_dataclass(default):
            name = HF_NAMES.get(item.name, item.name)
            out.append(HFField(name, (item.name,), item.type, default, docs.get(item.name, "")))
            continue
        section: type = type(default)
        section_docs = field_docs(section)
        for inner in dataclasses.fields(default):
            inner_default = field_default(inner)
            if section_named_by(inner) is None and not dataclasses.is_dataclass(inner_default):
                doc = section_docs.get(inner.name, "")
                out.append(
                    HFField(f"{item.name}_{inner.name}", (item.name, inner.name), inner.type, inner_default, doc)
                )
    return tuple(out)


def _args_doc(fields: tuple[HFField, ...], source: type) -> str:
    """The fields in Hugging Face's docstring form: `name (`type`, *optional*, defaults to D):`, the field's
    docstring and where it lies in `source`."""
    lines = ["Args:"]
    for item in fields:
        where = ".".join([source.__name__, *item.path])
        lines.append(f"    {item.name} (`{type_name(item.annotation)}`, *optional*, defaults to `{item.default!r}`):")
        text = f"{item.doc} ({where})" if item.doc else where
        lines += textwrap.wrap(text, 100, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)


def with_model_fields(name: str, base: type[PretrainedConfig], source: type = ModelConfig) -> type[PretrainedConfig]:
    """A subclass of `base` with one field per field of `source` (hf_fields): Hugging Face makes each
    configuration class a dataclass, and this one's fields are those of `source`, made when it is."""
    fields = hf_fields(source)

    def body(namespace: dict[str, Any]) -> None:
        namespace |= {"__module__": __name__, "__qualname__": name, "__doc__": _args_doc(fields, source)}
        namespace["__annotations__"] = {item.name: item.annotation for item in fields}
        namespace |= {item.name: item.default for item in fields}
        namespace |= {"model_config_class": source, "model_fields": fields}  # class attributes, not fields

    return types.new_class(name, (base,), exec_body=body)


ModelFields = with_model_fields("ModelFields", PretrainedConfig)


class FreeTransformerConfig(ModelFields):  # type: ignore[misc,valid-type]  # a base made at import: mypy cannot follow it
    __doc__ = (
        "Defaults equal `ModelConfig()`'s. latent_units = 0 describes the plain baseline decoder. A saved config "
        "in earlier field names (latent_bits) is read in today's.\n\n" + str(ModelFields.__doc__)
    )

    model_type = "free_transformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the KV cache, named as transformers >= 5.24 and before

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
        values: dict[str, Any] = {}
        for item in self.model_fields:
            into = values
            for section in item.path[:-1]:  # ("latent", "kind"): values["latent"]["kind"]
                into = into.setdefault(section, {})
            into[item.path[-1]] = getattr(self, item.name)
        if self.latent_settings is not None:
            values["latent"][self.latent_kind] = dict(self.latent_settings)
        return self.model_config_class(**values)

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> FreeTransformerConfig:
        # item.path ("latent", "kind"): config.latent.kind
        values: dict[str, Any] = {item.name: functools.reduce(getattr, item.path, config) for item in cls.model_fields}
        section = config.latent.section()
        values["latent_settings"] = None if section is None else dataclasses.asdict(section)
        return cls(**values, **kwargs)
