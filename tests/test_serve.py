"""`free-transformer serve`: a real uvicorn server on 127.0.0.1, driven by the official openai client."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import tiny_checkpoint

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from free_transformer.cli import main  # noqa: E402
from free_transformer.data.tokenizer import get_tokenizer  # noqa: E402
from free_transformer.inference import step_runner as runner_module  # noqa: E402
from free_transformer.runs.checkpoint import load_model  # noqa: E402
from free_transformer.serve import batcher as loop  # noqa: E402
from free_transformer.serve.app import build_app  # noqa: E402
from free_transformer.serve.batcher import settled  # noqa: E402
from free_transformer.serve.request_plan import Engine  # noqa: E402

NAME = "tiny"
COOL = 0.1  # a temperature at which the random tiny model's logits, so its latents, shape the text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve"), NAME, latent_units=4)


def start_server(checkpoint, **options):
    """(base URL, engine, uvicorn server) of a server on a free port, in a thread of this process."""
    model, config = load_model(checkpoint)
    engine = Engine(model, get_tokenizer(config["tokenizer"]), NAME, **options.pop("engine", {}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(build_app(engine, **options), log_level="critical"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", engine, uv


@pytest.fixture(scope="module")
def server(checkpoint):
    """(base URL, engine) of a server on a free port, in a thread of this process."""
    url, engine, uv = start_server(checkpoint)
    yield url, engine
    uv.should_exit = True


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0], api_key="none", max_retries=0)  # a 500 must not be retried


def complete(client, prompt="Hello", **options):
    options = {"max_tokens": 12, "seed": 7, **options}
    return client.completions.create(model=NAME, prompt=prompt, **options)


def texts(response) -> list[str]:
    assert [choice.index for choice in response.choices] == list(range(len(response.choices)))
    return [choice.text for choice in response.choices]


def test_models_lists_the_one_model(client):
    assert [model.id for model in client.models.list().data] == [NAME]


def test_a_completion_has_max_tokens_and_the_same_seed_gives_the_same_text(client):
    first = complete(client, max_tokens=12)
    assert first.object == "text_completion" and first.model == NAME
    assert first.choices[0].finish_reason == "length"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (5, 12, 17)
    assert texts(complete(client, max_tokens=12)) == texts(first)
    assert texts(complete(client, max_tokens=12, seed=8)) != texts(first)


def test_each_prompt_of_a_list_and_each_of_n_is_its_own_seeded_completion(client):
    """Prompts of different lengths in one request; completion i of prompt p samples with its own stream,
    sample_seed(seed, p, i): four distinct completions, the same again for the same request, the first prompt's
    those of a request with it alone (at the same index, 0)."""
    both = texts(complete(client, ["Hi", "Hello there"], n=2, temperature=COOL))
    assert len(both) == 4 and len(set(both)) == 4
    assert texts(complete(client, ["Hi", "Hello there"], n=2, temperature=COOL)) == both
    assert texts(complete(client, "Hi", n=2, temperature=COOL)) == both[:2]


def test_a_stream_sends_the_text_in_pieces_as_it_is_sampled(client, monkeypatch):
    """Several chunks that add up to the unstreamed text for the same seed; the first reaches the client
    while the tokens after it are not yet sampled (sampling waits for it, or gives up after 10 s)."""
    steps, received = [], threading.Event()
    real = loop.Batcher._take

    def watched(self, row, *args):
        steps.append(row.sampled)
        if row.sampled == 20:
            received.wait(10)
        return real(self, row, *args)

    whole = texts(complete(client, ["Hi", "Hello there"], n=2, max_tokens=40))
    monkeypatch.setattr(loop.Batcher, "_take", watched)
    chunks, sampled_at_first = [], None
    for chunk in complete(client, ["Hi", "Hello there"], n=2, max_tokens=40, stream=True):
        if sampled_at_first is None:
            sampled_at_first = len(steps)  # tokens sampled so far, every choice's
            received.set()
        chunks.append(chunk)
    # before any row passed its 20th token (the sampler waits at a row's 21st take, its prefill's included, for
    # the first chunk): 4 rows x 21 takes at most, of the 4 x 40 the stream samples, whatever the machine's load
    assert sampled_at_first <= 4 * 21 < len(steps)
    assert len(chunks) > 8
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)]
    assert streamed == whole
    ends = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason is not None]
    assert ends == ["length"] * 4


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(client):
    full = texts(complete(client, max_tokens=30, temperature=COOL))[0]
    # two printable characters (bytes that decode alone): the first shows before the second comes
    start = next(i for i in range(5, len(full)) if full[i : i + 2].isascii() and full[i : i + 2].isprintable())
    stop = full[start : start + 2]
    cut = full[: full.index(stop)]
    stopped = complete(client, max_tokens=30, temperature=COOL, stop=[stop, "never"])
    assert texts(stopped) == [cut] and stopped.choices[0].finish_reason == "stop"
    streamed = list(complete(client, max_tokens=30, temperature=COOL, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def cli_texts(capsys, checkpoint, prompt, seed, *options) -> list[str]:
    """The continuations `free-transformer generate` samples (its jsonl output: the texts unescaped)."""
    assert (
        main(
            [
                "generate",
                str(checkpoint),
                "--prompt",
                prompt,
                "--seed",
                str(seed),
                "--max-new-tokens",
                "12",
                "--temperature",
                str(COOL),
                "--format",
                "jsonl",
                *options,
            ]
        )
        == 0
    )
    return [json.loads(line)["sample"] for line in capsys.readouterr().out.splitlines()]


def test_the_latent_fields_choose_z_as_the_generate_command_does(client, checkpoint, capsys):
    prompt, reference = "Hello", "Once upon a time"
    by_choice = {}
    for choice in ["encoder", "prior", "shared", "reference"]:
        extra = {"latents": choice, **({"reference": reference} if choice == "reference" else {})}
        served = texts(complete(client, prompt, n=2, temperature=COOL, extra_body=extra))
        by_choice[choice] = cli_texts(
            capsys,
            checkpoint,
            prompt,
            7,
            "-n",
            "2",
            "--latents",
            choice,
            *(["--reference", reference] if choice == "reference" else []),
        )
        assert served == by_choice[choice], choice
    assert len({tuple(t) for t in by_choice.values()}) == 4  # each choice gives other texts: the test can fail
    # latent_seed: the draw of "shared" apart from the sampling seed
    shared = texts(complete(client, prompt, temperature=COOL, extra_body={"latents": "shared", "latent_seed": 7}))
    assert shared == texts(complete(client, prompt, temperature=COOL, extra_body={"latents": "shared"}))

    def prompt_scores(**seed) -> list[float]:  # the prompt's log-probabilities under the shared Z
        echoed = complete(
            client, prompt, max_tokens=1, logprobs=1, echo=True, extra_body={"latents": "shared", **seed}
        ).choices[0]
        return echoed.logprobs.token_logprobs[1 : len(prompt)]

    assert prompt_scores(latent_seed=7) == prompt_scores()
    assert prompt_scores(latent_seed=8) != prompt_scores(latent_seed=7)  # another draw of Z


def test_echo_with_max_tokens_0_gives_the_prompt_alone_with_its_logprobs(client):
    """OpenAI's way to score a prompt (echo, max_tokens 0): the prompt back, its tokens' log-probabilities those
    of the same request with one new token, no completion token billed; streamed alike. Without echo, a 400."""
    prompt, seed = "Hello there", {"latents": "shared", "latent_seed": 3}
    scored = complete(client, prompt, max_tokens=0, logprobs=1, echo=True, extra_body=seed)
    choice, one = scored.choices[0], complete(client, prompt, max_tokens=1, logprobs=1, echo=True, extra_body=seed)
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert choice.logprobs.tokens == list(prompt) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[: len(prompt)]
    streamed = list(complete(client, prompt, max_tokens=0, echo=True, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed) == prompt
    with pytest.raises(openai.BadRequestError, match="0 goes with echo"):
        complete(client, prompt, max_tokens=0)


def test_the_sampling_fields_sample_what_generate_samples(client, checkpoint, capsys):
    """The request's sampling fields are SamplingParams' (top_k and min_p too, as extra_body): a completion is
    `free-transformer generate`'s sample for the same settings and seed."""
    settings = {"temperature": 0.5, "top_k": 20, "min_p": 0.5}
    got = texts(
        complete(client, "Hello", max_tokens=12, seed=7, temperature=0.5, extra_body={"top_k": 20, "min_p": 0.5})
    )
    options = [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]
    assert (
        main(
            [
                "generate",
                str(checkpoint),
                "--prompt",
                "Hello",
                "-n",
                "1",
                "--seed",
                "7",
                "--max-new-tokens",
                "12",
                "--format",
                "jsonl",
                *options,
            ]
        )
        == 0
    )
    assert got == [json.loads(capsys.readouterr().out)["sample"]]


def error_of(server, body: dict, path="/completions", status=400) -> dict:
    response = httpx.post(
        server[0] + path,
        content=json.dumps(body),
        timeout=30,  # lone surrogates escaped
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"]
    return error


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"model": "other"}, "model", "does not exist"),
        ({"max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
        ({"max_tokens": 61}, "max_tokens", "at most 60"),
        ({"prompt": "x" * 65}, "prompt", "at most 64"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": ["ok", ""]}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [1.5]}, "prompt", "a string, a list of strings, a list of token ids"),
        ({"prompt": [[1, 256]]}, "prompt", "token ids must lie in [0, 256)"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"n": 0}, "n", "must be >= 1, got 0"),
        ({"n": 129}, "n", "at most 128"),
        ({"temperature": -1.0}, "temperature", "must be a finite number >= 0"),
        ({"top_p": 1.5}, "top_p", "must be in (0, 1]"),
        ({"top_k": 0}, "top_k", "must be >= 1"),
        ({"min_p": 1.5}, "min_p", "must be in (0, 1]"),
        ({"max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"suffix": "x"}, "suffix", "suffix out or null"),
        ({"best_of": 1, "n": 2}, "best_of", "must be >= n (2), got 1"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "does not bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "with stream true"),
        ({"n": 9, "prompt": ["a"] * 120}, "n", "at most 1024"),
        ({"stop": ["a"] * 17}, "stop", "at most 16 strings"),
        ({"stop": "x" * 257}, "stop", "at most 256 characters"),
        ({"prompt": "\ud800 lone"}, "prompt", "lone surrogate"),
        ({"stop": ["\udfff"]}, "stop", "lone surrogate"),
        ({"prompt": None}, "prompt", "a string"),
        ({"presence_penalty": 1.0}, "presence_penalty", "penalties"),
        ({"latents": "posterior-ish"}, "latents", "'encoder', 'prior', 'shared', 'reference'"),
        ({"latents": "reference"}, "latents", "needs a reference text"),
        ({"latents": "reference", "reference": "Hi"}, "reference", "prompt"),
        ({"latents": "shared", "reference": "Hello there"}, "reference", "goes with latents='reference'"),
        # every integer field within int64: top_k 2**63 overflowed in sampling, a 500 for every request in flight
        ({"top_k": 2**63}, "top_k", "at most 2**63 - 1 (any value above the vocabulary keeps every token)"),
        ({"max_tokens": 2**63}, "max_tokens", "at most 2**63 - 1"),
        ({"n": 2**63}, "n", "at most"),
        ({"seed": 2**63}, "seed", "must be in [0, 2**63)"),
        ({"latent_seed": -1}, "latent_seed", "must be in [0, 2**63)"),
        ({"logprobs": 2**63}, "logprobs", "less than or equal to 20"),
        ({"best_of": 2**64}, "best_of", "from 1 to 128 (MAX_CANDIDATES per prompt)"),
        ({"prompt": [[2**64]]}, "prompt", "token ids must lie in [0, 256)"),
    ],
)
def test_a_bad_request_is_a_400_with_one_line(server, client, body, param, words):
    request = {"model": NAME, "prompt": "Hello", "max_tokens": 5, **body}
    error = error_of(server, request, status=404 if param == "model" else 400)
    assert error["param"] == param and words in error["message"], error
    if param in ("latents", "reference", "top_k", "min_p"):  # the fields a client sends as extra_body
        with pytest.raises(openai.BadRequestError):  # what a client sees of the extra fields
            client.completions.create(model=NAME, prompt="Hello", max_tokens=5, extra_body=dict(body))


def test_a_top_k_above_the_vocabulary_samples_every_token(client):
    """top_k 2**63 - 1, the largest an int64 holds, keeps every token: the text of no top_k (it used to be a 500)."""
    everything = texts(complete(client, temperature=1.5))
    assert texts(complete(client, temperature=1.5, extra_body={"top_k": 2**63 - 1})) == everything
    assert texts(complete(client, temperature=1.5, extra_body={"top_k": 256})) == everything


def test_chat_completions_say_there_is_no_chat_template(server, client):
    with pytest.raises(openai.NotFoundError, match="no chat template"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello"}])
    assert error_of(server, {"nothing": 1}, path="/nowhere", status=404)["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_an_exception_in_a_request_is_a_500_and_the_next_request_is_served(client, monkeypatch, stream):
    def broken(*args, **kwargs):
        raise RuntimeError("the kernel\nfell over")

    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "next_tokens", broken)
        with pytest.raises(openai.InternalServerError) as caught:
            complete(client, stream=stream)
        assert caught.value.status_code == 500
        assert caught.value.body["message"].endswith("RuntimeError: the kernel fell over")
    assert texts(complete(client, stream=False))[0]


def test_an_exception_mid_stream_ends_it_with_an_error_event(server, monkeypatch):
    real, calls = runner_module.next_tokens, []

    def breaks_later(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("fell over mid-stream")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "next_tokens", breaks_later)
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 12, "seed": 7, "stream": True}
    with httpx.stream("POST", server[0] + "/completions", json=body, timeout=30) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200
    assert "fell over mid-stream" in json.loads(events[-1])["error"]["message"]
    assert all("choices" in json.loads(event) for event in events[:-1])


def test_the_serve_command_serves_the_checkpoint_under_its_name(checkpoint):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
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
            "my-model",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not answer within 60 s"
                time.sleep(0.2)
        assert [model["id"] for model in models["data"]] == ["my-model"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="my-model", prompt="Hi", max_tokens=3).usage.completion_tokens == 3
    finally:
        process.terminate()
        process.wait(10)


def test_without_the_serve_extra_the_command_says_how_to_install_it(checkpoint, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` fails as if not installed
    monkeypatch.delitem(sys.modules, "free_transformer.serve.app")
    assert main(["serve", str(checkpoint)]) == 2
    from free_transformer.base.install import install_hint

    assert capsys.readouterr().err == f"error: serve needs fastapi and uvicorn: {install_hint('serve')}\n"


def test_the_package_and_its_command_line_import_no_server_library():
    code = (
        "import sys, free_transformer, free_transformer.cli as cli; cli.build_parser(); "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_stream_holds_back_what_a_later_token_may_change():
    assert settled("caf\ufffd", []) == "caf"  # a character whose bytes are not all there
    assert settled("the EN", ["END", "NEVER"]) == "the "  # may become a stop string
    assert settled("the ENDS", ["END"]) == "the ENDS"  # a stop string found is cut by the caller, not here
    assert settled("the E.", ["END"]) == "the E."
