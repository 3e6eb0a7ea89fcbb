"""`free-transformer serve`: a checkpoint behind OpenAI's completions API (docs/serving.md)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from ..base.devices import DTYPE_NAMES
from ..base.errors import UserError
from ..base.install import install_hint
from ..inference.params import CONTEXT_LATENTS
from ..serve.config import DEFAULT_MAX_BATCH, DEFAULT_MAX_REQUEST_MB

NAME = "serve"
HELP = "serve a checkpoint over HTTP with OpenAI's completions API, requests batched together (docs/serving.md)"
FORMATTER = "defaults"  # cli.py: --help shows every default
API_KEY_VARIABLE = "FREE_TRANSFORMER_API_KEY"


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                        help="weights and KV cache while decoding: auto is bf16 on a CUDA device that supports it, "
                             "else fp32")
    parser.add_argument("--model-name", help="the model's id in the API (default: the name of the directory given)")
    parser.add_argument("--api-key", help=f"clients must send 'Authorization: Bearer KEY' (default: the environment "
                                          f"variable {API_KEY_VARIABLE}; unset: no key)")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                        help="completions decoded together, each step (each holds a KV cache of the model's context)")
    parser.add_argument("--latents", choices=CONTEXT_LATENTS, default=CONTEXT_LATENTS[0],
                        help="Z of a request that names none: the prompt's from the encoder, or every Z from the "
                             "prior (what a log-likelihood through echo should use: docs/serving.md)")
    parser.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_MB,
                        help="largest request body read, in MiB")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a one-line UserError (an unknown host, a port in use or not allowed)."""
    if not 0 <= port < 2**16:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise UserError(f"--host {host!r} is not an address of this machine's: {error}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def run(args) -> int:
    from ..base.devices import decoding_dtype, parse_device
    from ..data.tokenizer import get_tokenizer
    from ..runs.checkpoint import load_model

    try:
        import uvicorn

        from ..serve.app import build_app
        from ..serve.engine import Engine
    except ImportError as error:
        if error.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
            raise
        raise UserError(f"serve needs fastapi and uvicorn: {install_hint('serve')}") from None
    if args.max_batch < 1 or not args.max_request_mb > 0:
        raise UserError(f"--max-batch must be >= 1 and --max-request-mb > 0, got {args.max_batch} and "
                        f"{args.max_request_mb}")
    sock = listening_socket(args.host, args.port)
    device = parse_device(args.device)
    model, config = load_model(args.checkpoint, device)
    model = model.to(decoding_dtype(args.dtype, device))
    name = args.model_name or Path(args.checkpoint).resolve().name
    engine = Engine(model, get_tokenizer(config.get("tokenizer", "byte")), name, max_batch=args.max_batch,
                    latents=args.latents)
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    app = build_app(engine, api_key=api_key, max_body_bytes=int(args.max_request_mb * 2**20))
    port = sock.getsockname()[1]
    print(f"serving {name!r} at http://{args.host}:{port}/v1 (up to {args.max_batch} completions batched"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0
