import pytest
import torch

from free_transformer import GenerationConfig, generate, infer_latents, shared_prior_latents
from free_transformer.generate import filter_logits
from conftest import tiny_model


def _prompts(B=3, P=5, device="cpu"):
    return torch.randint(0, 50, (B, P), generator=torch.Generator().manual_seed(3)).to(device)


def _generators(seeds, device):
    return [torch.Generator(device).manual_seed(s) for s in seeds]


@pytest.mark.parametrize("latent_bits", [0, 4])
def test_cached_decoding_equals_full_forward(latent_bits, device):
    model = tiny_model(latent_bits=latent_bits, device=device)
    tokens = torch.randint(0, 50, (2, 20), device=device)
    latents = torch.randint(0, 16, (2, 20), device=device) if latent_bits else "prior"
    full = model(tokens, latents=latents).logits
    cache = model.new_cache(2)
    pieces = [model(tokens[:, :6], latents=latents[:, :6] if latent_bits else "prior", cache=cache).logits]
    pos = 6
    for width in (1, 4, 1, 1, 8):  # single steps and multi-token chunks after a prefix
        chunk = latents[:, pos : pos + width] if latent_bits else "prior"
        pieces.append(model(tokens[:, pos : pos + width], latents=chunk, cache=cache, start=pos).logits)
        pos += width
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.length == 20


def _naive_greedy(model, prompts, steps, latents):
    """Greedy decoding by rerunning the full forward on the growing sequence, no cache."""
    seq = prompts
    for _ in range(steps):
        L = seq.shape[1]
        logits = model(seq, latents=latents[:, :L] if latents is not None else "prior").logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    return seq[:, prompts.shape[1] :]


@pytest.mark.parametrize("latent_bits", [0, 4])
def test_greedy_generation_equals_naive_loop(latent_bits, device):
    model = tiny_model(latent_bits=latent_bits, device=device)
    prompts = _prompts(device=device)
    cfg = GenerationConfig(max_new_tokens=12, temperature=0)
    result = generate(model, prompts, cfg, seeds=[0, 1, 2])
    expected = _naive_greedy(model, prompts, 12, result.latents)
    assert result.tokens == expected.tolist()
    if latent_bits:
        assert result.latents.device.type == device.type  # Z for the 5 prompt positions + 11 fed new tokens, none redrawn
        assert result.latents.shape == (3, 16)


def test_prompt_latents_come_from_the_posterior(device):
    model = tiny_model(device=device)
    prompts = _prompts(device=device)
    result = generate(model, prompts, GenerationConfig(max_new_tokens=2), seeds=[4, 5, 6])
    posterior = infer_latents(model, prompts, generator=_generators((4, 5, 6), device))
    assert torch.equal(result.latents[:, :5], posterior)


def test_sampled_generation_is_reproducible_per_row(device):
    model = tiny_model(device=device)
    prompts = _prompts(device=device)
    cfg = GenerationConfig(max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9)
    batch = generate(model, prompts, cfg, seeds=[7, 8, 9])
    alone = generate(model, prompts[1:2], cfg, seeds=[8])
    assert batch.tokens[1] == alone.tokens[0]
    assert torch.equal(batch.latents[1], alone.latents[0])
    again = generate(model, prompts, cfg, seeds=[7, 8, 9])
    assert again.tokens == batch.tokens


def test_shared_latents_are_used_by_every_row(device):
    model = tiny_model(device=device)
    prompts = _prompts(P=4, device=device)
    shared = shared_prior_latents(model, 4 + 9, torch.Generator(device).manual_seed(0))
    result = generate(model, prompts, GenerationConfig(max_new_tokens=10), latents=shared)
    assert torch.equal(result.latents, shared.expand(3, -1))


def test_shared_latents_shorter_than_generation_fall_back_to_prior():
    model = tiny_model()
    prompts = _prompts(P=4)
    shared = shared_prior_latents(model, 6)
    result = generate(model, prompts, GenerationConfig(max_new_tokens=10), latents=shared, seeds=[1, 2, 3])
    assert torch.equal(result.latents[:, :6], shared.expand(3, -1))
    assert result.latents.shape == (3, 13)


def test_stop_tokens_end_rows(device):
    model = tiny_model(latent_bits=0, device=device)
    prompts = _prompts(device=device)
    free_run = generate(model, prompts, GenerationConfig(max_new_tokens=8, temperature=0))
    stop = free_run.tokens[0][2]
    stopped = generate(model, prompts, GenerationConfig(max_new_tokens=8, temperature=0, stop_tokens=(stop,)))
    assert stopped.tokens[0] == free_run.tokens[0][: free_run.tokens[0].index(stop) + 1]


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, None)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, None, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, None, 0.81)).tolist() == [[False, False, False, True]]


def test_generation_errors():
    model = tiny_model()
    short = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        generate(model, _prompts(P=30), GenerationConfig(max_new_tokens=20))
    with pytest.raises(ValueError, match="latents must be integer indices of shape"):
        generate(model, _prompts(P=5), short, latents=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="seeds"):
        generate(model, _prompts(B=3), short, seeds=[1])
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1)
    with pytest.raises(ValueError, match="latent indices must lie in \\[0, 2\\^4\\)"):
        generate(model, _prompts(P=5), short, latents=torch.full((1, 5), 16))
    with pytest.raises(ValueError, match="token ids must lie in"):
        generate(model, torch.full((1, 3), 50), short)
    with pytest.raises(ValueError, match="explicit latents need a Free Transformer"):
        generate(tiny_model(latent_bits=0), _prompts(), short, latents=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("latent_bits", [0, 4])
def test_should_stop_finishes_rows_early(latent_bits, device):
    model = tiny_model(latent_bits=latent_bits, device=device)
    prompts = _prompts(device=device)
    cfg = GenerationConfig(max_new_tokens=10, temperature=0)
    full = generate(model, prompts, cfg, seeds=[0, 1, 2]).tokens
    calls = []

    def stop_after_three(tokens):
        calls.append(len(tokens))
        return len(tokens) >= 3

    short = generate(model, prompts, cfg, seeds=[0, 1, 2], should_stop=stop_after_three).tokens
    assert short == [row[:3] for row in full]  # same tokens, cut where the callback said so
    assert max(calls) == 3


def test_returned_latents_are_ordinary_tensors(device):
    """generate decodes under inference_mode; the latents it returns must still feed a training forward."""
    model = tiny_model(device=device)
    prompts = _prompts(device=device)
    result = generate(model, prompts, GenerationConfig(max_new_tokens=6), seeds=[0, 1, 2])
    assert not result.latents.is_inference()
    tokens = torch.cat([prompts, torch.tensor(result.tokens, device=device)[:, :-1]], 1)  # the positions the latents were fed at
    model.train()
    model(tokens, tokens, latents=result.latents).loss.backward()
    assert model.latent.mapper.weight.grad is not None


@pytest.mark.parametrize("latent_bits", [0, 4])
def test_static_decoding_gives_the_eager_tokens_and_latents(latent_bits):
    """compile=True decodes through StaticDecodeStep (the step a GPU captures as a CUDA graph: device
    position, whole static cache under a mask); on CPU it runs eagerly and must match the eager path."""
    model = tiny_model(latent_bits=latent_bits)
    prompts, seeds = _prompts(B=3, P=4), [11, 12, 13]
    stop = generate(model, prompts, GenerationConfig(max_new_tokens=12), seeds=seeds).tokens[0][4]
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, stop_tokens=(stop,))
    eager = generate(model, prompts, config, seeds=seeds)
    static = generate(model, prompts, config, seeds=seeds, compile=True)
    assert static.tokens == eager.tokens
    assert any(len(t) < 12 for t in eager.tokens)  # a stop token cut a row short: the stop check is exercised
    if latent_bits:
        assert torch.equal(static.latents, eager.latents)
    else:
        assert static.latents is None and eager.latents is None


def test_static_step_matches_the_cached_forward():
    model = tiny_model()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    latents = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    full = model(tokens, latents=latents).logits
    cache = model.new_cache(2)
    model(tokens[:, :5], latents=latents[:, :5], cache=cache)
    assert cache.length == 5 and int(cache.position) == 5
    for t in range(5, 9):
        step = model(tokens[:, t : t + 1], latents=latents[:, t : t + 1], cache=cache, start=cache.position)
        torch.testing.assert_close(step.logits[:, 0], full[:, t], rtol=1e-10, atol=1e-10)
    assert int(cache.position) == 9
    with pytest.raises(ValueError, match="static decoding step"):
        model(tokens[:, :2], latents=latents[:, :2], cache=cache, start=cache.position)
