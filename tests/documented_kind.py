"""docs/latent-variants.md's latent kind with settings of its own, in one file ("A kind with settings, in one
file"): its source as the reader saves it, `ternary_kind.py`, and that module imported in this process, which
registers the kind `ternary` as a plugin does. The contract test checks it, test_latent_plugin.py runs it from
the command line, test_docs.py gives it to the page's commands."""

from __future__ import annotations

import sys
import types
from pathlib import Path

PAGE = Path(__file__).parents[1] / "docs" / "latent-variants.md"
MODULE = "ternary_kind"


def documented_kind_source() -> str:
    """The page's Python block under its heading "A kind with settings, in one file"."""
    section = PAGE.read_text(encoding="utf-8").split("## A kind with settings, in one file", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def import_documented_kind() -> types.ModuleType:
    """The block as the module `ternary_kind` (imported once: its kind registers once)."""
    if MODULE not in sys.modules:
        module = types.ModuleType(MODULE)
        sys.modules[MODULE] = module
        exec(compile(documented_kind_source(), f"{MODULE}.py (docs/latent-variants.md)", "exec"), module.__dict__)
    return sys.modules[MODULE]
