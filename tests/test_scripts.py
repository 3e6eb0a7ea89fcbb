"""Every script of scripts/ imports what it names, so that a rename in the package cannot break one unseen (the
scripts run on trained runs or a GPU; their own tests, where they have one, run them: test_search.py,
test_gpu_check.py, ...)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_the_script_imports(script):
    spec = importlib.util.spec_from_file_location(f"script_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # its imports and definitions; main() is not run
