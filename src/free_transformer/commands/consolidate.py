"""`free-transformer consolidate`: a sharded (DCP) checkpoint of a ddp / fsdp run -> model.safetensors."""

from __future__ import annotations

NAME = "consolidate"
HELP = (
    "gather the sharded (DCP) checkpoint of a ddp / fsdp run into model.safetensors, so that generate, "
    "eval and convert read it; no process group needed"
)


def add_arguments(parser) -> None:
    parser.add_argument("path", help="run directory (its newest checkpoint) or a step_* checkpoint directory")
    parser.add_argument(
        "--out",
        "-o",
        help="write a new checkpoint directory (model.safetensors + config.json) here instead of "
        "adding model.safetensors next to the shards",
    )


def run(args) -> int:
    from ..distributed.sharded_checkpoint import consolidate

    target = consolidate(args.path, args.out)
    print(f"consolidated: {target / 'model.safetensors'}")
    return 0
