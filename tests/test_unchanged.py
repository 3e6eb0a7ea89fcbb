"""What users have must not change: every preset resolves to the training config it resolved to before
presets were code (recorded in 0.3's layout, every latent kind's section: read as runs/saved_config.py
reads it), and the smoke demo and study give the measures and generations recorded then
(tests/data/smoke-outputs.json, compared by test_demo.py and test_study.py)."""

import json
import math
from pathlib import Path

import pytest

from free_transformer.experiments.demo.presets import PRESETS as DEMO_PRESETS
from free_transformer.experiments.demo.run import VARIANTS, demo_sweep
from free_transformer.experiments.study.presets import PRESETS as STUDY_PRESETS
from free_transformer.experiments.study.presets import StudyPlan
from free_transformer.runs.saved_config import upgrade_saved_train_config
from free_transformer.train.config import load_train_config, overrides_of

DATA = Path(__file__).parent / "data"
RECORDED = json.loads((DATA / "preset-configs.json").read_text())
SMOKE = json.loads((DATA / "smoke-outputs.json").read_text())


def _demo_config(preset: str, slug: str, seed: int) -> dict:
    variant = next(v for v in VARIANTS if v.slug == slug)
    return (
        demo_sweep(DEMO_PRESETS[preset], Path("runs"), seeds=(seed,)).train_config(variant, seed, threads=1).to_dict()
    )


def _study_config(preset: str, slug: str, seed: int) -> dict:
    plan = StudyPlan(STUDY_PRESETS[preset], Path("runs"), (0, 1), STUDY_PRESETS[preset].kappas)
    variant = next(v for v in plan.variants() if v.slug == slug)
    return plan.train_config(variant, seed, threads=1).to_dict()


def _jsonable(values):
    return json.loads(json.dumps(values))


@pytest.mark.parametrize("key", sorted(RECORDED["demo"]))
def test_every_demo_preset_resolves_to_its_recorded_config(key):
    preset, slug, seed = key.split("/")
    assert _jsonable(_demo_config(preset, slug, int(seed))) == upgrade_saved_train_config(RECORDED["demo"][key])


@pytest.mark.parametrize("key", sorted(RECORDED["study"]))
def test_every_study_preset_resolves_to_its_recorded_config(key):
    preset, slug, seed = key.split("/")
    assert _jsonable(_study_config(preset, slug, int(seed))) == upgrade_saved_train_config(RECORDED["study"][key])


# The recorded floats are float32 results of training and measuring. Another CPU, thread count or BLAS build
# sums in another order, which moves a value by the float32 rounding of the quantities it is made of: a
# cross-entropy of ~8 bits (or ~700 nats over a document) by ~1e-7 of itself, and a measure that is the
# difference of two such cross-entropies (bits Z saves, ~1e-3) by the same absolute amount. Measured between
# two x86 CPUs: at most 3.4e-7 bits on such a difference (3e-4 of its value), 2.5e-6 nats on 705 nats. So
# values compare at 1e-5 relative, and near zero at 1e-5 absolute: 30 times the largest difference seen,
# and 100 times finer than the 3 decimals the reports print.
FLOAT_TOLERANCE = dict(rel_tol=1e-5, abs_tol=1e-5)


def same_measures(got, want, where: str = "") -> None:
    """Equal structure, strings and integers (generated text, counts); floats equal within FLOAT_TOLERANCE
    (the smoke models are trained with as many threads as the machine has)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) >= set(want), where
        for key, value in want.items():
            same_measures(got[key], value, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want)):
            same_measures(a, b, f"{where}[{index}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert math.isclose(got, want, **FLOAT_TOLERANCE), (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("key", sorted(RECORDED["demo"])[::5])
def test_a_reports_train_overrides_give_its_config_again(key):
    preset, slug, seed = key.split("/")
    variant = next(v for v in VARIANTS if v.slug == slug)
    config = demo_sweep(DEMO_PRESETS[preset], Path("runs"), seeds=(int(seed),)).train_config(variant, int(seed), 1)
    assert load_train_config(None, overrides_of(config)) == config
