"""The demo's models and its sweep: torch-free, so that the command checks the settings of its runs before it
imports what trains them (experiments/demo/run.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...train.config import TrainConfig, apply_overrides
from ..launch.sweep import Sweep, Variant
from .presets import DemoPreset

VARIANTS = (
    Variant("baseline", "baseline", None),
    Variant("kappa-1-64", "κ = 1/64 bit", 1 / 64),
    Variant("kappa-1-8", "κ = 1/8 bit", 1 / 8),
    Variant("kappa-1", "κ = 1 bit", 1.0),
    Variant("kappa-8", "κ = 8 bits", 8.0),
    Variant("coins", "coin flips, κ = 1/8 bit", 1 / 8, task="coins"),
)


def demo_sweep(
    preset: DemoPreset,
    out_dir: Path,
    *,
    seeds: tuple[int, ...] = (0,),
    extra: tuple[str, ...] = (),
    device: str = "cpu",
    models: tuple[str, ...] | None = None,
) -> Sweep:
    """The demo's runs: the preset's configs, the user's overrides (`extra`) on top, a few checkpoints each.
    models: the slugs of the variants to run (default: all of VARIANTS); the claims of the others are not judged."""
    unknown = sorted(set(models or ()) - {v.slug for v in VARIANTS})
    if unknown:
        known = ", ".join(v.slug for v in VARIANTS)
        raise ValueError(f"unknown demo model(s) {', '.join(unknown)}; choose among {known}")
    variants = VARIANTS if models is None else tuple(v for v in VARIANTS if v.slug in models)

    def config(variant: Variant) -> TrainConfig:
        config = apply_overrides(preset.config(variant), list(extra))
        return dataclasses.replace(config, log_every=25, keep_checkpoints=1, checkpoint_every=max(1, config.steps // 4))

    return Sweep(out_dir, variants, seeds, config, device)
