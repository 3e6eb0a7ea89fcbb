"""`--help` is read without loading torch (nor numpy): the settings, their types and defaults come from
dataclasses that import neither, and each command imports its heavy modules when it runs. Checked in a
fresh interpreter, by what it imported, not by a timing."""

import subprocess
import sys

import pytest

from free_transformer.cli import COMMAND_MODULES

HEAVY = ("torch", "numpy", "transformers", "fastapi")


@pytest.mark.parametrize(
    "argv",
    [[command, "--help"] for command in COMMAND_MODULES] + [["--help"]],
    ids=[*COMMAND_MODULES, "free-transformer"],
)
def test_help_does_not_import_torch(argv):
    script = (
        "import contextlib, io, sys\n"
        "from free_transformer.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        f"    main({argv!r})\n"
        "assert 'usage: free-transformer' in out.getvalue()\n"
        f"print(','.join(name for name in {HEAVY!r} if name in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{' '.join(argv)} imported {done.stdout.strip()}"


def test_the_package_imports_without_torch_and_loads_it_on_first_use():
    script = (
        "import sys, free_transformer\n"
        "assert 'torch' not in sys.modules\n"
        "assert free_transformer.GenerationConfig(top_k=3).top_k == 3 and 'torch' not in sys.modules\n"
        "free_transformer.FreeTransformer\n"
        "assert 'torch' in sys.modules\n"
        "from free_transformer import *\n"
        "assert sorted(free_transformer.__all__) == free_transformer.__all__ and 'load_model' in dir()"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_device_and_dtype_are_declared_once_for_every_command():
    """--device and --dtype of every command that takes them are Placement's fields: one help, one default."""
    import argparse

    from free_transformer.base.devices import Placement
    from free_transformer.base.settings import field_docs
    from free_transformer.cli import build_parser

    docs = field_docs(Placement)
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    seen = {}
    for name, parser in commands.items():
        for action in parser._actions:
            option = next(
                (o for o in action.option_strings if o in ("--device", "--dtype") and name != "convert"), None
            )
            if option is not None:  # convert's --dtype casts the weights it writes: another setting
                seen.setdefault(option, []).append(name)
                assert action.help.startswith(docs[option[2:]]) and action.default == "auto", (name, option)
    assert sorted(seen["--device"]) == ["demo", "eval", "generate", "serve", "study"]
    assert sorted(seen["--dtype"]) == ["generate", "serve"]
