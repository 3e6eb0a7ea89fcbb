"""Tokenize a corpus once: its documents (readers.py) are cut into batches of text, encoded by worker
processes in order, and written to a flat file of token ids that is then memory-mapped (corpora larger
than RAM work). Each document is followed by the tokenizer's document separator (GPT-2: end-of-text;
bytes: a line break). The tokens do not depend on the number of workers: every piece of text is encoded
on its own, wherever it is encoded, and the pieces are put back in order."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..base.fileio import remove_stale_partials
from .datasets import DataError
from .readers import documents, read_text, reader_for
from .tokenizer import Tokenizer, get_tokenizer

BATCH_CHARS = 1 << 22  # characters of text sent to a worker at a time (a few MB of tokens back)


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def default_workers() -> int:
    """min(CPUs this process may run on, 8): beyond that, reading the corpus is the bottleneck."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cpus, 8)


def _batches(files: list[Path], field: str, batch_chars: int) -> Iterator[tuple[list[tuple[str, bool]], int]]:
    """([(text, ends a document), ...] of about batch_chars characters, bytes of the files read meanwhile)."""
    pieces, chars, read = [], 0, 0
    for path in files:
        position = 0
        for text, ends, position_now in documents(path, field):
            read, position = read + max(0, position_now - position), max(position, position_now)
            pieces.append((text, ends))
            chars += len(text)
            if chars >= batch_chars:
                yield pieces, read
                pieces, chars, read = [], 0, 0
        read += max(0, path.stat().st_size - position)  # the file is done: whatever its reader reported
    if pieces or read:
        yield pieces, read


def _encode(tokenizer: Tokenizer, dtype: type, pieces: list[tuple[str, bool]]) -> np.ndarray:
    ids: list[int] = []
    for text, ends in pieces:
        ids += tokenizer.encode(text)
        if ends:
            ids += tokenizer.document_separator
    return np.asarray(ids, dtype=dtype)


_WORKER: tuple[Tokenizer, type] | None = None  # a worker process's tokenizer and token dtype


def _die_with(parent: int) -> None:
    """Linux: the kernel kills this worker when its parent dies, even by SIGKILL, which leaves no one to shut
    the pool down (its workers would wait for work forever). The parent may have died already: then exit."""
    if not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _start_worker(tokenizer_name: str, dtype: type, parent: int) -> None:
    global _WORKER
    _die_with(parent)
    _WORKER = (get_tokenizer(tokenizer_name), dtype)


def _encode_in_worker(pieces: list[tuple[str, bool]]) -> np.ndarray:
    assert _WORKER is not None  # set by the pool's initializer, _start_worker
    return _encode(*_WORKER, pieces)


def _pool_context():
    """fork on Linux: workers start at once and only run the tokenizer over strings, never torch, whose
    threads the parent may hold. Elsewhere the platform's default (spawn on macOS and Windows)."""
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)


def encode_corpus(
    files: list[Path],
    tokenizer: Tokenizer,
    field: str = "text",
    workers: int = 0,
    progress: bool | None = None,
    batch_chars: int = BATCH_CHARS,
) -> Iterator[np.ndarray]:
    """The token ids of the files' documents, in order, as consecutive arrays (uint16 or uint32).

    workers: processes that encode (0: default_workers(); 1: this process). progress: a bar over the
    bytes of the files read (None: only on a terminal)."""
    if workers < 0:
        raise DataError(f"workers must be >= 0 (0: one per CPU, up to 8), got {workers}")
    dtype = token_dtype(tokenizer.vocab_size)
    total = sum(f.stat().st_size for f in files)
    workers = 1 if total <= batch_chars else workers or default_workers()  # one batch: no process to start
    if multiprocessing.current_process().daemon:  # a pool's worker: it may not start processes
        workers = 1
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="tokenizing", disable=None if progress is None else not progress
    ) as bar:
        if workers == 1:
            for pieces, read in _batches(files, field, batch_chars):
                yield _encode(tokenizer, dtype, pieces)
                bar.update(read)
            return
        with ProcessPoolExecutor(
            workers, _pool_context(), initializer=_start_worker, initargs=(tokenizer.name, dtype, os.getpid())
        ) as pool:
            # (a batch's tokens, bytes read), at most 2 batches a worker in flight: the corpus is never all in memory
            pending: deque[tuple[Future[np.ndarray], int]] = deque()
            try:
                for pieces, read in _batches(files, field, batch_chars):
                    pending.append((pool.submit(_encode_in_worker, pieces), read))
                    if len(pending) >= 2 * workers:
                        future, done = pending.popleft()
                        yield future.result()
                        bar.update(done)
                while pending:
                    future, done = pending.popleft()
                    yield future.result()
                    bar.update(done)
            finally:
                pool.shutdown(cancel_futures=True)


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME or ~/.cache, then free-transformer/tokens: never beside the corpus, whose folder may
    be read-only or someone else's (the file names hold a fingerprint of the corpus, so corpora never mix)."""
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "free-transformer" / "tokens"


def _fingerprint(files: list[Path], tokenizer: Tokenizer, field: str) -> str:
    """The corpus as files (path, size, mtime) and how they are read: the field only where a reader uses
    it, so that caches of .txt corpora made before other formats were read stay valid."""
    key = [tokenizer.name, tokenizer.document_separator] + [
        [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files
    ]
    if any(reader_for(f) is not read_text for f in files):
        key.append(field)
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def tokenize_files(
    files: list[Path],
    tokenizer: Tokenizer,
    cache_dir: Path,
    field: str = "text",
    workers: int = 0,
    progress: bool | None = None,
    batch_chars: int = BATCH_CHARS,
) -> np.ndarray:
    """The files' token ids, tokenized once into `cache_dir` (written to a temporary file, then renamed)
    and memory-mapped."""
    dtype = token_dtype(tokenizer.vocab_size)
    try:
        target = cache_dir / f"{tokenizer.name.replace('/', '_')}-{_fingerprint(files, tokenizer, field)}.bin"
    except OSError as error:
        raise DataError(f"cannot read {error.filename}: {error.strerror or error}") from None
    remove_stale_partials(cache_dir, f"{target.stem}.partial*")
    if not target.exists():
        partial = target.with_suffix(f".partial{os.getpid()}")
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as out:
                for ids in encode_corpus(files, tokenizer, field, workers, progress, batch_chars):
                    out.write(ids.tobytes())
            os.replace(partial, target)
        except OSError as error:  # an unwritable cache, a full disk (unreadable files are DataErrors)
            with contextlib.suppress(OSError):
                partial.unlink()
            raise DataError(
                f"cannot tokenize the corpus into the cache {cache_dir}: {error.strerror or error} "
                f"({error.filename}); set data.text.cache_dir= to a writable folder"
            ) from None
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
    if target.stat().st_size == 0:  # no document at all (mmap cannot map an empty file)
        return np.zeros(0, dtype=dtype)
    return np.memmap(target, dtype=dtype, mode="r")
