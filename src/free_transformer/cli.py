"""`free-transformer` command line: one subcommand per module in free_transformer.commands.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`. Errors
that a user can fix (bad config, corrupt checkpoint, bad data, a path that cannot be read or written)
are printed as one line with exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .base.compat import OPTIONS_RENAMED
from .base.errors import Stopped, UserError
from .base.plugins import PluginError, load_plugins

COMMAND_MODULES = [
    "demo",
    "study",
    "train",
    "rl",
    "inspect",
    "generate",
    "eval",
    "compare",
    "info",
    "convert",
    "consolidate",
    "tokenize",
    "serve",
]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, once: not for options without one (None, a flag's False, an
    empty value) nor where the help already says it."""

    def _get_help_string(self, action) -> str | None:
        if (
            action.default is None
            or action.default is False
            or action.default in ("", [])
            or "default" in (action.help or "")
        ):
            return action.help
        return super()._get_help_string(action)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or where `argv` names one, of that command alone: only its module is
    imported, and none imports torch before its command runs (`train --help` stays fast)."""
    from .base.version import __version__

    parser = argparse.ArgumentParser(prog="free-transformer", description="The Free Transformer (Fleuret, 2025).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    named = next((word for word in argv or [] if not word.startswith("-")), None)
    for module_name in [named] if named in COMMAND_MODULES else COMMAND_MODULES:
        module = importlib.import_module(f"free_transformer.commands.{module_name}")
        formatter = (
            DefaultsHelpFormatter
            if getattr(module, "FORMATTER", None) == "defaults"
            else argparse.RawDescriptionHelpFormatter
        )
        sub = subparsers.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.HELP,
            epilog=module.epilog(argv or []) if hasattr(module, "epilog") else getattr(module, "EPILOG", None),
            formatter_class=formatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None):
    """parse_args, except that section.field=value overrides may also come after options (`train a=1 --out
    D b=2`): argparse takes one run of positionals and rejects the rest as unrecognized. An option renamed
    since 0.3, and a setting written as an option (`--optim.lr=3e-4`), are refused in one line that gives
    the spelling to use."""
    words = sys.argv[1:] if argv is None else argv
    for word in words:
        flag = word.partition("=")[0]
        if flag in OPTIONS_RENAMED:
            parser.exit(2, f"error: {flag} is {OPTIONS_RENAMED[flag]} since 0.4\n")
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]  # later ones win, as on the command line
    elif extra:
        dashed = next((k for k, word in enumerate(extra) if word.startswith("--") and "." in word.split("=")[0]), None)
        if dashed is not None and hasattr(args, "overrides"):
            name, equals, value = extra[dashed].removeprefix("--").partition("=")
            after = extra[dashed + 1 : dashed + 2]  # `--optim.lr 3e-4`: its value is the next word
            value = value if equals else (after[0] if after and not after[0].startswith("-") else "VALUE")
            parser.exit(
                2,
                f"error: unrecognized argument {extra[dashed]}: settings are written without dashes, "
                f"as section.field=value: {name}={value}\n",
            )
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        load_plugins()  # FREE_TRANSFORMER_PLUGINS: kinds and tasks from outside the package, before any name is read
    except PluginError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    args = parse_args(build_parser(sys.argv[1:] if argv is None else argv), argv)
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a reader that stopped is found here, not in the interpreter's last flush
        return code
    except BrokenPipeError:  # the reader of stdout stopped (`generate | head`): no error, as for any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit flush must not fail again
        return 141  # 128 + SIGPIPE, as a shell reports a writer the closed pipe stopped
    except (UserError, ValueError, OSError) as error:  # OSError: a path that cannot be read or written
        if isinstance(error, Stopped):  # a saved, resumable stop is no error; under torchrun rank 0 says it
            from .distributed.env import is_main_process

            if is_main_process():
                print(" ".join(str(error).split()), file=sys.stderr)
        else:
            print("error: " + " ".join(str(error).split()), file=sys.stderr)  # always one line
        return getattr(error, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
