"""The package's layers (docs/design.md's Layout): each folder of src/free_transformer is a layer, and a module
imports only from its own layer and the layers that layer is declared to build on. A new import up, or
across to a layer not below, fails here with the file, the line and the layer it reached."""

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "free_transformer"

# Each layer and the layers it may import from (besides itself), lowest first.
LAYERS = {
    "base": set(),
    "data": {"base"},
    "model": {"base"},
    "runs": {"base", "model"},
    "inference": {"base", "model"},
    "analysis": {"base", "model"},
    "distributed": {"base", "model", "runs"},
    "eval": {"base", "data", "model", "runs", "inference", "analysis"},
    "train": {"base", "data", "model", "runs", "inference", "analysis", "distributed", "eval"},
    "hf": {"base", "data", "model", "runs", "inference"},
    "serve": {"base", "data", "model", "runs", "inference"},
    "reports": {"base", "eval", "train"},
    "experiments.launch": {"base", "data", "model", "runs", "distributed", "train"},
    "experiments.demo": {"base", "data", "model", "runs", "inference", "analysis", "train", "experiments.launch"},
    "experiments.study": {
        "base",
        "data",
        "model",
        "runs",
        "inference",
        "analysis",
        "eval",
        "train",
        "experiments.launch",
    },
    "commands": None,  # the command line may import any layer
}
TOP = {"__init__", "cli", "experiments"}  # the public API, the command-line entry point, a folder of layers


def layer_of(module: str) -> str:
    """The layer of a package-relative module name: "experiments.demo.run" -> "experiments.demo"."""
    parts = module.split(".")
    for depth in (2, 1):
        if ".".join(parts[:depth]) in LAYERS:
            return ".".join(parts[:depth])
    if module in TOP or module == "":
        return "__top__"
    raise AssertionError(f"{module}: in no layer; add its folder to LAYERS and to docs/design.md's Layout")


def imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, package-relative module) for every import of this package in `path`."""
    module_parts = list(path.relative_to(root).with_suffix("").parts)
    package = module_parts[:-1]  # a package's __init__ sits in the package it names
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = [*base, *(node.module.split(".") if node.module else [])]
            names = [a.name for a in node.names] if node.module is None else [""]
            found += [(node.lineno, ".".join(p for p in [*target, name] if p)) for name in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "free_transformer":
            found.append((node.lineno, node.module.partition(".")[2]))
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name.partition(".")[2])
                for a in node.names
                if a.name.split(".")[0] == "free_transformer"
            ]
    return found


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def up_imports(root: Path = PACKAGE) -> list[str]:
    wrong = []
    for path in sorted(root.rglob("*.py")):
        here = layer_of(module_name(path, root))
        allowed = LAYERS.get(here)
        if here == "__top__" or allowed is None:
            continue
        for line, target in imports(path, root):
            there = layer_of(target)
            if there != here and there not in allowed:
                wrong.append(
                    f"{path.relative_to(root)}:{line} ({here}) imports {target or 'free_transformer'} ({there})"
                )
    return wrong


def test_every_module_imports_only_from_its_own_layer_or_the_layers_below():
    assert up_imports() == []


def import_circle(root: Path = PACKAGE) -> list[str] | None:
    """A circle of imports between the package's modules, or None. Every import counts, at module level or
    inside a function (a deferred import that closes a circle still runs a module half made, as soon as the
    function is called). An import names a module, or a package whose `__init__` it runs; `from pkg import
    name` counts as an import of `pkg.name` where that is a module."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, target in imports(path, root):
            while target not in modules and "." in target:  # a name imported from a module: the module
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                graph[name].add(target)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return None


def test_no_module_imports_itself_through_others():
    assert import_circle() is None


def test_an_import_circle_is_found(tmp_path):
    copy = tmp_path / "free_transformer"
    (copy / "model" / "latent").mkdir(parents=True)
    (copy / "model" / "__init__.py").write_text("")
    (copy / "model" / "config.py").write_text("def kinds():\n    from .latent import KINDS\n")  # deferred
    (copy / "model" / "latent" / "__init__.py").write_text("from .ternary import Ternary\n")
    (copy / "model" / "latent" / "ternary.py").write_text("from ..config import kinds\n")
    assert set(import_circle(copy) or ()) == {"model.config", "model.latent", "model.latent.ternary"}
    (copy / "model" / "config.py").write_text("")
    assert import_circle(copy) is None


def test_every_folder_is_a_declared_layer():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders |= {f"experiments.{p.name}" for p in (PACKAGE / "experiments").iterdir() if (p / "__init__.py").is_file()}
    assert folders - {"experiments"} == set(LAYERS)  # experiments holds three layers, nothing else
    assert not [p.name for p in (PACKAGE / "experiments").glob("*.py") if p.name != "__init__.py"]


def test_the_layer_order_has_no_circle():
    order = []

    def visit(layer, path=()):
        assert layer not in path, f"a circle: {' -> '.join([*path, layer])}"
        for below in sorted(LAYERS[layer] or ()):
            visit(below, (*path, layer))
        order.append(layer)

    for layer in LAYERS:
        visit(layer)


@pytest.mark.parametrize(
    "line",
    [
        "from ..train.config import TrainConfig\n",
        "from ..experiments.demo import run\n",
        "import free_transformer.cli\n",
        "from .. import cli\n",
    ],
)
def test_an_import_up_is_found(tmp_path, line):
    """The check catches each form of import: relative, absolute, and `from .. import module`."""
    copy = tmp_path / "free_transformer"
    (copy / "model").mkdir(parents=True)
    (copy / "model" / "__init__.py").write_text("")
    (copy / "model" / "extra.py").write_text(line)
    assert len(up_imports(copy)) == 1


def test_the_model_folder_holds_only_the_model():
    """model/ holds the model: its modules, its config, its loss and its latent spaces. What reads what
    earlier code wrote lives in runs/migrations.py (one adapter for every loader), and what measures a
    user's sizes against the machine in runs/memory.py (called by the entry points)."""
    model = PACKAGE / "model"
    assert not [p.name for p in model.rglob("*.py") if "migration" in p.stem or "state_names" in p.stem]
    compat = [  # the package's compatibility shims: read at the entry points, never by the model
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(model.rglob("*.py"))
        for line, target in imports(path)
        if target.startswith("base.compat")
    ]
    assert compat == []
    found = [  # a migration (upgrade_*, LEGACY_* names) or a look at the machine's memory
        f"{path.relative_to(PACKAGE)}: {word}"
        for path in sorted(model.rglob("*.py"))
        for word in ("upgrade_", "LEGACY_", "sysconf")
        if word in path.read_text(encoding="utf-8")
    ]
    assert found == []


# File names several packages share because each holds the same job for its own package: its config dataclasses
# (config.py, eval's settings.py beside base's settings machinery), its error types, its training loop
# (trainer.py: next-token training, RL over Z or tokens), its run at a glance for `inspect` (summary.py: a training
# run, an rl run) and each experiment's presets, run and report. The command line's modules are named after their
# subcommands (commands/generate.py runs inference/generate.py's generate()).
SHARED_JOBS = {
    "__init__.py",
    "config.py",
    "settings.py",
    "errors.py",
    "presets.py",
    "run.py",
    "report.py",
    "trainer.py",
    "summary.py",
}


def test_no_two_modules_of_different_jobs_share_a_file_name():
    """A module's file name says its job: two files of one name (an engine that decodes and one that plans a request,
    three sampling.py) make a reader open the wrong one."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "commands":
            continue
        seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1 and name not in SHARED_JOBS}
    assert not shared, shared
