"""The contract of a latent kind, checked for every kind in the registry: the package's, one that this
module registers itself, as a user's plugin would, and the documented plugin with a setting of its own
(docs/latent-variants.md's ternary kind, units in {-1, 0, +1}). A kind registered anywhere is checked here with no
other edit; the per-kind test files keep only what is specific to one kind.

What a kind must satisfy, from the definition of each of its methods (docs/latent-variants.md):
  kl           the exact E_q[log q(z) - log p(z)], which `sample` and `log_ratio` estimate by Monte Carlo
               (and `value_log_probs` sums exactly, where the kind lists its values); log_ratio broadcasts
               between its posterior and its values (kl_split's mixture needs it)
  prior_       reproducible from a generator, row by row, and distributed as the prior: E_p[q(z)/p(z)] = 1
               for any posterior q, with log q(z)/p(z) the kind's own `log_ratio`
  check_values takes prior draws as they are and refuses values outside the space
  sample       R carries a gradient to the encoder's read-out (the decoder's loss alone, KL hinged off),
               and the decoder, the read-out and the kind's own parameters all learn
and end to end: the KV cache gives the full forward's logits, generate's decoding (eager and with its
static step) picks the full forward's greedy tokens, every latent choice works in generate, the held-out
bounds are ordered (IWAE(K) no looser than the ELBO, tightening with K), the Hugging Face export and back
gives the same logits, and serve completes what generate samples for a seed."""

import json
import math

import pytest
import torch
from conftest import tiny_checkpoint, tiny_model
from documented_kind import import_documented_kind
from torch import Tensor

from free_transformer import GenerationConfig, generate
from free_transformer.base.counter_random import row_keys
from free_transformer.cli import main
from free_transformer.model.latent import LATENT_KINDS, GaussianLatent, register_latent_kind
from free_transformer.model.latent.draws import counter_policy_noise, counter_policy_words, counter_prior, fill_rows_
from free_transformer.runs.checkpoint import load_model, save_checkpoint


@register_latent_kind("contract_wide_gaussian")
class WideGaussian(GaussianLatent):
    """A user's plugin: the Gaussian kind with the prior N(0, 4 I) instead of N(0, I)."""

    def prior_(self, out: Tensor, generator=None) -> Tensor:
        return fill_rows_(out, lambda rows, g: rows.normal_(0.0, 2.0, generator=g), generator)

    def prior_from_words(self, words: Tensor) -> Tensor:
        return 2.0 * super().prior_from_words(words)

    def kl_per_unit(self, posterior: Tensor) -> Tensor:
        mean, log_var = self._moments(posterior)  # KL(N(mu, s^2) || N(0, 4)) per unit
        return 0.5 * ((mean.square() + log_var.exp()) / 4 - 1 - log_var + math.log(4))

    def log_ratio(self, posterior: Tensor, value: Tensor) -> Tensor:
        mean, log_var = (x.double() for x in self._moments(posterior))
        z = value.double()
        return (0.5 * (z.square() / 4 + math.log(4) - (z - mean).square() / log_var.exp() - log_var)).sum(-1)

    def prior_params(self) -> Tensor:  # a learned prior starts at N(0, 4 I): means 0, log-variances log 4
        return torch.cat([torch.zeros(self.units), torch.full((self.units,), math.log(4))])


import_documented_kind()  # docs/latent-variants.md's ternary kind, whose values include -1, with a setting
KINDS = sorted(LATENT_KINDS)  # at collection: the package's kinds and the plugins above
H, D = 4, 8  # tiny_model's latent_units and a read-out's width


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def _space(kind):
    torch.manual_seed(0)
    return LATENT_KINDS[kind](H, D).double()


def _posterior(space, lead=(2, 3), scale=1.0, seed=0) -> Tensor:
    """A random read-out (*lead, H * params_per_unit) in float64."""
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*lead, space.units * space.params_per_unit, generator=generator, dtype=torch.float64)


def _rows(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _mean_and_error(samples: Tensor) -> tuple[Tensor, Tensor]:
    """Monte Carlo mean over dim 0 and its standard error."""
    return samples.mean(0), samples.std(0) / math.sqrt(samples.shape[0])


# ---- the latent space on its own --------------------------------------------------------------------


def test_the_kl_is_the_monte_carlo_mean_of_log_ratio_over_samples(kind):
    space, N = _space(kind), 20000
    posterior = _posterior(space, lead=(1, 3))  # (1, T, P)
    _, values = space.sample(posterior.expand(N, -1, -1), torch.Generator().manual_seed(1))  # z ~ q
    assert values.shape == (N, 3, *space.value_shape) and values.dtype == space.value_dtype
    estimate, error = _mean_and_error(space.log_ratio(posterior, values))  # (T,)
    kl = space.kl(posterior)[0]
    assert kl.shape == (3,) and bool((kl >= 0).all())
    assert bool(((estimate - kl).abs() <= 5 * error + 1e-9).all()), (estimate, kl, error)
    if space.independent_units:  # the token's KL is the sum of its units' (the per-unit reports)
        per_unit = space.kl_per_unit(posterior)
        assert per_unit.shape == (1, 3, space.units) and bool((per_unit >= -1e-12).all())
        torch.testing.assert_close(per_unit.sum(-1)[0], kl)


def test_a_listed_space_lists_the_distributions_that_kl_and_log_ratio_measure(kind):
    """value_log_probs, where a kind lists its values (kl_split's exact sum), is a distribution whose KL to the
    listed prior is the kind's `kl`."""
    space = _space(kind)
    posterior = _posterior(space)
    listed = space.value_log_probs(posterior)
    if listed is None:
        pytest.skip(f"{kind} does not list its values: kl_split estimates by Monte Carlo")
    log_q, log_p = listed
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(log_p.exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close((log_q.exp() * (log_q - log_p)).sum(-1), space.kl(posterior).double())


def test_log_ratio_broadcasts_between_its_posterior_and_its_values(kind):
    space = _space(kind)
    posterior = _posterior(space, lead=(3, 2))  # (B, T, P)
    values = space.sample(posterior, torch.Generator().manual_seed(1))[1]  # (B, T, ...)
    pairs = space.log_ratio(posterior.unsqueeze(0), values.unsqueeze(1))  # (b, B, T): value b under posterior B'
    assert pairs.shape == (3, 3, 2)
    for b in range(3):
        for other in range(3):
            torch.testing.assert_close(pairs[b, other], space.log_ratio(posterior[other], values[b]))


def test_prior_draws_are_reproducible_row_by_row(kind):
    space = _space(kind)
    a = space.prior((3, 5), _rows(4, 5, 6))
    assert a.shape == (3, 5, *space.value_shape) and a.dtype == space.value_dtype
    assert torch.equal(a, space.prior((3, 5), _rows(4, 5, 6)))
    assert torch.equal(a[1], space.prior((1, 5), _rows(5))[0])  # a row's draws do not depend on its batch
    assert not torch.equal(a[0], a[1])
    out = torch.empty_like(a)
    assert space.prior_(out, _rows(4, 5, 6)) is out and torch.equal(out, a)  # in place, as the static step draws
    whole = space.prior((2, 5), torch.Generator().manual_seed(3))
    assert torch.equal(whole, space.prior((2, 5), torch.Generator().manual_seed(3)))


def test_prior_draws_follow_the_prior(kind):
    """E_{z ~ p}[q(z) / p(z)] = 1 for any q: the prior draws and log_ratio's prior are the same distribution."""
    space, N = _space(kind), 40000
    posterior = _posterior(space, lead=(1, 2), scale=0.3)  # near the prior: the ratio's variance stays small
    z = space.prior((N, 2), torch.Generator().manual_seed(2))
    estimate, error = _mean_and_error(space.log_ratio(posterior, z).exp())  # (T,)
    assert bool(((estimate - 1).abs() <= 5 * error + 1e-9).all()), (estimate, error)


def test_counter_based_prior_draws_follow_the_prior(kind):
    """The prior draws of the decoding engine (`counter_prior`: a function of each row's key and position) have
    the value shape and dtype, depend on their row's key alone, and follow the prior (the check of
    `test_prior_draws_follow_the_prior`)."""
    space, N = _space(kind), 40000
    keys, positions = row_keys(torch.arange(N)), torch.arange(2)
    z = counter_prior(space, keys[:, None], positions[None, :])  # (N, 2, ...)
    assert z.shape == (N, 2, *space.value_shape) and z.dtype == space.value_dtype
    assert torch.equal(z[5:6], counter_prior(space, keys[5:6, None], positions[None, :]))
    assert not torch.equal(z[:, 0], z[:, 1])
    posterior = _posterior(space, lead=(1, 2), scale=0.3)
    estimate, error = _mean_and_error(space.log_ratio(posterior, z).exp())  # (T,)
    assert bool(((estimate - 1).abs() <= 5 * error + 1e-9).all()), (estimate, error)


def _policy_space(kind, units=H):
    """The kind's space with units `units`, or a skip for a kind that cannot have a learned prior (after checking
    that it says so in one line)."""
    torch.manual_seed(0)
    space = LATENT_KINDS[kind](units, D).double()
    if not space.has_learned_prior:
        for method in (space.prior_params, lambda: space.policy_words):
            with pytest.raises(ValueError, match="cannot have a learned prior") as raised:
                method()
            assert "\n" not in str(raised.value)
        pytest.skip(f"{kind} has no learned prior")
    return space


def test_a_learned_priors_kl_to_the_kinds_prior_is_the_kinds_kl(kind):
    """kl_between(q, prior_params) is the kind's own KL to its prior; kl_between(q, q) is 0 and the KL is >= 0."""
    space = _policy_space(kind)
    q, p = _posterior(space), _posterior(space, seed=1)
    prior = space.prior_params().double()
    assert prior.shape == (space.posterior_size,)
    torch.testing.assert_close(space.kl_between(q, prior.expand_as(q)), space.kl(q).double())
    torch.testing.assert_close(space.kl_between(q, q), torch.zeros(2, 3, dtype=torch.float64))
    assert bool((space.kl_between(q, p) > 0).all())


def test_log_prob_is_log_ratio_plus_the_priors_and_normalises(kind):
    """log_prob(q, z) - log_prob(prior_params, z) = log_ratio(q, z); E_{z ~ prior}[exp(log_prob(q, z)) / p(z)] = 1."""
    space, N = _policy_space(kind), 40000
    q = _posterior(space, lead=(1, 2), scale=0.3)
    prior = space.prior_params().double().expand_as(q)
    z = space.prior((N, 2), torch.Generator().manual_seed(2))
    log_q, log_p = space.log_prob(q, z), space.log_prob(prior, z)
    assert log_q.shape == (N, 2)
    torch.testing.assert_close(log_q - log_p, space.log_ratio(q, z).to(log_q.dtype))
    estimate, error = _mean_and_error((log_q - log_p).exp())
    assert bool(((estimate - 1).abs() <= 5 * error + 1e-9).all()), (estimate, error)


def test_draws_from_words_follow_log_prob(kind):
    """sample_from_words on counter-based words: E[log q(z) - log p(z)] = kl_between(q, p) (z ~ q), and on a small
    discrete space the frequency of every value is exp(log_prob), which sums to 1 over the values."""
    space, N = _policy_space(kind, units=2), 60000
    q, p = _posterior(space, lead=(1, 2)), _posterior(space, lead=(1, 2), seed=1)
    keys, positions = row_keys(torch.arange(N)), torch.arange(2)
    words = counter_policy_words(space, keys[:, None], positions[None, :])  # (N, 2, policy_words)
    assert words.shape == (N, 2, space.policy_words) and words.dtype == torch.int64
    z = space.sample_from_words(q.expand(N, -1, -1), words)
    assert z.shape == (N, 2, *space.value_shape) and z.dtype == space.value_dtype
    # the draw in two parts, as the decoding engine makes it (the noise as a row joins, the rest in the step)
    assert torch.equal(space.sample_from_noise(q.expand(N, -1, -1), space.policy_noise(words)), z)
    assert torch.equal(space.check_values(z), z)
    estimate, error = _mean_and_error(space.log_prob(q, z) - space.log_prob(p, z))
    assert bool(((estimate - space.kl_between(q, p)[0]).abs() <= 5 * error + 1e-9).all()), (estimate, error)
    if space.value_dtype.is_floating_point:
        return
    for t in range(2):
        values, counts = torch.unique(z[:, t].reshape(N, -1), dim=0, return_counts=True)
        values = values.reshape(-1, *space.value_shape)
        probabilities = space.log_prob(q[0, t], values).exp()
        frequencies = counts.double() / N
        error = (probabilities * (1 - probabilities) / N).sqrt()
        assert bool(((frequencies - probabilities).abs() <= 5 * error + 1e-9).all()), (frequencies, probabilities)
        torch.testing.assert_close(probabilities.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_check_values_takes_prior_draws_and_refuses_values_outside_the_space(kind):
    """The values outside the space are the kind's own (`outside_values`): -1 is a value of some integer spaces."""
    space = _space(kind)
    z = space.prior((2, 3), torch.Generator().manual_seed(0))
    assert torch.equal(space.check_values(z), z)
    outside = space.outside_values(z)
    assert outside and all(v.shape == z.shape and v.dtype == z.dtype and not torch.equal(v, z) for v in outside)
    outside.append(z.long() if space.value_dtype.is_floating_point else z.double())  # the other kind of number
    if space.value_shape:
        outside.append(torch.cat([z, z[..., :1]], dim=-1))  # one unit too many
    for values in outside:
        with pytest.raises(ValueError) as raised:
            space.check_values(values)
        assert "\n" not in str(raised.value)


def test_a_kinds_settings_are_the_latent_config_section_named_after_it(kind):
    """So that they are model.latent.<kind>.* in --help, config.yaml, the HF config and the checks."""
    from free_transformer.base.settings import describe, to_dict
    from free_transformer.model.config import LatentConfig

    settings_type = LATENT_KINDS[kind].settings_type
    latent = LatentConfig(kind)
    if settings_type is None:
        assert latent.section() is None and set(to_dict(latent)) == {"kind", "encoder_layers", "policy"}
        return
    assert isinstance(latent.section(), settings_type)
    assert _space(kind).settings == settings_type()  # built without settings: the defaults
    resolved = LatentConfig(kind, settings=latent.section())
    assert set(to_dict(resolved)) == {"kind", "encoder_layers", "policy", kind}  # the chosen kind's section only
    paths = [item.path for item in describe(resolved)]
    assert paths[3:] and all(path.startswith(f"{kind}.") for path in paths[3:])


# ---- in the model -----------------------------------------------------------------------------------


def _model(kind, **overrides):
    return tiny_model(latent={"kind": kind}, **overrides)


def test_gradients_reach_the_encoders_readout_and_the_decoder(kind):
    model = _model(kind).train()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=1e9, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.loss, out.cross_entropy_nats)  # the KL hinged off: R alone carries the gradient
    assert out.posterior.shape == (2, 8, H * model.latent_space.params_per_unit)
    out.loss.backward()
    decoder = model.layers[model.config.injection_layer].self_attn.o_proj.weight  # the block that receives R
    for name, parameter in [("the read-out", model.latent.readout.weight), ("the decoder", decoder)]:
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.latent.mapper.parameters())
    assert model.num_params() == model.config.num_params()


def test_the_kv_cache_gives_the_full_forwards_logits(kind):
    model = _model(kind)
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    z = model.latent_space.prior((2, 10), torch.Generator().manual_seed(1))
    full = model(tokens, latents=z).logits
    cache = model.new_cache(2)
    first = model(tokens[:, :6], latents=z[:, :6], cache=cache).logits
    rest = [model(tokens[:, t : t + 1], latents=z[:, t : t + 1], cache=cache).logits for t in range(6, 10)]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_greedy_decoding_picks_the_full_forwards_argmax(kind, compile):
    """Decoding with the cache (the engine's step eager, and compiled) against the cache-free full forward on the
    sequence it produced, with the latents it reports."""
    model = _model(kind)
    prompts = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(0))
    out = generate(
        model,
        prompts,
        GenerationConfig(max_new_tokens=6, temperature=0),
        seeds=[1, 2],
        latents="prior",
        compile=compile,
    )
    fed = torch.cat([prompts, torch.tensor(out.tokens)[:, :-1]], dim=1)  # (B, P + N - 1)
    logits = model(fed, latents=torch.stack(out.latents)).logits  # each row fed P + N - 1 positions
    assert logits[:, 3:].argmax(-1).tolist() == out.tokens


def test_compiled_decoding_samples_as_eager_decoding(kind):
    model = _model(kind, dtype=torch.float32)
    prompts = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=6, temperature=0.7, top_k=30)
    explicit = model.latent_space.prior((3, 5), torch.Generator().manual_seed(2))  # then prior draws
    eager = generate(model, prompts, config, seeds=[1, 2, 3], latents=explicit)
    static = generate(model, prompts, config, seeds=[1, 2, 3], latents=explicit, compile=True)
    assert static.tokens == eager.tokens and torch.equal(torch.stack(static.latents), torch.stack(eager.latents))
    assert torch.equal(torch.stack(eager.latents)[:, :5], explicit)


@pytest.mark.parametrize("choice", ["encoder", "prior", "shared", "reference", "values"])
def test_generate_takes_every_latent_choice(kind, choice):
    model = _model(kind)
    space = model.latent_space
    prompts, config = torch.randint(0, 50, (3, 4)), GenerationConfig(max_new_tokens=5, temperature=0.5)
    values = space.prior((1, 6), torch.Generator().manual_seed(3))
    options = {
        "values": dict(latents=values),
        "reference": dict(latents="reference", reference=torch.randint(0, 50, (1, 8))),
    }
    kwargs = options.get(choice, dict(latents=choice))
    out = generate(model, prompts, config, seeds=[1, 2, 3], latent_seed=0, **kwargs)
    out.latents = torch.stack(out.latents)  # every row fed 4 + 5 - 1 positions
    assert out.latents.shape == (3, 4 + 5 - 1, *space.value_shape) and out.latents.dtype == space.value_dtype
    assert torch.equal(space.check_values(out.latents), out.latents)  # every Z used lies in the space
    if choice == "values":
        assert torch.equal(out.latents[:, :6], values.expand(3, *values.shape[1:]))
    if choice in ("shared", "reference"):  # one sequence of Z for every row
        assert torch.equal(out.latents[0], out.latents[1])
    again = generate(model, prompts, config, seeds=[1, 2, 3], latent_seed=0, **kwargs)
    assert again.tokens == out.tokens and torch.equal(torch.stack(again.latents), out.latents)


def test_the_heldout_bounds_are_ordered(kind):
    """IWAE(K) is no looser than the ELBO and tightens with K: in expectation, so each is averaged over seeds."""
    from free_transformer.data.tokenizer import get_tokenizer
    from free_transformer.eval.likelihood import heldout_likelihood

    model, tokenizer = _model(kind, vocab_size=256), get_tokenizer("byte")
    text = "the cat sat on the mat; " * 6  # 4 windows of tiny_model's 40 tokens

    def mean_bounds(K: int) -> tuple[float, float]:
        runs = [heldout_likelihood(model, tokenizer, text, samples=K, seed=seed) for seed in range(4)]
        return tuple(sum(run[name]["nats"] for run in runs) / len(runs) for name in ("iwae", "elbo"))

    bounds = {K: mean_bounds(K) for K in (4, 16, 64)}  # {K: (IWAE(K), ELBO)}
    assert all(math.isfinite(iwae) and iwae <= elbo for iwae, elbo in bounds.values()), bounds
    assert bounds[64][0] <= bounds[16][0] <= bounds[4][0], bounds


def test_the_hf_export_and_back_gives_the_same_logits(kind, tmp_path):
    model = _model(kind, dtype=torch.float32)
    save_checkpoint(tmp_path / "run", 3, model, {"tokenizer": "byte"})
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["latent_kind"] == kind
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to", "checkpoint"]) == 0
    back, _ = load_model(tmp_path / "back")
    assert back.config == model.config
    tokens = torch.randint(0, 50, (2, 7))
    z = model.latent_space.prior((2, 7), torch.Generator().manual_seed(1))
    assert torch.equal(back(tokens, latents=z).logits, model(tokens, latents=z).logits)


def test_serve_completes_what_generate_samples_for_a_seed(kind, tmp_path, capsys):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from free_transformer.data.tokenizer import get_tokenizer
    from free_transformer.serve.app import build_app
    from free_transformer.serve.request_plan import Engine

    checkpoint = tiny_checkpoint(tmp_path, "k", latent_units=H, latent={"kind": kind})
    model, config = load_model(checkpoint)
    client = TestClient(build_app(Engine(model, get_tokenizer(config["tokenizer"]), "k")))
    for latents in ("encoder", "prior", "shared"):
        body = {"model": "k", "prompt": "Hi", "max_tokens": 6, "seed": 3, "temperature": 0.5, "latents": latents}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert (
            main(
                [
                    "generate",
                    str(checkpoint),
                    "--prompt",
                    "Hi",
                    "-n",
                    "1",
                    "--seed",
                    "3",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    "0.5",
                    "--latents",
                    latents,
                    "--format",
                    "jsonl",
                ]
            )
            == 0
        )
        assert response.json()["choices"][0]["text"] == json.loads(capsys.readouterr().out)["sample"], latents


# ---- a learned prior or policy in the model ---------------------------------------------------------


def _policy_model(kind, **overrides):
    if kind not in _kinds_with_a_learned_prior():
        with pytest.raises(ValueError, match="cannot have a learned prior"):
            tiny_model(latent={"kind": kind, "policy": True})
        pytest.skip(f"{kind} has no learned prior")
    model = tiny_model(latent={"kind": kind, "policy": True}, **overrides)
    with torch.no_grad():  # a head away from the prior, so that its params matter
        model.latent.policy.out.weight.normal_(0, 0.5)
    return model


def _kinds_with_a_learned_prior() -> set[str]:
    return {kind for kind in KINDS if LATENT_KINDS[kind].has_learned_prior}


def _policy_draw(model, B, T, seeds=None):
    from free_transformer.model.latent import PolicyDraw

    keys = row_keys(torch.tensor(seeds or list(range(B))))
    return PolicyDraw(counter_policy_noise(model.latent_space, keys[:, None], torch.arange(T)[None, :]))


def test_an_untrained_policy_is_the_kinds_prior(kind):
    if kind not in _kinds_with_a_learned_prior():
        pytest.skip(f"{kind} has no learned prior")
    model = tiny_model(latent={"kind": kind, "policy": True})
    x_half = torch.randn(2, 5, model.config.dim, dtype=torch.float64)
    params = model.latent.policy(x_half, torch.randn_like(x_half))
    prior = model.latent_space.prior_params().to(params.dtype)
    assert params.shape == (2, 5, model.latent_space.posterior_size)
    torch.testing.assert_close(params, prior.expand_as(params))
    assert model.num_params() == model.config.num_params()


def test_a_policy_draw_is_the_heads_params_sampled_with_the_rows_words(kind):
    """The forward's Z from a PolicyDraw: sample_from_noise of the head's params, which read the first half's output
    at t and the Z drawn at t - 1 (teacher-forced `policy_params` gives the same params); the logits are those of
    the same values given explicitly, and decoding with the cache, one position at a time from the Z fed before,
    draws the same Z as the full forward."""
    model = _policy_model(kind)
    tokens = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(0))
    draw = _policy_draw(model, 3, 9)
    out = model(tokens, latents=draw)
    space = model.latent_space
    assert out.latents.shape == (3, 9, *space.value_shape) and out.posterior.shape == (3, 9, space.posterior_size)
    torch.testing.assert_close(out.latents, space.sample_from_noise(out.posterior, draw.noise))
    torch.testing.assert_close(out.posterior, model.latent.policy_params(model.first_half(tokens), out.latents))
    torch.testing.assert_close(out.logits, model(tokens, latents=out.latents).logits)
    cache, steps = model.new_cache(3), []
    for t in range(9):
        previous = steps[-1].latents[:, -1] if steps else None
        steps.append(model(tokens[:, t : t + 1], latents=type(draw)(draw.noise[:, t : t + 1], previous), cache=cache))
    assert torch.equal(torch.cat([s.latents for s in steps], 1), out.latents)
    torch.testing.assert_close(torch.cat([s.logits for s in steps], 1), out.logits, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("max_rounds", [1, 3, 32])
def test_a_prefills_policy_draws_by_rounds_are_the_loops(kind, max_rounds, monkeypatch):
    """Several positions are drawn by rounds over all of them at once (LatentPath._settled_draws): settled, or cut
    after max_rounds and finished by the loop, with a Z before the chunk and a row that takes given values, their
    Z, params and R are those of the loop, one position at a time from the Z drawn before."""
    from free_transformer.model import latent_path
    from free_transformer.model.latent import PolicyDraw

    model = _policy_model(kind)
    with torch.no_grad():  # Z_{t-1} weighs on Z_t (a change at one position can reach the next), a Gaussian's finite
        model.latent.policy.memory.weight.normal_(0, 0.2 / math.sqrt(model.config.dim))
    tokens = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(2))
    x_half = model.first_half(tokens)
    other = model(tokens, latents=_policy_draw(model, 3, 12, seeds=[7, 8, 9])).latents
    noise, use = _policy_draw(model, 3, 12).noise, torch.tensor([True, False, True])
    monkeypatch.setattr(latent_path, "MAX_ROUNDS", max_rounds)
    r, sample = model.latent.draw_from_policy(x_half, PolicyDraw(noise, other[:, 0], given=other, use=use))
    previous, loop = other[:, 0], []
    for t in range(12):
        draw = PolicyDraw(noise[:, t : t + 1], previous, given=other[:, t : t + 1], use=use)
        loop.append(model.latent.draw_from_policy(x_half[:, t : t + 1], draw))
        previous = loop[-1][1].value[:, 0]
    assert not sample.value.is_floating_point() or bool(sample.value.isfinite().all())  # a chain that stays finite
    assert torch.equal(sample.value, torch.cat([s.value for _, s in loop], 1)) and torch.equal(
        sample.value[1], other[1]
    )
    # the same values; params and R from matrix products over all positions or one, equal to float64's last digits
    tight = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sample.posterior, torch.cat([s.posterior for _, s in loop], 1), **tight)
    torch.testing.assert_close(r, torch.cat([r_t for r_t, _ in loop], 1), **tight)


def test_a_policys_params_at_t_depend_on_the_z_fed_at_t_minus_1(kind):
    """The head reads R_{t-1}: with another Z at t - 1 the params at t change (and nowhere before t)."""
    model = _policy_model(kind)
    x_half = model.first_half(torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1)))
    space = model.latent_space
    fed = model(torch.zeros(2, 6, dtype=torch.int64), latents=_policy_draw(model, 2, 6)).latents
    other = model(torch.zeros(2, 6, dtype=torch.int64), latents=_policy_draw(model, 2, 6, seeds=[7, 8])).latents
    changed = fed.clone()
    changed[:, 2] = other[:, 2]
    assume = (fed[:, 2] != other[:, 2]).reshape(2, -1).any(1).all()
    assert bool(assume), "two seeds' draws at position 2 should differ"
    before, after = model.latent.policy_params(x_half, fed), model.latent.policy_params(x_half, changed)
    assert torch.equal(before[:, :3], after[:, :3]) and not torch.allclose(before[:, 3], after[:, 3])
    assert after.shape == (2, 6, space.posterior_size)


def test_a_policy_is_saved_with_the_run_and_survives_the_hf_export(kind, tmp_path):
    model = _policy_model(kind, dtype=torch.float32)
    save_checkpoint(tmp_path / "run", 3, model, {"tokenizer": "byte"})
    loaded, _ = load_model(tmp_path / "run")
    assert loaded.config.latent.policy and torch.equal(loaded.latent.policy.out.weight, model.latent.policy.out.weight)
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to", "checkpoint"]) == 0
    back, _ = load_model(tmp_path / "back")
    tokens, draw = torch.randint(0, 50, (2, 7)), _policy_draw(model, 2, 7)
    assert torch.equal(back(tokens, latents=draw).logits, model(tokens, latents=draw).logits)


def test_a_policy_draw_without_a_policy_is_refused_in_one_line(kind):
    from free_transformer.model.latent import PolicyDraw

    model = _model(kind)
    noise = torch.zeros(1, 3, 1)
    for candidate in (model, tiny_model(latent_units=0)):
        with pytest.raises(ValueError, match="policy") as raised:
            candidate(torch.zeros(1, 3, dtype=torch.int64), latents=PolicyDraw(noise))
        assert "\n" not in str(raised.value)


def test_a_kind_that_gives_sample_from_words_alone_draws_from_the_policy_unchanged():
    """LatentSpace's defaults split no draw: the noise is the words, and sample_from_noise is sample_from_words, so
    a plugin kind written before the split draws in the engine's step as it did."""
    from free_transformer.model.latent import GaussianLatent, LatentSpace
    from free_transformer.model.latent.gaussian import normal_from_words

    class WordsOnly(GaussianLatent):
        policy_noise = LatentSpace.policy_noise
        sample_from_noise = LatentSpace.sample_from_noise

        def sample_from_words(self, params, words):
            return GaussianLatent.sample_from_noise(self, params, normal_from_words(words))

    space, gaussian = WordsOnly(3, 8), GaussianLatent(3, 8)
    words = counter_policy_words(space, row_keys(torch.arange(4))[:, None], torch.arange(2)[None, :])
    params = torch.randn(4, 2, space.posterior_size, generator=torch.Generator().manual_seed(0))
    assert space.policy_noise(words) is words
    assert torch.equal(space.sample_from_noise(params, words), gaussian.sample_from_words(params, words))
