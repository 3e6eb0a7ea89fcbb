"""q/k/v as one projection and gate/up as one: the same model as separate matrices, initialised as
before, and every checkpoint written with the separate weights (ours, sharded, Hugging Face exports)
still loads to the same model."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import tiny_config
from reference import naive_forward
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict

from free_transformer import FreeTransformer
from free_transformer.distributed.sharded_checkpoint import consolidate, load_sharded, load_single_file
from free_transformer.model.config import LatentConfig
from free_transformer.model.layers import FUSED_PROJECTIONS
from free_transformer.runs.checkpoint import load_model, load_training_state, optimizer_param_names
from free_transformer.runs.migrations import (
    legacy_latent_key_mapping,
    part_names,
    split_state_dict,
    upgrade_optimizer_state,
    upgrade_state_dict,
)
from free_transformer.train.config import OptimConfig
from free_transformer.train.optim import build_optimizer

LEGACY_RUN = Path(__file__).parent / "data" / "legacy-run"  # written by 0.1: separate q/k/v and gate/up


def _separate_state(model: FreeTransformer, seed: int) -> dict:
    """Random weights for `model` in the layout of separate q, k, v, gate and up matrices."""
    generator = torch.Generator().manual_seed(seed)
    separate = split_state_dict(model.state_dict(), model.config)
    return {
        name: torch.randn(tensor.shape, generator=generator, dtype=torch.float64) * 0.05
        for name, tensor in separate.items()
    }


@pytest.mark.parametrize(
    "overrides",
    [
        dict(latent_units=0),
        dict(latent_units=4),
        dict(n_kv_heads=4),
        dict(latent=LatentConfig("binary_mapper", encoder_layers=2)),
        dict(latent=LatentConfig("bit_linear")),
    ],
)
def test_the_fused_projections_equal_separate_matmuls(overrides):
    """Weights written as separate matrices, loaded into the fused model, give the logits (and bit-logits) of
    a naive forward doing one matmul per matrix: every block, the encoder's query from zeta against keys and
    values from the first half, and the injection block's queries from X against keys and values from X + R."""
    model = FreeTransformer(tiny_config(**overrides)).double().eval()
    separate = _separate_state(model, seed=1)
    assert any(name.endswith("q_proj.weight") for name in separate) and not any("qkv" in name for name in separate)
    model.load_state_dict(upgrade_state_dict(dict(separate)))
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    latents = None
    if model.config.is_free:
        latents = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(3))
    expected, expected_bits = naive_forward(model, tokens, latents, state=separate)
    with torch.no_grad():
        out = model(tokens, latents=latents) if latents is not None else model(tokens)
        torch.testing.assert_close(out.logits, expected, rtol=1e-9, atol=1e-9)
        if model.config.is_free:
            encoded = model(tokens).posterior  # the encoder's posterior: the same for every draw of Z
            torch.testing.assert_close(encoded, expected_bits, rtol=1e-9, atol=1e-9)


def test_the_state_dict_splits_and_fuses_back_exactly():
    model = FreeTransformer(tiny_config(n_kv_heads=2))
    state = model.state_dict()
    separate = split_state_dict(state, model.config)
    blocks = model.config.n_layers + model.config.latent.encoder_layers
    assert len(separate) == len(state) + blocks * sum(len(parts) - 1 for parts in FUSED_PROJECTIONS.values())
    fresh = FreeTransformer(model.config)
    fresh.load_state_dict(upgrade_state_dict(dict(separate)))
    assert all(torch.equal(fresh.state_dict()[name], tensor) for name, tensor in state.items())


def test_a_seed_gives_the_weights_of_the_separate_projections():
    """The parts of each fused weight are drawn in the order they had as separate parameters: these are
    the values the separate k, v and up of a seed-0 tiny model had (last row, last three columns)."""
    torch.manual_seed(0)
    state = split_state_dict(FreeTransformer(tiny_config(latent_units=4)).state_dict(), tiny_config())
    recorded = {
        "layers.3.self_attn.v_proj.weight": [-0.004909119103103876, 0.011500936932861805, -0.0007267298642545938],
        "layers.3.mlp.up_proj.weight": [-0.026597479358315468, 0.010256750509142876, 0.022246677428483963],
        "latent.encoder.0.self_attn.k_proj.weight": [-0.021503107622265816, 0.0009656038018874824, 0.03027396649122238],
        "latent.encoder.0.mlp.up_proj.weight": [-0.007142751477658749, 0.02096027508378029, 0.0014819169882684946],
    }
    for name, values in recorded.items():
        assert state[name][-1, -3:].tolist() == values, name


def _trained(seed=0):
    torch.manual_seed(seed)
    model = FreeTransformer(tiny_config(latent_units=4)).train()
    optimizer = build_optimizer(model, OptimConfig())
    tokens = torch.randint(0, 50, (2, 9))
    for _ in range(2):
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _separate_optimizer_state(optim_state: dict, config) -> dict:
    """A named optimizer state (get_state_dict's) as it was with separate parameters."""
    state, groups = {}, []
    for name, value in optim_state["state"].items():
        parts = part_names(name)
        if parts is None:
            state[name] = value
            continue
        pieces = {
            key: list(split_state_dict({name: tensor}, config).values())  # moments: split as the weight
            if torch.is_tensor(tensor) and tensor.dim()
            else [tensor] * len(parts)  # the step: in every part
            for key, tensor in value.items()
        }
        for i, part in enumerate(parts):
            state[part] = {key: values[i] for key, values in pieces.items()}
    for group in optim_state["param_groups"]:
        groups.append({**group, "params": [p for name in group["params"] for p in (part_names(name) or [name])]})
    return {"state": state, "param_groups": groups}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_with_separate_projections_loads_and_consolidates(tmp_path):
    """DCP reads by the reader's names: a checkpoint written with separate q/k/v and gate/up weights (and
    their optimizer state) is read in its own layout, then fused: weights and AdamW moments as saved."""
    model, optimizer = _trained()
    model_state, optim_state = get_state_dict(model, optimizer)
    step_dir = tmp_path / "checkpoints" / "step_00000002"
    dcp.save(
        {
            "model": split_state_dict(model_state, model.config),
            "optim": _separate_optimizer_state(optim_state, model.config),
        },
        checkpoint_id=step_dir / "dcp",
        no_dist=True,
    )
    (step_dir / "config.json").write_text(json.dumps({"model": model.config.to_dict(), "step": 2}))
    metadata = dcp.FileSystemReader(step_dir / "dcp").read_metadata().state_dict_metadata
    assert "model.layers.0.self_attn.q_proj.weight" in metadata
    assert "model.layers.0.self_attn.qkv_proj.weight" not in metadata

    fresh, fresh_optimizer = _trained(seed=1)
    assert load_sharded(step_dir, fresh, fresh_optimizer) == 2
    assert all(torch.equal(fresh.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    loaded = fresh_optimizer.state_dict()
    for index, saved in optimizer.state_dict()["state"].items():
        assert all(torch.equal(loaded["state"][index][key], value) for key, value in saved.items())

    out = consolidate(step_dir, tmp_path / "consolidated")
    weights = load_file(out / "model.safetensors")
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())


def test_the_hf_key_mapping_renames_the_latent_path_as_upgrade_state_dict_does():
    """An HF export of 0.1 is renamed by from_pretrained's key_mapping (regular expressions, the first
    that matches), a checkpoint by upgrade_state_dict: both give every old name of the 0.1 run the same
    current name, and the result loads strictly into the model."""
    checkpoint = LEGACY_RUN / "checkpoints" / "step_00000004"
    weights = {"model." + name: tensor for name, tensor in load_file(checkpoint / "model.safetensors").items()}
    assert any(name.startswith("model.post_sampler") for name in weights)  # the old names are there
    renamed = {}
    for name, tensor in weights.items():
        for pattern, replacement in legacy_latent_key_mapping("model.").items():
            name, found = re.subn(pattern, replacement, name)
            if found:
                break
        renamed[name] = tensor
    upgraded = upgrade_state_dict(dict(weights), "model.")
    assert upgrade_state_dict(renamed, "model.").keys() == upgraded.keys()
    model, _ = load_model(checkpoint)
    model.load_state_dict({name.removeprefix("model."): tensor for name, tensor in upgraded.items()})


def test_a_one_process_checkpoint_with_separate_projections_continues_on_several():
    """load_single_file (a one-process checkpoint continued by ddp / fsdp) of the 0.1 run: the weights and
    optimizer state the one-process resume gives."""
    checkpoint = LEGACY_RUN / "checkpoints" / "step_00000004"
    reference, _ = load_model(checkpoint)
    reference.train()
    optimizer = build_optimizer(reference, OptimConfig())
    saved = load_training_state(checkpoint)["optimizer"]
    assert len(saved["state"]) > len(list(reference.parameters()))  # numbered with separate q/k/v, gate/up
    optimizer.load_state_dict(upgrade_optimizer_state(saved, optimizer_param_names(reference, optimizer)))

    model, _ = load_model(checkpoint)
    model.train()
    other = build_optimizer(model, OptimConfig())
    with torch.no_grad():  # nothing of the checkpoint left in place before the load
        for param in model.parameters():
            param.normal_()
    assert load_single_file(checkpoint, model, other) == 4
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in reference.state_dict().items())
    for index, state in optimizer.state_dict()["state"].items():
        assert all(torch.equal(other.state_dict()["state"][index][key], value) for key, value in state.items())


def test_a_hugging_face_export_with_separate_projections_loads(tmp_path):
    """An export whose safetensors hold q/k/v and gate/up separately (as every export did) loads to the same
    model, and from_pretrained reports nothing missing or unused."""
    pytest.importorskip("transformers")
    from free_transformer.hf import FreeTransformerForCausalLM

    torch.manual_seed(0)
    model = FreeTransformer(tiny_config(latent_units=4)).eval()
    FreeTransformerForCausalLM.from_free_transformer(model).save_pretrained(tmp_path / "hf")
    shutil.copytree(tmp_path / "hf", tmp_path / "old")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    separate = {
        f"model.{name}": tensor.contiguous()
        for name, tensor in split_state_dict(
            {k.removeprefix("model."): v for k, v in weights.items()}, model.config
        ).items()
    }
    save_file(separate, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    loaded, info = FreeTransformerForCausalLM.from_pretrained(
        tmp_path / "old", local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(loaded.model.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    tokens = torch.randint(0, 50, (1, 10))
    latents = torch.randint(0, 16, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(tokens, latents=latents).logits, model(tokens, latents=latents).logits, rtol=0, atol=0
        )
