"""Extensions from outside the package in a command-line process: the modules named in the environment variable
FREE_TRANSFORMER_PLUGINS (comma-separated, importable from sys.path / PYTHONPATH) are imported before the
command's arguments are read. A module registers what it defines as it is imported: a latent kind with its
settings (`register_latent_kind`), a benchmark (`eval.tasks.register`). The variable is read by every
`free-transformer` process alike (train, its --resume, convert, generate, serve, torchrun's workers), so a
run of a plugin's kind is read back wherever it is set. In Python, import the module instead."""

from __future__ import annotations

import importlib
import os

from .errors import UserError

PLUGINS_VARIABLE = "FREE_TRANSFORMER_PLUGINS"


class PluginError(UserError):
    """A module named in FREE_TRANSFORMER_PLUGINS that cannot be imported."""


def plugin_modules(environ=os.environ) -> list[str]:
    """The module names FREE_TRANSFORMER_PLUGINS lists, in order."""
    return [name.strip() for name in environ.get(PLUGINS_VARIABLE, "").split(",") if name.strip()]


def load_plugins(environ=os.environ) -> list[str]:
    """Import each module FREE_TRANSFORMER_PLUGINS names (once: Python keeps the modules imported); a module
    that cannot be imported is one PluginError naming it. Returns the names."""
    names = plugin_modules(environ)
    for name in names:
        try:
            importlib.import_module(name)
        except SystemExit as error:  # sys.exit(0) at import made every command exit 0 having done nothing
            raise PluginError(f"{PLUGINS_VARIABLE}: cannot import {name}: it called sys.exit({error.code!r})") from None
        except Exception as error:  # any failure of a user's module is theirs to fix: one line naming it
            detail = " ".join(f"{type(error).__name__}: {error}".split())
            raise PluginError(f"{PLUGINS_VARIABLE}: cannot import {name}: {detail}") from error
    return names
