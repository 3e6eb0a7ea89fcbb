"""`free-transformer inspect RUN`: what a run's latent does, from its logged measures."""

from __future__ import annotations

NAME = "inspect"
HELP = (
    "summarise a run: losses, and for a Free Transformer the bits Z saves, KL per bit, collapse warnings; for a run "
    "of free-transformer rl, what it trained and its reward and KL"
)


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="run directory")
    parser.add_argument(
        "--history", type=int, default=8, help="evaluations of the bits Z saves (an rl run: logged steps) to list"
    )


def run(args) -> int:
    from pathlib import Path

    from ..train.rl.summary import rl_section, summarize_rl_run
    from ..train.summary import summarize_run

    if args.history < 1:
        raise ValueError("--history must be >= 1")
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file() and rl_section(run_dir) is not None:  # a run of free-transformer rl
        print(summarize_rl_run(run_dir, history=args.history))
    else:
        print(summarize_run(run_dir, history=args.history))
    return 0
