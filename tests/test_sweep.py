"""The sweep under both experiments: run layout, the run's own settings, and overrides on typed configs."""

from pathlib import Path

import pytest

from free_transformer.base.checks import ConfigError
from free_transformer.experiments.demo.presets import PRESETS as DEMO
from free_transformer.experiments.demo.run import VARIANTS, demo_sweep
from free_transformer.experiments.launch.sweep import Sweep, Variant
from free_transformer.train.config import TrainConfig, apply_overrides, load_train_config, overrides_of


def test_runs_live_under_seed_dirs_whatever_the_number_of_seeds():
    variant = Variant("kappa-1", "κ = 1 bit", 1.0)
    several = Sweep(Path("out"), (variant,), (0, 3), lambda v: TrainConfig())
    assert several.run_dir(3, variant) == Path("out/seed-3/kappa-1")
    assert (
        several.run_dir(0, variant)
        == demo_sweep(DEMO["quick"], Path("out")).run_dir(0, VARIANTS[3])
        == Path("out/seed-0/kappa-1")
    )  # the demo's one seed is where its three seeds look
    assert Sweep(Path("out"), (variant,), (0,), lambda v: TrainConfig()).run_dir(0, variant) == Path(
        "out/seed-0/kappa-1"
    )
    assert [(s, v.slug) for s, v in several.runs()] == [(0, "kappa-1"), (3, "kappa-1")]


def test_the_sweep_sets_each_runs_seed_device_and_threads_and_nothing_else():
    sweep = demo_sweep(DEMO["quick"], Path("out"), seeds=(4,), device="cpu")
    config = sweep.train_config(VARIANTS[3], 4, threads=2)
    assert (config.seed, config.device, config.threads, config.progress) == (4, "cpu", 2, False)
    assert (config.kappa_bits, config.steps, config.checkpoint_every) == (1.0, 900, 225)
    assert sweep.config(VARIANTS[0]).model.latent_units == 0  # the baseline


def test_user_overrides_go_on_top_of_a_preset_and_a_typo_fails():
    sweep = demo_sweep(DEMO["paper"], Path("out"), extra=("steps=7", "model.n_layers=2", "optim.lr=3e-4"))
    config = sweep.config(VARIANTS[2])
    assert (config.steps, config.model.n_layers, config.model.dim, config.optim.lr) == (7, 2, 64, 3e-4)
    assert config.checkpoint_every == 1  # a quarter of the steps, at least 1
    with pytest.raises(ConfigError, match="unknown setting optim.lrr: did you mean optim.lr"):
        demo_sweep(DEMO["quick"], Path("out"), extra=("optim.lrr=1",)).config(VARIANTS[0])


def test_a_size_override_keeps_a_baseline_a_baseline():
    baseline = TrainConfig(model=TrainConfig().model.replace(latent_units=0))
    assert apply_overrides(baseline, ["model.size=debug"]).model.latent_units == 0
    assert apply_overrides(baseline, ["model.size=debug", "model.dim=64"]).model.dim == 64
    assert apply_overrides(TrainConfig(), ["model.size=debug"]).model.n_layers == 2


def test_overrides_of_a_config_give_it_back():
    config = apply_overrides(
        TrainConfig(),
        [
            "data.kind=coinflip",
            "data.coinflip.length=8",
            "kappa_bits=0.125",
            "optim.betas=[0.9,0.99]",
            "model.latent.kind=bit_linear",
        ],
    )
    assert load_train_config(None, overrides_of(config)) == config
    assert overrides_of(TrainConfig()) == []


def test_a_one_seed_demo_written_before_the_one_layout_moves_into_it(tmp_path):
    from free_transformer.experiments.demo.run import move_one_seed_runs
    from free_transformer.train.config import save_train_config

    for run in ("kappa-1", "coins", "seed-0/coins"):
        (tmp_path / run).mkdir(parents=True)
    save_train_config(TrainConfig(seed=2), tmp_path / "kappa-1" / "config.yaml")  # the old OUT/SLUG
    save_train_config(TrainConfig(seed=0), tmp_path / "coins" / "config.yaml")
    save_train_config(TrainConfig(seed=0), tmp_path / "seed-0" / "coins" / "config.yaml")  # already there
    assert move_one_seed_runs(tmp_path) == [f"{tmp_path / 'kappa-1'} -> {tmp_path / 'seed-2' / 'kappa-1'}"]
    assert (tmp_path / "seed-2" / "kappa-1" / "config.yaml").is_file() and (tmp_path / "coins").is_dir()
    assert move_one_seed_runs(tmp_path) == []
