import subprocess
import sys

import pytest
import torch
from conftest import on_cpu, tiny_config, tiny_model, tolerance
from reference import _rope, naive_forward

from free_transformer import ConfigError, FreeTransformer, ModelConfig, named_config
from free_transformer.inference.latents import check_latent_values
from free_transformer.model.config import LatentConfig
from free_transformer.model.latent import free_bits_kl
from free_transformer.model.layers import apply_rope, rope_tables
from free_transformer.runs.migrations import split_state_dict, upgrade_state_dict


def _tokens(B=2, T=12, vocab=50, seed=0, device="cpu"):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dim=30), "must divide dim"),
        (dict(n_kv_heads=3), "must divide n_heads"),
        (dict(latent_layer=4), "latent_layer"),
        (dict(latent_layer=0), "latent_layer"),
        (dict(latent_units=-1), "latent_units"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(n_layers=1), "n_layers >= 2"),
        (dict(latent_units=25), "latent_units must be an integer in \\[0, 24\\] for latent kind binary_mapper"),
        (dict(latent_units=63, latent=LatentConfig(kind="bit_linear")), "\\[0, 62\\]"),
        (dict(latent=LatentConfig(kind="vq")), "unknown latent kind 'vq'; choose one of binary_mapper, bit_linear"),
        (dict(latent=LatentConfig(encoder_layers=0)), "encoder_layers must be a positive integer"),
        (dict(latent={"kind": "binary_mapper", "depth": 2}), "unknown setting model.latent.depth"),
    ],
)
def test_config_errors(overrides, message):
    """A wrong field is a ConfigError before any model work: the config's own fields when it is made, the
    latent kind's name and limit (its registry imports torch) when a model is built or a run's config
    validated (test_train)."""
    with pytest.raises(ConfigError, match=message):
        FreeTransformer(tiny_config(**overrides))


def test_config_round_trip_and_unknown_field():
    cfg = tiny_config(latent_layer=1, latent=LatentConfig(kind="bit_linear", encoder_layers=2))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k != "latent"}  # a config.json written by 0.1
    assert ModelConfig.from_dict(old).latent == LatentConfig()
    with pytest.raises(ConfigError, match="unknown model config field"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_experts": 8})
    with pytest.raises(ConfigError, match="unknown model size"):
        named_config("gigantic")


@pytest.mark.parametrize("latent", [LatentConfig(), LatentConfig("bit_linear", encoder_layers=3)])
@pytest.mark.parametrize("name", ["debug", "cpu-small", "paper-1.5b", "paper-8b"])
def test_param_count_matches_model_built_on_meta(name, latent):
    cfg = named_config(name, latent=latent)
    with torch.device("meta"):
        model = FreeTransformer(cfg)
        baseline = FreeTransformer(cfg.replace(latent_units=0))
    assert model.num_params() == cfg.num_params()
    assert baseline.num_params() == cfg.replace(latent_units=0).num_params()


def test_paper_overhead_is_about_one_block():
    cfg = named_config("paper-1.5b")
    ratio = cfg.training_flops_per_token(4096) / cfg.replace(latent_units=0).training_flops_per_token(4096)
    assert 1.03 < ratio < 1.06  # one extra block of 28 (3.6%) plus the post-sampler's backward


VARIANTS = [
    dict(latent=LatentConfig("bit_linear")),
    dict(latent=LatentConfig(encoder_layers=2)),
    dict(latent=LatentConfig("bit_linear", encoder_layers=3), latent_units=5),
]


@pytest.mark.parametrize(
    "overrides", [dict(latent_units=0), dict(latent_units=4), dict(latent_units=3, tie_embeddings=True), *VARIANTS]
)
def test_forward_matches_naive_algorithm(overrides, device):
    model = tiny_model(device=device, **overrides)
    tokens = _tokens()
    latents = torch.randint(0, 2 ** max(1, model.config.latent_units), tokens.shape)
    out = model(tokens.to(device), latents=latents.to(device))
    ref_logits, _ = naive_forward(on_cpu(model).double(), tokens, latents)
    torch.testing.assert_close(out.logits.cpu().double(), ref_logits, **tolerance(model))


@pytest.mark.parametrize("overrides", [{}, *VARIANTS])
def test_encoder_bit_logits_match_naive_encoder(overrides, device):
    model = tiny_model(device=device, **overrides)
    tokens = _tokens()
    out = model(tokens.to(device), latents="encoder")
    ref_logits, ref_bits = naive_forward(on_cpu(model).double(), tokens, out.latents.cpu())
    torch.testing.assert_close(out.posterior.cpu().double(), ref_bits, **tolerance(model))
    torch.testing.assert_close(out.logits.cpu().double(), ref_logits, **tolerance(model))


def test_free_model_with_zero_post_sampler_equals_baseline(device):
    free = tiny_model(device=device)
    with torch.no_grad():
        free.latent.mapper.weight.zero_()
    baseline = FreeTransformer(free.config.replace(latent_units=0)).to(device, free.embed_tokens.weight.dtype)
    missing, unexpected = baseline.load_state_dict(free.state_dict(), strict=False)
    assert not missing and unexpected  # the baseline is the Free Transformer minus the latent path
    tokens = _tokens(device=device)
    torch.testing.assert_close(
        free(tokens).logits,
        baseline(tokens).logits,
        rtol=0,
        atol=1e-12 if free.embed_tokens.weight.dtype == torch.float64 else 1e-6,
    )


def test_loss_is_cross_entropy_plus_free_bits_kl(device):
    model = tiny_model(device=device)
    tokens = _tokens(T=13, device=device)
    out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.05, generator=torch.Generator(device).manual_seed(0))
    assert out.logits is None  # the cross-entropy is fused with the read-out (tests/test_loss.py)
    # the same Z (same generator seed), the logits kept: the loss is then taken from them
    full = model(
        tokens[:, :-1],
        tokens[:, 1:],
        kappa_nats=0.05,
        generator=torch.Generator(device).manual_seed(0),
        return_logits=True,
    )
    assert torch.equal(full.latents, out.latents)
    ce = torch.nn.functional.cross_entropy(full.logits.flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(full.cross_entropy_nats, ce)
    torch.testing.assert_close(out.cross_entropy_nats, ce)
    torch.testing.assert_close(out.loss, ce + free_bits_kl(out.kl_per_token_nats, 0.05))
    torch.testing.assert_close(full.loss, out.loss)
    assert out.kl_per_token_nats.shape == (2, 12) and out.kl_nats > 0.05


def test_decoder_is_causal_given_fixed_latents(device):
    model = tiny_model(device=device)
    tokens = _tokens(B=1, device=device)
    latents = torch.randint(0, 16, tokens.shape, device=device)
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 50
    a, b = model(tokens, latents=latents).logits, model(changed, latents=latents).logits
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_encoder_is_not_causal():
    model = tiny_model()
    tokens = _tokens(B=1)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 50
    a, b = model(tokens).posterior, model(changed).posterior
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-6  # the last token changes the first position's bits


def test_gqa_equals_repeated_kv_heads(device):
    gqa = tiny_model(n_heads=4, n_kv_heads=2, device=device)
    mha = FreeTransformer(gqa.config.replace(n_kv_heads=4)).to(device, gqa.embed_tokens.weight.dtype).eval()
    state = split_state_dict(gqa.state_dict(), gqa.config)  # separate k and v (loaded fused again below)
    hd = gqa.config.head_dim
    for key, value in list(state.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):  # (kv*hd, D) -> each kv head used twice
            state[key] = value.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(upgrade_state_dict(state))  # fused again
    tokens, latents = _tokens(device=device), torch.randint(0, 16, (2, 12), device=device)
    torch.testing.assert_close(
        gqa(tokens, latents=latents).logits, mha(tokens, latents=latents).logits, **tolerance(gqa)
    )


def test_bad_inputs_raise_clear_errors():
    """Shapes are checked by forward; value ranges by the entry points' checks (they read the values)."""
    model = tiny_model()
    with pytest.raises(ValueError, match="token ids must lie in"):
        model.check_tokens(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="token ids must lie in"):
        model.check_tokens(torch.tensor([[-1, 2]]))
    model.check_tokens(torch.tensor([[0, 49]]))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, 41, dtype=torch.long))
    with pytest.raises(ValueError, match="explicit latents"):
        model(torch.zeros(1, 5, dtype=torch.long), latents=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="latent indices must lie in \\[0, 2\\^4\\)"):
        check_latent_values(model, torch.tensor([[0, 16, 1]]), 1)
    with pytest.raises(ValueError, match="must be integer indices"):
        check_latent_values(model, torch.zeros(1, 3), 1)
    with pytest.raises(ValueError, match="must have shape .* with N >= 4"):
        check_latent_values(model, torch.zeros(1, 3, dtype=torch.long), 1, min_length=4)
    with pytest.raises(ValueError, match="need a Free Transformer"):
        check_latent_values(tiny_model(latent_units=0), torch.zeros(1, 3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="encoder latents need the whole sequence"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=model.new_cache(1), start=2)
    with pytest.raises(ValueError, match="latents must be 'encoder', 'prior', a PolicyDraw or a tensor of values"):
        model(torch.zeros(1, 3, dtype=torch.long), latents="posteriour")
    x, position = torch.zeros(1, 1, model.config.dim, dtype=torch.float64), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="a decoding step .* needs a cache"):  # an attention layer called alone
        model.layers[0].self_attn(x, x, model.rope_cos[:1], model.rope_sin[:1], causal=True, start=position)


def test_forward_takes_resolved_sources_only():
    """A user's spelling is parsed by free_transformer.inference.latents, not by the model: the old name of
    "encoder" is not a source, and the forward says what is."""
    with pytest.raises(ValueError, match="latents must be 'encoder', 'prior', a PolicyDraw or a tensor of values"):
        tiny_model()(_tokens(), latents="posterior")


@pytest.mark.parametrize("overrides", [{}, *VARIANTS])
def test_gradients_reach_every_parameter(overrides, device):
    model = tiny_model(dtype=torch.float32, device=device, **overrides).train()
    tokens = _tokens(T=13, device=device)
    model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.0).loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    assert not no_grad, no_grad


def test_bf16_autocast_forward_backward(device):
    model = tiny_model(dtype=torch.float32, device=device).train()
    tokens = _tokens(T=13, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(tokens[:, :-1], tokens[:, 1:])
        logits = model(tokens[:, :-1]).logits
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.loss.dtype == torch.float32 and logits.dtype == torch.bfloat16
    assert model.latent.readout.weight.grad.abs().max() > 0


def test_gqa_route_policy():
    from free_transformer.model.layers import gqa_route

    assert gqa_route("cpu", torch.float32, 128, masked=False) == "native"
    assert gqa_route("cuda", torch.bfloat16, 128, masked=False) == "native"  # flash takes GQA itself
    assert gqa_route("cuda", torch.float32, 128, masked=False) == "expand"  # else the math kernel
    assert gqa_route("cuda", torch.bfloat16, 1, masked=False) == "fold"
    assert gqa_route("cuda", torch.float32, 4, masked=True) == "fold"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_gqa_routes_give_the_native_attention(dtype, monkeypatch):
    """The routes a GPU takes (rows folded, K/V repeated), run here on CPU: the same logits as SDPA's
    own enable_gqa, for a full forward, a masked chunk after a cache, one-token steps and a decoding step."""
    from free_transformer.model import layers

    model = tiny_model(dtype=torch.float32)
    tokens, latents = _tokens(T=12), torch.randint(0, 16, (2, 12))

    def run():
        cache = model.new_cache(2)
        pieces = [
            model(tokens[:, :5], latents=latents[:, :5], cache=cache).logits,
            model(tokens[:, 5:8], latents=latents[:, 5:8], cache=cache).logits,
            model(tokens[:, 8:9], latents=latents[:, 8:9], cache=cache).logits,
            model(tokens[:, 9:10], latents=latents[:, 9:10], cache=cache, start=torch.full((2,), 9)).logits,
        ]
        with torch.autocast("cpu", dtype, enabled=dtype != torch.float32):
            return model(tokens, latents=latents).logits.float(), torch.cat(pieces, 1)

    native = run()
    cuda_route = layers.gqa_route
    monkeypatch.setattr(layers, "gqa_route", lambda device, dt, T, masked: cuda_route("cuda", dt, T, masked))
    routed = run()
    for a, b in zip(native, routed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("latent_units", [0, 4])
def test_a_forward_without_backward_leaves_nothing_alive_once_its_output_is_dropped(latent_units, device):
    """The model holds no reference to its last forward: after a training forward (the autograd graph
    built) that is never backpropagated, dropping the output frees every tensor autograd saved for the
    backward and every tensor of the output, by reference counting alone (no gc.collect)."""
    import weakref

    model = tiny_model(device=device, latent_units=latent_units).train()
    tokens = _tokens(T=13, device=device)
    saved = []

    def pack(tensor):
        alias = tensor.detach()  # what autograd keeps in the graph; an alias, so no cycle through `tensor`
        saved.append(weakref.ref(alias))
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda alias: alias):
        out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.1)
    produced = [weakref.ref(t) for t in (out.loss, out.logits, out.kl_nats, out.latents) if t is not None]
    assert len(saved) > 20 and all(ref() is not None for ref in saved)  # alive while the caller holds `out`
    del out
    assert [ref for ref in saved + produced if ref() is not None] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_llamas_rotate_half_to_the_bit(dtype):
    """apply_rope's roll over the signed sin table gives Llama's x * cos + cat(-x2, x1) * sin exactly; the
    tables are the reference's float64 angles to float32 rounding."""
    head_dim, T = 16, 40
    cos, signed_sin = rope_tables(head_dim, T, 10000.0)
    half = head_dim // 2
    sin = torch.cat([-signed_sin[:, :half], signed_sin[:, half:]], -1)  # Llama's table: (sin, sin)
    x = torch.randn(2, 3, T, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    llama = x * cos.to(dtype) + torch.cat([-x[..., half:], x[..., :half]], -1) * sin.to(dtype)
    assert torch.equal(apply_rope(x, cos, signed_sin), llama)
    x64 = x.double()
    torch.testing.assert_close(
        apply_rope(x64, cos, signed_sin), _rope(x64, torch.arange(T), 10000.0), atol=1e-5, rtol=0
    )


def test_building_and_decoding_a_model_of_any_kind_loads_no_compiler():
    """A model of every built-in kind is built (its latent space built once more on the meta device for its
    sizes) and decodes a token without importing torch._dynamo: its import takes a second and grows the heap of
    the process by half, which every later garbage collection walks (a decoding step's time with it)."""
    code = (
        "import sys, torch\n"
        "from free_transformer import FreeTransformer, GenerationConfig, generate, named_config\n"
        "from free_transformer.model.config import LatentConfig\n"
        "from free_transformer.model.latent import LATENT_KINDS\n"
        "for kind in sorted(LATENT_KINDS):\n"
        "    model = FreeTransformer(named_config('debug', latent=LatentConfig(kind)))\n"
        "    generate(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=2), seed=0)\n"
        "print(sorted(LATENT_KINDS), 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout
    assert "categorical" in out.stdout and "binary_mapper" in out.stdout


def test_a_decoding_step_over_a_cache_of_another_dtype_matches_the_models_own():
    """Rows at different positions (a (B,) position tensor) over a bf16 cache of a float32 model: the step casts
    its keys, values and additive mask to the queries' dtype, and its logits are those of a float32 cache up to
    bf16 rounding."""
    model = tiny_model(latent_units=4, dtype=torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.inference_mode():
            cache = model.new_cache(2, dtype=dtype, capacity=8)
            model(tokens, latents=torch.zeros(1, 5, dtype=torch.int64), cache=cache)
            step = model(
                tokens[:, -1:], latents=torch.ones(1, 1, dtype=torch.int64), cache=cache, start=torch.tensor([5, 4])
            )
        logits[dtype] = step.logits
    assert logits[torch.bfloat16].dtype == torch.float32
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], atol=0.05, rtol=0.05)
