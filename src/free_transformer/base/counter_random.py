"""Counter-based random numbers: a random 64-bit word is a hash of (a row's key, a position, a stream, an index),
so that every row's draws at its own position come out of one tensor operation on the batch, with no generator
object per row and no state to advance, inside or outside a captured graph alike.

The hash is SplitMix64's (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014),
used twice as SplitMix64 splits: a row's key is mix(seed); its state at position t is mix(key + (t + 1) *
POSITION_GAMMA), the t-th output of SplitMix64 seeded with the key; word j of stream s there is
mix(state + (s * STREAM_STRIDE + j + 1) * GAMMA), the sequence SplitMix64 outputs from that state (which passes
BigCrush). All of it is int64 tensor arithmetic, whose products wrap modulo 2^64 on every device torch runs on
(the tests check the words against `mix_int`, the same hash on Python integers).

    row_keys(seeds)                      (...,) keys of 63-bit seeds
    states(keys, positions)              (...,) each row's state at its position
    offsets(stream, n)                   (n,) the counters of a stream's first n words, times GAMMA
    words(keys, positions, stream, n)    (..., n) those words: mix(states[..., None] + offsets)
    uniform(words)                       floats in (0, 1) from a word's top 24 bits
    uniform64(words)                     doubles in (0, 1) from a word's top 53 bits

A caller drawing several streams at once (the decoding engine: prior Z and token noise) concatenates their
offsets and mixes once.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit unsigned constant as the int64 that has its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


GAMMA = 0x9E3779B97F4A7C15  # the golden ratio's 64-bit fraction: SplitMix64's increment
POSITION_GAMMA = 0xD1B54A32D192ED03  # another odd increment, for the positions' states
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's multipliers
STREAM_STRIDE = 1 << 32  # words per stream at a position
TOKEN, LATENT = 0, 1  # the streams: the noise of the token sampled from a position's logits, the prior Z fed there


def mix_int(x: int) -> int:
    """SplitMix64's finaliser on a Python integer (the reference of `mix`), modulo 2^64."""
    x &= MASK64
    x ^= x >> 30
    x = (x * M1) & MASK64
    x ^= x >> 27
    x = (x * M2) & MASK64
    return x ^ (x >> 31)


def shift_right(x: Tensor, bits: int) -> Tensor:
    """The logical right shift of int64 `x` (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: Tensor) -> Tensor:
    """SplitMix64's finaliser, elementwise on int64 (products wrap modulo 2^64)."""
    x = x ^ shift_right(x, 30)
    x = x * _signed(M1)
    x = x ^ shift_right(x, 27)
    x = x * _signed(M2)
    return x ^ shift_right(x, 31)


def row_keys(seeds: Tensor) -> Tensor:
    """(...,) int64 keys of (...,) non-negative int64 seeds: one per row, set once when the row starts."""
    return mix(seeds)


def states(keys: Tensor, positions: Tensor) -> Tensor:
    """(...,) int64 state of each key (...,) at its position (...,)."""
    return mix(keys + (positions + 1) * _signed(POSITION_GAMMA))


def offsets(stream: int, n: int, device=None) -> Tensor:
    """(n,) int64: the counters of words [0, n) of `stream` (TOKEN or LATENT), times GAMMA (wrapping)."""
    counters = torch.arange(stream * STREAM_STRIDE + 1, stream * STREAM_STRIDE + n + 1, device=device)
    return counters * _signed(GAMMA)


def words(keys: Tensor, positions: Tensor, stream: int, n: int) -> Tensor:
    """(..., n) int64 random words: n of the `stream` of each key (...,) at its position (...,)."""
    return mix(states(keys, positions)[..., None] + offsets(stream, n, keys.device))


# The largest float32 below 1: where (k + 1/2) / 2^24 rounds to 1 (k = 2^24 - 1), `uniform` gives this instead.
BELOW_ONE = 1.0 - 2.0**-24


def uniform(word: Tensor) -> Tensor:
    """Float32 in (0, 1) from each word's top 24 bits k: (k + 1/2) / 2^24 rounded to float32, never 0 nor 1. Below
    1/2 it is exact; above, float32's step is 2^-24 and it rounds to a neighbour, the last word's (1) to BELOW_ONE."""
    return ((shift_right(word, 40).float() + 0.5) * 2.0**-24).clamp_(max=BELOW_ONE)


def uniform64(word: Tensor) -> Tensor:
    """Float64 in (0, 1) from each word's top 53 bits: (k + 1/2) / 2^53, never 0 nor 1."""
    return (shift_right(word, 11).double() + 0.5) * 2.0**-53
