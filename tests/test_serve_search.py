"""Best-of-N over a real server and the command line: `best_of` through the official openai client returns the
candidates of the highest mean token log-probability (OpenAI's meaning), streaming it is a 400, `vary` chooses
what differs between candidates, `free-transformer generate --best-of` prints what `best_of()` chooses, and
the candidates of a prompt are rows of one engine batch."""

import json

import pytest
from conftest import tiny_checkpoint
from test_serve import NAME, start_server, texts

from free_transformer import GenerationConfig, best_of
from free_transformer.cli import main
from free_transformer.inference import engine as engine_module
from free_transformer.inference.search import ranking

openai = pytest.importorskip("openai")

PROMPTS = ["Hello", "Hi"]
TOKENS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve-search"), NAME, latent_units=4)


@pytest.fixture(scope="module")
def served(checkpoint):
    url, engine, uv = start_server(checkpoint)
    yield url, engine
    uv.should_exit = True


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0], api_key="none", max_retries=0)


def candidates(model, vary: str, seed: int, count: int = 4):
    """What best_of() decodes and scores (each candidate's tokens' mean log-probability) for PROMPTS."""
    ids = [list(prompt.encode()) for prompt in PROMPTS]
    return best_of(model, ids, count, GenerationConfig(max_new_tokens=TOKENS, temperature=1.0), vary=vary, seed=seed)


def mean(values) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("vary", ["both", "latent", "tokens"])
def test_best_of_returns_the_candidates_of_highest_mean_log_probability(client, served, vary):
    """best_of=4, n=2: each prompt's two candidates of the highest mean log-probability, best first, as the
    decode-time logprobs the server returns say and as a teacher-forced forward under each candidate's Z
    (best_of()) scores them; every candidate's tokens are billed."""
    response = client.completions.create(
        model=NAME, prompt=PROMPTS, max_tokens=TOKENS, n=2, best_of=4, seed=11, logprobs=0, extra_body={"vary": vary}
    )
    got = texts(response)
    assert response.usage.completion_tokens == len(PROMPTS) * 4 * TOKENS  # every candidate, as OpenAI bills
    found = candidates(served[1].model, vary, 11)
    for p, scores in enumerate(found.scores):
        best = ranking(scores)[:2]
        assert got[2 * p : 2 * p + 2] == [served[1].tokenizer.decode(found.tokens[p][k]) for k in best]
        served_scores = [mean(response.choices[2 * p + i].logprobs.token_logprobs) for i in range(2)]
        assert served_scores == pytest.approx([scores[k] for k in best], abs=1e-4)
        assert served_scores[0] >= served_scores[1]
    # the choice is not the first candidates' by luck: some prompt's best two are others
    assert any(ranking(scores)[:2] != [0, 1] for scores in found.scores)


def test_best_of_picks_among_the_candidates_a_request_of_n_best_of_returns(client):
    """vary=latent with best_of equal to n returns every candidate, in order, with its logprobs: best_of=4 n=1
    returns the one whose returned logprobs have the highest mean (read from the response alone)."""
    options = {"model": NAME, "prompt": PROMPTS, "max_tokens": TOKENS, "seed": 6, "extra_body": {"vary": "latent"}}
    every = client.completions.create(n=4, logprobs=0, **options)
    chosen = client.completions.create(n=1, best_of=4, logprobs=0, **options).choices
    for p in range(len(PROMPTS)):
        group = every.choices[4 * p : 4 * p + 4]
        means = [mean(choice.logprobs.token_logprobs) for choice in group]
        best = max(range(4), key=lambda k, m=means: (m[k], -k))
        assert chosen[p].text == group[best].text and best != 0  # not the first candidate's by luck
        # its own Z, not only its text (a random tiny model's candidates may read alike)
        assert chosen[p].logprobs.token_logprobs == pytest.approx(group[best].logprobs.token_logprobs, abs=1e-5)


def test_a_streamed_best_of_above_n_is_a_400_and_equal_to_n_streams(client):
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(model=NAME, prompt="Hi", max_tokens=3, n=1, best_of=2, stream=True)
    chunks = list(client.completions.create(model=NAME, prompt="Hi", max_tokens=3, n=2, best_of=2, stream=True))
    assert {chunk.choices[0].index for chunk in chunks} == {0, 1}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"n": 2, "best_of": 1}, "best_of", "must be >= n (2), got 1"),
        ({"best_of": 0}, "best_of", "must be an integer from 1 to 128"),
        ({"best_of": 129}, "best_of", "from 1 to 128 (MAX_CANDIDATES per prompt)"),
        ({"best_of": 9, "prompt": ["a"] * 120}, "best_of", "at most 1024"),
        ({"vary": "z"}, "vary", "'both', 'latent' or 'tokens'"),
        ({"vary": "tokens", "temperature": 0}, "vary", "must not be tokens at temperature 0"),
        ({"best_of": 2, "extra_body": {"latents": "shared"}}, "latents", "must be 'encoder', 'prior' or 'policy'"),
        ({"n": 2, "vary": "latent", "extra_body": {"latents": "policy"}}, "vary", "must be both with latents policy"),
    ],
)
def test_a_bad_best_of_or_vary_is_a_400_naming_it(client, body, param, words):
    options = {"model": NAME, "prompt": "Hello", "max_tokens": 3, **body}
    extra = options.pop("extra_body", {})
    extra.update({name: options.pop(name) for name in ("vary",) if name in options})
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**options, extra_body=extra)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error


def test_best_of_candidates_are_rows_of_one_engine_batch(client, served):
    """One prompt, best_of=8, 6 tokens: the prefill gives each candidate its first token, then 5 steps decode
    all 8 together (8 requests of n=1 one after another would take 40)."""
    batcher = served[1].batcher
    before = batcher.steps
    response = client.completions.create(model=NAME, prompt="Hello", max_tokens=TOKENS, n=1, best_of=8, seed=2)
    assert batcher.steps - before == TOKENS - 1
    assert response.usage.completion_tokens == 8 * TOKENS


def generate_lines(checkpoint, capsys, *options) -> list[dict]:
    args = ["generate", str(checkpoint), "--max-new-tokens", str(TOKENS), "--format", "jsonl", *options]
    assert main(args) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_generate_command_prints_the_best_of_its_candidates_as_the_server_returns_them(
    checkpoint, client, served, capsys, monkeypatch
):
    """`generate --best-of 4 -n 2`: per prompt the two best candidates of best_of(), best first, with their
    scores and every candidate's, decoded in one engine batch; the server returns the same texts."""
    steps = []
    step = engine_module.DecodeEngine.step
    monkeypatch.setattr(engine_module.DecodeEngine, "step", lambda self: steps.append(1) or step(self))
    prompts = [option for prompt in PROMPTS for option in ("--prompt", prompt)]
    lines = generate_lines(
        checkpoint, capsys, *prompts, "-n", "2", "--best-of", "4", "--seed", "11", "--vary", "latent"
    )
    assert len(steps) == TOKENS - 1  # 8 candidates, one batch
    found = candidates(served[1].model, "latent", 11)
    assert [(line["index"], line["candidate"]) for line in lines] == [
        (p, k) for p, scores in enumerate(found.scores) for k in ranking(scores)[:2]
    ]
    for line in lines:
        p, k = line["index"], line["candidate"]
        assert line["scores"] == pytest.approx(found.scores[p], abs=1e-9)
        assert line["score"] == line["scores"][k]
        assert line["sample"] == served[1].tokenizer.decode(found.tokens[p][k])
        assert line["seed"] == found.seeds[p][k] and line["vary"] == "latent"
    response = client.completions.create(
        model=NAME, prompt=PROMPTS, max_tokens=TOKENS, n=2, best_of=4, seed=11, extra_body={"vary": "latent"}
    )
    assert texts(response) == [line["sample"] for line in lines]


def test_the_generate_command_refuses_a_best_of_below_n_in_its_own_words(checkpoint, capsys):
    assert main(["generate", str(checkpoint), "--prompt", "Hi", "-n", "4", "--best-of", "2"]) != 0
    assert "--best-of must be >= n (4), got 2" in capsys.readouterr().err
    assert main(["generate", str(checkpoint), "--prompt", "Hi", "-n", "1", "--best-of", "2", "--latents", "shared"])
    assert "--latents must be 'encoder', 'prior' or 'policy'" in capsys.readouterr().err
