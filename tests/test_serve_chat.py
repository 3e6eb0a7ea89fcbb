"""`free-transformer serve`'s /v1/chat/completions, driven by the openai client's `chat.completions`: a Llama
converted with a tokenizer that ships a chat template answers through that template, as /v1/completions
answers the templated text; a model whose tokenizer has none answers one 404 line."""

import socket
import threading
import time

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
from free_transformer.serve.engine import Engine  # noqa: E402

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


def start_server(checkpoint):
    """(base URL, uvicorn server) of `serve CHECKPOINT` on a free port, in a thread of this process."""
    model, config = load_model(checkpoint)
    engine = Engine(model, get_tokenizer(config["tokenizer"]), NAME)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server


def serving(tmp_path_factory, template: str | None):
    directory = tmp_path_factory.mktemp("llama")
    llama = llama_with_tokenizer(directory / "llama", template)
    assert main(["convert", llama, str(directory / "run"), "--to", "checkpoint", "--latent-units", "4"]) == 0
    url, server = start_server(directory / "run")
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0), server


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    client, server = serving(tmp_path_factory, TEMPLATE)
    yield client
    server.should_exit = True


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
        (dict(messages=MESSAGES, max_tokens=500), "max_tokens 500 does not fit"),
    ],
)
def test_a_chat_request_it_cannot_serve_is_one_400_line(client, options, refused):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, **options)
    message = caught.value.body["message"]
    assert refused in message and "\n" not in message, message


def test_without_a_chat_template_chat_is_one_404_line(tmp_path_factory):
    """A converted Llama whose tokenizer ships no template, and our byte tokenizer: completions only."""
    without, server = serving(tmp_path_factory, None)
    byte_url, byte_server = start_server(tiny_checkpoint(tmp_path_factory.mktemp("byte"), NAME, latent_units=4))
    try:
        for client in (without, openai.OpenAI(base_url=byte_url, api_key="none", max_retries=0)):
            with pytest.raises(openai.NotFoundError) as caught:
                client.chat.completions.create(model=NAME, messages=MESSAGES)
            message = caught.value.body["message"]
            assert "has no chat template; send text to /v1/completions" in message and "\n" not in message
            assert client.completions.create(model=NAME, prompt="hello", max_tokens=2).choices[0].text is not None
    finally:
        server.should_exit = byte_server.should_exit = True
