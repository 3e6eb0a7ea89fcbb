"""Evaluation during training: validation cross-entropy and KL on held-out batches and, for a Free
Transformer, what its latent does: the honest cross-entropy with Z drawn from the prior (as at
generation), the bits the encoder's Z saves per token, the KL of each bit, and a warning when Z has
collapsed or carries the tokens themselves. Computed with its own generators: training's RNG streams
are untouched."""

from __future__ import annotations

import contextlib

import torch

from ..distributed import ParallelEnv
from ..latent.sampling import kl_per_bit
from ..units import LN2
from .config import TrainConfig
from ..seeding import generator
from .noise import latent_generators


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# A bit whose KL to a fair coin is under this (bits per token) carries nothing.
DEAD_BIT_KL = 0.01
# Z is unused (collapsed) when it saves less than this per token (bits) once training has settled.
COLLAPSED_SAVING = 0.01
# The encoder channels the tokens when the KL sits at its free budget kappa (within 10 %), kappa is at
# least this (bits), and Z saves at least half of the KL it spends: the training loss then flatters the
# model by about the KL, and generation, which draws Z from the prior, is that much worse.
COPYING_KAPPA, COPYING_SHARE = 2.0, 0.5


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, config: TrainConfig, device: torch.device,
             env: ParallelEnv | None = None) -> dict:
    """Validation measures in bits per token, on `config.eval_batches` held-out batches (the same ones at
    every evaluation). Under ddp / fsdp (env given) each rank computes its slice of every batch.

    val_cross_entropy_bits, val_kl_bits: with Z from the encoder, as the training loss.
    For a Free Transformer also: val_prior_cross_entropy_bits (Z from the uniform prior: what generation
    does; an upper bound of the honest -log P(x)), latent_bits_saved (prior minus encoder cross-entropy),
    val_kl_bits_per_bit (H values), dead_bits (bits under DEAD_BIT_KL)."""
    env = env or ParallelEnv("none", device)
    free = getattr(model, "module", model).latent is not None  # ddp wraps the model
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=env.device)  # CE encoder Z, KL, CE prior Z (nats)
    per_bit = torch.zeros(config.model.latent_bits, dtype=torch.float64, device=env.device)  # (H,) KL nats
    rows = env.rows(config.batch_size)
    for index in range(config.eval_batches):
        batch = dataset.batch(index, config.batch_size, split="val")[rows.start : rows.stop].to(env.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast_context(config.precision, env.device):
            out = model(inputs, targets, kappa_nats=config.kappa_nats(config.steps),
                        generator=_generator(config, index, rows, env, "val"))
            prior = model(inputs, targets, latents="prior", generator=_generator(config, index, rows, env, "prior"))\
                if free else None
        totals[0] += out.cross_entropy_nats.double()
        if free:
            totals[1] += out.kl_nats.double()
            totals[2] += prior.cross_entropy_nats.double()
            per_bit += kl_per_bit(out.bit_logits).double().mean(dim=(0, 1))
    model.train()
    totals, per_bit = env.mean(totals) / config.eval_batches / LN2, env.mean(per_bit) / config.eval_batches / LN2
    ce, kl, prior_ce = totals.tolist()
    if not free:
        return {"val_cross_entropy_bits": ce, "val_kl_bits": 0.0}
    kl_bits = per_bit.tolist()
    return {"val_cross_entropy_bits": ce, "val_kl_bits": kl, "val_prior_cross_entropy_bits": prior_ce,
            "latent_bits_saved": prior_ce - ce, "val_kl_bits_per_bit": kl_bits,
            "dead_bits": sum(value < DEAD_BIT_KL for value in kl_bits)}


def _generator(config: TrainConfig, index: int, rows: range, env: ParallelEnv, split: str):
    """Latent noise of validation batch `index`: one generator per row (row noise) or per rank, seeded from
    the run's seed and the batch alone, never from training's streams."""
    if config.latent_noise == "row":
        return latent_generators("row", config.seed, index, rows, env.device, split=split)
    return generator(config.seed, "eval", split, index, env.rank, device=env.device)


def latent_warning(metrics: dict, kappa_bits: float, settled: bool) -> str | None:
    """A one-line warning when Z is unused (once training has `settled`) or carries the tokens, from
    `evaluate`'s measures; else None."""
    if "latent_bits_saved" not in metrics:
        return None
    saved, kl = metrics["latent_bits_saved"], metrics["val_kl_bits"]
    if settled and saved < COLLAPSED_SAVING:
        return (f"Z is unused: it saves {saved:.3f} bits per token (KL {kl:.3f} bits), the decoder ignores it; "
                "a larger post_sampler_init_std or optim.latent_lr_scale, or another seed, may revive it")
    if kappa_bits >= COPYING_KAPPA and kl >= 0.9 * kappa_bits and saved >= COPYING_SHARE * kl:
        return (f"Z carries the tokens: KL {kl:.2f} bits at kappa {kappa_bits:g} and Z saves {saved:.2f} bits per "
                "token, so the training loss flatters the model; generation (prior Z) scores "
                f"{metrics['val_prior_cross_entropy_bits']:.3f} bits per token")
    return None
