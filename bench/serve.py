"""`free-transformer serve` under load on the CPU: the aggregate decoding rate of 8 concurrent clients
against one client alone (the decoding engine batches the requests in flight) and against offline
`generate()` of the same rows in one call, the latency of a 1-token request while a 2,000-token completion
streams, and of a 4-token request sent behind 40 queued requests of 64 rows each (fair admission).

A random cpu-small model (4 blocks of width 128, H = 8, byte vocabulary) with a 2,112-token context,
saved as a checkpoint and served by a `free-transformer serve` process on 127.0.0.1; the clients are
httpx threads of this process, and offline generate() runs in this process too, while the server idles.
One client, the clients together and offline generate() take turns, --rounds times; each ratio printed is
the median of the rounds' ratios. Targets (bench/README.md): 8 clients at least 3x one client's tokens/s and
at least 0.8x offline generate's, and the short request answered in under 2 s.

On a GPU (--device cuda --size paper-1.5b --dtype bf16 --compile --clients 16, the `serve` step of
scripts/gpu-check.sh): the server compiles and captures its step at start-up, and 16 concurrent clients
should reach >= 0.7x offline generate(compile=True) at B=16 (bench/targets.py: serve-b16-vs-offline), with
no step compiled or captured after start-up (counted in the server's log).

    PYTHONPATH=src python bench/serve.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from common import add_smoke_argument

from free_transformer.model.config import named_config
from free_transformer.model.transformer import FreeTransformer
from free_transformer.runs.checkpoint import save_checkpoint

MODEL = "bench"
# one client for every thread: httpx.post would build a client (and its SSL context) per request
HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64))
SPEEDUP_TARGET = 3.0
OFFLINE_TARGET = 0.8
LATENCY_TARGET_S = 2.0
PROMPT = "Once upon a time"


def start(directory: Path, args) -> tuple[subprocess.Popen, str]:
    """A `free-transformer serve` process of a random model, once it answers /health; its stderr goes to
    directory/server.log."""
    torch.manual_seed(0)
    config = named_config(args.size, max_seq_len=args.context)
    save_checkpoint(directory / MODEL, 1, FreeTransformer(config), {"tokenizer": "byte"})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}  # 0: torch's
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "free_transformer.cli",
            "serve",
            str(directory / MODEL),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--port",
            str(port),
            "--max-batch",
            str(args.max_batch),
            "--compile",
            "on" if args.compile else "off",
        ],
        env=env,
        stderr=open(directory / "server.log", "w"),  # noqa: SIM115 (open for the server's whole life)
    )
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server, f"http://127.0.0.1:{port}/v1/completions"
        except httpx.TransportError:
            if server.poll() is not None:
                raise SystemExit("the server did not start") from None
            time.sleep(0.2)


def complete(url: str, max_tokens: int, seed: int, stream: bool = False) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "seed": seed, "stream": stream}
    if not stream:
        return HTTP.post(url, json=body).json()["usage"]["completion_tokens"]
    with HTTP.stream("POST", url, json=body) as response:
        for _ in response.iter_lines():
            pass
    return max_tokens


def rate(url: str, clients: int, tokens: int) -> float:
    """Tokens per second of `clients` concurrent requests of `tokens` new tokens each."""
    done = [0] * clients

    def one(i: int) -> None:
        done[i] = complete(url, tokens, seed=i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - started)


def short_beside_long(url: str, long_tokens: int) -> tuple[float, bool]:
    """Seconds to answer a 1-token request sent 1 s into a `long_tokens` streamed completion, and whether
    the long completion was still streaming when the answer came."""
    long = threading.Thread(target=complete, args=(url, long_tokens, 0, True))
    long.start()
    time.sleep(1.0)
    started = time.perf_counter()
    complete(url, 1, seed=1)
    latency, streaming = time.perf_counter() - started, long.is_alive()
    long.join()
    return latency, streaming


def offline_decoder(directory: Path, args) -> Callable[[], float]:
    """A function that measures the tokens per second of `generate()` decoding the rows of the clients' requests
    in one call, in this process (compiled with --compile; a first call, which compiles, is made here)."""
    from free_transformer import GenerationConfig, generate, load_model
    from free_transformer.base.devices import decoding_dtype

    device = torch.device(args.device)
    model, _ = load_model(directory / MODEL, device)
    model = model.to(decoding_dtype(args.dtype, device))
    prompts = [list(PROMPT.encode())] * args.clients
    config = GenerationConfig(max_new_tokens=args.tokens)

    def decode():
        return generate(
            model, prompts, config, seeds=range(args.clients), compile=args.compile, batch_size=args.max_batch
        )

    def measured() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = decode()
        return sum(map(len, result.tokens)) / (time.perf_counter() - started)

    decode()  # warm-up
    return measured


def short_behind_queue(url: str, requests: int, rows: int, tokens: int) -> float:
    """Seconds to answer a 4-token request sent once `requests` requests of `rows` completions each are queued."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "n": rows}

    def queued(seed: int) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server is stopped with these still queued
            HTTP.post(url, json={**body, "seed": seed})

    for i in range(requests):
        threading.Thread(target=queued, args=(i,), daemon=True).start()
    time.sleep(1.0)
    started = time.perf_counter()
    complete(url, 4, seed=requests)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--tokens",
        type=int,
        default=256,
        help="new tokens per client (64 measures the requests' fixed cost as much as decoding)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of (1 client, N clients)")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the server and of offline generate (0: torch's default; two "
        "threads on two cores make the server's OpenMP threads and the clients compete)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="the server's --max-batch (1: one completion at a time, as before batching)",
    )
    parser.add_argument(
        "--queued",
        type=int,
        nargs=2,
        default=(40, 64),
        metavar=("REQUESTS", "ROWS"),
        help="the requests queued ahead of the 4-token one, and their completions each",
    )
    parser.add_argument("--size", default="cpu-small", help="the model's named size")
    parser.add_argument("--context", type=int, default=2112, help="the model's max_seq_len")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compile", action="store_true", help="serve --compile on, and generate(compile=True)")
    parser.add_argument("--figures", metavar="PATH", help="append serve-b16-vs-offline to PATH (bench/targets.py)")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.tokens, args.rounds, args.long_tokens, args.queued, args.context = 2, 4, 1, 16, (2, 2), 128
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        server, url = start(Path(directory), args)
        try:
            measure(url, args, Path(directory))
        finally:
            server.kill()  # not terminate: it would drain the queued requests first
            server.wait(30)


def compiled_steps(directory: Path) -> int:
    """Steps the server has compiled or captured so far, as its log says."""
    return (directory / "server.log").read_text().count("compiled the decoding step")


def measure(url: str, args, directory: Path) -> None:
    offline_rate = offline_decoder(directory, args)
    rate(url, 1, 8)  # warm-up
    compiled = compiled_steps(directory)
    ratios, alone, together, offline, served_ratios = [], [], [], [], []
    for _ in range(args.rounds):  # interleaved: the machine's load moves all three alike
        alone.append(rate(url, 1, args.tokens))
        together.append(rate(url, args.clients, args.tokens))
        offline.append(offline_rate())  # the server idle meanwhile
        ratios.append(together[-1] / alone[-1])
        served_ratios.append(together[-1] / offline[-1])
    del offline_rate  # its model and cache: their memory goes back for the server's process
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    speedup = statistics.median(ratios)
    latency, streaming = short_beside_long(url, args.long_tokens)
    queued = short_behind_queue(url, *args.queued, tokens=args.tokens)
    print(f"1 client:  {statistics.median(alone):7.1f} tokens/s ({args.tokens} new tokens)")
    print(
        f"{args.clients} clients: {statistics.median(together):7.1f} tokens/s aggregate, "
        f"{speedup:.1f}x one client (median of {args.rounds} interleaved rounds)"
    )
    served = statistics.median(served_ratios)
    recompiled = compiled_steps(directory) - compiled
    if args.figures:
        from targets import write_figure

        write_figure(
            args.figures,
            "serve-b16-vs-offline",
            served,
            f"{args.clients} clients, {args.tokens} tokens, {recompiled} steps compiled after start-up",
        )
    print(f"steps compiled or captured by the server after start-up: {recompiled}")
    print(
        f"offline generate() of the same {args.clients} rows in one call: {statistics.median(offline):7.1f} tokens/s; "
        f"the server {served:.2f}x of it (median of the rounds' ratios)"
    )
    print(
        f"a 1-token request while a {args.long_tokens}-token completion streams: answered in {latency:.2f} s"
        + ("" if streaming else " (after the long completion had ended: it waited for it)")
    )
    print(
        f"a 4-token request behind {args.queued[0]} queued requests of {args.queued[1]} completions: answered in "
        f"{queued:.2f} s"
    )
    print(
        f"targets: {args.clients} clients >= {SPEEDUP_TARGET:.0f}x one client "
        f"{'PASS' if speedup >= SPEEDUP_TARGET else 'FAIL'}; >= {OFFLINE_TARGET}x offline generate "
        f"{'PASS' if served >= OFFLINE_TARGET else 'FAIL'}; short request < {LATENCY_TARGET_S:.0f} s "
        f"{'PASS' if latency < LATENCY_TARGET_S and streaming else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
