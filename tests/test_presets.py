"""Presets: one registry type (base/presets.py) for every kind, each preset with its recorded values, each
building a valid config, and every kind listed by `info --presets` and read by the commands' --help. The
training configs the demo's and the study's presets resolve to are compared in test_unchanged.py."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from free_transformer import NAMED_CONFIGS, ConfigError, FreeTransformer, named_config
from free_transformer.base.presets import Presets
from free_transformer.cli import main
from free_transformer.commands.info import PRESET_KINDS, yaml_summary
from free_transformer.experiments.demo.presets import PRESETS as DEMO_PRESETS
from free_transformer.experiments.demo.run import VARIANTS, demo_sweep
from free_transformer.experiments.study.presets import PRESETS as STUDY_PRESETS
from free_transformer.experiments.study.presets import StudyPlan
from free_transformer.train.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
# Each preset's values as recorded from the code before presets had one registry: a model size's config;
# a demo or study preset's settings besides its config function, and a study preset's description.
RECORDED = json.loads((ROOT / "tests" / "golden" / "presets.json").read_text())
KINDS = {"model": NAMED_CONFIGS, "demo": DEMO_PRESETS, "study": STUDY_PRESETS}


def _recorded_fields(kind: str, name: str, fields: dict) -> dict:
    """The preset's `fields` as JSON holds them (tuples as lists), a section's recorded fields only; None for
    a field it lacks."""
    value = KINDS[kind][name]
    values = value.to_dict() if kind == "model" else {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if kind == "study":
        values["about"] = STUDY_PRESETS.about(name)

    def recorded(values: dict, fields: dict) -> dict:
        return {
            field: recorded(values.get(field) or {}, sub) if isinstance(sub, dict) else values.get(field)
            for field, sub in fields.items()
        }

    return json.loads(json.dumps(recorded(values, fields)))


def test_every_preset_is_recorded():
    assert sorted(RECORDED) == sorted(f"{kind}/{name}" for kind, presets in KINDS.items() for name in presets)


@pytest.mark.parametrize("key", list(RECORDED))
def test_every_preset_keeps_its_recorded_values(key):
    """Every recorded value is unchanged; a field added since takes its default and is not compared."""
    kind, name = key.split("/")
    assert _recorded_fields(kind, name, RECORDED[key]) == RECORDED[key]


def test_an_unknown_preset_is_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError) as raised:
        DEMO_PRESETS["fast"]
    assert str(raised.value) == "unknown demo preset 'fast'; choose one of quick, paper, narrow, smoke"
    with pytest.raises(ConfigError, match="unknown model size 'gigantic'; choose one of debug, cpu-small, paper-1.5b"):
        load_train_config(None, ["model.size=gigantic"])
    with pytest.raises(ConfigError, match="unknown study preset 'tpu'"):
        STUDY_PRESETS.about("tpu")


def test_a_registry_is_a_read_only_mapping():
    sizes = Presets("size", {"small": (1, "one"), "large": (2, "two")})
    assert list(sizes) == ["small", "large"] and len(sizes) == 2 and dict(sizes.items()) == {"small": 1, "large": 2}
    assert "small" in sizes and "medium" not in sizes and sizes.get("medium") is None and sizes.get("large") == 2
    assert sizes.about("large") == "two" and sizes.help() == "small: one; large: two"
    with pytest.raises(TypeError):
        sizes["medium"] = 3
    for about in ("", "two\nlines"):
        with pytest.raises(ValueError, match="one non-empty line"):
            Presets("size", {"small": (1, about)})


def test_named_config_is_the_registrys_size_with_overrides():
    assert named_config("debug") == NAMED_CONFIGS["debug"]
    assert named_config("debug", dim=64) == NAMED_CONFIGS["debug"].replace(dim=64)


def test_a_demo_or_study_preset_is_registered_under_its_own_name():
    for presets in (DEMO_PRESETS, STUDY_PRESETS):  # the name a report records is the one the command takes
        assert all(presets[name].name == name for name in presets)


@pytest.mark.parametrize("name", list(NAMED_CONFIGS))
def test_every_model_size_builds(name):
    config = NAMED_CONFIGS[name]
    with torch.device("meta"):
        model = FreeTransformer(config)
    assert model.num_params() == config.num_params()


@pytest.mark.parametrize("name", list(DEMO_PRESETS))
def test_every_demo_preset_builds_a_valid_config_per_variant(name):
    sweep = demo_sweep(DEMO_PRESETS[name], Path("runs"))
    for variant in VARIANTS:
        config = sweep.train_config(variant, 0)
        assert config.validate() is config
        if variant.kappa_bits is None:
            assert not config.model.is_free
        else:
            assert config.model.is_free and config.kappa_bits == variant.kappa_bits


@pytest.mark.parametrize("name", list(STUDY_PRESETS))
def test_every_study_preset_builds_a_valid_config_per_variant(name):
    preset = STUDY_PRESETS[name]
    plan = StudyPlan(preset, Path("runs"), tuple(range(preset.seeds)), preset.kappas)
    for variant in plan.variants():
        config = plan.train_config(variant, 0)
        assert config.validate() is config
        if variant.kappa_bits is None:  # a baseline; the matched one has one more block
            assert not config.model.is_free
            assert config.model.n_layers == preset.config().model.n_layers + variant.matched
        else:
            assert config.model.is_free and config.kappa_bits == variant.kappa_bits


def test_info_lists_every_registry_in_the_package():
    """A registry made anywhere in the package (a `Presets("kind", ...)` call) is one that info lists."""
    made = set()
    for path in (ROOT / "src" / "free_transformer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Presets":
                made.add(node.args[0].value)
    assert made == {presets.kind for presets, _ in PRESET_KINDS} == {"model size", "demo preset", "study preset"}


def test_info_presets_lists_every_preset_and_yaml_config(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["info", "--presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for presets, _ in PRESET_KINDS:
        for name in presets:
            assert any(line.split() == [name, *presets.about(name).split()] for line in lines), name
    yamls = sorted((ROOT / "configs").glob("*.yaml"))
    assert yamls
    for path in yamls:
        assert any(line.split() == [path.name, *yaml_summary(path).split()] for line in lines), path.name


def test_a_yaml_configs_summary_is_its_opening_sentence(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text(
        "# Letters, one model: small.\n# More prose.\n#   free-transformer train --config a.yaml\n"
        "model:\n  size: debug\n"
    )
    assert yaml_summary(path) == "Letters, one model: small."
    path.write_text("# Fine-tune a model\n# (see docs/huggingface.md):\n#   free-transformer convert x y\nsteps: 1\n")
    assert yaml_summary(path) == "Fine-tune a model (see docs/huggingface.md)"
    assert yaml_summary(ROOT / "configs" / "letters-free.yaml").startswith("The paper's synthetic letters")


def test_info_without_a_size_or_presets_is_one_line(capsys):
    assert main(["info"]) == 2
    assert "give a model size or --presets" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, presets", [("demo", DEMO_PRESETS), ("study", STUDY_PRESETS), ("info", NAMED_CONFIGS)]
)
def test_a_commands_help_gives_every_preset_and_its_description(command, presets, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines between words and after hyphens
    for name in presets:
        assert "".join(f"{name}: {presets.about(name)}".split()) in text, name
