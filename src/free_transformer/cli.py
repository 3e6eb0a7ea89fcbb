"""`free-transformer` command line: one subcommand per module in free_transformer.commands.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`. Errors
that a user can fix (bad config, corrupt checkpoint, bad data) are printed as one line with exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import Stopped, UserError

COMMAND_MODULES = ["demo", "train", "generate", "eval", "compare", "info", "convert", "consolidate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="free-transformer", description="The Free Transformer (Fleuret, 2025).")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(f"free_transformer.commands.{module_name}")
        sub = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as error:
        prefix = "" if isinstance(error, Stopped) else "error: "  # a saved, resumable stop is no error
        print(prefix + " ".join(str(error).split()), file=sys.stderr)  # always one line
        return getattr(error, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
