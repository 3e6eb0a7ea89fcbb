"""Z from a policy head inside the decoding engine's step (latents="policy"): a prefix-dependent Z cannot be drawn
before decoding, so the step draws it from the head's output at each row's position with the row's counter-based
words. The engine's Z and tokens equal the step-by-step reference loop's (free_transformer.train.rl.rollout), eager,
bucketed and deferred, alone or beside rows of the prior in one batch; the Hugging Face wrapper's with seeds too."""

import json

import pytest
import torch
from conftest import tiny_checkpoint, tiny_model

from free_transformer import GenerationConfig, generate
from free_transformer.base.counter_random import row_keys
from free_transformer.inference.engine import DecodeEngine, Row, run_rows
from free_transformer.runs.checkpoint import load_model
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


@pytest.mark.parametrize("every", [False, True], ids=["policy-beside-prior", "policy-only"])
@pytest.mark.parametrize("prompts", [PROMPTS, MIXED], ids=["one-length", "mixed-lengths"])
@pytest.mark.parametrize("kind", ["eager", "bucketed", "deferred"])
def test_the_engines_policy_z_and_tokens_are_the_reference_loops(model, kind, prompts, every):
    """Rows of the policy beside rows of the prior in one engine, or only rows of the policy (an eager step then
    takes no row's given Z): each row's Z and tokens are the reference loop's for that row alone."""
    engine = DecodeEngine(model, 4, capacity=16, compile=kind == "bucketed", deferred=kind == "deferred")
    config = GenerationConfig(max_new_tokens=NEW, temperature=1.0)
    policy = [every or i % 2 == 0 for i in range(len(prompts))]
    rows = [Row(p, config, s, "policy" if policy[i] else "prior") for i, (p, s) in enumerate(zip(prompts, SEEDS))]
    for _ in run_rows(engine, rows):
        pass
    for i, row in enumerate(rows):
        expected = reference(model, [i], policy[i], prompts)
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


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory):
    """A byte-tokenizer run whose model has a policy head far from the prior."""
    from free_transformer.runs.checkpoint import save_checkpoint

    run = tiny_checkpoint(tmp_path_factory.mktemp("policy"), "free", latent_units=4, max_seq_len=64)
    model = with_policy_head(load_model(run)[0], seed=0)
    with torch.no_grad():
        for param in model.latent.policy.parameters():
            param.normal_(0, 1.0)
    save_checkpoint(run, 2, model, {"tokenizer": "byte"})
    return run


def completion(run, body: dict, latents: str = "encoder"):
    """The answer to one completion request (`body` without its model) of a server of `run` started for it, its
    default Z `latents` (serve --latents), then stopped."""
    import httpx
    from test_serve import NAME, start_server

    url, _, uv = start_server(run, engine={"latents": latents})
    try:
        return httpx.post(url + "/completions", json={"model": NAME, **body}, timeout=60)
    finally:
        uv.should_exit = True


def test_latents_policy_through_the_cli_and_the_server_is_pythons(policy_run, capsys):
    """`generate --latents policy` prints, and a completion request with "latents": "policy" (or naming none, to a
    server started with --latents policy) returns, the samples of Python's generate(latents="policy") with the same
    seeds; on a run without a head, generate and serve are one line and exit 2."""
    from free_transformer.base.seeding import sample_seed
    from free_transformer.cli import main
    from free_transformer.data.tokenizer import get_tokenizer

    model = load_model(policy_run)[0]
    ids = list(b"K>")
    seeds = [sample_seed(7, 0, i) for i in range(2)]
    expected = generate(
        model, [ids, ids], GenerationConfig(max_new_tokens=8, temperature=1.0), seeds=seeds, latents="policy"
    )
    decode = get_tokenizer("byte").decode
    texts = [decode(ids + tokens)[len(decode(ids)) :] for tokens in expected.tokens]
    argv = ["generate", str(policy_run), "--prompt", "K>", "-n", "2", "--max-new-tokens", "8", "--seed", "7"]
    assert main([*argv, "--latents", "policy", "--format", "jsonl"]) == 0
    assert [json.loads(line)["sample"] for line in capsys.readouterr().out.splitlines()] == texts
    response = completion(policy_run, {"prompt": "K>", "max_tokens": 8, "n": 2, "seed": 7, "latents": "policy"})
    assert response.status_code == 200, response.text
    served = [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]
    assert served == texts
    # serve --latents policy: the Z of a request that names none
    response = completion(policy_run, {"prompt": "K>", "max_tokens": 8, "n": 2, "seed": 7}, latents="policy")
    assert [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])] == texts
    without = tiny_checkpoint(policy_run.parent, "without", latent_units=4, max_seq_len=64)
    assert main(["generate", str(without), "--prompt", "K>", "--latents", "policy"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "needs a run with a learned prior or policy" in error
    assert main(["serve", str(without), "--latents", "policy", "--port", "0", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--latents policy needs a run with a learned prior or policy" in error


def test_best_of_with_the_policy_decodes_its_candidates_as_generate_and_the_server(model, policy_run, capsys):
    """best_of(latents="policy"): each candidate is generate()'s sample of the policy with the candidate's seed,
    and the server's best_of and `generate --best-of` choose the same one; a vary that draws Z before decoding is
    refused in one line, the head's Z depending on the tokens."""
    from free_transformer import best_of
    from free_transformer.cli import main
    from free_transformer.data.tokenizer import get_tokenizer

    config = GenerationConfig(max_new_tokens=NEW, temperature=1.0)
    found = best_of(model, PROMPTS[:2], 3, config, seed=5, latents="policy")
    rows = [prompt for prompt in PROMPTS[:2] for _ in range(3)]
    seeds = [seed for candidates in found.seeds for seed in candidates]
    expected = generate(model, rows, config, seeds=seeds, latents="policy")
    assert [tokens for candidates in found.tokens for tokens in candidates] == expected.tokens
    assert best_of(model, PROMPTS[:2], 3, config, seed=5, latents="prior").tokens != found.tokens
    for vary in ("latent", "tokens"):
        with pytest.raises(ValueError, match="vary must be both with latents policy"):
            best_of(model, PROMPTS[:2], 3, config, vary=vary, latents="policy")

    run_model, ids, decode = load_model(policy_run)[0], list(b"K>"), get_tokenizer("byte").decode
    chosen = best_of(run_model, [ids], 4, GenerationConfig(max_new_tokens=8), seed=7, latents="policy").best[0]
    text = decode(ids + chosen)[len(decode(ids)) :]
    argv = ["generate", str(policy_run), "--prompt", "K>", "-n", "1", "--best-of", "4", "--max-new-tokens", "8"]
    assert main([*argv, "--seed", "7", "--latents", "policy", "--format", "jsonl"]) == 0
    assert json.loads(capsys.readouterr().out)["sample"] == text
    response = completion(policy_run, {"prompt": "K>", "max_tokens": 8, "best_of": 4, "seed": 7, "latents": "policy"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == text


def test_a_steps_policy_rows_are_none_some_or_all_and_a_compiled_step_serves_every_mix():
    from free_transformer.inference.row_draws import PolicyRows

    assert PolicyRows.of([], compiled=False) == PolicyRows.of([False, False], compiled=True) == PolicyRows.NONE
    assert PolicyRows.of([True, False], compiled=False) == PolicyRows.SOME
    assert PolicyRows.of([True, True], compiled=False) == PolicyRows.ALL
    assert PolicyRows.of([True, True], compiled=True) == PolicyRows.SOME  # one compiled step for every mix


# The ops a decoding step with the policy adds to one of the prior, at most, when every row draws from the policy:
# the head (its RMSNorm, three Linears, add, SiLU), the draw (sigmoid, lt, bits_to_index's four), the
# embedding of Z_{t-1}, the views of the rows' noise and previous Z and the keeping of the Z drawn (bench/README.md:
# at a small width each op costs about what one of the model's does, so their count is the policy's cost).
POLICY_STEP_EXTRA_OPS = 17


def test_a_step_with_the_policy_adds_a_bounded_count_of_ops(model):
    """The top-level aten ops of one eager step, rows of the policy against rows of the prior (torch.profiler)."""
    from collections import Counter

    counts = {}
    for latents in ("prior", "policy"):
        engine = DecodeEngine(model, 2, capacity=16, compile=False)
        engine.add([Row(p, GenerationConfig(max_new_tokens=NEW), s, latents) for p, s in zip(PROMPTS[:2], SEEDS)])
        with torch.inference_mode():
            engine.step()
            engine.step()  # past the prefill: a step of one position a row
            with torch.profiler.profile() as profile:
                engine.step()
        ops = [event.name for event in profile.events() if event.cpu_parent is None and event.name.startswith("aten")]
        counts[latents] = Counter(ops)
    extra = counts["policy"].total() - counts["prior"].total()
    assert 0 < extra <= POLICY_STEP_EXTRA_OPS, dict(counts["policy"] - counts["prior"])
