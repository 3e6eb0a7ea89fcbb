"""Validation during training (every `validate_every` steps): cross-entropy and KL on held-out batches
and, for a Free Transformer, what its latent does (measures.py): the honest cross-entropy with Z
drawn from the prior (as at generation), the bits the encoder's Z saves per token, the KL of each unit of Z,
and a warning when Z has collapsed or carries the tokens themselves. Computed with its own
generators: training's RNG streams are untouched. Benchmarks scored during training are another
thing: train/periodic.py."""

from __future__ import annotations

import contextlib

import torch

from ..analysis.measures import dead_units, latent_verdict, saving
from ..base.latent_choice import LatentChoice
from ..base.seeding import generator
from ..base.units import LN2
from ..distributed import ParallelEnv
from ..inference.latents import LatentPlan
from ..model.latent import LatentSpace
from ..model.transformer import FreeTransformer
from .config import TrainConfig
from .noise import latent_generators


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def validate(
    model: torch.nn.Module, dataset, config: TrainConfig, device: torch.device, env: ParallelEnv | None = None
) -> dict:
    """Validation measures in bits per token, on `config.validation_batches` held-out batches (the same ones at
    every evaluation). Under ddp / fsdp (env given) each rank computes its slice of every batch.

    val_cross_entropy_bits, val_kl_bits: with Z from the encoder, as the training loss.
    For a Free Transformer also: val_prior_cross_entropy_bits (Z from the uniform prior: what generation
    does; an upper bound of the honest -log P(x)), latent_bits_saved (measures.saving of the two),
    and where the latent space's units are independent (so each one's KL means something on its own),
    val_kl_bits_per_unit (H values) and dead_units (measures.dead_units)."""
    env = env or ParallelEnv("none", device)
    free = config.model.is_free
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=env.device)  # CE encoder Z, KL, CE prior Z (nats)
    space = _latent_space(model)
    # the space whose units' KLs are logged one by one: where they are independent (each means something alone)
    unit_space = space if space is not None and space.independent_units else None
    per_bit = torch.zeros(config.model.latent_units, dtype=torch.float64, device=env.device)  # (H,) KL nats
    rows = env.rows(config.batch_size)
    for index in range(config.validation_batches):
        batch = dataset.batch(index, config.batch_size, split="val")[rows.start : rows.stop].to(env.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast_context(config.precision, env.device):
            out = model(
                inputs,
                targets,
                kappa_nats=config.kappa_nats(config.steps),
                generator=_generator(config, index, rows, env, "val"),
            )
            if free:
                prior_z = _prior(model, inputs, _generator(config, index, rows, env, "prior"))  # (B, T, ...)
                prior = model(inputs, targets, latents=prior_z)
        totals[0] += out.cross_entropy_nats.double()
        if free:
            totals[1] += out.kl_nats.double()
            totals[2] += prior.cross_entropy_nats.double()
            if unit_space is not None:
                per_bit += unit_space.kl_per_unit(out.posterior).double().mean(dim=(0, 1))
    model.train()
    totals, per_bit = (
        env.mean(totals) / config.validation_batches / LN2,
        env.mean(per_bit) / config.validation_batches / LN2,
    )
    ce, kl, prior_ce = totals.tolist()
    if not free:
        return {"val_cross_entropy_bits": ce, "val_kl_bits": 0.0}
    measures = {
        "val_cross_entropy_bits": ce,
        "val_kl_bits": kl,
        "val_prior_cross_entropy_bits": prior_ce,
        "latent_bits_saved": saving(prior_ce, ce),
    }
    if unit_space is not None:
        kl_bits = per_bit.tolist()
        measures |= {"val_kl_bits_per_unit": kl_bits, "dead_units": dead_units(kl_bits)}
    return measures


def _latent_space(model: torch.nn.Module) -> LatentSpace | None:
    """The latent space of `model`, a FreeTransformer or one that ddp wraps (its .module); None for a baseline."""
    inner = getattr(model, "module", model)
    assert isinstance(inner, FreeTransformer)  # fsdp shards the model in place: still a FreeTransformer
    return inner.latent_space


def _prior(model: torch.nn.Module, inputs: torch.Tensor, generator) -> torch.Tensor:
    """(B, T, *value_shape) prior Z for a validation batch, from the plan of a generation without a prompt."""
    plan = LatentPlan(inputs.shape[0], _latent_space(model), prompt_source=LatentChoice.PRIOR, generators=generator)
    return plan.draw(inputs.shape[1], inputs.device)  # what plan.source(0, T) gives: no prompt, all prior


def _generator(config: TrainConfig, index: int, rows: range, env: ParallelEnv, split: str):
    """Latent noise of validation batch `index`: one generator per row (row noise) or per rank, seeded from
    the run's seed and the batch alone, never from training's streams."""
    if config.latent_noise == "row":
        return latent_generators("row", config.seed, index, rows, env.device, split=split)
    return generator(config.seed, "eval", split, index, env.rank, device=env.device)


def settled(config: TrainConfig, step: int) -> bool:
    """Z is unused early in every run: only a quarter into training, and past the warm-up, is that news."""
    return step > max(config.optim.warmup_steps, config.steps // 4)


def latent_warning(metrics: dict, kappa_bits: float, settled: bool) -> str | None:
    """measures.latent_verdict on `validate`'s measures (None for a baseline)."""
    if "latent_bits_saved" not in metrics:
        return None
    return latent_verdict(
        metrics["latent_bits_saved"],
        metrics["val_kl_bits"],
        kappa_bits,
        metrics["val_prior_cross_entropy_bits"],
        settled,
    )
