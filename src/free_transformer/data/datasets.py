"""Datasets as pure functions of (step, split): batch k of a run is the same whatever happened before,
so a resumed run sees exactly the batches an uninterrupted one would, with no loader state to save."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..errors import UserError
from ..tokenizer import Tokenizer, get_tokenizer
from .config import DataConfig
from .corpora import is_named, named_corpus
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
    """Random windows of a tokenized corpus, memory-mapped from disk (corpora larger than RAM work).

    A file or folder: the last `val_fraction` of its tokens is the validation split. A named corpus
    (`corpus:NAME`, data/corpora.py): its held-out documents are, so no validation window overlaps a
    training document."""

    def __init__(self, config: DataConfig, seed: int):
        self.seed, self.sequence_length = seed, config.seq_len
        self.tokenizer_name = config.tokenizer
        tokenizer = get_tokenizer(config.tokenizer)
        if is_named(config.path):
            train_files, val_files = named_corpus(config.path).files()
            self.splits = {"train": tokenize_files(train_files, tokenizer, _cache_dir(config)),
                           "val": tokenize_files(val_files, tokenizer, _cache_dir(config))}
        else:
            tokens = tokenize_files(corpus_files(config.path), tokenizer, _cache_dir(config))
            split_at = int(len(tokens) * (1 - config.val_fraction))
            self.splits = {"train": tokens[:split_at], "val": tokens[split_at:]}
        for split, tokens in self.splits.items():
            if len(tokens) < self.sequence_length + 1 and (split == "train" or config.val_fraction > 0 or is_named(config.path)):
                raise DataError(
                    f"the {split} split of {config.path} has {len(tokens)} tokens, fewer than seq_len + 1 = "
                    f"{self.sequence_length + 1}"
                )

    def batch(self, step, batch_size, split="train"):
        tokens = self.splits[split]
        starts = torch.randint(0, len(tokens) - self.sequence_length, (batch_size,),
                               generator=_generator(self.seed, step, split))
        rows = [np.asarray(tokens[s : s + self.sequence_length + 1], dtype=np.int64) for s in starts.tolist()]
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


def _cache_dir(config: DataConfig) -> Path:
    """data.cache_dir, else the user's cache: never beside the corpus, whose folder may be read-only or
    someone else's (the file names hold a fingerprint of the corpus's resolved paths, so corpora never mix)."""
    if config.cache_dir:
        return Path(config.cache_dir)
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "free-transformer" / "tokens"


def tokenize_files(files: list[Path], tokenizer: Tokenizer, cache_dir: Path, chunk_chars: int = 1 << 20) -> np.memmap:
    """Tokenize files once into a flat binary file (streamed, chunk by chunk) and memory-map it. Each
    document is followed by the tokenizer's document separator (GPT-2: end-of-text; bytes: a line break)."""
    separator = tokenizer.document_separator
    fingerprint = hashlib.sha256(json.dumps(
        [tokenizer.name, separator] + [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    ).encode()).hexdigest()[:16]
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    target = cache_dir / f"{tokenizer.name.replace('/', '_')}-{fingerprint}.bin"
    if not target.exists():
        partial = target.with_suffix(f".partial{os.getpid()}")
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as out:
                for file in files:
                    with open(file, encoding="utf-8", errors="replace") as handle:
                        while chunk := handle.read(chunk_chars):
                            chunk += handle.readline()  # end chunks at a line break, not inside a token
                            out.write(np.asarray(tokenizer.encode(chunk), dtype=dtype).tobytes())
                    out.write(np.asarray(separator, dtype=dtype).tobytes())
            os.replace(partial, target)
        except OSError as error:  # unreadable corpus, unwritable cache, full disk
            with contextlib.suppress(OSError):
                partial.unlink()
            raise DataError(f"cannot tokenize the corpus into the cache {cache_dir}: {error.strerror or error} "
                            f"({error.filename}); set data.cache_dir= to a writable folder") from None
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
