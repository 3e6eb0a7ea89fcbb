"""`free-transformer serve` under hostile and heavy load: bounded requests refused before any sampling,
invalid text a 4xx, a departed client's rows dropped, one decoding loop shared by the requests in
flight, stop strings looked for in the new text only, and a bad address refused in one line."""

import dataclasses
import queue
import socket
import threading
import time

import httpx
import pytest
from conftest import tiny_checkpoint
from test_serve import NAME, start_server

pytest.importorskip("openai")

from free_transformer.cli import main
from free_transformer.serve import batcher as loop
from free_transformer.serve.batcher import Batcher, Delta, Job, RowText, TokenLogprob
from free_transformer.serve.protocol import CompletionRequest
from free_transformer.serve.request_plan import Plan


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve-load"), NAME, latent_units=4, max_seq_len=256)


@pytest.fixture(scope="module")
def served(checkpoint):
    url, engine, uv = start_server(checkpoint, max_body_bytes=4096, engine={"max_batch": 4})
    yield url, engine
    uv.should_exit = True


def post(served, body, timeout=60, **options):
    return httpx.post(
        served[0] + "/completions", timeout=timeout, **({"json": body} if body is not None else {}), **options
    )


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole(served):
    steps = served[1].batcher.steps
    declared = post(served, {"model": NAME, "prompt": "x" * 5000})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 1000

    streamed = httpx.post(served[0] + "/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413 and "at most 4096" in streamed.json()["error"]["message"]
    assert served[1].batcher.steps == steps


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "tiny", "prompt": "\xff\xfe"}',
        b'{"model": "tiny", "prompt": "\\ud800"}',
        b'{"model": "tiny", "prompt": ["ok", "\\udc00x"]}',
        b"\xc3(",
        b"[1, 2]",
        b"[" * 2000 + b"]" * 2000,
    ],
)
def test_text_or_json_that_is_not_valid_is_a_400(served, body):
    response = post(served, None, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_requests_over_the_bounds_take_no_decoding_step(served):
    steps = served[1].batcher.steps
    for body in [
        {"prompt": ["a"] * 200, "n": 6},
        {"stop": ["x" * 300]},
        {"stop": [str(i) for i in range(20)]},
        {"max_tokens": 250, "prompt": "x" * 10},
    ]:
        assert post(served, {"model": NAME, "prompt": "Hi", **body}).status_code == 400
    assert served[1].batcher.steps == steps


def slow_steps(monkeypatch, seconds: float, record: list) -> None:
    """Each decoding step takes `seconds` more, and `record` gets each step's rows."""
    real = loop.Batcher._step

    def step(self):
        record.append([row.config.max_new_tokens for row in self.rows])
        time.sleep(seconds)
        return real(self)

    monkeypatch.setattr(loop.Batcher, "_step", step)


def wait_idle(engine, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.batcher.rows or engine.batcher.waiting:
        assert time.monotonic() < deadline, "the decoding loop still holds rows"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_a_departed_clients_rows_leave_the_batch_at_the_next_step(served, monkeypatch, stream):
    """A client gives up after ~5 steps of a 200-token completion: its row is dropped within a step or two
    of the disconnect (it used to be sampled to its end)."""
    steps: list = []
    slow_steps(monkeypatch, 0.02, steps)
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 200, "stream": stream}
    if stream:  # reads 3 chunks, then closes the connection
        with httpx.stream("POST", served[0] + "/completions", json=body, timeout=30) as response:
            for _, _ in zip(range(3), response.iter_lines()):
                pass
    else:
        with pytest.raises(httpx.ReadTimeout):
            post(served, body, timeout=0.3)
    left = len(steps)
    wait_idle(served[1])
    assert 0 < len(steps) < 200 and len(steps) - left <= 3, (left, len(steps))


def test_one_loop_batches_a_short_request_beside_a_long_stream(served, monkeypatch):
    """While a 100-token completion streams, a 3-token request is answered at once (its row joins the batch
    at the next step), and the two share steps; so do 3 concurrent completions."""
    steps: list = []
    slow_steps(monkeypatch, 0.01, steps)
    long_done, events = threading.Event(), []

    def long_stream():
        body = {"model": NAME, "prompt": "Once", "max_tokens": 100, "stream": True, "seed": 1}
        with httpx.stream("POST", served[0] + "/completions", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                pass
        events.append("long")
        long_done.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    while len(steps) < 10:
        time.sleep(0.005)
    short = post(served, {"model": NAME, "prompt": "Hi", "max_tokens": 3, "seed": 2})
    events.append("short")
    thread.join(60)
    assert short.status_code == 200 and events == ["short", "long"]
    assert [rows for rows in steps if len(rows) == 2] == [[100, 3]] * 2  # its 2 steps after the prefill's token
    steps.clear()
    answers = []
    threads = [
        threading.Thread(
            target=lambda s=s: answers.append(
                post(served, {"model": NAME, "prompt": "Hi", "max_tokens": 40, "seed": s})
            )
        )
        for s in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(a.status_code == 200 for a in answers)
    assert max(map(len, steps)) == 3 and len(steps) < 3 * 40


def test_concurrent_completions_are_the_ones_each_gets_alone(served):
    bodies = [
        {"model": NAME, "prompt": p, "max_tokens": 16, "seed": s, "temperature": 0.1, "n": 2}
        for p, s in [("Hi", 1), ("Hello there", 2), ("Hi", 4)]
    ]
    alone = [post(served, body).json()["choices"] for body in bodies]
    together: dict = {}
    threads = [
        threading.Thread(target=lambda i=i, b=b: together.__setitem__(i, post(served, b).json()["choices"]))
        for i, b in enumerate(bodies)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [together[i] for i in range(len(bodies))] == alone


def test_stop_strings_are_looked_for_in_the_new_text_only(monkeypatch):
    """Each token's search starts at most len(stop) - 1 characters before the new text: a 256-character stop
    string and 2,000 tokens read about 2,000 x 256 characters, not 2,000^2 / 2."""
    searched = []
    real = loop.stop_at

    def counted(text, stops, start=0):
        searched.append(len(text) - start)
        return real(text, stops, start)

    monkeypatch.setattr(loop, "stop_at", counted)
    stop = "z" * 255 + "!"
    text = RowText(lambda ids: bytes(ids).decode("utf-8", errors="replace"), [stop])
    for token in b"ab" * 1000:
        text.push(token)
    assert text.stop_end is None and max(searched) <= len(stop)
    for token in stop.encode():
        text.push(token)
    assert text.stop_end == 2000 and text.final == "ab" * 1000
    multibyte = RowText(lambda ids: bytes(ids).decode("utf-8", errors="replace"), ["é!"])
    for token in "café! more".encode():
        multibyte.push(token)
    assert multibyte.final == "caf"


def test_a_bad_host_or_a_port_in_use_is_one_line_and_exit_2(checkpoint, capsys):
    assert main(["serve", str(checkpoint), "--host", "no-such-host.invalid", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --host 'no-such-host.invalid'") and err.count("\n") == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(checkpoint), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


@pytest.mark.parametrize("route", ["native", "fold", "expand"])
def test_a_step_of_rows_at_their_own_positions_equals_each_row_alone(monkeypatch, route):
    """The continuous batch's step (start a (B,) tensor of positions) gives each row the logits of its own
    one-row decoding, on each of attend's grouped-query routes (CUDA takes "fold" for one-token queries)."""
    import torch

    from free_transformer.model import layers
    from free_transformer.model.config import ModelConfig
    from free_transformer.model.transformer import FreeTransformer

    torch.manual_seed(0)
    model = FreeTransformer(
        ModelConfig(
            vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64, latent_units=4
        )
    ).eval()
    prompts = [torch.randint(0, 256, (1, length)) for length in (7, 12, 3)]
    batch, alone = model.new_cache(4), [model.new_cache(1) for _ in prompts]
    with torch.no_grad():
        for slot, (prompt, cache) in enumerate(zip(prompts, alone)):
            model(prompt, latents="prior", generator=torch.Generator().manual_seed(slot), cache=cache)
            model(
                prompt,
                latents="prior",
                generator=torch.Generator().manual_seed(slot),
                cache=batch.view(slice(slot, slot + 1), prompt.shape[1]),
            )
        monkeypatch.setattr(layers, "gqa_route", lambda *args: route)
        tokens, latents = torch.tensor([[5], [9], [200]]), torch.tensor([[3], [11], [0]])
        positions = torch.tensor([7, 12, 3])
        together = model(tokens, latents=latents, cache=batch.view(slice(0, 3), 13), start=positions).logits[:, -1]
        for row, cache in enumerate(alone):
            single = model(tokens[row : row + 1], latents=latents[row : row + 1], cache=cache).logits[0, -1]
            assert torch.allclose(together[row], single, atol=1e-5)


def test_valid_extreme_settings_are_sampled_and_fail_no_other_request(served):
    """A temperature of 1e-40 or 1e-39 is greedy and a top_p of 1e-300 keeps the likeliest token: each is
    answered, alone or beside another request (they used to give NaN: a 500 for every request in flight)."""
    base = {"model": NAME, "prompt": "Hi", "max_tokens": 6, "seed": 3}
    greedy = post(served, {**base, "temperature": 0}).json()["choices"][0]["text"]
    for extreme in ({"temperature": 1e-40}, {"top_p": 1e-300, "temperature": 1e-39}):
        answers: dict = {}
        threads = [
            threading.Thread(target=lambda k=k, b=b: answers.__setitem__(k, post(served, b)))  # noqa: B023 (joined below)
            for k, b in enumerate([{**base, **extreme}, {**base, "prompt": "Hello", "max_tokens": 12}])
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert [answers[k].status_code for k in range(2)] == [200, 200], answers[0].text
        assert answers[0].json()["choices"][0]["text"] == greedy


def steps_of_a_short_request_behind(served, bodies: list[dict], waiting: int) -> tuple[int, int]:
    """Send the `bodies` requests from threads, wait until `waiting` of them are queued, then a 4-token request:
    (the steps the engine took until it was answered, the engine's step count when it was sent), once every
    queued request has ended."""
    engine = served[1]
    queued = [threading.Thread(target=post, args=(served, body), kwargs={"timeout": 600}) for body in bodies]
    for thread in queued:
        thread.start()
    deadline = time.monotonic() + 30
    while len(engine.batcher.waiting) < waiting:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    before = engine.batcher.steps
    assert post(served, {"model": NAME, "prompt": "Hi", "max_tokens": 4, "seed": 1}, timeout=600).status_code == 200
    waited = engine.batcher.steps - before
    for thread in queued:
        thread.join(600)
    return waited, before


def test_a_short_request_starts_within_a_few_steps_behind_a_queue(served, monkeypatch):
    """6 requests of 4 completions of 20 tokens fill the 4 slots and the queue; a 4-token request sent then
    gets the next free slot (the fewest rows in flight, then to start), not the queue's end: it is answered in far fewer
    steps than the queue takes (it used to wait for every older request's rows). Steps are slowed, so that
    the queue is still whole when the short request comes, however fast the machine."""
    engine = served[1]
    slow_steps(monkeypatch, 0.02, [])
    bodies = [{"model": NAME, "prompt": "Once", "n": 4, "max_tokens": 20, "seed": s} for s in range(6)]
    waited, before = steps_of_a_short_request_behind(served, bodies, waiting=6)
    assert waited <= 20 + 4 + 4, waited  # at most one row's length to free a slot, then its own 4 tokens
    assert engine.batcher.steps - before >= 6 * 4 * 20 // 4 - 6  # the queue itself took every slot for that long


def test_a_short_request_passes_the_one_row_requests_queued_before_it(served, monkeypatch):
    """8 one-row requests of 60 tokens fill the 4 slots and queue 4 more; a 4-token request sent then starts at the
    first free slot, since it is due first (it used to wait for every one-row request queued before it: two
    rounds of 60 steps). Steps are slowed, so that the queue is still whole when it comes, however fast the
    machine."""
    engine = served[1]
    slow_steps(monkeypatch, 0.05, [])  # the short request is due first unless it takes 56 steps to arrive
    bodies = [{"model": NAME, "prompt": "Once", "max_tokens": 60, "seed": s} for s in range(8)]
    waited, before = steps_of_a_short_request_behind(served, bodies, waiting=4)
    assert waited <= 60 + 4, waited  # a slot freed by the first 4 requests' end, then its own 4 tokens
    assert engine.batcher.steps - before >= 100  # the queue itself took two rounds of 60 steps


def run_jobs(engine, jobs: list[dict]) -> list[tuple[list[Delta], Exception | None]]:
    """Each job (Job's fields but emit and finish) submitted to a new scheduler over the server's model before it
    starts, so that all join at its first admission: each one's pieces and the error that ended it."""
    batcher = Batcher(engine.model, engine.tokenizer, max_batch=4)
    results = [([], queue.Queue()) for _ in jobs]
    for fields, (pieces, ended) in zip(jobs, results):
        batcher.submit(Job(**fields, emit=pieces.append, finish=ended.put))
    batcher.start()
    return [(pieces, ended.get(timeout=60)) for pieces, ended in results]


def plan(engine, **fields) -> Plan:
    return engine.plan(CompletionRequest(model=NAME, **{"max_tokens": 12, "seed": 3, "temperature": 0.5, **fields}))


def job(plan: Plan, logprobs: int | None = None) -> dict:
    return dict(rows=plan.rows, stops=plan.stops, logprobs=logprobs, echo=False, stream=False)


@pytest.mark.parametrize("failure", ["prefill", "logprobs"])
def test_a_row_that_fails_ends_its_own_request_only(served, failure):
    """A request whose row fails, admitted with good ones: it ends with its error, and every good one gives the
    tokens it gives alone. The door refuses both causes now; they stand for any failure of a row's prefill or of
    its logprobs: a prefill that raised (top_k 2**63 overflowed int64) used to end every request prefilled with
    it, and logprobs over the vocabulary (topk failing) every request in flight."""
    engine = served[1]
    good = [job(plan(engine, prompt=prompt, n=2)) for prompt in ("Hello", "Hi there", "Hello")]
    bad = job(plan(engine, prompt="Hello"))
    if failure == "prefill":  # a row whose prefill raises: its settings' top_k overflows the device's int64
        spec = bad["rows"][0]
        config = dataclasses.replace(spec.prompt.config)
        object.__setattr__(config, "top_k", 2**63)
        bad["rows"] = [dataclasses.replace(spec, prompt=dataclasses.replace(spec.prompt, config=config))]
    else:  # more alternatives per token than the vocabulary holds: torch.topk raises
        bad["logprobs"] = engine.model.config.vocab_size + 1
    alone = [run_jobs(engine, [fields])[0] for fields in good]
    together = run_jobs(engine, [good[0], bad, *good[1:]])
    assert together[1][1] is not None  # the bad request's error
    assert [error for _, error in alone] == [error for k, (_, error) in enumerate(together) if k != 1] == [None] * 3
    assert [pieces for pieces, _ in alone] == [pieces for k, (pieces, _) in enumerate(together) if k != 1]
    assert all(len(pieces) == 2 and pieces[0].tokens == 12 for pieces, _ in alone)


def test_the_request_path_is_built_by_field_name():
    """A request's job, its rows, its plan and the pieces it answers with take their fields by name only, so that
    a field added or reordered cannot shift the others' meaning."""
    for cls in (loop.RowSpec, Job, Delta, TokenLogprob, Plan, loop.Served):
        assert all(field.kw_only for field in dataclasses.fields(cls)), cls.__name__


@pytest.fixture(scope="module")
def small_vocabulary(tmp_path_factory):
    """A server of a model of 16 tokens (token-id prompts; the byte tokenizer decodes them)."""
    url, engine, uv = start_server(
        tiny_checkpoint(tmp_path_factory.mktemp("vocab16"), NAME, latent_units=4, vocab_size=16),
        engine={"max_batch": 4},
    )
    yield url, engine
    uv.should_exit = True


def test_logprobs_over_the_vocabulary_are_refused_at_the_door_and_fail_no_other_request(small_vocabulary):
    """logprobs 20 on a model of 16 tokens is a 400 naming the field, and the requests sent with it get what they
    get alone (it used to fail every request in flight with a 500)."""
    good = [{"model": NAME, "prompt": [[1, 2, 3]], "max_tokens": 8, "seed": s, "logprobs": 2} for s in range(3)]

    def tokens(response) -> list[list[str]]:  # each choice's tokens (their log-probabilities: up to float rounding)
        return [choice["logprobs"]["tokens"] for choice in response.json()["choices"]]

    alone = [tokens(post(small_vocabulary, body)) for body in good]
    bodies = [*good, {"model": NAME, "prompt": [[1, 2, 3]], "max_tokens": 8, "logprobs": 20}]
    answers: dict = {}
    threads = [
        threading.Thread(target=lambda k=k, b=b: answers.__setitem__(k, post(small_vocabulary, b)))
        for k, b in enumerate(bodies)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [tokens(answers[k]) for k in range(3)] == alone
    refused = answers[3]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert "this model has 16 tokens" in refused.json()["error"]["message"]
    assert post(small_vocabulary, {**good[0], "logprobs": 16}).status_code == 200
