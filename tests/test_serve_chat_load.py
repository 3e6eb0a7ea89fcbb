"""`free-transformer serve`'s chat under load, with real clients against a real server: renders wait on the chat
queue's own threads, so that /health and other clients' completions are answered while every render thread is
taken; past the queue's bound a chat request is a 429 with Retry-After and the API's error body at once; a flood of
long conversations ends in 400s and 429s, never a 5xx; a render past its time bound is a 400 even when its caller
wakes after the worker's own timer has ended it."""

import threading
import time

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("transformers")

from test_serve_chat import MESSAGES, NAME, TEMPLATE, serving

from free_transformer.data import chat_template
from free_transformer.data.chat_template import WORKERS, ChatRenderer, ChatTemplateRefused

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
    real = engine.tokenizer.chat_prompt

    def slow(messages):
        held.release()
        release.wait(60)
        return real(messages)

    monkeypatch.setattr(engine.tokenizer, "chat_prompt", slow)
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


def test_a_flood_of_long_conversations_is_400s_and_429s_and_health_answers(chat):
    """A smaller flood than the one bench/serving.py measures: 12 chats of 20,000 messages at once."""
    base = chat[0]
    statuses: list[int] = []
    body = chat_body([MESSAGES[1]] * 20_000)
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=16)) as client:
        threads = [
            threading.Thread(
                target=lambda: statuses.append(client.post(f"{base}v1/chat/completions", json=body).status_code)
            )
            for _ in range(12)
        ]
        for thread in threads:
            thread.start()
        health = httpx.get(f"{base}health", timeout=60)
        for thread in threads:
            thread.join(300)
    assert health.status_code == 200
    assert len(statuses) == 12 and set(statuses) <= {400, 429} and 400 in statuses, statuses


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
