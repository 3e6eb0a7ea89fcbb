"""Pre-tokenized shards in llm.c's format (karpathy/llm.c dev/data/data_common.py; modded-nanogpt reads
the same): a header of 256 little-endian int32 (magic, version, token count, then zeros), then exactly
that many tokens. llm.c writes two variants: GPT-2's (magic 20240520, version 1, uint16 tokens) and
Llama 3's (magic 20240801, version 7, uint32 tokens, for vocabularies beyond 2^16 ids). Shards are
memory-mapped, never read whole. The `tokens` kind trains on them; `free-transformer tokenize` writes them.

Validation, as in llm.c (fineweb_val_000000.bin, tinyshakespeare_val.bin): the shards whose file name
has the word val, valid or validation; without such shards, the last `val_fraction` of the tokens."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..base.fileio import remove_stale_partials
from .config import TokensConfig
from .datasets import DataError, Split, TokenWindows, check_sequence_length, register_data_kind
from .tokenizer import get_tokenizer

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# (magic, version) -> token dtype
FORMATS: dict[tuple[int, int], np.dtype] = {(20240520, 1): np.dtype("<u2"), (20240801, 7): np.dtype("<u4")}
MAX_SHARD_TOKENS = 2**31 - 1  # the count is an int32
VALIDATION_WORDS = {"val", "valid", "validation"}


def shard_format(vocab_size: int) -> tuple[int, int]:
    """(magic, version) of the smallest format that holds every id of a vocabulary."""
    return (20240520, 1) if vocab_size <= 2**16 else (20240801, 7)


def read_shard(path: Path) -> np.ndarray:
    """A shard's tokens, memory-mapped; a file that is not a whole shard is a DataError naming it."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path} is not a token shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    magic, version, count = (int(v) for v in np.fromfile(path, dtype="<i4", count=3))
    dtype = FORMATS.get((magic, version))
    if dtype is None:
        raise DataError(
            f"{path} is not an llm.c token shard: magic {magic} version {version}, expected "
            f"{' or '.join(f'{m} version {v}' for m, v in FORMATS)}"
        )
    expected = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected:
        raise DataError(
            f"{path} is {'truncated' if size < expected else 'longer than its header says'}: "
            f"{count} tokens make {expected} bytes, the file has {size}"
        )
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def is_validation(path: Path) -> bool:
    """fineweb_val_000000.bin, val.bin, shard-validation-3.bin: yes; interval_000.bin: no."""
    return bool(VALIDATION_WORDS & set(re.split(r"[^a-z]+", path.stem.lower())))


class ShardWriter:
    """Writes a stream of token arrays as shards of at most `shard_tokens` tokens, named
    {prefix}_{split}_{index:06d}.bin (llm.c's names); each is written to a temporary file, its header last,
    then renamed, so a shard on disk is always whole."""

    def __init__(self, folder: Path, prefix: str, split: str, vocab_size: int, shard_tokens: int):
        if not 0 < shard_tokens <= MAX_SHARD_TOKENS:
            raise DataError(f"shard_tokens must be in [1, {MAX_SHARD_TOKENS}], got {shard_tokens}")
        self.folder, self.prefix, self.split, self.shard_tokens = folder, prefix, split, shard_tokens
        self.magic, self.version = shard_format(vocab_size)
        self.dtype = FORMATS[self.magic, self.version]
        self.paths: list[Path] = []
        self.tokens = 0  # written, all shards
        self._handle: BinaryIO | None = None  # the open shard
        self._count = 0  # its tokens so far
        remove_stale_partials(folder, f"{prefix}_{split}_*.partial*")

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while len(ids):
            handle = self._handle if self._handle is not None else self._open()
            room = self.shard_tokens - self._count
            handle.write(ids[:room].tobytes())
            self._count += min(room, len(ids))
            ids = ids[room:]
            if self._count == self.shard_tokens:
                self._close()

    def close(self) -> list[Path]:
        """Finish the last shard; the paths of all the shards written."""
        if self._handle is not None:
            self._close()
        return self.paths

    def _path(self) -> Path:
        return self.folder / f"{self.prefix}_{self.split}_{len(self.paths):06d}.bin"

    def _open(self) -> BinaryIO:
        self._handle = handle = open(self._path().with_suffix(f".partial{os.getpid()}"), "wb")  # noqa: SIM115 (closed by _close)
        handle.write(bytes(HEADER_BYTES))  # the header is written when the count is known
        self._count = 0
        return handle

    def _close(self) -> None:
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = self.magic, self.version, self._count
        handle = self._handle
        assert handle is not None  # called on an open shard only
        handle.seek(0)
        handle.write(header.tobytes())
        handle.close()
        path = self._path()
        os.replace(handle.name, path)
        self.paths.append(path)
        self.tokens += self._count
        self._handle = None

    def abort(self) -> None:
        """Remove the shard being written (after an error); finished shards stay."""
        if self._handle is not None:
            self._handle.close()
            Path(self._handle.name).unlink(missing_ok=True)
            self._handle = None


def write_shards(
    arrays: Iterable[np.ndarray], folder: Path, prefix: str, split: str, vocab_size: int, shard_tokens: int
) -> list[Path]:
    """Write a stream of token arrays (encode_corpus) as shards; their paths."""
    writer = ShardWriter(folder, prefix, split, vocab_size, shard_tokens)
    try:
        for ids in arrays:
            writer.write(ids)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def shard_files(pattern: str) -> list[Path]:
    """The shards a path names: a glob (sorted), a folder (its *.bin files) or one file."""
    path = Path(pattern).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.bin"))
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"no token shards match {pattern}")
    return files


def _hold_out_tail(arrays: list[np.ndarray], fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, val): the last `fraction` of the tokens of consecutive arrays, cut where it falls."""
    keep = int(sum(len(a) for a in arrays) * (1 - fraction))
    train, val = [], []
    for array in arrays:
        cut = min(max(keep, 0), len(array))
        train.append(array[:cut])
        val.append(array[cut:])
        keep -= len(array)
    return [a for a in train if len(a)], [a for a in val if len(a)]


@register_data_kind("tokens")
def build_tokens(config: TokensConfig, seed: int) -> TokenWindows:
    if not config.path:
        raise DataError(
            "data.tokens.path is required: token shards, e.g. 'data/fineweb_*.bin' "
            "(free-transformer tokenize writes them)"
        )
    seq_len = check_sequence_length("data.tokens.seq_len", config.seq_len)
    files = shard_files(config.path)
    train = [read_shard(f) for f in files if not is_validation(f)]
    val = [read_shard(f) for f in files if is_validation(f)]
    if not train:
        raise DataError(f"every shard that {config.path} names is a validation shard (val in its name)")
    if not val:
        train, val = _hold_out_tail(train, config.val_fraction)
    vocab_size = get_tokenizer(config.tokenizer).vocab_size
    return TokenWindows(
        {"train": Split(train), "val": Split(val)},
        seq_len,
        seed,
        config.tokenizer,
        config.path,
        val_required=any(map(is_validation, files)) or config.val_fraction > 0,
        vocab_size=vocab_size,
    )
