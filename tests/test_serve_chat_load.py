"""`free-transformer serve`'s chat under load, with real clients against a real server: renders wait on the chat
queue's own threads, so that /health and other clients' completions are answered while every render thread is
taken; past the queue's bound a chat request is a 429 with Retry-After and the API's error body at once; a flood of
long conversations ends in 400s and 429s, never a 5xx, and /health answers meanwhile in under 0.3 s (the bodies
are parsed in the render workers, never in the server's process); a render past its time bound is a 400 even when
its caller wakes after the worker's own timer has ended it."""

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("transformers")

from test_serve_chat import MESSAGES, NAME, TEMPLATE, serving

from free_transformer.data import chat_template
from free_transformer.data.chat_template import WORKERS, ChatRenderer, ChatTemplateRefused
from free_transformer.serve.protocol import ChatCompletionRequest

QUEUE = 2  # chat requests that may wait for a render thread


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    client, server, engine = serving(tmp_path_factory, TEMPLATE, chat_queue=QUEUE)
    yield str(client.base_url).removesuffix("v1/"), engine, server.config.app.app.state.chats
    server.should_exit = True


def chat_body(messages: list, **fields) -> dict:
    return {"model": NAME, "messages": messages, "max_tokens": 2, **fields}


def test_with_every_render_thread_taken_health_and_completions_answer_and_the_excess_is_a_429(chat, monkeypatch):
    base, engine, queue = chat
    held, release = threading.Semaphore(0), threading.Event()
    real = engine.tokenizer.read_chat

    def slow(body, reader):
        held.release()
        release.wait(60)
        return real(body, reader)

    monkeypatch.setattr(engine.tokenizer, "read_chat", slow)
    answers: list = []

    def ask() -> None:
        answers.append(httpx.post(f"{base}v1/chat/completions", json=chat_body(MESSAGES, seed=1), timeout=120))

    threads = [threading.Thread(target=ask) for _ in range(WORKERS + QUEUE)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(WORKERS):  # every render thread holds a render
            assert held.acquire(timeout=60)
        deadline = time.monotonic() + 60
        while queue.admitted < WORKERS + QUEUE:  # the queued requests may still be on their way
            assert time.monotonic() < deadline, queue.admitted
            time.sleep(0.01)
        refused = [httpx.post(f"{base}v1/chat/completions", json=chat_body(MESSAGES), timeout=30)]
        assert refused[0].status_code == 429, refused[0].text
        error = refused[0].json()["error"]
        assert error["code"] == "server_busy" and "serve --chat-queue" in error["message"], error
        assert int(refused[0].headers["Retry-After"]) >= 1
        assert httpx.get(f"{base}health", timeout=30).status_code == 200
        completion = httpx.post(
            f"{base}v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 1}, timeout=30
        )
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 1
        assert not answers  # all of that while the renders still wait
    finally:
        release.set()
        for thread in threads:
            thread.join(120)
    assert [answer.status_code for answer in answers] == [200] * (WORKERS + QUEUE)
    again = httpx.post(f"{base}v1/chat/completions", json=chat_body(MESSAGES), timeout=60)
    assert again.status_code == 200  # the queue drained


def test_a_flood_of_long_conversations_is_400s_and_429s_and_health_answers_at_once(chat):
    """A smaller flood than the one bench/serving.py measures: 8 chats of 100,000 messages (4.4 MB each) at once,
    /health probed meanwhile. Each body parsed in the server's process held its GIL for 0.1-0.3 s: /health waited
    0.9 s at worst on a loaded 2-core VM, 0.05 s once the render workers parse them."""
    base = chat[0]
    statuses: list[int] = []
    body = json.dumps(chat_body([MESSAGES[1]] * 100_000)).encode()  # encoded once: the clients only send it
    headers = {"Content-Type": "application/json"}
    health: list[float] = []
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=16)) as client:
        threads = [
            threading.Thread(
                target=lambda: statuses.append(
                    client.post(f"{base}v1/chat/completions", content=body, headers=headers).status_code
                )
            )
            for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        with httpx.Client(timeout=60) as probe:
            while any(thread.is_alive() for thread in threads):
                started = time.perf_counter()
                assert probe.get(f"{base}health").status_code == 200
                health.append(time.perf_counter() - started)
                time.sleep(0.05)
        for thread in threads:
            thread.join(300)
    assert len(statuses) == 8 and set(statuses) <= {400, 429} and 400 in statuses, statuses
    assert max(health) < 0.3, sorted(health)[-5:]


def test_the_server_process_never_parses_a_chat_body(chat, monkeypatch):
    """The body is parsed and checked in the render worker: in the server's process, ChatCompletionRequest
    reads nothing, and a chat is answered and a bad one refused all the same."""
    base = chat[0]

    def parsed(*args, **kwargs):
        raise AssertionError("a chat body was parsed in the server's process")

    for name in ("model_validate_json", "model_validate"):
        monkeypatch.setattr(ChatCompletionRequest, name, parsed)
    answered = httpx.post(f"{base}v1/chat/completions", json=chat_body(MESSAGES), timeout=60)
    assert answered.status_code == 200, answered.text
    refused = httpx.post(f"{base}v1/chat/completions", json=chat_body([]), timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text


def test_a_render_past_its_bound_is_refused_even_when_its_caller_wakes_late(monkeypatch):
    """The caller reads the reply only once the worker's own timer has ended it (a loaded machine's late thread):
    that was 'the chat template's worker process ended (exit code -14)', a 500."""
    real = chat_template._Worker._reply

    def late(self, deadline):
        if self.ready:  # the render's reply, not the worker's start
            self.process.wait(30)
        return real(self, deadline)

    monkeypatch.setattr(chat_template._Worker, "_reply", late)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    renderer = ChatRenderer(loop, {}, seconds=0.5)
    with pytest.raises(ChatTemplateRefused, match="took more than 0.5 s"):
        renderer.render(MESSAGES)
