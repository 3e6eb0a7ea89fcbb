"""Z per position, dispensed: the one rule of which Z position t of a row takes, for every path that feeds Z
(the decoding engine's rows, `LatentPlan` and with it the Hugging Face wrapper and scoring, the model's own
prior draws):

    explicit values   the positions [0, N) a row's given (N, *value_shape) values cover;
    the prior         every other position: with counter-based row keys, row i's LATENT stream at t (a function
                      of (key_i, t) alone: free_transformer.base.counter_random); else a draw of
                      `LatentSpace.prior` from generator i (one per row) or the global RNG.

Drawn beforehand (`planned_z`): every Z a row will feed is known before its first step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .draws import Generators, counter_prior
from .space import LatentSpace


def prior_z(
    space: LatentSpace,
    rows: int,
    start: int,
    end: int,
    *,
    keys: Tensor | None = None,
    generators: Generators = None,
    device=None,
) -> Tensor:
    """(rows, end - start, *value_shape) prior Z of positions [start, end): row i's counter-based LATENT stream at
    each position with `keys` (rows,), else `space.prior` from generators[i] (or the global RNG)."""
    if keys is None:
        return space.prior((rows, end - start), generators, device)
    positions = torch.arange(start, end, device=keys.device)
    return counter_prior(space, keys.view(-1, 1), positions[None, :])


def planned_z(
    space: LatentSpace,
    rows: int,
    start: int,
    end: int,
    *,
    explicit: Sequence[Tensor | None] | Tensor | None = None,
    keys: Tensor | None = None,
    generators: Generators = None,
    device=None,
) -> Tensor:
    """(rows, end - start, *value_shape) the Z of positions [start, end): row i's explicit[i] values (N_i,
    *value_shape) at the positions they cover, the prior's (`prior_z`) at the others. A range that every row's
    values cover draws nothing (a generator's state moves only for the positions the prior fills)."""
    given = [None] * rows if explicit is None else list(explicit)
    if given and all(values is not None and values.shape[0] >= end for values in given):
        return torch.stack([values[start:end] for values in given if values is not None])
    out = prior_z(space, rows, start, end, keys=keys, generators=generators, device=device)
    for row, values in enumerate(given):
        if values is not None and values.shape[0] > start:
            covered = min(values.shape[0], end)
            out[row, : covered - start] = values[start:covered].to(out.device)
    return out
