"""A checkpoint written by a released version loads with today's loaders and computes what it computed
then: tests/data/checkpoint-0.2.0 (its README says how 0.2.0 wrote it) holds a run's checkpoint and its
Hugging Face export, in 0.2.0's layout (separate q/k/v and gate/up projections, `latent_bits` in the saved
configs), and the logits 0.2.0 computed on fixed tokens. tests/data/checkpoint-0.3.0 holds two runs in 0.3's
layout (every latent kind's section in each config, the kind chosen or not): a bit_linear run and a categorical
one with settings of its own, its export, and their logits. runs/migrations.py and runs/saved_config.py bring
them to today's names and layout; no release removes them."""

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from free_transformer.cli import main
from free_transformer.model.latent import CategoricalSettings
from free_transformer.runs.checkpoint import checkpoint_dirs, load_model, read_checkpoint_config, verify_checkpoint
from free_transformer.train.config import load_train_config

RELEASE_0_2_0 = Path(__file__).parent / "data" / "checkpoint-0.2.0"
EXPECTED = load_file(RELEASE_0_2_0 / "expected.safetensors")  # tokens, latents (B, T); logits (B, T, V)
RELEASE_0_3_0 = Path(__file__).parent / "data" / "checkpoint-0.3.0"
EXPECTED_0_3_0 = load_file(RELEASE_0_3_0 / "expected.safetensors")  # tokens (B, T); per kind: latents, logits
SETTINGS_0_3_0 = {"bit_linear": None, "categorical": CategoricalSettings(classes=3, temperature=0.5)}


def _same_logits(forward) -> None:
    """The logits with the explicit Z, and with Z drawn from the encoder under 0.2.0's seeded generator."""
    with torch.no_grad():
        explicit = forward(EXPECTED["tokens"], latents=EXPECTED["latents"])
        sampled = forward(EXPECTED["tokens"], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(explicit.logits, EXPECTED["logits"], rtol=0, atol=1e-6)
    torch.testing.assert_close(sampled.logits, EXPECTED["encoder_logits"], rtol=0, atol=1e-6)


def test_a_checkpoint_written_by_0_2_0_loads_and_computes_the_same_logits():
    checkpoint = RELEASE_0_2_0 / "run" / "checkpoints" / "step_00000001"
    assert verify_checkpoint(checkpoint) is None
    model, config = load_model(RELEASE_0_2_0 / "run")
    assert config["model"]["latent_units"] == 2 and "latent_bits" not in config["model"]  # today's names
    assert "layers.0.self_attn.qkv_proj.weight" in model.state_dict()  # 0.2.0's separate projections, fused
    _same_logits(lambda tokens, **latents: model(tokens, **latents))
    with torch.no_grad():  # the encoder's draw itself is 0.2.0's
        drawn = model(EXPECTED["tokens"], generator=torch.Generator().manual_seed(1)).latents
    assert torch.equal(drawn, EXPECTED["encoder_latents"])


def test_a_hugging_face_export_written_by_0_2_0_loads_and_computes_the_same_logits():
    pytest.importorskip("transformers")
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    model = FreeTransformerForCausalLM.from_pretrained(RELEASE_0_2_0 / "hf", local_files_only=True).eval()
    assert model.config.latent_units == 2
    _same_logits(lambda tokens, **latents: model(input_ids=tokens, **latents))


def _same_logits_as_0_3_0(kind: str, forward) -> None:
    with torch.no_grad():
        explicit = forward(EXPECTED_0_3_0["tokens"], latents=EXPECTED_0_3_0[f"{kind}.latents"])
        sampled = forward(EXPECTED_0_3_0["tokens"], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(explicit.logits, EXPECTED_0_3_0[f"{kind}.logits"], rtol=0, atol=1e-6)
    torch.testing.assert_close(sampled.logits, EXPECTED_0_3_0[f"{kind}.encoder_logits"], rtol=0, atol=1e-6)
    assert torch.equal(sampled.latents, EXPECTED_0_3_0[f"{kind}.encoder_latents"])


@pytest.mark.parametrize("kind", sorted(SETTINGS_0_3_0))
def test_a_run_written_by_0_3_0_loads_with_the_chosen_kinds_settings_only(kind):
    run = RELEASE_0_3_0 / kind
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]["latent"]
    assert saved["categorical"] == (
        {"classes": 4, "temperature": 1.0} if kind == "bit_linear" else {"classes": 3, "temperature": 0.5}
    )
    config = load_train_config(run / "config.yaml")  # 0.3's every section: the chosen kind's only
    assert config.model.latent.kind == kind and config.model.latent.settings == SETTINGS_0_3_0[kind]
    checkpoint = checkpoint_dirs(run)[-1]
    assert verify_checkpoint(checkpoint) is None
    latent = read_checkpoint_config(checkpoint)["model"]["latent"]  # read through the migrations
    assert set(latent) == {"kind", "encoder_layers"} | ({kind} if SETTINGS_0_3_0[kind] else set())
    model, _ = load_model(run)
    assert model.config.latent.settings == SETTINGS_0_3_0[kind]
    _same_logits_as_0_3_0(kind, lambda tokens, **latents: model.eval()(tokens, **latents))


@pytest.mark.parametrize("kind", sorted(SETTINGS_0_3_0))
def test_a_run_written_by_0_3_0_resumes_and_saves_todays_layout(tmp_path, kind):
    run = tmp_path / kind
    shutil.copytree(RELEASE_0_3_0 / kind, run)
    assert main(["train", "--out", str(run), "--resume", "steps=3", "checkpoint_every=3", "progress=false"]) == 0
    assert [path.name for path in checkpoint_dirs(run)] == ["step_00000002", "step_00000003"]
    latent = {"kind": kind, "encoder_layers": 1, "policy": False}
    if SETTINGS_0_3_0[kind] is not None:
        latent[kind] = {"classes": 3, "temperature": 0.5}
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["latent"] == latent  # rewritten: today's
    assert read_checkpoint_config(checkpoint_dirs(run)[-1])["model"]["latent"] == latent


def test_a_hugging_face_export_written_by_0_3_0_loads_with_its_kinds_settings():
    pytest.importorskip("transformers")
    from free_transformer.hf.modeling import FreeTransformerForCausalLM

    model = FreeTransformerForCausalLM.from_pretrained(RELEASE_0_3_0 / "hf", local_files_only=True).eval()
    assert (
        model.config.latent_kind == "categorical"
        and model.model.config.latent.settings == SETTINGS_0_3_0["categorical"]
    )
    _same_logits_as_0_3_0("categorical", lambda tokens, **latents: model(input_ids=tokens, **latents))
