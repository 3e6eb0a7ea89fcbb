"""Each row's seed in a sampling call: the one rule for `generate()` and the Hugging Face wrapper's
`generate(seeds=)`, apart from the engine (a Hugging Face export ships this module, not the engine's)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..base.seeding import sample_seed
from .params import check_seed


def row_seeds(seeds: Sequence[int] | None, batch_size: int, seed: int | None = None) -> list[int]:
    """Each row's seed: `seeds` (one per row) as given; else row k's `sample_seed(seed, k, 0)`, with a `seed`
    drawn from torch's global RNG when none is given (so that it follows torch.manual_seed). Each is checked by
    `check_seed`, the one rule of the CLI, the server and Python."""
    if seeds is not None and seed is not None:
        raise ValueError("pass seeds (one per row) or seed (one for the call), not both")
    if seeds is None:
        seed = int(torch.randint(0, 2**62, ())) if seed is None else check_seed(seed)
        return [sample_seed(seed, k, 0) for k in range(batch_size)]
    if len(seeds) != batch_size:
        raise ValueError(f"got {len(seeds)} seeds for {batch_size} prompts")
    return [check_seed(s, f"seeds[{k}]") for k, s in enumerate(seeds)]
