"""A sweep: variants x seeds -> one TrainConfig per run -> runs trained by a launcher (launchers.py: side by side
here, or one Slurm job each) -> the runs, for an experiment to measure and report. It names no experiment.

Run layout: OUT/seed-S/SLUG, whatever the number of seeds, so that a seed finished by one command is reused by
the next (`demo`, then `demo --seeds 3`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from ...train.config import TrainConfig

if TYPE_CHECKING:  # the launchers import torch: when a sweep trains, not when presets are described
    from .launchers import Launcher


@dataclass(frozen=True)
class Variant:
    """One model of an experiment, trained once per seed."""

    slug: str  # its run directory's name
    label: str
    kappa_bits: float | None = None  # None: a baseline (no latent)
    matched: bool = False  # the baseline with a Free Transformer's extra block (ModelConfig.matched_baseline)
    task: str = "letters"  # what it is trained on, for experiments with several (the demo: letters, coins)

    @property
    def is_free(self) -> bool:
        """A Free Transformer (it has a kappa), not a baseline: what ModelConfig.is_free says of its model."""
        return self.kappa_bits is not None


def with_latent(config: TrainConfig, variant: Variant, *, fast: bool = True) -> TrainConfig:
    """The variant's latent: none for a baseline; kappa and, when `fast`, the larger post-sampler
    initialisation and 3x learning rate on the latent path with which Z is read several times sooner."""
    if variant.kappa_bits is None:  # a baseline (not variant.is_free)
        return dataclasses.replace(config, model=config.model.replace(latent_units=0))
    config = dataclasses.replace(config, kappa_bits=variant.kappa_bits)
    return fast_latent(config) if fast else config


# The "fast" latent recipe: the post-sampler's initial standard deviation and the latent path's learning-rate
# multiplier with which Z is read several times sooner (what they rest on: docs/demo.md).
FAST_POST_SAMPLER_STD, FAST_LATENT_LR_SCALE = 0.3, 3.0


def fast_latent(config: TrainConfig) -> TrainConfig:
    """The larger post-sampler initialisation and learning rate on the latent path (FAST_*)."""
    return dataclasses.replace(
        config,
        post_sampler_init_std=FAST_POST_SAMPLER_STD,
        optim=dataclasses.replace(config.optim, latent_lr_scale=FAST_LATENT_LR_SCALE),
    )


def kappa_fraction(kappa: float) -> str:
    return str(Fraction(kappa).limit_denominator(64))  # 0.125 -> "1/8"


def kappa_label(kappa: float) -> str:
    return f"{kappa_fraction(kappa)} bit" + ("s" if kappa > 1 else "")


@dataclass(frozen=True)
class Sweep:
    out_dir: Path
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...]
    config: Callable[[Variant], TrainConfig]  # a variant's config, before the run's seed, device, threads
    device: str = "cpu"

    def runs(self) -> list[tuple[int, Variant]]:
        return [(seed, variant) for seed in self.seeds for variant in self.variants]

    def seed_dir(self, seed: int) -> Path:
        return self.out_dir / f"seed-{seed}"

    def run_dir(self, seed: int, variant: Variant) -> Path:
        return self.seed_dir(seed) / variant.slug

    def train_config(self, variant: Variant, seed: int, threads: int = 0) -> TrainConfig:
        """The run's config: the variant's, with the seed, device and threads (0: torch's default) of
        this sweep, without a progress bar (the launcher shows one for all)."""
        return dataclasses.replace(self.config(variant), seed=seed, device=self.device, threads=threads, progress=False)

    def train(self, launcher: Launcher) -> dict[str, float]:
        """Train every run through `launcher`; finished runs are reused, stopped ones resumed. The wall
        seconds of each run trained now, by run directory."""
        jobs = [
            (self.train_config(variant, seed, launcher.threads), self.run_dir(seed, variant))
            for seed, variant in self.runs()
        ]
        return launcher.train(jobs, desc=f"training {len(jobs)} models")
