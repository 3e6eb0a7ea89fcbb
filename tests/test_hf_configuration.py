"""FreeTransformerConfig's model fields are derived from ModelConfig: a field added to the dataclass appears in the
Hugging Face config with its default and docstring, and round-trips through it and through config.json."""

import ast
import dataclasses
import inspect

import pytest

pytest.importorskip("transformers")

from conftest import tiny_config

from free_transformer import ModelConfig
from free_transformer.hf import FreeTransformerConfig, configuration
from free_transformer.hf.configuration import HF_NAMES, hf_fields, with_model_fields
from free_transformer.model.config import LatentConfig


@dataclasses.dataclass(frozen=True)
class WiderModelConfig(ModelConfig):
    sliding_window: int = 64
    """Keys each query attends to, a field the Hugging Face config has never heard of."""


def test_a_field_added_to_model_config_is_in_the_hf_config(tmp_path):
    Wider = with_model_fields("WiderConfig", FreeTransformerConfig, WiderModelConfig)
    field = {item.name: item for item in dataclasses.fields(Wider)}["sliding_window"]
    assert field.default == 64 and Wider().sliding_window == 64
    assert "sliding_window (`int`, *optional*, defaults to `64`)" in Wider.__doc__
    assert "Keys each query attends to" in Wider.__doc__

    config = WiderModelConfig(**tiny_config(latent_units=2).to_dict(), sliding_window=8)
    hf_config = Wider.from_model_config(config)
    assert hf_config.sliding_window == 8 and hf_config.to_model_config() == config
    hf_config.save_pretrained(tmp_path)
    assert Wider.from_pretrained(tmp_path).to_model_config() == config


def test_every_model_config_field_with_its_default_and_hf_name():
    derived = {item.name: item for item in dataclasses.fields(FreeTransformerConfig)}
    ours = {item.name for item in dataclasses.fields(ModelConfig)} - {"latent"}
    ours |= {
        f"latent_{item.name}"
        for item in dataclasses.fields(LatentConfig)
        if item.name in ("kind", "encoder_layers", "policy")
    }
    assert {item.name for item in hf_fields()} == {HF_NAMES.get(name, name) for name in ours}
    for item in hf_fields():
        assert derived[item.name].default == item.default, item.name
    assert derived["hidden_size"].default == ModelConfig().dim and "dim" not in derived
    assert FreeTransformerConfig().to_model_config() == ModelConfig()


def test_the_kind_settings_round_trip():
    config = tiny_config(latent_units=3, latent={"kind": "categorical", "categorical": {"classes": 3}})
    hf_config = FreeTransformerConfig.from_model_config(config)
    assert hf_config.latent_kind == "categorical" and hf_config.latent_settings == {"classes": 3, "temperature": 1.0}
    assert hf_config.to_model_config() == config


def test_the_module_declares_no_model_config_field():
    tree = ast.parse(inspect.getsource(configuration))
    declared = {
        node.target.id
        for klass in tree.body
        if isinstance(klass, ast.ClassDef) and klass.name == "FreeTransformerConfig"
        for node in klass.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    assert declared and not declared & {item.name for item in hf_fields()}
