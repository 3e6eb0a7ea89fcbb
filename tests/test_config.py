"""The one config system: every setting in `--help` with its type, default and docstring; `--print-config`
gives a file that loads back to the same config and trains to the same losses; the names of settings
renamed before 0.3 are refused with today's; `eval`'s flags are the config's `eval` section."""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import TINY, legacy_run_in_todays_names
from conftest import run_losses as _losses

from free_transformer import ModelConfig
from free_transformer.base import settings
from free_transformer.base.checks import ConfigError
from free_transformer.base.compat import SETTINGS_RENAMED
from free_transformer.cli import build_parser, main
from free_transformer.commands.eval import _settings as eval_flags_settings
from free_transformer.distributed.env import is_main_process
from free_transformer.eval.settings import EvalConfig
from free_transformer.train.config import TrainConfig, load_train_config

ROOT = Path(__file__).parent.parent
LEGACY_RUN = Path(__file__).parent / "data" / "legacy-run"  # written by 0.1, with eval_every and eval_batches
SOME = [
    "model.latent_units=3",
    "optim.lr=3e-3",
    "optim.betas=[0.8,0.9]",
    "kappa_bits=0.125",
    "validate_every=2",
    "eval.tasks=arc_easy",
    "eval.limit=3",
    "data.kind=coinflip",
    "data.coinflip.length=12",
]


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


def _printed(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _keys(values: dict, prefix: str = "") -> list[str]:
    """The dotted paths of a nested mapping's leaves."""
    return [
        path
        for key, value in values.items()
        for path in (_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key])
    ]


def test_train_help_shows_every_setting_that_print_config_prints(capsys):
    text = _help(capsys, "train")
    yaml_keys = set(_keys(yaml.safe_load(_printed(capsys, "train", "--print-config"))))
    assert yaml_keys == set(settings.flat(TrainConfig())) and len(yaml_keys) > 70
    for key in yaml_keys:
        assert f"  {key}=" in text, key
    assert "  optim.lr=0.001  (float)\n      Peak learning rate (AdamW)." in text
    assert "  eval.latents=prior  (encoder | prior | policy)" in text
    assert "  model.size=cpu-small  (debug | cpu-small" in text  # the named sizes, besides the fields
    assert "eval_every" not in text and "old names" not in text  # settings renamed before 0.3 are gone


@pytest.mark.parametrize("command", ["demo", "study"])
def test_demo_and_study_help_list_the_settings_their_overrides_set(capsys, command):
    text = _help(capsys, command)
    for key in settings.flat(TrainConfig()):
        assert f"  {key}=" in text, key


def test_every_setting_has_a_docstring():
    undocumented = [item.path for item in settings.describe(TrainConfig()) if not item.doc]
    assert undocumented == []


def test_print_config_loads_back_to_the_same_config(capsys, tmp_path):
    text = _printed(capsys, "train", "--print-config", *TINY, *SOME)
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_train_config(path) == load_train_config(None, TINY + SOME)
    assert _printed(capsys, "train", "--print-config", "-c", str(path)) == text  # and prints the same again


def test_print_config_says_what_a_special_value_means(capsys):
    """`threads: 0` alone says nothing: the printed config carries the meaning its docstring gives, as a comment
    that loading ignores; a saved config.yaml carries none."""
    text = _printed(capsys, "train", "--print-config", *TINY)
    assert "\nthreads: 0  # torch's default\n" in text and "\nvalidate_every: 0  # never\n" in text
    assert "    workers: 0  # min(CPU count, 8)\n" in text  # data.text.workers: to the matching parenthesis
    assert "\nsteps: 1000\n" in text  # nothing where the docstring gives no meaning of the value
    assert "#" not in settings.to_yaml(TrainConfig())


def test_print_config_of_a_resume_is_the_runs_config_with_the_overrides(capsys, tmp_path):
    run = legacy_run_in_todays_names(tmp_path)
    text = _printed(capsys, "train", "--out", str(run), "--resume", "--print-config", "steps=6")
    assert yaml.safe_load(text)["steps"] == 6 and yaml.safe_load(text)["model"]["latent_units"] == 3
    assert not (run / "config-changes.jsonl").exists()  # printing trains nothing and records nothing


def test_a_printed_config_trains_to_the_same_first_losses(capsys, tmp_path):
    overrides = [*TINY, "steps=3", "model.latent_units=3", "optim.lr=3e-3", "kappa_bits=0.125"]
    path = tmp_path / "printed.yaml"
    path.write_text(_printed(capsys, "train", "--print-config", *overrides))
    assert main(["train", "--out", str(tmp_path / "direct"), *overrides]) == 0
    assert main(["train", "--out", str(tmp_path / "printed"), "-c", str(path)]) == 0
    assert _losses(tmp_path / "printed") == _losses(tmp_path / "direct") and len(_losses(tmp_path / "direct")) == 3


@pytest.mark.parametrize("command", ["demo", "study"])
def test_demo_and_study_print_every_runs_config(capsys, tmp_path, command):
    preset = ["--preset", "smoke"] if command == "study" else []
    text = _printed(
        capsys, command, "--print-config", "--out", str(tmp_path / "out"), *preset, "--seeds", "2", "steps=7"
    )
    documents = text.split("---\n")
    assert len(documents) == (2 * 4 if command == "study" else 2 * 6)  # every variant of every seed
    for document in documents:
        path = tmp_path / "one.yaml"
        path.write_text(document)
        assert document.startswith(f"# {tmp_path / 'out'}")
        assert load_train_config(path).steps == 7
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("old", list(SETTINGS_RENAMED))
def test_a_setting_renamed_before_0_3_is_refused_in_one_line(tmp_path, capsys, old):
    """0.3.0 reads today's names only: an old name fails before anything runs (exit 2, one line naming the new
    one), from a file as from the command line."""
    *section, leaf = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({section[0]: {leaf: 1}} if section else {leaf: 1}))
    for argv in (["-c", str(path)], [f"{old}=1"]):
        assert main(["train", "--print-config", *argv]) == 2
        error = capsys.readouterr().err
        assert error == f"error: unknown setting {old}: it is {SETTINGS_RENAMED[old]} since 0.3\n", error
    with pytest.raises(TypeError, match="latent_bits"):
        ModelConfig(latent_bits=3)  # the keyword too


def test_the_saved_model_configs_older_field_names_are_read_for_good():
    """What a checkpoint or an export wrote is no setting: its config.json's latent_bits (written by 0.1) is
    read as latent_units, without a warning, by the checkpoint and the Hugging Face loaders."""
    pytest.importorskip("transformers")
    from free_transformer.hf.configuration import FreeTransformerConfig
    from free_transformer.runs.checkpoint import read_checkpoint_config

    exported = json.loads((LEGACY_RUN.parent / "legacy-hf" / "config.json").read_text())
    assert "latent_bits" in exported
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = read_checkpoint_config(LEGACY_RUN / "checkpoints" / "step_00000004")["model"]
        assert ModelConfig.from_dict(saved).latent_units == 3 and "latent_bits" not in saved
        assert FreeTransformerConfig.from_dict(exported).to_model_config().latent_units == 3


def test_every_shipped_config_loads_without_a_warning():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # today's names: no warning
            load_train_config(path)


def test_the_legacy_runs_config_is_refused_until_renamed(tmp_path):
    """A run's config.yaml written by 0.1 names each setting renamed since: one line names them, and the
    run in today's names loads (its checkpoints as 0.1 wrote them: runs/migrations.py reads those)."""
    with pytest.raises(
        ConfigError,
        match="^unknown setting eval_batches: it is validation_batches since 0.3; unknown setting eval_every: ",
    ):
        load_train_config(LEGACY_RUN / "config.yaml")
    saved = yaml.safe_load((LEGACY_RUN / "config.yaml").read_text())
    config = load_train_config(legacy_run_in_todays_names(tmp_path) / "config.yaml")
    assert (config.validate_every, config.validation_batches) == (saved["eval_every"], saved["eval_batches"])
    assert config.model.latent_units == saved["model"]["latent_bits"]


def test_eval_flags_are_the_config_eval_section(capsys):
    text = " ".join(_help(capsys, "eval").split())
    for item in dataclasses.fields(EvalConfig):
        if item.name in ("every", "sandbox"):  # training's only; the sandbox's two options below
            continue
        flag = f"--{item.name.replace('_', '-')}"
        shown = "none" if item.default in (None, "") else item.default
        assert flag in text and settings.field_docs(EvalConfig)[item.name].split(".")[0] in text, flag
        assert f"(default: {shown}" in text.split(flag)[-1], flag  # every default, from the dataclass
    assert "--code-timeout" in text and "(default: 10.0)" in text and "(default: 1024)" in text
    assert "Wall-clock seconds before the process group is killed" in text  # SandboxLimits' docstrings
    parser = build_parser()
    defaults = parser.parse_args(["eval", "ckpt"])
    assert eval_flags_settings(defaults) == EvalConfig().settings()
    given = parser.parse_args(
        [
            "eval",
            "ckpt",
            "--tasks",
            "arc_easy",
            "--limit",
            "3",
            "--data",
            "race_high=a.jsonl",
            "--data",
            "race_middle=b.jsonl",
            "--num-fewshot",
            "2",
            "--latent-samples",
            "2",
        ]
    )
    section = load_train_config(
        None,
        [
            "eval.tasks=arc_easy",
            "eval.limit=3",
            "eval.num_fewshot=2",
            "eval.data=race_high=a.jsonl,race_middle=b.jsonl",
            "eval.latent_samples=2",
        ],
    ).eval
    assert eval_flags_settings(given) == section.settings()  # the same settings, the same record key


def test_the_record_key_of_settings_is_unchanged():
    """Keys of RUN/eval/curve.jsonl written before EvalConfig: equal settings must still be found scored."""
    assert EvalConfig().settings().key == "fb6d70a444"
    options = EvalConfig(tasks="arc_easy", data="race_high=x", heldout="a.txt", num_fewshot="2,boolq=3", limit=3)
    assert options.settings().key == "7eb8c0cd4a"


def test_rank_zero_has_one_owner(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert is_main_process()
    monkeypatch.setenv("RANK", "1")
    assert not is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert is_main_process()


def test_train_without_out_is_one_line_error(capsys):
    assert main(["train", *TINY]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, line",
    [
        ("optim.lrr=1", "error: unknown setting optim.lrr: did you mean optim.lr?"),
        ("kapa_bits=1", "error: unknown setting kapa_bits: did you mean kappa_bits?"),
        ("data.text.pth=x.txt", "error: unknown setting data.text.pth: did you mean data.text.path?"),
        ("model.latent.knid=bit_linear", "error: unknown setting model.latent.knid: did you mean model.latent.kind?"),
        ("model.sise=debug", "error: unknown setting model.sise: did you mean model.size?"),  # read before the rest
    ],
)
def test_a_misspelt_setting_names_the_closest_real_one(tmp_path, capsys, override, line):
    """One line naming the closest real field (difflib), a non-zero exit, nothing written."""
    assert main(["train", "--out", str(tmp_path / "run"), override]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "run").exists()


def test_an_unknown_model_setting_lists_size_among_the_models_fields():
    with pytest.raises(ConfigError, match=r"^unknown setting model.qqqq: model has size, vocab_size, dim, "):
        load_train_config(None, ["model.qqqq=1"])


def test_a_training_config_sets_the_sandbox_limits_of_its_evaluations(tmp_path):
    """eval.sandbox.* is a section of the config, read by the periodic evaluation; a limit that fails every
    program is refused when the config is read."""
    config = load_train_config(None, ["eval.sandbox.timeout_s=3", "eval.sandbox.memory_mb=512"])
    assert (config.eval.sandbox.timeout_s, config.eval.sandbox.memory_mb) == (3.0, 512)
    with pytest.raises(ConfigError, match=r"^eval.sandbox.memory_mb must be >= 1, got 0$"):
        load_train_config(None, ["eval.sandbox.memory_mb=0"])
