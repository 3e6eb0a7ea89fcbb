"""Seeds and generators. Every random stream of the package is named by parts (the run's seed, what
it is for, the step, the row...) and hashed to a seed, so that it is the same on every machine,
process and Python hash seed, and independent of every other stream.

    seed_of(*parts)           blake2b: training's data batches and latent noise, validation
    benchmark_seed(*parts)    sha256: benchmark few-shot choices and latent draws (the digest their
                              records were scored with, kept so that a record's lines stay comparable)
    generator(*parts)         a torch.Generator seeded by seed_of(*parts)
    generators(seeds)         one torch.Generator per explicit seed (a batch's rows)
    sample_seed(seed, p, i)   the seed of sample i of prompt p of a call seeded `seed` (seed_of)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def seed_of(*parts) -> int:
    """A 63-bit seed (manual_seed takes a non-negative int64) of the parts joined by '/'."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """The seed of sample `sample` of prompt `prompt` (its index in the call) of a sampling call seeded `seed`:
    every sample of a call its own stream, the same whatever the batch it is decoded in."""
    return seed_of("sample", seed, prompt, sample)


def benchmark_seed(*parts) -> int:
    """A 63-bit seed of the parts joined by ':' (sha256): the benchmarks' streams."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def generator(*parts, device="cpu") -> torch.Generator:
    """The named stream `parts` (seeded by seed_of) on `device`."""
    return torch.Generator(device=device).manual_seed(seed_of(*parts))


def generators(seeds: Sequence[int], device="cpu") -> list[torch.Generator]:
    """One generator per seed, on the device whose random numbers it will make."""
    return [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]
