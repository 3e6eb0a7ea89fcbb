"""`free-transformer inspect RUN`: what a run's latent does, from its logged measures."""

from __future__ import annotations

NAME = "inspect"
HELP = "summarise a run: losses, and for a Free Transformer the bits Z saves, KL per bit, collapse warnings"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="run directory")
    parser.add_argument("--history", type=int, default=8, help="evaluations of the bits Z saves to list")


def run(args) -> int:
    from ..train.summary import summarize_run

    if args.history < 1:
        raise ValueError("--history must be >= 1")
    print(summarize_run(args.run_dir, history=args.history))
    return 0
