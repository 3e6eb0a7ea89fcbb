"""The paper's synthetic letters (section "Synthetic Dataset") and the coin flips of its Motivation.

Letters: 64 underscores; an upper-case letter repeated 8 times at a uniformly random position;
every character replaced by '!' with probability 1/16; the prompt "<letter>>" in front. 66 bytes.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

BODY_LENGTH = 64
TARGET_LENGTH = 8
NOISE_PROBABILITY = 1 / 16
LETTERS = string.ascii_uppercase
N_POSITIONS = BODY_LENGTH - TARGET_LENGTH + 1  # 57 possible target starts


def letters_batch(batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """(B, 66) byte ids: "K>" then the 64-character body."""
    letter = torch.randint(0, 26, (batch_size,), generator=generator) + ord("A")
    start = torch.randint(0, N_POSITIONS, (batch_size,), generator=generator)
    pos = torch.arange(BODY_LENGTH)
    in_target = (pos >= start[:, None]) & (pos < start[:, None] + TARGET_LENGTH)  # (B, 64)
    body = torch.where(in_target, letter[:, None], torch.full_like(in_target, ord("_"), dtype=torch.int64))
    noise = torch.rand(batch_size, BODY_LENGTH, generator=generator) < NOISE_PROBABILITY
    body = torch.where(noise, ord("!"), body)
    prompt = torch.stack([letter, torch.full_like(letter, ord(">"))], dim=1)
    return torch.cat([prompt, body], dim=1)


COIN_START = ord("\n")  # the start byte: every X_t is predicted, and generation can begin before the first


def coinflip_batch(batch_size: int, length: int, epsilon: float, generator: torch.Generator) -> torch.Tensor:
    """(B, 1 + length) bytes: the start byte, then '0'/'1' values X_1..X_length of a hidden fair coin Z,
    each X_t equal to Z flipped with probability epsilon."""
    return coinflip_with_coins(batch_size, length, epsilon, generator)[0]


def coinflip_with_coins(
    batch_size: int, length: int, epsilon: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`coinflip_batch`'s sequences (B, 1 + length) and their hidden coins (B,) in {0, 1}."""
    coin = torch.randint(0, 2, (batch_size, 1), generator=generator)
    flips = (torch.rand(batch_size, length, generator=generator) < epsilon).long()
    start = torch.full((batch_size, 1), COIN_START, dtype=torch.long)
    return torch.cat([start, (coin ^ flips) + ord("0")], dim=1), coin[:, 0]


def majority_coin(values: str) -> int | None:
    """The coin a generated sequence shows: its majority value; None on a tie or a byte other than 0/1."""
    if not values or set(values) - {"0", "1"}:
        return None
    ones = values.count("1")
    return None if 2 * ones == len(values) else int(2 * ones > len(values))


@dataclass(frozen=True)
class LetterAnalysis:
    """What a generated 64-character body says about the task's structure."""

    valid: bool  # the prompt's letter forms exactly one block of 8 (noise allowed) and nothing else
    position: int | None  # start of the block, when valid
    noise: frozenset[int]  # positions of '!'


def analyse_letters(body: str, letter: str) -> LetterAnalysis:
    noise = frozenset(i for i, c in enumerate(body) if c == "!")
    hits = [i for i, c in enumerate(body) if c == letter]
    allowed = {"_", "!", letter}
    if len(body) != BODY_LENGTH or not hits or any(c not in allowed for c in body):
        return LetterAnalysis(False, None, noise)
    for start in range(max(0, hits[-1] - TARGET_LENGTH + 1), min(hits[0], N_POSITIONS - 1) + 1):
        window = body[start : start + TARGET_LENGTH]
        if "_" not in window:  # every letter inside, only letters and noise in the block
            return LetterAnalysis(True, start, noise)
    return LetterAnalysis(False, None, noise)
