"""`free-transformer serve`'s /v1/chat/completions, driven by the openai client's `chat.completions`: a Llama
converted with a tokenizer that ships a chat template answers through that template, as /v1/completions
answers the templated text; a model whose tokenizer has none answers one 404 line."""

import re
import resource
import socket
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")

from conftest import tiny_checkpoint  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from free_transformer.cli import main  # noqa: E402
from free_transformer.data.tokenizer import get_tokenizer  # noqa: E402
from free_transformer.runs.checkpoint import load_model  # noqa: E402
from free_transformer.serve.app import build_app  # noqa: E402
from free_transformer.serve.request_plan import Engine  # noqa: E402

NAME = "chat"
# A template in the usual shape: each message as "role : content ;", then the assistant's turn opened.
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('the system message comes first') }}{% endif %}"
    "{{ m.role }} : {{ m.content }} ; {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
)
WORDS = ["[UNK]", "system", "user", "assistant", ":", ";", "hello", "world", "be", "brief"]


def llama_with_tokenizer(directory, template: str | None) -> str:
    """A random 2-block Llama (vocabulary 64) saved with a word-level tokenizer of 64 words, with `template`."""
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=True,
        )
    ).save_pretrained(directory)
    vocab = {word: i for i, word in enumerate(WORDS + [f"w{i}" for i in range(64 - len(WORDS))])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", chat_template=template)
    tokenizer.save_pretrained(directory)
    return str(directory)


def start_server(checkpoint, **app_options):
    """(base URL, uvicorn server, engine) of `serve CHECKPOINT` on a free port, in a thread of this process."""
    model, config = load_model(checkpoint)
    engine = Engine(model, get_tokenizer(config["tokenizer"]), NAME)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, **app_options), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server, engine


def serving(tmp_path_factory, template: str | None, **app_options):
    """(openai client, uvicorn server, engine) of a converted Llama whose tokenizer ships `template`."""
    directory = tmp_path_factory.mktemp("llama")
    llama = llama_with_tokenizer(directory / "llama", template)
    assert main(["convert", llama, str(directory / "run"), "--to", "checkpoint", "--latent-units", "4"]) == 0
    url, server, engine = start_server(directory / "run", **app_options)
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60), server, engine


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    client, server, engine = serving(tmp_path_factory, TEMPLATE)
    yield client, engine
    server.should_exit = True


@pytest.fixture(scope="module")
def client(chat):
    return chat[0]


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
PROMPT = "system : be brief ; user : hello world ; assistant :"  # MESSAGES through TEMPLATE


def test_chat_answers_what_completions_gives_for_the_templated_messages(client):
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, seed=3)
    text = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, seed=3)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-") and chat.model == NAME
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == text.choices[0].text and choice.message.content.strip()
    assert chat.usage.prompt_tokens == text.usage.prompt_tokens == len(PROMPT.split())
    assert chat.usage.completion_tokens == 6


def test_chat_takes_the_completion_fields_and_streams(client):
    """n, the Free Transformer's latent choice (extra_body) and streaming, as /v1/completions takes them."""
    options = dict(
        model=NAME, messages=MESSAGES, max_completion_tokens=5, seed=1, n=2, extra_body={"latents": "shared"}
    )
    whole = client.chat.completions.create(**options)
    text = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=5, seed=1, n=2, extra_body={"latents": "shared"}
    )
    assert [c.message.content for c in whole.choices] == [c.text for c in text.choices]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content
    assert streamed == [c.message.content for c in whole.choices] and chunk.usage.completion_tokens == 10


@pytest.mark.parametrize(
    "options, refused",
    [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role"),
        (dict(messages=MESSAGES[::-1]), "the chat template refused these messages: the system message comes first"),
        (dict(messages=MESSAGES, temperature=-1.0), "temperature"),
        (dict(messages=MESSAGES, extra_body={"echo": True}), "unknown or unsupported field 'echo' in a chat request"),
        (
            dict(messages=MESSAGES, max_tokens=4, max_completion_tokens=5),
            "max_tokens and max_completion_tokens disagree",
        ),
        (dict(messages=MESSAGES, max_tokens=500), "max_tokens (500) - 1 exceeds max_seq_len"),
    ],
)
def test_a_chat_request_it_cannot_serve_is_one_400_line(client, options, refused):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, **options)
    message = caught.value.body["message"]
    assert refused in message and "\n" not in message, message


def test_without_a_chat_template_chat_is_one_404_line(tmp_path_factory):
    """A converted Llama whose tokenizer ships no template, and our byte tokenizer: completions only."""
    without, server, _ = serving(tmp_path_factory, None)
    byte_url, byte_server, _ = start_server(tiny_checkpoint(tmp_path_factory.mktemp("byte"), NAME, latent_units=4))
    try:
        for client in (without, openai.OpenAI(base_url=byte_url, api_key="none", max_retries=0)):
            with pytest.raises(openai.NotFoundError) as caught:
                client.chat.completions.create(model=NAME, messages=MESSAGES)
            message = caught.value.body["message"]
            assert "has no chat template; send text to /v1/completions" in message and "\n" not in message
            assert client.completions.create(model=NAME, prompt="hello", max_tokens=2).choices[0].text is not None
    finally:
        server.should_exit = byte_server.should_exit = True


def test_the_chat_prompt_is_what_transformers_renders(chat):
    """The bounded render (free_transformer.data.chat_template) gives apply_chat_template's text, the tokenizer's
    special tokens included."""
    tokenizer = chat[1].tokenizer
    for template in (TEMPLATE, "{{ unk_token }}" + TEMPLATE):
        tokenizer.chat_template = template
        expected = tokenizer._tokenizer.apply_chat_template(
            MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.chat_prompt(MESSAGES) == expected
    tokenizer.chat_template = TEMPLATE
    assert expected.startswith("[UNK]system")


@pytest.mark.parametrize(
    "template, error, words",
    [
        (  # 10**10 iterations: it froze the server, /health included, until SIGKILL
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            openai.BadRequestError,
            "took more than 2 s to render these messages",
        ),
        # a 400 MB format: it grew the server by 4 GB (on a busy machine the time bound may come first)
        ("{{ strftime_now('%Y' * 10**8) }}", openai.BadRequestError, "needed more than 512 MiB|took more than 2 s"),
        ("{{ 'x' * 10**7 }}", openai.BadRequestError, "made 10000000 characters of these messages; at most 4194304"),
        # an exception other than Jinja's: it was a bare "Internal Server Error", not the API's error body
        ("{{ 1 / 0 }}", openai.InternalServerError, "the chat template failed: ZeroDivisionError: division by zero"),
        ("{{ messages[0].content + 1 }}", openai.InternalServerError, "TypeError"),
    ],
)
def test_a_template_past_its_bounds_or_failing_is_one_line_and_the_server_serves_on(chat, template, error, words):
    client, engine = chat
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB: this process runs the server's threads
    tokenizer = engine.tokenizer
    tokenizer.chat_template = template
    try:
        with pytest.raises(error) as caught:
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
    finally:
        tokenizer.chat_template = TEMPLATE
    message = caught.value.body["message"]
    assert re.search(words, message) and "\n" not in message, message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024  # the render's memory: elsewhere
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, seed=3)
    assert answer.choices[0].finish_reason == "length"


def test_a_render_never_holds_the_event_loop(chat, monkeypatch):
    """While a conversation is rendered, /health and other clients are answered (the render ran on the event
    loop: a template's loop stopped every client)."""
    client, engine = chat
    rendering, release = threading.Event(), threading.Event()
    real = engine.tokenizer.read_chat

    def slow(body, reader):
        rendering.set()
        release.wait(30)
        return real(body, reader)

    monkeypatch.setattr(engine.tokenizer, "read_chat", slow)
    answers: list = []
    thread = threading.Thread(
        target=lambda: answers.append(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2))
    )
    thread.start()
    assert rendering.wait(30)
    try:
        health = httpx.get(str(client.base_url).removesuffix("v1/") + "health", timeout=10)
        assert health.status_code == 200 and not answers  # answered while the render still waits
    finally:
        release.set()
        thread.join(60)
    assert answers[0].choices[0].finish_reason == "length"


def test_a_hundred_thousand_messages_are_one_400_line(chat):
    """100,000 messages (4.4 MB): dumped and rendered off the event loop, within the render's bounds, then refused
    in one line (past the render's time on a busy machine, else past the context)."""
    client, _ = chat
    body = {"model": NAME, "messages": [MESSAGES[1]] * 100_000, "max_tokens": 2}
    response = httpx.post(f"{client.base_url}chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] in ("messages", "prompt") and "\n" not in error["message"], error
