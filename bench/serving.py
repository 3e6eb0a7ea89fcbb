"""`free-transformer serve` measured as vLLM's benchmark_serving.py measures a server: requests sent at a request
rate (Poisson arrivals: exponential gaps of mean 1/rate), a mix of streamed completions, streamed chats, plain
completions and best_of requests; request and output-token throughput, time to first token (TTFT), time per output
token after the first (TPOT) and inter-token latency (ITL) at p50/p90/p99, and the latency of /health, probed
every 0.2 s meanwhile. Then the flood: `--flood` chat requests of 100,000 messages each sent at once, with
/health, a one-token completion of another client and the TTFT of a short streamed request probed while they
last, and the flood's status codes counted.

The model: a random 2-block Llama (width 64, vocabulary 64) converted to a Free Transformer checkpoint, with a
word-level tokenizer that ships a chat template, served by a `free-transformer serve` process on 127.0.0.1
(--src: the `src` folder of another checkout to serve with, so that two versions are measured by one client).
The clients are httpx threads of this process; the flood is sent by a child process, so that its 100,000-message
bodies do not delay the probes' clocks.

    PYTHONPATH=src python bench/serving.py --rates 1 4 16 --flood 48 64 128
    PYTHONPATH=src python bench/serving.py --rates --flood 48 64 128   # the flood alone
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import add_smoke_argument

MODEL = "bench"
TEMPLATE = "{% for m in messages %}{{ m.role }} : {{ m.content }} ; {% endfor %}assistant :"
WORDS = ["[UNK]", "system", "user", "assistant", ":", ";", "hello", "world"]
MESSAGE = {"role": "user", "content": "hello world"}
KINDS = ("stream", "chat", "plain", "best_of")  # the mix, in equal shares
FLOOD_MESSAGES = 100_000
PROBE_EVERY_S = 0.2


def build_model(directory: Path, context: int) -> Path:
    """A converted random Llama whose tokenizer has TEMPLATE; the checkpoint's directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from free_transformer.cli import main

    torch.manual_seed(0)
    llama = directory / "llama"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=context,
            tie_word_embeddings=True,
        )
    ).save_pretrained(llama)
    vocab = {word: i for i, word in enumerate(WORDS + [f"w{i}" for i in range(64 - len(WORDS))])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", chat_template=TEMPLATE).save_pretrained(llama)
    if main(["convert", str(llama), str(directory / MODEL), "--to", "checkpoint", "--latent-units", "4"]) != 0:
        raise SystemExit("the model's conversion failed")
    return directory / MODEL


def start(checkpoint: Path, src: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A `free-transformer serve` process of `checkpoint` (its package from `src`) once /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "free_transformer.cli", "serve", str(checkpoint), "--port", str(port)]
    server = subprocess.Popen(command + ["--model-name", MODEL], env=env, stderr=open(log, "w"))  # noqa: SIM115
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return server, base
        except httpx.TransportError:
            if server.poll() is not None:
                raise SystemExit(f"the server did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)


def percentiles(values: list[float]) -> str:
    if not values:
        return "     -      -      -"
    ordered = sorted(values)
    pick = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99)]
    return " ".join(f"{1000 * value:6.0f}" for value in pick)


class Record:
    """What one request measured: its kind, status, output tokens, TTFT, latency and its gaps between chunks."""

    def __init__(self, kind: str):
        self.kind, self.status, self.tokens = kind, 0, 0
        self.ttft: float | None = None
        self.latency = 0.0
        self.gaps: list[float] = []


def request_body(kind: str, tokens: int, seed: int) -> tuple[str, dict]:
    common = {"model": MODEL, "max_tokens": tokens, "seed": seed}
    if kind == "chat":
        return "/v1/chat/completions", {**common, "messages": [MESSAGE], "stream": True}
    body = {**common, "prompt": "hello world hello"}
    if kind == "stream":
        return "/v1/completions", {**body, "stream": True}
    if kind == "best_of":
        return "/v1/completions", {**body, "best_of": 4, "n": 1}
    return "/v1/completions", body


def send(client: httpx.Client, base: str, kind: str, tokens: int, seed: int) -> Record:
    """One request, timed: streamed ones chunk by chunk (a chunk is a token of this word-level model)."""
    path, body = request_body(kind, tokens, seed)
    record, started = Record(kind), time.perf_counter()
    if not body.get("stream"):
        response = client.post(base + path, json=body)
        record.status, record.latency = response.status_code, time.perf_counter() - started
        if response.status_code == 200:
            record.tokens = response.json()["usage"]["completion_tokens"]
        return record
    with client.stream("POST", base + path, json=body) as response:
        record.status, last = response.status_code, None
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if json.loads(line[6:]).get("choices"):
                record.tokens += 1
                if last is None:
                    record.ttft = now - started
                else:
                    record.gaps.append(now - last)
                last = now
    record.latency = time.perf_counter() - started
    return record


class HealthProbe:
    """/health's latency every PROBE_EVERY_S seconds on a thread, until stopped."""

    def __init__(self, base: str):
        self.base, self.latencies, self.statuses = base, [], collections.Counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self.stopped.is_set():
                started = time.perf_counter()
                try:
                    self.statuses[client.get(self.base + "/health").status_code] += 1
                except httpx.HTTPError as error:
                    self.statuses[type(error).__name__] += 1
                self.latencies.append(time.perf_counter() - started)
                self.stopped.wait(PROBE_EVERY_S)

    def stop(self) -> list[float]:
        self.stopped.set()
        self.thread.join(600)
        return self.latencies


def at_rate(base: str, rate: float, count: int, tokens: int, seed: int) -> str:
    """One table row: `count` requests of the mix at `rate` per second (Poisson arrivals)."""
    rng = random.Random(seed)
    records: list[Record] = []
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))
    probe = HealthProbe(base)
    threads, started = [], time.perf_counter()
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        thread = threading.Thread(target=lambda k=kind, s=i: records.append(send(client, base, k, tokens, s)))
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(rate))
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    health = probe.stop()
    client.close()
    ok = [record for record in records if record.status == 200]
    streamed = [record for record in ok if record.ttft is not None]
    tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in streamed if r.ttft is not None and r.tokens > 1]
    itl = [gap for record in streamed for gap in record.gaps]
    output = sum(record.tokens for record in ok)
    return (
        f"{rate:5g} | {len(ok):3d}/{count:<3d} | {len(ok) / elapsed:6.2f} | {output / elapsed:7.1f} | "
        f"{percentiles([r.ttft for r in streamed if r.ttft is not None])} | {percentiles(tpot)} | "
        f"{percentiles(itl)} | {percentiles(health)}"
    )


def flood_sender(base: str, chats: int, messages: int, statuses) -> None:
    """(In a child process.) `chats` chat requests of `messages` messages each, all at once; their statuses (or the
    transport error's name) put on `statuses`."""
    body = json.dumps({"model": MODEL, "messages": [MESSAGE] * messages, "max_tokens": 1}).encode()
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=chats + 4))
    headers = {"Content-Type": "application/json"}

    def one() -> None:
        try:
            response = client.post(base + "/v1/chat/completions", content=body, headers=headers)
            statuses.put(response.status_code)
        except httpx.HTTPError as error:
            statuses.put(type(error).__name__)

    threads = [threading.Thread(target=one) for _ in range(chats)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def flood(base: str, chats: int, messages: int) -> str:
    """/health, a one-token completion of another client and a short request's TTFT while `chats` chat requests of
    `messages` messages are in flight; their statuses."""
    alone = send(httpx.Client(timeout=60), base, "plain", 1, 0).latency
    statuses = multiprocessing.get_context("spawn").Queue()
    sender = multiprocessing.get_context("spawn").Process(target=flood_sender, args=(base, chats, messages, statuses))
    sender.start()
    time.sleep(1.0)  # the bodies on their way
    probe = HealthProbe(base)
    one_token, short_ttft = [], []
    with httpx.Client(timeout=600) as client:
        while sender.is_alive():
            one_token.append(send(client, base, "plain", 1, 1).latency)
            short = send(client, base, "stream", 2, 2)
            short_ttft.append(short.ttft if short.ttft is not None else short.latency)
            sender.join(PROBE_EVERY_S)
    health = probe.stop()
    counted = collections.Counter(statuses.get() for _ in range(chats))
    return (
        f"{chats:4d} | {max(health):6.2f} {statistics.median(health):6.2f} | {max(one_token):6.2f} "
        f"({max(one_token) / alone:5.0f}x alone) | {percentiles(short_ttft)} | "
        + ", ".join(f"{status}: {n}" for status, n in sorted(counted.items(), key=str))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 4.0, 16.0], help="requests per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="each rate's span (its requests: rate x this)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--flood", type=int, nargs="*", default=[48], help="chat requests of the flood, each run")
    parser.add_argument("--messages", type=int, default=FLOOD_MESSAGES, help="messages of each flood request")
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"), help="the server's code")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rates, args.seconds, args.tokens, args.flood, args.messages = [4.0], 1.0, 4, [4], 1000
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        checkpoint = build_model(directory, context=256)
        server, base = start(checkpoint, args.src, directory / "server.log")
        try:
            with httpx.Client(timeout=120) as client:  # warm-up: the chat template's render workers start
                for kind in KINDS:
                    send(client, base, kind, args.tokens, 0)
            print(f"server: {args.src}; {args.tokens} new tokens a request; mix {', '.join(KINDS)}")
            print(
                "rate/s |  ok/sent | req/s |  tok/s | TTFT ms p50 p90 p99 | TPOT ms p50 p90 p99 | "
                "ITL ms p50 p90 p99 | /health ms p50 p90 p99"
            )
            for rate in args.rates:
                print(at_rate(base, rate, max(4, round(rate * args.seconds)), args.tokens, seed=0), flush=True)
            print(f"flood of chats of {args.messages:,} messages (seconds):")
            print("chats | /health max median | 1-token completion max | short TTFT ms p50 p90 p99 | flood statuses")
            for chats in args.flood:
                print(flood(base, chats, args.messages), flush=True)
        finally:
            server.kill()
            server.wait(30)


if __name__ == "__main__":
    main()
