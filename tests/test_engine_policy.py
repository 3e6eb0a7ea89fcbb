"""Z from a policy head inside the decoding engine's step (latents="policy"): a prefix-dependent Z cannot be drawn
before decoding, so the step draws it from the head's output at each row's position with the row's counter-based
words. The engine's Z and tokens equal the step-by-step reference loop's (free_transformer.train.rl.rollout), eager,
bucketed and deferred, alone or beside rows of the prior in one batch; the Hugging Face wrapper's with seeds too."""

import pytest
import torch
from conftest import tiny_model

from free_transformer import GenerationConfig, generate
from free_transformer.base.counter_random import row_keys
from free_transformer.inference.engine import DecodeEngine, Row, run_rows
from free_transformer.train.rl.rollout import rollout
from free_transformer.train.rl.trainer import with_policy_head

PROMPTS = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
MIXED = [[1], [4, 5, 6, 7], [7, 8], [10, 11, 12]]  # rows at their own positions: the step's gathered draws
SEEDS = [11, 12, 13, 14]
NEW = 6


@pytest.fixture(scope="module")
def model():
    model = with_policy_head(tiny_model(latent_units=4, dtype=torch.float32), seed=0).float().eval()
    with torch.no_grad():  # a head far from the uniform prior: its Z must differ from the prior's
        for param in model.latent.policy.parameters():
            param.normal_(0, 1.0)
    return model


def reference(model, rows: list[int], policy: bool, prompts=PROMPTS):
    keys = row_keys(torch.tensor([SEEDS[i] for i in rows]))
    return rollout(model, torch.tensor([prompts[i] for i in rows]), NEW, keys, policy=policy)


@pytest.mark.parametrize("prompts", [PROMPTS, MIXED], ids=["one-length", "mixed-lengths"])
@pytest.mark.parametrize("kind", ["eager", "bucketed", "deferred"])
def test_the_engines_policy_z_and_tokens_are_the_reference_loops(model, kind, prompts):
    """Rows of the policy beside rows of the prior in one engine: each row's Z and tokens are the reference loop's
    for that row alone."""
    engine = DecodeEngine(model, 4, capacity=16, compile=kind == "bucketed", deferred=kind == "deferred")
    config = GenerationConfig(max_new_tokens=NEW, temperature=1.0)
    rows = [Row(p, config, s, "policy" if i % 2 == 0 else "prior") for i, (p, s) in enumerate(zip(prompts, SEEDS))]
    for _ in run_rows(engine, rows):
        pass
    for i, row in enumerate(rows):
        expected = reference(model, [i], i % 2 == 0, prompts)
        assert row.tokens == expected.generated()[0]
        assert torch.equal(row.fed, expected.latents[0])


def test_generate_and_hf_with_seeds_draw_the_policy_as_the_reference_loop(model):
    pytest.importorskip("transformers")
    from free_transformer.hf import FreeTransformerForCausalLM

    config = GenerationConfig(max_new_tokens=NEW, temperature=1.0)
    result = generate(model, PROMPTS, config, seeds=SEEDS, latents="policy")
    expected = reference(model, [0, 1, 2, 3], True)
    assert result.tokens == expected.generated()
    assert all(torch.equal(z, expected.latents[i]) for i, z in enumerate(result.latents))
    prior = generate(model, PROMPTS, config, seeds=SEEDS, latents="prior")
    assert prior.tokens != result.tokens  # the head's Z are not the prior's
    hf = FreeTransformerForCausalLM.from_free_transformer(model)
    out = hf.generate(
        torch.tensor(PROMPTS),
        max_new_tokens=NEW,
        do_sample=True,
        seeds=SEEDS,
        latents="policy",
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert out.sequences[:, 3:].tolist() == expected.generated()
    assert torch.equal(out["latents"], expected.latents)


def test_policy_on_a_run_without_a_head_is_one_line():
    with pytest.raises(ValueError, match="latents='policy' needs a run with a learned prior or policy"):
        generate(tiny_model(latent_units=4), PROMPTS, GenerationConfig(max_new_tokens=2), latents="policy")
