"""FreeTransformerForCausalLM: Auto-class registration, save/load, forward with Hugging Face's cache,
and generate() against our own `generate` for every latent choice."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_config, tiny_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from free_transformer import ConfigError, GenerationConfig, generate, infer_latents, shared_prior_latents  # noqa: E402
from free_transformer.hf import FreeTransformerConfig, FreeTransformerForCausalLM  # noqa: E402
from free_transformer.hf.modeling import CACHE_FIELD  # noqa: E402

P, NEW = 5, 8  # prompt length, new tokens


def _prompts(B=3):
    return torch.randint(0, 50, (B, P), generator=torch.Generator().manual_seed(3))


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.fixture(scope="module")
def free_pair():
    model = tiny_model(latent_units=4)
    return model, FreeTransformerForCausalLM.from_free_transformer(model)


def test_config_maps_one_to_one_and_validates():
    config = tiny_config(latent_layer=1, tie_embeddings=True, rope_theta=5000.0)
    hf_config = FreeTransformerConfig.from_model_config(config)
    assert hf_config.to_model_config() == config
    assert hf_config.hidden_size == config.dim and hf_config.num_hidden_layers == config.n_layers
    with pytest.raises(ConfigError, match="must divide"):
        FreeTransformerConfig(hidden_size=30)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        FreeTransformerConfig.from_dict({"model_type": "llama", "hidden_size": 32})


@pytest.mark.parametrize("latent_units,tie", [(0, False), (4, True)])
def test_save_pretrained_from_pretrained_through_auto_classes(tmp_path, latent_units, tie):
    model = tiny_model(latent_units=latent_units, tie_embeddings=tie)
    hf_model = FreeTransformerForCausalLM.from_free_transformer(model)
    ours = model.state_dict()
    assert set(hf_model.state_dict()) == {f"model.{k}" for k in ours}  # our names under one prefix
    hf_model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert type(AutoConfig.from_pretrained(tmp_path)) is FreeTransformerConfig
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(loaded) is FreeTransformerForCausalLM and loaded.dtype == torch.float64
    for name, tensor in ours.items():
        assert torch.equal(loaded.state_dict()[f"model.{name}"], tensor), name
    assert torch.equal(loaded.model.rope_cos, model.rope_cos)  # not checkpointed: rebuilt on load
    tokens = torch.randint(0, 50, (2, 12))
    latents = torch.randint(0, 16, (2, 12)) if latent_units else None
    expected = model(tokens, latents=latents if latent_units else "prior").logits
    assert torch.equal(loaded(tokens, latents=latents).logits, expected)


def test_forward_loss_follows_hf_label_convention(free_pair):
    model, hf_model = free_pair
    tokens = torch.randint(0, 50, (2, 10))
    out = hf_model(tokens, labels=tokens, generator=_gens([0, 1]), kappa_nats=0.1)
    targets = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], 1)  # labels are shifted inside
    ours = model(tokens, targets, generator=_gens([0, 1]), kappa_nats=0.1)
    assert torch.equal(out.loss, ours.loss) and torch.equal(out.kl_nats, ours.kl_nats)
    assert torch.equal(out.latents, ours.latents)


@pytest.mark.parametrize("cache_argument", ["cache", "past_key_values"])  # transformers >= 5.24, and before
def test_forward_with_hf_cache_equals_full_forward(free_pair, cache_argument):
    model, hf_model = free_pair
    tokens, latents = torch.randint(0, 50, (2, 16)), torch.randint(0, 16, (2, 16))
    full = model(tokens, latents=latents).logits
    cache, pieces, pos = DynamicCache(config=hf_model.config), [], 0
    for width in (6, 1, 4, 1, 4):
        out = hf_model(tokens[:, pos : pos + width], latents=latents[:, pos : pos + width], **{cache_argument: cache})
        assert getattr(out, CACHE_FIELD) is cache
        pieces.append(out.logits)
        pos += width
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.get_seq_length() == 16


def _ours(model, prompts, seeds, latents=None, **sampling):
    config = GenerationConfig(max_new_tokens=NEW, **{"temperature": 0.0, **sampling})
    return generate(model, prompts, config, seeds=seeds, latents=latents)


SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.5)


@pytest.mark.parametrize("choice", ["explicit", "encoder", "prior", "shared", "reference", "sampled"])
def test_hf_generate_equals_our_generate(free_pair, choice):
    model, hf_model = free_pair
    prompts, seeds = _prompts(), [7, 8, 9]
    hf_args = dict(max_new_tokens=NEW, do_sample=False, seeds=seeds, return_dict_in_generate=True)
    sampling = {}
    if choice == "explicit":  # shorter than the generation: the prior takes over after 10 positions
        latents = torch.randint(0, 16, (3, 10))
        ours, hf_args["latents"] = _ours(model, prompts, seeds, latents), latents
    elif choice == "encoder":
        ours = _ours(model, prompts, seeds)
    elif choice == "prior":
        ours, hf_args["latents"] = _ours(model, prompts, seeds, "prior"), "prior"
    elif choice == "shared":
        shared = shared_prior_latents(model, model.config.max_seq_len, torch.Generator().manual_seed(5))
        ours = _ours(model, prompts, seeds, shared)
        hf_args.update(latents="shared", latent_seed=5)
    elif choice == "reference":
        reference = torch.randint(0, 50, (1, 9))
        ours = _ours(model, prompts, seeds, infer_latents(model, reference, torch.Generator().manual_seed(5)))
        hf_args.update(latent_reference=reference, latent_seed=5)
    else:  # per-row seeded sampling, same draws in the same order as ours
        sampling = SAMPLING
        ours = _ours(model, prompts, seeds, **sampling)
        hf_args.update(do_sample=True, **sampling)
    out = hf_model.generate(prompts, **hf_args)
    assert torch.equal(out.sequences[:, :P], prompts)
    assert out.sequences[:, P:].tolist() == ours.tokens
    assert torch.equal(out.latents, torch.stack(ours.latents))  # (B, P + NEW - 1): prompt Z and one per fed token
    if choice in ("shared", "reference"):
        assert (out.latents[:, :9] == out.latents[:1, :9]).all()


def test_hf_generate_without_cache_keeps_the_latents(free_pair):
    """use_cache=False re-feeds the whole sequence each step: recorded Z are reused, not redrawn."""
    model, hf_model = free_pair
    prompts, seeds = _prompts(), [7, 8, 9]
    ours = _ours(model, prompts, seeds, **SAMPLING)
    out = hf_model.generate(
        prompts,
        max_new_tokens=NEW,
        do_sample=True,
        seeds=seeds,
        use_cache=False,
        return_dict_in_generate=True,
        **SAMPLING,
    )
    assert out.sequences[:, P:].tolist() == ours.tokens and torch.equal(out.latents, torch.stack(ours.latents))


def test_hf_generate_equals_ours_for_a_baseline():
    model = tiny_model(latent_units=0)
    hf_model = FreeTransformerForCausalLM.from_free_transformer(model)
    prompts, seeds = _prompts(), [1, 2, 3]
    for sampling in ({}, SAMPLING):
        ours = _ours(model, prompts, seeds, **sampling)
        out = hf_model.generate(prompts, max_new_tokens=NEW, do_sample=bool(sampling), seeds=seeds, **sampling)
        assert out[:, P:].tolist() == ours.tokens


def test_hf_native_sampling_keeps_every_latent(free_pair):
    """Without seeds Hugging Face samples with the global RNG (not comparable to ours token by token).
    What holds: reproducible under torch.manual_seed, and every step's logits are those of a full
    forward over the final sequence with the recorded Z, so no Z_t was redrawn after it was fed."""
    model, hf_model = free_pair
    prompts = _prompts()
    args = dict(max_new_tokens=NEW, do_sample=True, top_k=0, return_dict_in_generate=True, output_logits=True)
    torch.manual_seed(11)
    out = hf_model.generate(prompts, **args)
    torch.manual_seed(11)
    again = hf_model.generate(prompts, **args)
    assert torch.equal(out.sequences, again.sequences) and torch.equal(out.latents, again.latents)
    fed = out.sequences[:, :-1]
    full = model(fed, latents=out.latents).logits  # (B, P + NEW - 1, V)
    steps = torch.stack(out.logits, 1)  # (B, NEW, V), float32
    torch.testing.assert_close(steps, full[:, P - 1 :].float(), rtol=1e-5, atol=1e-5)


def test_hf_generate_gives_num_return_sequences_rows_a_prompt_each_with_its_z(free_pair):
    """num_return_sequences=n with sampling: n rows a prompt, grouped by prompt as Hugging Face returns them, each
    with its own Z from the latents chosen (its own draws; one shared sequence; the prompt's explicit Z)."""
    _, hf_model = free_pair
    prompts, n = _prompts(2), 3
    args = dict(max_new_tokens=NEW, do_sample=True, num_return_sequences=n, return_dict_in_generate=True)
    torch.manual_seed(0)
    drawn = hf_model.generate(prompts, **args)
    assert drawn.sequences.shape == (2 * n, P + NEW) and torch.equal(
        drawn.sequences[:, :P], prompts.repeat_interleave(n, 0)
    )
    assert drawn.latents.shape[0] == 2 * n and len({tuple(z) for z in drawn.latents.tolist()}) == 2 * n
    shared = hf_model.generate(prompts, latents="shared", latent_seed=0, **args)
    assert (shared.latents == shared.latents[:1]).all()
    given = drawn.latents[::n]  # (2, P + NEW - 1): each prompt's Z at every position
    fixed = hf_model.generate(prompts, latents=given, **args)
    assert torch.equal(fixed.latents, given.repeat_interleave(n, 0))
    with pytest.raises(ValueError, match="num_return_sequences > 1 with seeds"):
        hf_model.generate(prompts, seeds=[1, 2], **args)


def test_generate_rejects_bad_input(free_pair):
    _, hf_model = free_pair
    prompts = _prompts()
    with pytest.raises(ValueError, match="padded batches"):
        hf_model.generate(prompts, attention_mask=torch.tensor([[0, 1, 1, 1, 1]] * 3), max_new_tokens=2)
    with pytest.raises(ValueError, match="latents of kind binary_mapper must have shape"):
        hf_model.generate(prompts, latents=torch.zeros(3, 2, dtype=torch.int64), max_new_tokens=2)
    with pytest.raises(ValueError, match="latents must be one of 'encoder', 'prior', 'shared', 'reference'"):
        hf_model.generate(prompts, latents="posterior-ish", max_new_tokens=2)
    with pytest.raises(ValueError, match="latent indices"):
        hf_model.generate(prompts, latents=torch.full((1, 8), 16), max_new_tokens=2)
    with pytest.raises(ValueError, match="beam search"):
        hf_model.generate(prompts, num_beams=2, max_new_tokens=2)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        hf_model.generate(prompts, max_new_tokens=40)
    with pytest.raises(ValueError, match="only caches that hold exactly"):
        hf_model.generate(prompts, cache_implementation="static", max_new_tokens=2)
    with pytest.raises(ValueError, match="seeds"):
        hf_model.generate(prompts, seeds=[1], max_new_tokens=2)
    baseline = FreeTransformerForCausalLM.from_free_transformer(tiny_model(latent_units=0))
    with pytest.raises(ValueError, match="need a Free Transformer"):
        baseline.generate(prompts, latents="prior", max_new_tokens=2)


def test_from_pretrained_errors(tmp_path):
    FreeTransformerConfig(latent_units=2).save_pretrained(tmp_path)
    with pytest.raises(OSError, match="model.safetensors"):
        FreeTransformerForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    llama_dir = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2).save_pretrained(llama_dir)
    with pytest.raises(ValueError, match="got model_type 'llama'"):
        FreeTransformerForCausalLM.from_pretrained(llama_dir, local_files_only=True)
