"""The noise of the posterior sampling of Z during training (config.latent_noise).

global: the torch RNG stream. One process draws from one stream seeded once by `seed` (and saved in
its checkpoints). Several processes must not draw the same noise for different rows, so under ddp /
fsdp each rank's stream is reseeded at every step from (seed, step, rank): independent across ranks and reproducible,
also after a resume on the same number of processes, but not equal to a one-process run's.

row: row i of the global batch of step s draws its bits from its own generator seeded from
(seed, split, s, i). Z is then a function of the data and the weights alone: a run on 1 or N processes,
with any grad_accum, samples the same Z for the same row, which is what makes the losses of a
2-process and a 1-process run comparable to rounding error (tests/test_distributed.py).
"""

from __future__ import annotations

import torch

from ..base.seeding import generator, seed_of


def latent_row_generators(
    seed: int, step: int, rows: range, device: torch.device, split: str = "train"
) -> list[torch.Generator]:
    """One generator per global row index in `rows`, for the model's `generator=` argument."""
    return [generator(seed, "latent", split, step, row, device=device) for row in rows]


def latent_generators(
    latent_noise: str,
    seed: int,
    step: int,
    rows: range,
    device: torch.device,
    *,
    rank: int | None = None,
    split: str = "train",
) -> list[torch.Generator] | None:
    """The `generator=` argument for the rows `rows` of batch `step`: per-row generators (row noise),
    or None after reseeding this rank's global stream (global noise, rank given: several processes),
    or None (global noise, one process)."""
    if latent_noise == "row":
        return latent_row_generators(seed, step, rows, device, split)
    if rank is not None:
        torch.manual_seed(seed_of(seed, "stream", split, step, rank))
    return None
