"""`free-transformer serve`: a checkpoint behind OpenAI's completions API (docs/serving.md)."""

from __future__ import annotations

import gc
import os
import socket
import sys
from dataclasses import fields
from pathlib import Path

from ..base.errors import UserError
from ..base.install import install_hint
from ..base.latent_choice import LatentChoice
from ..base.settings import add_option
from ..serve.config import ServeConfig
from .arguments import checked_options

NAME = "serve"
HELP = "serve a checkpoint over HTTP with OpenAI's completions API, requests batched together (docs/serving.md)"
API_KEY_VARIABLE = "FREE_TRANSFORMER_API_KEY"

# the defaults this command resolves when the option is left out (run), as its help says them
RESOLVED_DEFAULTS = {
    "model_name": "the name of the directory given",
    "api_key": f"the environment variable {API_KEY_VARIABLE}",
}
METAVARS = {"port": "PORT", "api_key": "KEY"}  # KEY: as the help writes it; an int is N unless named


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    for item in fields(ServeConfig):
        add_option(
            parser,
            ServeConfig,
            item.name,
            metavar=METAVARS.get(item.name),
            default_help=RESOLVED_DEFAULTS.get(item.name, ""),
        )


def serve_config(args) -> ServeConfig:
    """The options as the ServeConfig they stand for, checked: a bad value is one line naming its option."""
    return checked_options(ServeConfig(**{item.name: getattr(args, item.name) for item in fields(ServeConfig)}))


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (a port ServeConfig.check allows), or a one-line UserError (an unknown
    host, a port in use or not allowed to this user)."""
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
    config = serve_config(args)
    from ..base.devices import decoding_dtype, parse_device
    from ..data.tokenizer import get_tokenizer
    from ..inference.latents import refuse_without_policy
    from ..runs.checkpoint import load_model
    from ..runs.memory import allocating, check_cache_fits

    try:
        import uvicorn

        from ..serve.app import build_app
        from ..serve.request_plan import Engine
    except ImportError as error:
        if error.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
            raise
        raise UserError(f"serve needs fastapi and uvicorn: {install_hint('serve')}") from None
    sock = listening_socket(config.host, config.port)
    device = parse_device(config.device)
    model, recorded = load_model(args.checkpoint, device)  # recorded: the checkpoint's config.json
    if config.latents == LatentChoice.POLICY:  # every request naming no latents would be refused
        try:
            refuse_without_policy(model, "--latents")
        except ValueError as error:
            raise UserError(str(error)) from None
    model = model.to(decoding_dtype(config.dtype, device))
    # the batcher allocates a KV cache of max_batch rows of the model's whole context
    cache_dtype, context = model.embed_tokens.weight.dtype, model.config.max_seq_len
    check_cache_fits(model.config, config.max_batch, context, cache_dtype, device, hint="lower --max-batch")
    name = config.model_name or Path(args.checkpoint).resolve().name
    compile = config.compiles(device.type)
    with allocating(f"a KV cache of {config.max_batch:,} rows of {context:,} positions (lower --max-batch)"):
        engine = Engine(
            model,
            get_tokenizer(recorded.get("tokenizer", "byte")),
            name,
            max_batch=config.max_batch,
            latents=config.latents,
            compile=compile,
        )
    if compile:
        from .generate import say_compile_times

        say_compile_times()
        print(
            "compiling the decoding step for batches of "
            f"{', '.join(map(str, engine.batcher.engine.runner.buckets))} rows",
            file=sys.stderr,
            flush=True,
        )
        engine.batcher.engine.warm_up()
    api_key = config.api_key or os.environ.get(API_KEY_VARIABLE) or None
    app = build_app(engine, api_key=api_key, max_body_bytes=config.max_request_bytes, chat_queue=config.chat_queue)
    port = sock.getsockname()[1]
    print(
        f"serving {name!r} at http://{config.host}:{port}/v1 (up to {config.max_batch} completions batched"
        f"{', API key required' if api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    # What the start made (torch, transformers, the model: hundreds of thousands of objects, alive to the end) is
    # left out of the collector's passes: a full pass over it held the GIL for 1 s under a flood of chats.
    gc.collect()
    gc.freeze()
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0
