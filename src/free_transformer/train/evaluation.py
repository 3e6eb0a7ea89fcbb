"""Evaluation during training: validation cross-entropy and KL on held-out batches, computed without
touching training's RNG streams."""

from __future__ import annotations

import contextlib
import math

import torch

from ..distributed import ParallelEnv
from .config import TrainConfig
from .noise import latent_generators

LN2 = math.log(2.0)


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()



@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, config: TrainConfig, device: torch.device,
             env: ParallelEnv | None = None) -> dict:
    """Validation cross-entropy (posterior latents, as in training) and KL, in bits per token; under
    ddp / fsdp (env given) each rank computes its slice of every validation batch."""
    env = env or ParallelEnv("none", device)
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # cross-entropy, KL (nats)
    rows = env.rows(config.batch_size)
    rng_state = torch.get_rng_state()  # keep the training RNG stream independent of evaluation
    for index in range(config.eval_batches):
        batch = dataset.batch(index, config.batch_size, split="val")[rows.start : rows.stop].to(env.device)
        generator = latent_generators(config.latent_noise, config.seed, index, rows, env.device, split="val")
        with autocast_context(config.precision, env.device):
            out = model(batch[:, :-1], batch[:, 1:], kappa_nats=config.kappa_nats(config.steps),
                        generator=generator)
        kl = out.kl_nats if out.kl_nats is not None else torch.zeros((), device=env.device)
        totals += torch.stack([out.cross_entropy_nats.double(), kl.double()]) / config.eval_batches
    torch.set_rng_state(rng_state)
    model.train()
    ce, kl = env.mean(totals).tolist()
    return {"val_cross_entropy_bits": ce / LN2, "val_kl_bits": kl / LN2}
