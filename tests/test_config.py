"""The one config system: every setting in `--help` with its type, default and docstring; `--print-config`
gives a file that loads back to the same config and trains to the same losses; renamed fields still read
(with a warning) from old files, old command lines and old runs; `eval`'s flags are the config's `eval`
section."""

import dataclasses
import shutil
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import TINY
from conftest import run_losses as _losses

from free_transformer.base import settings
from free_transformer.base.checks import ConfigError
from free_transformer.cli import build_parser, main
from free_transformer.commands.eval import _settings as eval_flags_settings
from free_transformer.distributed.env import is_main_process
from free_transformer.eval.settings import EvalConfig
from free_transformer.train.config import RENAMED, TrainConfig, load_train_config

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
    assert "  eval.latents=prior  (encoder | prior)" in text
    assert "  model.size=cpu-small  (debug | cpu-small" in text  # the named sizes, besides the fields
    assert "eval_every: now validate_every (the old name is read until 0.3)" in text


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


def test_print_config_of_a_resume_is_the_runs_config_with_the_overrides(capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(LEGACY_RUN, run)
    with pytest.warns(FutureWarning, match="eval_every is now validate_every"):
        text = _printed(capsys, "train", "--out", str(run), "--resume", "--print-config", "steps=6")
    assert yaml.safe_load(text)["steps"] == 6 and yaml.safe_load(text)["model"]["latent_units"] == 3
    assert not (run / "config-changes.jsonl").exists()  # printing trains nothing and records nothing


def test_a_resumed_run_rewrites_its_config_yaml_in_todays_names(capsys, tmp_path):
    """A run written before the renames, resumed with the same settings: its config.yaml is rewritten in the
    new names (read without a warning from then on), no change is recorded and its checkpoints stay."""
    run = tmp_path / "run"
    shutil.copytree(LEGACY_RUN, run)
    checkpoints = {path: path.read_bytes() for path in (run / "checkpoints").rglob("*") if path.is_file()}
    with pytest.warns(FutureWarning, match="eval_every is now validate_every"):
        legacy = load_train_config(LEGACY_RUN / "config.yaml")
        assert main(["train", "--out", str(run), "--resume"]) == 0
    assert (
        "rewritten in today's names (it used eval_every, eval_batches, data.path, data.tokenizer, data.seq_len, "
        "data.val_fraction, data.cache_dir, data.coinflip_length, data.coinflip_epsilon, model.latent_bits)"
    ) in capsys.readouterr().err
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert "eval_every" not in saved and (saved["validate_every"], saved["validation_batches"]) == (0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert load_train_config(run / "config.yaml") == legacy
    assert not (run / "config-changes.jsonl").exists()
    assert {path: path.read_bytes() for path in checkpoints} == checkpoints


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


def test_old_field_names_warn_and_give_the_same_config(tmp_path):
    new = load_train_config(None, ["validate_every=5", "validation_batches=2"])
    for old in RENAMED:  # the one table of old names: each with the release that stops reading it
        assert old.until == "0.3" and (
            old.old in {"eval_every", "eval_batches", "model.latent_bits"} or old.old.startswith("data.")
        )
    with pytest.warns(FutureWarning, match="eval_batches is now validation_batches"):
        assert load_train_config(None, ["eval_every=5", "eval_batches=2"]) == new
    path = tmp_path / "old.yaml"
    path.write_text("eval_every: 5\neval_batches: 2\n")
    with pytest.warns(FutureWarning, match="the old name is read until version 0.3"):
        assert load_train_config(path) == new
    with pytest.warns(FutureWarning):  # a later layer wins, whatever name each gives
        assert load_train_config(path, ["validate_every=6"]).validate_every == 6
    path.write_text("eval_every: 5\nvalidate_every: 6\n")
    with pytest.raises(ConfigError, match=r"eval_every \(5\) and validate_every \(6\) disagree"):
        load_train_config(path)
    path.write_text("eval_every: 5\nvalidate_every: 5\nvalidation_batches: 2\n")
    with pytest.warns(FutureWarning):  # equal values under both names are one setting
        assert load_train_config(path) == new


def test_latent_bits_is_read_as_latent_units_everywhere_it_was_written(tmp_path):
    """The command line and a YAML file (until 0.3, with a warning), ModelConfig's keyword (likewise), and a
    saved model config: a checkpoint's config.json and a Hugging Face export's, for good."""
    from free_transformer import ModelConfig
    from free_transformer.runs.checkpoint import read_checkpoint_config

    with pytest.warns(FutureWarning, match="model.latent_bits is now model.latent_units"):
        assert load_train_config(None, ["model.latent_bits=3"]).model.latent_units == 3
    with pytest.warns(FutureWarning, match="latent_bits is now latent_units; the old name is read until version 0.3"):
        assert ModelConfig(latent_bits=3) == ModelConfig(latent_units=3)
    with pytest.raises(ConfigError, match="disagree"):
        ModelConfig(latent_bits=3, latent_units=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        saved = read_checkpoint_config(LEGACY_RUN / "checkpoints" / "step_00000004")["model"]
        assert "latent_bits" in saved and ModelConfig.from_dict(saved).latent_units == saved["latent_bits"]


def test_every_shipped_config_loads_with_and_without_the_old_names(tmp_path):
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # today's names: no warning
            config = load_train_config(path)
        old = tmp_path / path.name
        old.write_text(path.read_text().replace("validate_every:", "eval_every:"))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert load_train_config(old) == config, path.name


def test_the_legacy_runs_config_reads_its_old_names():
    with pytest.warns(FutureWarning):
        config = load_train_config(LEGACY_RUN / "config.yaml")
    saved = yaml.safe_load((LEGACY_RUN / "config.yaml").read_text())
    assert (config.validate_every, config.validation_batches) == (saved["eval_every"], saved["eval_batches"])


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
    ],
)
def test_a_misspelt_setting_names_the_closest_real_one(tmp_path, capsys, override, line):
    """One line naming the closest real field (difflib), a non-zero exit, nothing written."""
    assert main(["train", "--out", str(tmp_path / "run"), override]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "run").exists()


def test_a_training_config_sets_the_sandbox_limits_of_its_evaluations(tmp_path):
    """eval.sandbox.* is a section of the config, read by the periodic evaluation; a limit that fails every
    program is refused when the config is read."""
    config = load_train_config(None, ["eval.sandbox.timeout_s=3", "eval.sandbox.memory_mb=512"])
    assert (config.eval.sandbox.timeout_s, config.eval.sandbox.memory_mb) == (3.0, 512)
    with pytest.raises(ConfigError, match=r"^eval.sandbox.memory_mb must be >= 1, got 0$"):
        load_train_config(None, ["eval.sandbox.memory_mb=0"])


def test_no_compatibility_shim_outlives_its_release():
    """Every old spelling the package still reads is in base/compat.py with the release that drops it; this
    fails when the package reaches that release with the shim still there."""
    from free_transformer.base import compat
    from free_transformer.base.version import __version__

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:2])

    assert release(__version__) < release(compat.REMOVED_IN)
    assert all(release(rename.until) == release(compat.REMOVED_IN) for rename in compat.RENAMED)
