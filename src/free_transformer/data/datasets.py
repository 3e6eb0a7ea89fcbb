"""Datasets as pure functions of (step, split): batch k of a run is the same whatever happened before,
so a resumed run sees exactly the batches an uninterrupted one would, with no loader state to save.

Each kind of dataset registers here the function that builds it from its config section
(`register_data_kind`); `build_dataset` is one lookup. text.py and shards.py register theirs."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from ..base.errors import UserError
from ..base.seeding import generator
from .config import CoinflipConfig, DataConfig, LettersConfig, data_kinds
from .synthetic import coinflip_batch, letters_batch

SPLIT_STREAMS = {"train": 0, "val": 1}


class DataError(UserError, ValueError):
    """The dataset cannot be built from the configuration (missing or empty corpus, bad options)."""


class Dataset(Protocol):
    tokenizer_name: str
    sequence_length: int  # model input length T (each batch row holds T + 1 tokens)

    def batch(self, step: int, batch_size: int, split: str = "train") -> torch.Tensor:
        """(batch_size, T + 1) token ids for training step `step`."""


DATA_KINDS: dict[str, Callable[[object, int], Dataset]] = {}  # kind -> build(its config section, seed)


def register_data_kind(name: str):
    """Decorator: `build(section, seed) -> Dataset` builds the kind `name` from `DataConfig.<name>`."""
    if name not in data_kinds():
        raise TypeError(f"data kind {name!r} has no section in DataConfig (data/config.py)")

    def register(build):
        DATA_KINDS[name] = build
        return build

    return register


def check_sequence_length(name: str, seq_len: int | None) -> int:
    """A text or token section's seq_len, checked: set (a run's config gives it the model's max_seq_len) and >= 1."""
    if seq_len is None:
        raise DataError(f"{name} is not set: give it (a training config defaults it to model.max_seq_len)")
    if seq_len < 1:
        raise DataError(f"{name} must be >= 1, got {seq_len}")
    return seq_len


def build_dataset(config: DataConfig, seed: int) -> Dataset:
    """The dataset of `config`'s kind: those of text.py and shards.py are registered once the package hands
    out this function (free_transformer.data.build_dataset), which imports them."""
    if config.kind not in DATA_KINDS:
        raise DataError(f"unknown data kind {config.kind!r}; choose one of {', '.join(DATA_KINDS)}")
    return DATA_KINDS[config.kind](config.section(), seed)


def batch_generator(seed: int, step: int, split: str) -> torch.Generator:
    """A generator for one batch, derived from (seed, split, step) alone."""
    return generator(seed, SPLIT_STREAMS[split], step)


class LettersDataset:
    tokenizer_name = "byte"
    sequence_length = 65

    def __init__(self, seed: int):
        self.seed = seed

    def batch(self, step, batch_size, split="train"):
        return letters_batch(batch_size, batch_generator(self.seed, step, split))


class CoinFlipDataset:
    tokenizer_name = "byte"

    def __init__(self, seed: int, length: int, epsilon: float):
        if length < 2 or not 0 <= epsilon <= 1:
            raise DataError(f"coinflip needs length >= 2 and epsilon in [0, 1], got {length}, {epsilon}")
        self.seed, self.length, self.epsilon = seed, length, epsilon
        self.sequence_length = length  # the start byte, then `length` values: every value is predicted

    def batch(self, step, batch_size, split="train"):
        return coinflip_batch(batch_size, self.length, self.epsilon, batch_generator(self.seed, step, split))


@register_data_kind("letters")
def _letters(config: LettersConfig, seed: int) -> LettersDataset:
    return LettersDataset(seed)


@register_data_kind("coinflip")
def _coinflip(config: CoinflipConfig, seed: int) -> CoinFlipDataset:
    return CoinFlipDataset(seed, config.length, config.epsilon)


@dataclasses.dataclass
class Split:
    """One split of a token stream: 1-D arrays of ids (memory-mapped: a cache file, a slice of one, or
    the shards), in order. A window never spans two arrays: shards need not end where documents do."""

    arrays: list[np.ndarray]

    def tokens(self) -> int:
        return sum(len(a) for a in self.arrays)


class TokenWindows:
    """Random windows of T + 1 consecutive tokens from each split (the text and tokens kinds).

    The window start is uniform over every position of every array that leaves T + 1 tokens; with one
    array that is `randint(0, len - T)`."""

    def __init__(
        self,
        splits: dict[str, Split],
        sequence_length: int,
        seed: int,
        tokenizer_name: str,
        source: str,
        val_required: bool,
        vocab_size: int | None = None,
    ):
        self.splits, self.sequence_length, self.seed = splits, sequence_length, seed
        self.tokenizer_name, self.source, self.vocab_size = tokenizer_name, source, vocab_size
        self._ends = {}  # split -> cumulative number of window starts, array by array
        for name, split in splits.items():
            self._ends[name] = np.cumsum([max(0, len(a) - sequence_length) for a in split.arrays]).tolist()
            if (not self._ends[name] or not self._ends[name][-1]) and (name == "train" or val_required):
                longest = max((len(a) for a in split.arrays), default=0)
                where = " in its longest shard" if len(split.arrays) > 1 else ""
                raise DataError(
                    f"the {name} split of {source} has {longest} tokens{where}, fewer than seq_len + 1 = "
                    f"{sequence_length + 1}"
                )

    def batch(self, step, batch_size, split="train"):
        ends, arrays = self._ends[split], self.splits[split].arrays
        if not ends or not ends[-1]:
            raise DataError(f"{self.source} has no {split} split: set its val_fraction above 0")
        picks = torch.randint(0, ends[-1], (batch_size,), generator=batch_generator(self.seed, step, split))
        rows = []
        for pick in picks.tolist():
            index = bisect.bisect_right(ends, pick)
            start = pick - (ends[index - 1] if index else 0)
            rows.append(np.asarray(arrays[index][start : start + self.sequence_length + 1], dtype=np.int64))
        batch = np.stack(rows)
        if self.vocab_size is not None and batch.max() >= self.vocab_size:
            raise DataError(
                f"{self.source} holds token id {batch.max()}, beyond the {self.tokenizer_name} tokenizer's "
                f"{self.vocab_size} ids: name the tokenizer the shards were written with"
            )
        return torch.from_numpy(batch)
