"""`free-transformer serve` as OpenAI clients and harnesses use it: logprobs, echo, token-id prompts,
stream_options, /health, the API key, the tokenizer endpoints; and lm-eval's `local-completions`
against a real `serve` process, scored as `free-transformer eval` scores the same documents."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import tiny_checkpoint
from test_serve import NAME, start_server, texts

from free_transformer.base.counter_random import row_keys
from free_transformer.base.latent_choice import LatentChoice
from free_transformer.base.seeding import sample_seed
from free_transformer.model.latent.draws import counter_prior

openai = pytest.importorskip("openai")

from free_transformer.base.version import __version__  # noqa: E402

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve-clients"), NAME, latent_units=4)


@pytest.fixture(scope="module")
def served(checkpoint):
    url, engine, uv = start_server(checkpoint, api_key="sesame")
    yield url, engine
    uv.should_exit = True


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0], api_key="sesame", max_retries=0)


def direct_logprobs(model, ids: list[int], latents, seed: int) -> torch.Tensor:
    """(P - 1,) log P(token t | tokens < t) from one forward of the model with Z from `latents` drawn as the
    server's prefill draws them for the request's seed: the only row's seed is sample_seed(seed, 0, 0); the
    encoder's draw takes a generator seeded with it, the prior's is the row's counter-based stream."""
    row_seed = sample_seed(seed, 0, 0)
    if latents == LatentChoice.PRIOR:
        positions = torch.arange(len(ids))[None, :]
        latents = counter_prior(model.latent_space, row_keys(torch.tensor([row_seed]))[:, None], positions)
    with torch.no_grad():
        logits = model(
            torch.tensor([ids]), latents=latents, generator=[torch.Generator().manual_seed(row_seed)]
        ).logits[0]
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("latents", [LatentChoice.ENCODER, LatentChoice.PRIOR])
def test_echo_with_logprobs_scores_the_prompt_with_the_requests_z(client, served, latents):
    """logprobs=2, echo=True (the official client): the prompt comes back with its tokens' log-probabilities
    under the Z the request chose (the encoder's posterior draw or the prior's, seeded), then the completion's
    tokens, each with the two most likely alternatives and itself."""
    prompt = "Hello there"
    response = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        echo=True,
        seed=5,
        extra_body={"latents": latents},
    )
    choice = response.choices[0]
    assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(prompt) + 3
    assert "".join(choice.logprobs.tokens[: len(prompt)]) == prompt
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.text_offset[:3] == [0, 1, 2]
    expected = direct_logprobs(served[1].model, list(prompt.encode()), latents, seed=5)
    assert choice.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected.tolist(), abs=1e-5)
    other = direct_logprobs(
        served[1].model,
        list(prompt.encode()),
        LatentChoice.PRIOR if latents == LatentChoice.ENCODER else LatentChoice.ENCODER,
        5,
    )
    assert not torch.allclose(expected, other, atol=1e-3)  # Z shapes the scores: the test can fail
    for value, top in zip(choice.logprobs.token_logprobs[len(prompt) :], choice.logprobs.top_logprobs[len(prompt) :]):
        assert 2 <= len(top) <= 3 and value == pytest.approx(max(top.values()))  # greedy: the chosen is the top


def test_echo_without_logprobs_puts_the_prompt_before_the_completion(client):
    alone = client.completions.create(model=NAME, prompt=[72, 105, 33], max_tokens=4, seed=1).choices[0]
    echoed = client.completions.create(model=NAME, prompt=[72, 105, 33], max_tokens=4, seed=1, echo=True).choices[0]
    assert echoed.text == "Hi!" + alone.text and echoed.logprobs is None


def test_token_id_prompts_are_the_prompts_they_encode(client):
    as_text = texts(client.completions.create(model=NAME, prompt=["Hi", "Hello"], max_tokens=6, seed=3))
    as_ids = texts(
        client.completions.create(model=NAME, prompt=[[72, 105], [72, 101, 108, 108, 111]], max_tokens=6, seed=3)
    )
    one = texts(client.completions.create(model=NAME, prompt=[72, 105], max_tokens=6, seed=3))
    assert as_ids == as_text and one == as_text[:1]


def test_stream_options_include_usage_ends_with_the_usage(client):
    chunks = list(
        client.completions.create(
            model=NAME, prompt="Hi", max_tokens=5, n=2, seed=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(chunk.usage is None for chunk in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 10)


def test_every_field_at_its_default_is_accepted(served):
    body = {
        "model": NAME,
        "prompt": "Hi",
        "max_tokens": 3,
        "best_of": 1,
        "echo": False,
        "logprobs": None,
        "suffix": None,
        "logit_bias": None,
        "stream": False,
        "stream_options": None,
        "user": "me",
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "stop": None,
        "temperature": 1,
        "top_p": 1,
        "seed": None,
    }
    response = httpx.post(served[0] + "/completions", json=body, headers={"Authorization": "Bearer sesame"})
    assert response.status_code == 200, response.text
    with_best_of = httpx.post(
        served[0] + "/completions",
        json={**body, "n": 2, "best_of": 2, "seed": 1},
        headers={"Authorization": "Bearer sesame"},
    )
    assert len(with_best_of.json()["choices"]) == 2


def test_the_api_key_is_asked_for_everywhere_but_health(served):
    base = served[0].removesuffix("/v1")
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    for path in ("/v1/models", "/tokenizer_info"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            refused = httpx.get(base + path, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + path, headers={"Authorization": "Bearer sesame"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served[0], api_key="wrong", max_retries=0).models.list()
    assert httpx.get(base + "/openapi.json").json()["info"]["version"] == __version__


def test_a_missing_field_is_called_missing(served):
    response = httpx.post(served[0] + "/completions", json={"model": NAME}, headers={"Authorization": "Bearer sesame"})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "missing required field 'prompt'",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "missing_required_parameter",
    }


def test_the_tokenizer_endpoints_are_vllms(served):
    base, key = served[0].removesuffix("/v1"), {"Authorization": "Bearer sesame"}
    assert httpx.post(base + "/tokenize", json={"prompt": "Hi", "add_special_tokens": False}, headers=key).json()[
        "tokens"
    ] == [72, 105]
    assert httpx.post(base + "/detokenize", json={"tokens": [72, 105]}, headers=key).json() == {"prompt": "Hi"}
    assert "eos_token" in httpx.get(base + "/tokenizer_info", headers=key).json()


# ---- lm-eval's local-completions against a real `serve` process ------------------------------------------------

RACE_TASK = """task: tiny_race
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA_FILE
test_split: test
output_type: multiple_choice
doc_to_text: "Article: {{article}}\\n\\nQuestion: {{question}}\\nAnswer:"
doc_to_choice: "{{options}}"
doc_to_target: "{{['A', 'B', 'C', 'D'].index(answer)}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_process(checkpoint, port: int, *options) -> subprocess.Popen:
    """A `free-transformer serve` process, once it answers /health."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "free_transformer.cli",
            "serve",
            str(checkpoint),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--model-name",
            NAME,
            *options,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.stderr.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not answer within 60 s"
            time.sleep(0.2)


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_the_eval_command(tmp_path):
    """lm-eval 0.4's `local-completions` (echo + logprobs through /v1/completions, lm-eval's tokenizer the
    server's /tokenize) on a local RACE-style task gives the accuracy `free-transformer eval` gives on the same
    documents (`--data race_high=`), and each choice the same log-likelihood. A baseline decoder: its
    probabilities have no Z, so both must agree exactly (a Free Transformer's agree in distribution only:
    docs/serving.md)."""
    if shutil.which("lm_eval") is None and not (Path(sys.executable).parent / "lm_eval").exists():
        pytest.skip("lm_eval is not installed")
    checkpoint = tiny_checkpoint(tmp_path, "base", latent_units=0, max_seq_len=256)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_race.yaml").write_text(RACE_TASK.replace("DATA_FILE", str(DATA / "race_tiny.jsonl")))
    port = free_port()
    process = serve_process(checkpoint, port)
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"),
    }
    try:
        lm_eval = [
            str(Path(sys.executable).parent / "lm_eval"),
            "--model",
            "local-completions",
            "--model_args",
            f"model={NAME},base_url=http://127.0.0.1:{port}/v1/completions,max_length=256,num_concurrent=4",
            "--tasks",
            "tiny_race",
            "--include_path",
            str(tmp_path / "tasks"),
            "--output_path",
            str(tmp_path / "lm-eval"),
            "--log_samples",
        ]
        ran = subprocess.run(lm_eval, env=env, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
    finally:
        process.terminate()
        process.wait(10)
    [results] = (tmp_path / "lm-eval").rglob("results_*.json")
    [samples] = (tmp_path / "lm-eval").rglob("samples_tiny_race_*.jsonl")
    served_acc = json.loads(results.read_text())["results"]["tiny_race"]["acc,none"]
    served_scores = [
        [float(resp[0][0]) for resp in json.loads(line)["resps"]] for line in samples.read_text().splitlines()
    ]

    from free_transformer.cli import main

    assert (
        main(
            [
                "eval",
                str(checkpoint),
                "--tasks",
                "race_high",
                "--data",
                f"race_high={DATA / 'race_tiny.jsonl'}",
                "--output",
                str(tmp_path / "eval.json"),
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    ours = json.loads((tmp_path / "eval.json").read_text())["tasks"]["race_high"]
    assert served_acc == ours["also"]["acc_raw"]  # lm-eval's acc: the most likely choice, not length-normalised
    assert served_scores == [pytest.approx(doc["logprobs"], abs=1e-3) for doc in ours["per_doc"]]
