"""What a study trains: its variants (the baseline, the parameter-matched baseline, a Free Transformer per
kappa) and its presets, functions that return the typed training config every model starts from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...base.presets import Presets
from ...data import DataConfig
from ...data.config import TextConfig
from ...model.config import named_config
from ...train.config import OptimConfig, TrainConfig, apply_overrides
from ..launch.sweep import Sweep, Variant, kappa_fraction, kappa_label, with_latent


def variants(kappas: list[float]) -> list[Variant]:
    free = [Variant(f"kappa-{kappa_fraction(k).replace('/', '-')}", f"Free, κ = {kappa_label(k)}", k) for k in kappas]
    return [Variant("baseline", "baseline", None), Variant("matched-baseline", "matched baseline", None, True), *free]


@dataclass(frozen=True)
class StudyPreset:
    name: str  # its name in PRESETS, recorded in the report
    config: Callable[[], TrainConfig]  # every model's, before its variant
    fast_latent: bool = True  # the Free Transformers get launch.sweep.fast_latent
    kappas: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    seeds: int = 2
    heldout_windows: int = 256  # of the held-out text, for the likelihoods
    heldout_samples: int = 8  # K, for the prior cross-entropy and IWAE


def _shakespeare(tokenizer: str, seq_len: int) -> DataConfig:
    return DataConfig(kind="text", text=TextConfig(path="corpus:shakespeare", tokenizer=tokenizer, seq_len=seq_len))


def text_cpu() -> TrainConfig:
    """Byte-level Shakespeare, the demo's model size with a context of 128, 500 steps of 32 x 128 tokens
    (2 M tokens, a fifth of an epoch)."""
    return TrainConfig(
        model=named_config("cpu-small", max_seq_len=128, latent_units=8),
        data=_shakespeare("byte", 128),
        optim=OptimConfig(lr=2e-3, warmup_steps=50),
        batch_size=32,
        steps=500,
        log_every=25,
        validate_every=50,
        validation_batches=4,
        checkpoint_every=250,
        keep_checkpoints=1,
    )


def text_gpu() -> TrainConfig:
    """GPT-2's BPE, 8 blocks of width 512, H = 16 as in the paper, bf16."""
    model = named_config(
        "cpu-small",
        vocab_size=50257,
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=1536,
        max_seq_len=512,
        tie_embeddings=True,
        latent_units=16,
    )
    return TrainConfig(
        model=model,
        data=_shakespeare("gpt2", 512),
        optim=OptimConfig(lr=1e-3, warmup_steps=200),
        batch_size=64,
        steps=5000,
        precision="bf16",
        log_every=50,
        validate_every=250,
        validation_batches=8,
        checkpoint_every=1000,
        keep_checkpoints=1,
    )


def text_smoke() -> TrainConfig:
    return TrainConfig(
        model=named_config("debug", max_seq_len=32, latent_units=4),
        data=_shakespeare("byte", 32),
        optim=OptimConfig(warmup_steps=1),
        batch_size=4,
        steps=4,
        log_every=2,
        validate_every=2,
        validation_batches=1,
        keep_checkpoints=1,
    )


PRESETS: Presets[StudyPreset] = Presets(
    "study preset",
    {
        "cpu": (
            StudyPreset("cpu", text_cpu),
            "byte-level Shakespeare, 1.1 M-parameter models, 500 steps, 2 seeds (its time: docs/results.md)",
        ),
        "gpu": (
            StudyPreset("gpu", text_gpu, seeds=3, heldout_windows=1024),
            "GPT-2 BPE Shakespeare, 8 x 512 models, H = 16, 5,000 steps, 3 seeds, bf16 (one GPU)",
        ),
        "smoke": (
            StudyPreset(
                "smoke", text_smoke, fast_latent=False, kappas=(0.5, 4.0), seeds=2, heldout_windows=4, heldout_samples=2
            ),
            "a tiny model, 4 steps: checks the wiring",
        ),
    },
)


@dataclass(frozen=True)
class StudyPlan:
    """One study: a preset over seeds and kappas, with the user's overrides, as a sweep."""

    preset: StudyPreset
    out_dir: Path
    seeds: tuple[int, ...]
    kappas: tuple[float, ...]
    extra: tuple[str, ...] = ()  # the user's overrides, applied last to every model
    device: str = "cpu"

    def variants(self) -> list[Variant]:
        return variants(list(self.kappas))

    def config(self, variant: Variant) -> TrainConfig:
        config = self.preset.config()
        if not variant.matched:  # the matched baseline keeps the latent's size until matched_baseline() reads it
            config = with_latent(config, variant, fast=self.preset.fast_latent)
        config = apply_overrides(config, list(self.extra))
        if variant.matched:  # the control of the Free Transformers' model: no latent, one more block
            config = dataclasses.replace(config, model=config.model.matched_baseline())
        return config

    @property
    def sweep(self) -> Sweep:
        return Sweep(self.out_dir, tuple(self.variants()), self.seeds, self.config, self.device)

    def run_dir(self, seed: int, variant: Variant) -> Path:
        return self.sweep.run_dir(seed, variant)

    def train_config(self, variant: Variant, seed: int, threads: int = 0) -> TrainConfig:
        return self.sweep.train_config(variant, seed, threads)
