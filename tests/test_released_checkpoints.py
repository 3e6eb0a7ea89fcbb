"""A checkpoint written by a released version loads with today's loaders and computes what it computed
then: tests/data/checkpoint-0.2.0 (its README says how 0.2.0 wrote it) holds a run's checkpoint and its
Hugging Face export, in 0.2.0's layout (separate q/k/v and gate/up projections, `latent_bits` in the saved
configs), and the logits 0.2.0 computed on fixed tokens. runs/migrations.py brings both to today's names;
no release removes it."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from free_transformer.runs.checkpoint import load_model, verify_checkpoint

RELEASE_0_2_0 = Path(__file__).parent / "data" / "checkpoint-0.2.0"
EXPECTED = load_file(RELEASE_0_2_0 / "expected.safetensors")  # tokens, latents (B, T); logits (B, T, V)


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
