"""Datasets as pure functions of (step, split): batch k of a run is the same whatever happened before,
so a resumed run sees exactly the batches an uninterrupted one would, with no loader state to save."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..errors import UserError
from ..tokenizer import get_tokenizer
from .config import DataConfig
from .synthetic import coinflip_batch, letters_batch

SPLIT_STREAMS = {"train": 0, "val": 1}


class DataError(UserError, ValueError):
    """The dataset cannot be built from the configuration (missing or empty corpus, bad options)."""


class Dataset(Protocol):
    tokenizer_name: str
    sequence_length: int  # model input length T (each batch row holds T + 1 tokens)

    def batch(self, step: int, batch_size: int, split: str = "train") -> torch.Tensor:
        """(batch_size, T + 1) token ids for training step `step`."""


def _generator(seed: int, step: int, split: str) -> torch.Generator:
    """A generator for one batch, derived from (seed, split, step) alone."""
    digest = hashlib.blake2b(f"{seed}/{SPLIT_STREAMS[split]}/{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class LettersDataset:
    tokenizer_name = "byte"
    sequence_length = 65

    def __init__(self, seed: int):
        self.seed = seed

    def batch(self, step, batch_size, split="train"):
        return letters_batch(batch_size, _generator(self.seed, step, split))


class CoinFlipDataset:
    tokenizer_name = "byte"

    def __init__(self, seed: int, length: int, epsilon: float):
        if length < 2 or not 0 <= epsilon <= 1:
            raise DataError(f"coinflip needs length >= 2 and epsilon in [0, 1], got {length}, {epsilon}")
        self.seed, self.length, self.epsilon = seed, length, epsilon
        self.sequence_length = length - 1

    def batch(self, step, batch_size, split="train"):
        return coinflip_batch(batch_size, self.length, self.epsilon, _generator(self.seed, step, split))


class TextDataset:
    """Random windows of a tokenized corpus, memory-mapped from disk (corpora larger than RAM work)."""

    def __init__(self, config: DataConfig, seed: int):
        self.seed, self.sequence_length = seed, config.seq_len
        self.tokenizer_name = config.tokenizer
        self.tokens = tokenize_corpus(config)
        split_at = int(len(self.tokens) * (1 - config.val_fraction))
        self.splits = {"train": (0, split_at), "val": (split_at, len(self.tokens))}
        for split, (lo, hi) in self.splits.items():
            if hi - lo < self.sequence_length + 1 and (split == "train" or config.val_fraction > 0):
                raise DataError(
                    f"the {split} split of {config.path} has {hi - lo} tokens, fewer than seq_len + 1 = "
                    f"{self.sequence_length + 1}"
                )

    def batch(self, step, batch_size, split="train"):
        lo, hi = self.splits[split]
        starts = torch.randint(lo, hi - self.sequence_length, (batch_size,), generator=_generator(self.seed, step, split))
        rows = [np.asarray(self.tokens[s : s + self.sequence_length + 1], dtype=np.int64) for s in starts.tolist()]
        return torch.from_numpy(np.stack(rows))


def corpus_files(path: str | None) -> list[Path]:
    if not path:
        raise DataError("data.path is required for text data")
    root = Path(path)
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob("*.txt") if p.is_file())
        if files:
            return files
        raise DataError(f"no *.txt files under {root}")
    raise DataError(f"corpus not found: {root}")


def tokenize_corpus(config: DataConfig, chunk_chars: int = 1 << 20) -> np.memmap:
    """Tokenize the corpus once into a flat binary file (streamed, chunk by chunk) and memory-map it."""
    files = corpus_files(config.path)
    tokenizer = get_tokenizer(config.tokenizer)
    fingerprint = hashlib.sha256(
        json.dumps([tokenizer.name] + [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]).encode()
    ).hexdigest()[:16]
    cache_dir = Path(config.cache_dir) if config.cache_dir else Path(str(Path(config.path).resolve()) + ".tokens")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    target = cache_dir / f"{tokenizer.name}-{fingerprint}.bin"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".partial{os.getpid()}")
        with open(partial, "wb") as out:
            for file in files:
                with open(file, encoding="utf-8", errors="replace") as handle:
                    while chunk := handle.read(chunk_chars):
                        chunk += handle.readline()  # end chunks at a line break, not inside a token
                        out.write(np.asarray(tokenizer.encode(chunk), dtype=dtype).tobytes())
                out.write(np.asarray(tokenizer.encode("\n"), dtype=dtype).tobytes())
        os.replace(partial, target)
    return np.memmap(target, dtype=dtype, mode="r")


def build_dataset(config: DataConfig, seed: int) -> Dataset:
    if config.kind == "letters":
        return LettersDataset(seed)
    if config.kind == "coinflip":
        return CoinFlipDataset(seed, config.coinflip_length, config.coinflip_epsilon)
    if config.kind == "text":
        if config.seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {config.seq_len}")
        return TextDataset(config, seed)
    raise DataError(f"unknown data kind {config.kind!r}; choose letters, coinflip or text")
