import gc
import importlib
import math
import weakref

import pytest
import torch
from conftest import tiny_model, tolerance

from free_transformer import GenerationConfig, generate, infer_latents, shared_prior_latents
from free_transformer.base.counter_random import row_keys
from free_transformer.inference.engine import DecodeEngine
from free_transformer.inference.kept_engines import decoding_engine
from free_transformer.inference.params import Sampling
from free_transformer.inference.sampling import RowSettings, filtered, sample_next

kept_module = importlib.import_module("free_transformer.inference.kept_engines")


def filter_logits(logits, rule):
    """(B, V) logits with the tokens the rule's filters drop set to -inf (every row with the rule)."""
    settings = RowSettings(len(logits), logits.device)
    settings.set(slice(0, len(logits)), [rule] * len(logits))
    return filtered(logits, settings.view(slice(0, len(logits)))[1:])


def next_token_probs(logits, temperature, rule):
    return torch.softmax(filter_logits(logits.float() / temperature, rule), -1)


def _prompts(B=3, P=5, device="cpu"):
    return torch.randint(0, 50, (B, P), generator=torch.Generator().manual_seed(3)).to(device)


def _generators(seeds, device):
    return [torch.Generator(device).manual_seed(s) for s in seeds]


@pytest.mark.parametrize("latent_units", [0, 4])
def test_cached_decoding_equals_full_forward(latent_units, device):
    model = tiny_model(latent_units=latent_units, device=device)
    tokens = torch.randint(0, 50, (2, 20), device=device)
    latents = torch.randint(0, 16, (2, 20), device=device) if latent_units else "prior"
    full = model(tokens, latents=latents).logits
    cache = model.new_cache(2)
    pieces = [model(tokens[:, :6], latents=latents[:, :6] if latent_units else "prior", cache=cache).logits]
    pos = 6
    for width in (1, 4, 1, 1, 8):  # single steps and multi-token chunks after a prefix
        chunk = latents[:, pos : pos + width] if latent_units else "prior"
        pieces.append(model(tokens[:, pos : pos + width], latents=chunk, cache=cache, start=pos).logits)
        pos += width
    torch.testing.assert_close(torch.cat(pieces, 1), full, **tolerance(model))
    assert cache.length == 20


def _naive_greedy(model, prompts, steps, latents):
    """Greedy decoding by rerunning the full forward on the growing sequence, no cache."""
    seq = prompts
    for _ in range(steps):
        L = seq.shape[1]
        logits = model(seq, latents=latents[:, :L] if latents is not None else "prior").logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    return seq[:, prompts.shape[1] :]


@pytest.mark.parametrize("latent_units", [0, 4])
def test_greedy_generation_equals_naive_loop(latent_units, device):
    model = tiny_model(latent_units=latent_units, device=device)
    prompts = _prompts(device=device)
    cfg = GenerationConfig(max_new_tokens=12, temperature=0)
    result = generate(model, prompts, cfg, seeds=[0, 1, 2])
    latents = torch.stack(result.latents) if latent_units else None
    expected = _naive_greedy(model, prompts, 12, latents)
    assert result.tokens == expected.tolist()
    if latent_units:
        assert latents.device.type == device.type  # Z for the 5 prompt positions + 11 fed new tokens, none redrawn
        assert latents.shape == (3, 16)


def test_prompt_latents_come_from_the_posterior(device):
    model = tiny_model(device=device)
    prompts = _prompts(device=device)
    result = generate(model, prompts, GenerationConfig(max_new_tokens=2), seeds=[4, 5, 6])
    posterior = infer_latents(model, prompts, generator=_generators((4, 5, 6), device))
    assert torch.equal(torch.stack(result.latents)[:, :5], posterior)


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
    assert torch.equal(torch.stack(result.latents), shared.expand(3, -1))


def test_shared_latents_shorter_than_generation_fall_back_to_prior():
    model = tiny_model()
    prompts = _prompts(P=4)
    shared = shared_prior_latents(model, 6)
    result = generate(model, prompts, GenerationConfig(max_new_tokens=10), latents=shared, seeds=[1, 2, 3])
    assert torch.equal(torch.stack(result.latents)[:, :6], shared.expand(3, -1))
    assert torch.stack(result.latents).shape == (3, 13)


def test_stop_tokens_end_rows(device):
    model = tiny_model(latent_units=0, device=device)
    prompts = _prompts(device=device)
    free_run = generate(model, prompts, GenerationConfig(max_new_tokens=8, temperature=0))
    stop = free_run.tokens[0][2]
    stopped = generate(model, prompts, GenerationConfig(max_new_tokens=8, temperature=0, stop_tokens=(stop,)))
    assert stopped.tokens[0] == free_run.tokens[0][: free_run.tokens[0].index(stop) + 1]


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, Sampling(top_k=2))).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, Sampling(top_p=0.8))).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, Sampling(top_p=0.81))).tolist() == [[False, False, False, True]]


def _naive_filtered_probs(logits, temperature: float, top_k: int | None, min_p: float) -> list[list[float]]:
    """The next-token distribution from the rules' definitions, one row and one token at a time: p =
    softmax(logits / T); top-k keeps the k largest p_i; min-p keeps p_i >= min_p * max_j p_j of what is left;
    the kept ones renormalised."""
    out = []
    for row in logits.tolist():
        weights = [math.exp((x - max(row)) / temperature) for x in row]
        p = [w / sum(weights) for w in weights]
        kth = sorted(p, reverse=True)[top_k - 1] if top_k else 0.0
        kept = [pi if pi >= kth else 0.0 for pi in p]
        kept = [pi if pi >= min_p * max(kept) else 0.0 for pi in kept]
        out.append([pi / sum(kept) for pi in kept])
    return out


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("min_p, top_k", [(0.05, None), (0.3, None), (1.0, None), (0.1, 10)])
def test_min_p_keeps_the_tokens_the_naive_rule_keeps(temperature, min_p, top_k):
    logits = 3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    rule = Sampling(temperature=temperature, top_k=top_k, min_p=min_p)
    probs = next_token_probs(logits, temperature, rule)
    expected = torch.tensor(_naive_filtered_probs(logits, temperature, top_k, min_p), dtype=torch.float64)
    assert torch.equal(probs > 0, expected > 0)  # the same tokens kept
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-6)
    assert bool((probs == 0).any()) and (min_p < 1 or bool(((probs > 0).sum(-1) == 1).all()))  # it bites; 1: the top
    keys = row_keys(torch.arange(4))
    drawn = sample_next(logits, GenerationConfig(temperature=temperature, top_k=top_k, min_p=min_p), keys, 0)
    assert all(expected[row, token] > 0 for row, token in enumerate(drawn.tolist()))


def test_generation_errors():
    model = tiny_model()
    short = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        generate(model, _prompts(P=30), GenerationConfig(max_new_tokens=20))
    with pytest.raises(ValueError, match="latents of kind binary_mapper must have shape"):
        generate(model, _prompts(P=5), short, latents=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="seeds"):
        generate(model, _prompts(B=3), short, seeds=[1])
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=-1)
    for min_p in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"min_p must be in \(0, 1\]"):
            GenerationConfig(min_p=min_p)
    with pytest.raises(ValueError, match="latent indices must lie in \\[0, 2\\^4\\)"):
        generate(model, _prompts(P=5), short, latents=torch.full((1, 5), 16))
    with pytest.raises(ValueError, match="token ids must lie in"):
        generate(model, torch.full((1, 3), 50), short)
    with pytest.raises(ValueError, match="explicit latents need a Free Transformer"):
        generate(tiny_model(latent_units=0), _prompts(), short, latents=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("latent_units", [0, 4])
def test_should_stop_finishes_rows_early(latent_units, device):
    model = tiny_model(latent_units=latent_units, device=device)
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
    assert not any(latents.is_inference() for latents in result.latents)
    tokens = torch.cat(
        [prompts, torch.tensor(result.tokens, device=device)[:, :-1]], 1
    )  # the positions the latents were fed at
    model.train()
    model(tokens, tokens, latents=torch.stack(result.latents)).loss.backward()
    assert model.latent.mapper.weight.grad is not None


@pytest.mark.parametrize("latent_units", [0, 4])
def test_static_decoding_gives_the_eager_tokens_and_latents(latent_units, device):
    """compile=True decodes with the engine's bucketed step (the step a GPU captures as a CUDA graph: device
    positions, the whole cache under a mask); on CPU it runs eagerly and must match the eager step."""
    model = tiny_model(latent_units=latent_units, device=device)
    prompts, seeds = _prompts(B=3, P=4, device=device), [11, 12, 13]
    stop = generate(model, prompts, GenerationConfig(max_new_tokens=12), seeds=seeds).tokens[0][4]
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, stop_tokens=(stop,))
    eager = generate(model, prompts, config, seeds=seeds)
    static = generate(model, prompts, config, seeds=seeds, compile=True)
    assert static.tokens == eager.tokens
    assert any(len(t) < 12 for t in eager.tokens)  # a stop token cut a row short: the stop check is exercised
    if latent_units:
        assert all(torch.equal(a, b) for a, b in zip(static.latents, eager.latents))
    else:
        assert static.latents is None and eager.latents is None


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])  # None: the device tests' dtype
def test_a_decoding_step_matches_the_cached_forward(dtype, device):
    """The one decoding mode, a (B,) tensor of positions: rows at the same position here, at their own ones
    in tests/test_serve_load.py."""
    model = tiny_model(dtype=dtype, device=device)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    latents = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    full = model(tokens, latents=latents).logits
    cache = model.new_cache(2)
    model(tokens[:, :5], latents=latents[:, :5], cache=cache)
    assert cache.length == 5
    for t in range(5, 9):
        position = torch.full((2,), t, device=device)
        step = model(tokens[:, t : t + 1], latents=latents[:, t : t + 1], cache=cache, start=position)
        torch.testing.assert_close(step.logits[:, 0], full[:, t], **tolerance(model))
    assert cache.length == 5  # the caller keeps the positions
    with pytest.raises(ValueError, match="decoding step"):
        model(tokens[:, :2], latents=latents[:, :2], cache=cache, start=torch.full((2,), 5, device=device))
    with pytest.raises(ValueError, match="one position per row"):
        model(tokens[:, :1], latents=latents[:, :1], cache=cache, start=torch.tensor(5, device=device))


def test_compiled_decoding_reuses_one_engine_per_shape(device, monkeypatch):
    """generate(compile=True) keeps its engine (with its graphs on a GPU) per model, batch size and cache
    length, and later calls reuse it: their tokens are still those of eager decoding (the cache's old keys
    from the previous call are masked out). Its cache holds the fed positions rounded up to 64, not
    max_seq_len."""
    made = []
    monkeypatch.setattr(
        kept_module,
        "DecodeEngine",  # counts the compiled ones (eager calls make their own)
        lambda *args, **kw: (kw.get("compile") and made.append(args)) or DecodeEngine(*args, **kw),
    )
    model = tiny_model(device=device, max_seq_len=200)
    config = GenerationConfig(max_new_tokens=8, temperature=1.0)
    for prompt_seed in (3, 4):  # two different prompts
        prompts = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(prompt_seed)).to(device)
        static = generate(model, prompts, config, seeds=[1, 2, 3], compile=True)
        eager = generate(model, prompts, config, seeds=[1, 2, 3])
        assert static.tokens == eager.tokens
        assert all(torch.equal(a, b) for a, b in zip(static.latents, eager.latents))
    assert len(made) == 1
    engine = decoding_engine(model, 3, 5 + 8 - 1, compile=True)
    assert engine.capacity == 64 and engine.cache.cache.keys.dtype == model.embed_tokens.weight.dtype
    assert decoding_engine(model, 3, 70, compile=True).capacity == 128 and len(made) == 2
    assert decoding_engine(model, 3, 195, compile=True).capacity == 200  # never past max_seq_len
    assert decoding_engine(model, 3, 12, compile=True) is engine  # the first is still kept


def test_eager_decoding_caches_only_the_positions_it_feeds(monkeypatch):
    capacities = []
    model = tiny_model()
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda B, **kw: capacities.append(kw.get("capacity")) or new_cache(B, **kw))
    generate(model, _prompts(P=5), GenerationConfig(max_new_tokens=7))
    assert capacities == [5 + 7 - 1]


def test_generate_decodes_a_bf16_model_with_a_bf16_cache(monkeypatch):
    """The KV cache follows the model's dtype: a bf16 model (`free-transformer generate --dtype bf16`)
    reads and caches half the bytes of a float32 one, and decodes as the float32 model does: with the same Z, every
    greedy token it picks is one whose float32 logit is the largest up to bf16's rounding (a near tie may go
    either way)."""
    caches = []
    model32 = tiny_model(dtype=torch.float32)
    model16 = tiny_model(dtype=torch.bfloat16)
    new_cache = model16.new_cache
    monkeypatch.setattr(model16, "new_cache", lambda B, **kw: caches.append(new_cache(B, **kw)) or caches[-1])
    config = GenerationConfig(max_new_tokens=6, temperature=0)
    prompts = _prompts()
    bf16 = generate(model16, prompts, config, seeds=[0, 1, 2])
    assert caches[0].keys.dtype == torch.bfloat16
    fp32 = generate(model32, prompts, config, seeds=[0, 1, 2])
    assert all(torch.equal(a, b) for a, b in zip(bf16.latents, fp32.latents))
    sequences = torch.cat([prompts, torch.tensor(bf16.tokens)], 1)[:, :-1]
    logits = model32(sequences, latents=torch.stack(bf16.latents)).logits[:, prompts.shape[1] - 1 :]  # (B, 6, V)
    picked = logits.gather(-1, torch.tensor(bf16.tokens)[..., None])[..., 0]
    assert (picked >= logits.amax(-1) - 0.05 * logits.abs().amax(-1)).all()


def test_kept_engines_do_not_keep_a_model_alive():
    model = tiny_model()
    generate(model, _prompts(), GenerationConfig(max_new_tokens=3), compile=True)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_generate_command_decodes_in_the_dtype_asked(tmp_path, capsys, monkeypatch):
    """`--dtype bf16` casts the weights (and so the cache); auto is float32 on a CPU."""
    from conftest import tiny_checkpoint

    from free_transformer.cli import main
    from free_transformer.inference import batches as command  # where the command makes its engine

    dtypes = []
    real = command.decoding_engine
    monkeypatch.setattr(
        command,
        "decoding_engine",
        lambda model, *args, **kw: dtypes.append(model.embed_tokens.weight.dtype) or real(model, *args, **kw),
    )
    checkpoint = tiny_checkpoint(tmp_path, "run", 4)
    for dtype in ("bf16", "auto", "fp32"):
        assert (
            main(["generate", str(checkpoint), "--prompt", "K>", "-n", "2", "--max-new-tokens", "4", "--dtype", dtype])
            == 0
        )
    assert dtypes == [torch.bfloat16, torch.float32, torch.float32]
    assert len(capsys.readouterr().out.splitlines()) == 6


def test_generate_command_ends_a_sample_at_a_stop_string_which_is_not_printed(tmp_path, capsys):
    """A stop string is matched in the text (two characters, two byte tokens here), not by its last token's
    id, which used to stop at that character's first occurrence anywhere; escapes are read (--stop "\\n"
    is a newline, not the letter n)."""
    from conftest import tiny_checkpoint

    from free_transformer.cli import main
    from free_transformer.commands.generate import unescape

    assert (unescape(r"\n"), unescape(r"\t"), unescape("END"), unescape(r"a\\b\q")) == ("\n", "\t", "END", r"a\b\q")
    checkpoint = tiny_checkpoint(tmp_path, "run", 4)
    command = ["generate", str(checkpoint), "--prompt", "K>", "-n", "1", "--temperature", "0", "--max-new-tokens", "24"]
    assert main(command) == 0
    full = capsys.readouterr().out.rstrip("\n")
    new = full[len("K>") :]
    at = next(i for i in range(1, len(new) - 1) if "\\" not in new[i : i + 2] and "\ufffd" not in new[i : i + 2])
    stop = new[at : at + 2]  # two characters the model wrote after its first one
    assert main([*command, "--stop", stop, "--stop", "\\n\\n\\n"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == full[: len("K>") + new.index(stop)]


def test_prompts_of_any_lengths_in_fewer_slots_sample_as_each_alone():
    """generate() takes lists of token ids of any lengths and `batch_size` slots: each row's tokens and
    latents are those of that prompt generated alone with its seed."""
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
    config = GenerationConfig(max_new_tokens=6, temperature=0.9, top_k=20)
    together = generate(model, prompts, config, seeds=[5, 6, 7, 8], batch_size=2)
    for row, (prompt, seed) in enumerate(zip(prompts, [5, 6, 7, 8])):
        alone = generate(model, [prompt], config, seeds=[seed])
        assert together.tokens[row] == alone.tokens[0]
        assert torch.equal(together.latents[row], alone.latents[0])
        assert together.latents[row].shape == (len(prompt) + 6 - 1,)
    with pytest.raises(ValueError, match="non-empty token id lists"):
        generate(model, [[1, 2], []], config)
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        generate(model, prompts, config, batch_size=0)
