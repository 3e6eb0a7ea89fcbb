"""The demo's presets: functions from a variant to its training config, typed, so that a wrong field
fails at import. What each setting rests on, measured: docs/demo.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ...base.presets import Presets
from ...data import DataConfig
from ...data.config import CoinflipConfig
from ...model.config import named_config
from ...train.config import OptimConfig, TrainConfig
from ..launch.sweep import Variant, with_latent


def letters(*, steps: int, batch_size: int = 64, **model) -> TrainConfig:
    """The synthetic letters on a cpu-small model (H = 8), a constant learning rate of 1e-3."""
    return TrainConfig(
        model=named_config("cpu-small", latent_units=8, **model),
        data=DataConfig(kind="letters"),
        optim=OptimConfig(lr=1e-3, schedule="constant", warmup_steps=100),
        batch_size=batch_size,
        steps=steps,
    )


def coins(*, length: int = 32, steps: int = 1000, batch_size: int = 64, warmup_steps: int = 100) -> TrainConfig:
    """The Motivation section's coin flips (each value the hidden coin flipped with probability 0.3) on
    a debug-size model (H = 4), about a minute of training."""
    return TrainConfig(
        model=named_config("debug", max_seq_len=64, latent_units=4),
        data=DataConfig(kind="coinflip", coinflip=CoinflipConfig(length=length, epsilon=0.3)),
        optim=OptimConfig(lr=1e-3, schedule="constant", warmup_steps=warmup_steps),
        batch_size=batch_size,
        steps=steps,
    )


@dataclass(frozen=True)
class WallTime:
    """Minutes one seed of the demo took with a preset, training to report (docs/results.md); None where not
    measured. An estimate for another run: the load of the machine changes it, and so do the seeds (on a CPU each
    adds about as much, on a GPU, where every run trains side by side, less)."""

    cpu: float | None = None  # on 2 CPU cores, two runs side by side
    gpu: float | None = None  # on one H100 GPU, every run side by side


@dataclass(frozen=True)
class DemoPreset:
    name: str  # its name in PRESETS, recorded in the report
    config: Callable[[Variant], TrainConfig]  # every variant's training config
    blue_size: int = 32  # the generated groups
    green_groups: int = 8
    green_size: int = 12
    minutes_per_seed: WallTime = WallTime()  # what the demo prints before it trains
    not_judged: str | None = None  # why its models' measures judge no claim (the report says so, marking none)


def quick(variant: Variant) -> TrainConfig:
    """kappa fixed as in the paper; cpu-small, 64 sequences per step, 400 steps (kappa = 1 bit 900, 8 bits 450)."""
    if variant.task == "coins":
        return with_latent(coins(), variant)
    steps = {"kappa-1": 900, "kappa-8": 450}.get(variant.slug, 400)
    return with_latent(letters(steps=steps), variant)


def paper(variant: Variant) -> TrainConfig:
    """The paper's recipe, kappa fixed for every model, 256 sequences per step, at width 64."""
    if variant.task == "coins":
        return with_latent(coins(), variant)
    steps = {"kappa-1-8": 1250, "kappa-1": 1000, "kappa-8": 600}.get(variant.slug, 500)
    return with_latent(letters(steps=steps, batch_size=256, dim=64, ffn_hidden=192), variant)


def narrow(variant: Variant) -> TrainConfig:
    """The paper's recipe at a lower cost: kappa fixed, 256 sequences per step, each block compiled; the letters
    models at width 32, but kappa = 1 bit at width 64 (why, and how it compares: docs/demo.md)."""
    if variant.task == "coins":
        return with_latent(coins(), variant)
    if variant.slug == "kappa-1":
        config = letters(steps=1000, batch_size=256, dim=64, ffn_hidden=192)
    else:
        steps = {"kappa-1-64": 600, "kappa-1-8": 750, "kappa-8": 400}.get(variant.slug, 500)
        config = letters(steps=steps, batch_size=256, dim=32, ffn_hidden=96)
    return with_latent(dataclasses.replace(config, compile=True), variant)


def smoke(variant: Variant) -> TrainConfig:
    """A debug model, 3 steps: checks the wiring."""
    if variant.task == "coins":
        model, data = (
            named_config("debug", max_seq_len=64, latent_units=4),
            DataConfig(kind="coinflip", coinflip=CoinflipConfig(length=8)),
        )
    else:
        model, data = named_config("debug", max_seq_len=72, latent_units=4), DataConfig(kind="letters")
    config = TrainConfig(model=model, data=data, optim=OptimConfig(warmup_steps=1), steps=3, batch_size=8)
    return with_latent(config, variant, fast=False)


PRESETS: Presets[DemoPreset] = Presets(
    "demo preset",
    {
        "quick": (
            DemoPreset("quick", quick, minutes_per_seed=WallTime(cpu=11.9, gpu=0.9)),
            "cpu-small, 64 sequences per step (what it reproduces: docs/results.md)",
        ),
        "paper": (
            DemoPreset("paper", paper, minutes_per_seed=WallTime(cpu=37.4, gpu=0.72)),
            "the paper's recipe (kappa fixed, 256 sequences per step, width 64; what it reproduces: docs/results.md)",
        ),
        "narrow": (
            DemoPreset("narrow", narrow, minutes_per_seed=WallTime(cpu=40.0)),
            "the paper's recipe at width 32 (kappa = 1 bit at 64), compiled",
        ),
        "smoke": (
            DemoPreset(
                "smoke",
                smoke,
                blue_size=4,
                green_groups=2,
                green_size=3,
                not_judged="preset smoke trains a debug model for 3 steps to check the wiring: its measures "
                "say nothing about the paper's claims",
            ),
            "a debug model, 3 steps: checks the wiring",
        ),
    },
)
