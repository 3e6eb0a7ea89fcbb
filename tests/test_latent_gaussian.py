"""What is specific to the gaussian latent kind (model.latent.kind=gaussian): its KL, log-ratio and
reparameterised sample against torch.distributions, its values' checks, the Monte Carlo branch of kl_split,
and the commands that name its units. What every kind satisfies is tests/test_latent_contract.py's."""

import json
import math

import pytest
import torch
from conftest import tiny_model
from torch.distributions import Normal, kl_divergence

from free_transformer import GenerationConfig, generate
from free_transformer.analysis.measures import iwae, kl_split
from free_transformer.cli import main
from free_transformer.model.latent import GaussianLatent

H, D = 3, 5
GAUSSIAN = {"latent": {"kind": "gaussian"}}


def _posterior(shape=(2, 4), seed=0):
    return torch.randn(*shape, 2 * H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_kl_and_log_ratio_are_those_of_torch_distributions():
    space = GaussianLatent(H, D).double()
    posterior = _posterior()
    mean, log_var = posterior[..., :H], posterior[..., H:]
    q, p = Normal(mean, (0.5 * log_var).exp()), Normal(torch.zeros_like(mean), torch.ones_like(mean))
    torch.testing.assert_close(space.kl_per_unit(posterior), kl_divergence(q, p), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(space.kl(posterior), kl_divergence(q, p).sum(-1), rtol=1e-12, atol=1e-12)
    z = torch.randn(2, 4, H, dtype=torch.float64)
    torch.testing.assert_close(
        space.log_ratio(posterior, z), (q.log_prob(z) - p.log_prob(z)).sum(-1), rtol=1e-12, atol=1e-12
    )


def test_the_sample_is_reparameterised_and_r_is_a_linear_map_of_it():
    space = GaussianLatent(H, D).double()
    posterior = _posterior().requires_grad_()
    r, z = space.sample(posterior, [torch.Generator().manual_seed(s) for s in (1, 2)])
    noise = space.prior((2, 4), [torch.Generator().manual_seed(s) for s in (1, 2)]).double()
    mean, log_var = posterior[..., :H], posterior[..., H:]
    expected = mean + (0.5 * log_var).exp() * noise
    # the value is float32 (value_dtype) whatever the posterior's dtype, and R is made of that value
    torch.testing.assert_close(z, expected.detach().float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r, z.double() @ space.weight.T, rtol=1e-12, atol=1e-12)
    assert not z.requires_grad  # the value handed back is data; R carries the gradient
    grad_r = torch.randn_like(r)
    (grad,) = torch.autograd.grad((r * grad_r).sum(), posterior)
    g = grad_r @ space.weight  # dL/dz
    torch.testing.assert_close(grad[..., :H], g, rtol=1e-6, atol=1e-6)  # dz/dmean = 1
    torch.testing.assert_close(grad[..., H:], g * 0.5 * (0.5 * log_var).exp() * noise, rtol=1e-6, atol=1e-6)


def test_the_prior_is_a_standard_normal():
    space = GaussianLatent(4, D)
    z = space.prior((2, 20000), torch.Generator().manual_seed(0))
    assert z.shape == (2, 20000, 4) and z.dtype == torch.float32
    torch.testing.assert_close(z.mean((0, 1)), torch.zeros(4), atol=0.02, rtol=0)
    torch.testing.assert_close(z.std((0, 1)), torch.ones(4), atol=0.02, rtol=0)


def test_explicit_values_are_checked_in_one_line():
    space = GaussianLatent(H, D)
    with pytest.raises(ValueError, match="must be real vectors"):
        space.check_values(torch.zeros(1, 2, H, dtype=torch.long))
    with pytest.raises(ValueError, match="must end in H = 3 values"):
        space.check_values(torch.zeros(1, 2, H + 1))
    with pytest.raises(ValueError, match="must be finite"):
        space.check_values(torch.tensor([[[0.0, math.nan, 1.0]]]))
    assert space.check_values(torch.zeros(1, 2, H, dtype=torch.float64)).dtype == torch.float32


def test_the_model_trains_with_the_free_bits_hinge_on_the_gaussian_kl():
    model = tiny_model(**GAUSSIAN).train()
    tokens = torch.randint(0, 50, (2, 9))
    out = model(tokens[:, :-1], tokens[:, 1:], generator=torch.Generator().manual_seed(0))
    assert out.posterior.shape == (2, 8, 8) and out.latents.shape == (2, 8, 4)
    torch.testing.assert_close(out.kl_per_token_nats, model.latent_space.kl(out.posterior))
    kappa = float(out.kl_per_token_nats.detach().mean())
    hinged = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=kappa, generator=torch.Generator().manual_seed(0))
    expected = out.cross_entropy_nats + (out.kl_per_token_nats - kappa).clamp(min=0).mean()
    torch.testing.assert_close(hinged.loss, expected)
    hinged.loss.backward()
    assert model.latent.readout.weight.grad.abs().sum() > 0 and model.latent.mapper.weight.grad.abs().sum() > 0
    assert model.num_params() == model.config.num_params()


def test_the_bounds_are_upper_bounds_and_the_kl_split_adds_up():
    model = tiny_model(**GAUSSIAN)
    tokens = torch.randint(0, 50, (6, 12))
    K = 4
    with torch.no_grad():
        out = model(tokens[:1].expand(K, -1), latents="encoder", generator=torch.Generator().manual_seed(0))
        logp = torch.log_softmax(out.logits[:, :-1].double(), -1).gather(-1, tokens[:1, 1:, None].expand(K, -1, 1))
    nll = -logp.sum((1, 2))
    bound = iwae(nll, model.latent_space, out.posterior[:, :-1], out.latents[:, :-1])
    log_ratio = model.latent_space.log_ratio(out.posterior[:, :-1], out.latents[:, :-1]).sum(-1)  # (K,)
    assert bound <= float((nll + log_ratio).mean()) + 1e-9  # Jensen: tighter than the ELBO estimate, same draws
    naive = -torch.logsumexp(-nll - log_ratio, 0) + math.log(K)
    assert bound == pytest.approx(float(naive))
    posterior = model(tokens, latents="encoder").posterior
    split = kl_split(model.latent_space, posterior, generator=torch.Generator().manual_seed(0))
    total = float(model.latent_space.kl(posterior.double()).mean()) / math.log(2)
    assert split["information"] + split["prior_mismatch"] == pytest.approx(total)
    assert split["prior_mismatch"] >= -0.5  # a Monte Carlo estimate of a KL: about non-negative


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gaussian")
    assert (
        main(
            [
                "train",
                "--out",
                str(root / "run"),
                "model.size=debug",
                "model.vocab_size=256",
                "model.max_seq_len=72",
                "model.latent.kind=gaussian",
                "data.kind=letters",
                "steps=4",
                "batch_size=4",
                "validate_every=4",
                "validation_batches=1",
                "optim.warmup_steps=1",
                "progress=false",
                "kappa_bits=0.5",
            ]
        )
        == 0
    )
    return root / "run"


def test_train_and_inspect_show_the_gaussian_kind(run, capsys):
    assert main(["inspect", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "H = 4 dimensions (gaussian)" in shown and "KL per dimension" in shown


@pytest.mark.parametrize("choice", ["encoder", "prior", "shared"])
def test_the_generate_command_samples_under_each_named_choice(run, choice, capsys):
    assert (
        main(
            [
                "generate",
                str(run),
                "--prompt",
                "K>",
                "-n",
                "2",
                "--max-new-tokens",
                "4",
                "--latents",
                choice,
                "--format",
                "jsonl",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(line["latents"] == choice for line in lines)


def test_eval_heldout_reports_honest_bounds(run, tmp_path):
    text = tmp_path / "heldout.txt"
    text.write_text("K>" + "ab!cd" * 30 + "\n")
    assert (
        main(["eval", str(run), "--tasks", "none", "--heldout", str(text), "--heldout-samples", "2", "--no-progress"])
        == 0
    )
    results = json.loads(next((run / "eval").glob("*.json")).read_text())
    like = results["likelihood"]
    for name in ("prior_ce", "elbo", "iwae"):
        assert math.isfinite(like[name]["bits_per_token"]) and like[name]["bits_per_token"] > 0
    assert like["kl"]["nats"] >= 0


def test_the_hf_wrapper_generates_as_ours_does():
    pytest.importorskip("transformers")
    from free_transformer.hf import FreeTransformerForCausalLM

    model = tiny_model(dtype=torch.float32, **GAUSSIAN)
    hf = FreeTransformerForCausalLM.from_free_transformer(model)
    prompts = torch.randint(0, 50, (2, 4))
    ours = generate(model, prompts, GenerationConfig(max_new_tokens=4, temperature=0), seeds=[0, 1])
    theirs = hf.generate(prompts, max_new_tokens=4, do_sample=False, seeds=[0, 1], return_dict_in_generate=True)
    assert theirs.sequences[:, 4:].tolist() == ours.tokens
    assert torch.equal(theirs["latents"], torch.stack(ours.latents))
