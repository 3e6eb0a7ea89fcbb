"""Each row's seed in a sampling call: the one rule for `generate()` and the Hugging Face wrapper's
`generate(seeds=)`, apart from the engine (a Hugging Face export ships this module, not the engine's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..base.seeding import sample_seed
from .params import MAX_SEED


def row_seeds(seeds: Sequence[int] | None, batch_size: int, seed: int | None = None) -> list[int]:
    """Each row's seed: `seeds` (one per row) as given; else row k's `sample_seed(seed, k, 0)`, with a `seed`
    drawn from torch's global RNG when none is given (so that it follows torch.manual_seed)."""
    if seeds is not None and seed is not None:
        raise ValueError("pass seeds (one per row) or seed (one for the call), not both")
    if seeds is None:
        seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        return [sample_seed(seed, k, 0) for k in range(batch_size)]
    if len(seeds) != batch_size:
        raise ValueError(f"got {len(seeds)} seeds for {batch_size} prompts")
    if not all(0 <= int(s) <= MAX_SEED for s in seeds):
        raise ValueError(f"every seed must be in [0, 2**63), got {list(seeds)}")
    return [int(s) for s in seeds]
