"""What a study trains: its variants (the baseline, the parameter-matched baseline, a Free Transformer per
kappa) and its presets (training overrides, as on the train command line)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from ..demo.experiment import FAST_LATENT
from ..train.config import TrainConfig, load_train_config


@dataclass(frozen=True)
class Variant:
    slug: str
    label: str
    kappa_bits: float | None  # None: a baseline
    matched: bool = False  # the baseline with the Free Transformer's extra blocks


def _fraction(kappa: float) -> str:
    return str(Fraction(kappa).limit_denominator(64))  # 0.125 -> "1/8"


def kappa_label(kappa: float) -> str:
    return f"{_fraction(kappa)} bit" + ("s" if kappa > 1 else "")


def variants(kappas: list[float]) -> list[Variant]:
    free = [Variant(f"kappa-{_fraction(k).replace('/', '-')}", f"Free, κ = {kappa_label(k)}", k) for k in kappas]
    return [Variant("baseline", "baseline", None), Variant("matched-baseline", "matched baseline", None, True), *free]


@dataclass(frozen=True)
class StudyPreset:
    name: str
    common: tuple[str, ...]  # every model
    free: tuple[str, ...] = ()  # Free Transformers only
    kappas: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    seeds: int = 2
    heldout_windows: int = 256  # of the held-out text, for the likelihoods
    heldout_samples: int = 8  # K, for the prior cross-entropy and IWAE
    about: str = ""


# Byte-level Shakespeare, the demo's model size with a context of 128, 500 steps of 32 x 128 tokens (2 M
# tokens, a fifth of an epoch). The latent path gets the demo's larger post-sampler initialisation and 3x
# learning rate (not the paper's, which reuses the baseline's settings: with them a model this small and
# this short-trained leaves Z unused; see docs/study.md).
TEXT_CPU = ("data.kind=text", "data.text.path=corpus:shakespeare", "data.text.tokenizer=byte",
            "data.text.seq_len=128", "model.size=cpu-small", "model.max_seq_len=128", "model.latent_bits=8",
            "batch_size=32", "steps=500",
            "optim.lr=2e-3", "optim.warmup_steps=50", "log_every=25", "eval_every=50", "eval_batches=4",
            "checkpoint_every=250", "keep_checkpoints=1")
PRESETS = {
    "cpu": StudyPreset("cpu", TEXT_CPU, FAST_LATENT,
                       about="byte-level Shakespeare, 1.1 M-parameter models, 500 steps, 2 seeds: 49 min on 2 cores"),
    # GPT-2's BPE, 8 blocks of width 512, H = 16 as in the paper, 3 seeds. Not yet run (no GPU here).
    "gpu": StudyPreset("gpu", ("data.kind=text", "data.text.path=corpus:shakespeare", "data.text.tokenizer=gpt2",
                               "data.text.seq_len=512", "model.size=cpu-small", "model.vocab_size=50257",
                               "model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4",
                               "model.ffn_hidden=1536",
                               "model.max_seq_len=512", "model.tie_embeddings=true", "model.latent_bits=16",
                               "batch_size=64", "steps=5000", "optim.lr=1e-3", "optim.warmup_steps=200",
                               "precision=bf16", "log_every=50", "eval_every=250", "eval_batches=8",
                               "checkpoint_every=1000", "keep_checkpoints=1"),
                       FAST_LATENT, seeds=3, heldout_windows=1024,
                       about="GPT-2 BPE Shakespeare, 8 x 512 models, H = 16, 5,000 steps, 3 seeds, bf16 (one GPU)"),
    "smoke": StudyPreset("smoke", ("data.kind=text", "data.text.path=corpus:shakespeare",
                                   "data.text.tokenizer=byte", "data.text.seq_len=32", "model.size=debug",
                                   "model.vocab_size=256", "model.max_seq_len=32",
                                   "model.latent_bits=4", "batch_size=4", "steps=4", "optim.warmup_steps=1",
                                   "log_every=2", "eval_every=2", "eval_batches=1", "keep_checkpoints=1"),
                         kappas=(0.5, 4.0), seeds=2, heldout_windows=4, heldout_samples=2,
                         about="a tiny model, 4 steps: checks the wiring"),
}


@dataclass(frozen=True)
class StudyPlan:
    preset: StudyPreset
    out_dir: Path
    seeds: tuple[int, ...]
    kappas: tuple[float, ...]
    extra: tuple[str, ...] = ()  # the user's overrides, applied last to every model
    device: str = "cpu"

    def variants(self) -> list[Variant]:
        return variants(list(self.kappas))

    def run_dir(self, seed: int, variant: Variant) -> Path:
        return self.out_dir / f"seed-{seed}" / variant.slug

    def train_config(self, variant: Variant, seed: int, threads: int) -> TrainConfig:
        latent = ["model.latent_bits=0"] if variant.kappa_bits is None and not variant.matched else []
        if variant.kappa_bits is not None:
            latent = [f"kappa_bits={variant.kappa_bits}", *self.preset.free]
        run = [f"seed={seed}", f"device={self.device}", f"threads={threads}", "progress=false"]
        config = load_train_config(None, [*self.preset.common, *latent, *self.extra, *run])
        if variant.matched:  # the control of the Free Transformers' model: no latent, one more block
            config.model = config.model.matched_baseline()
        return config
