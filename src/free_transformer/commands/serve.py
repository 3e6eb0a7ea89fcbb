"""`free-transformer serve`: a checkpoint behind OpenAI's completions API (docs/serving.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..base.devices import DTYPE_NAMES
from ..base.errors import UserError
from ..base.install import install_hint

NAME = "serve"
HELP = "serve a checkpoint over HTTP with OpenAI's completions API, one request at a time (docs/serving.md)"
FORMATTER = "defaults"  # cli.py: --help shows every default


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                        help="weights and KV cache while decoding: auto is bf16 on a CUDA device that supports it, "
                             "else fp32")
    parser.add_argument("--model-name", help="the model's id in the API (default: the name of the directory given)")


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
    if not 0 <= args.port < 2**16:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    device = parse_device(args.device)
    model, config = load_model(args.checkpoint, device)
    model = model.to(decoding_dtype(args.dtype, device))
    name = args.model_name or Path(args.checkpoint).resolve().name
    app = build_app(Engine(model, get_tokenizer(config.get("tokenizer", "byte")), name))
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1 (one request at a time)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port)
    return 0
