"""Document readers, one per file format, chosen by the file's suffix in `READERS`; and the layouts of a
corpus path (a file, a folder of files, a Hugging Face `save_to_disk` folder) that say which files are
its training and validation documents. A reader streams: it never holds more than one piece of about a
million characters of a .txt file, one line of a .jsonl file, or one record batch of an Arrow or Parquet
file, whose pages are memory-mapped or read batch by batch."""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ..base.bounded import loads_json
from ..base.install import install_hint
from .datasets import DataError

CHUNK_CHARS = 1 << 20  # a .txt document is read in pieces of this many characters, then up to a line break
ARROW_ROWS = 1024  # rows of a Parquet file read at a time

# A piece of a document: (its text, whether the document ends with it, bytes of the file read so far).
Piece = tuple[str, bool, int]
REPLACED = [0]  # bytes of invalid UTF-8 read as U+FFFD so far, by the "count_replaced" error handler


def _replace_and_count(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeDecodeError):  # a handler for reading only: another error is not its to handle
        raise error
    REPLACED[0] += error.end - error.start
    return "\ufffd", error.end


codecs.register_error("count_replaced", _replace_and_count)


@contextlib.contextmanager
def _warn_if_not_utf8(path: Path):
    """Say once, on stderr, when a file's bytes were not UTF-8 (a binary file, another encoding): they
    are read as U+FFFD, which would otherwise train a model on replacement characters in silence."""
    before = REPLACED[0]
    yield
    if REPLACED[0] > before:
        print(
            f"warning: {path} is not valid UTF-8: {REPLACED[0] - before} bytes were read as U+FFFD (a binary "
            "file, or another encoding?)",
            file=sys.stderr,
        )


Reader = Callable[[Path, str], Iterator[Piece]]  # (file, text field) -> its documents, piece by piece

READERS: dict[str, Reader] = {}


def reader(*suffixes: str):
    """Decorator: the reader of files whose names end with one of `suffixes`."""

    def register(read: Reader) -> Reader:
        READERS.update(dict.fromkeys(suffixes, read))
        return read

    return register


def reader_for(path: Path) -> Reader:
    """The reader of a file by its suffix (the longest that matches: .jsonl.gz before .gz). A file of
    another suffix, named on its own or by a named corpus, is one document of plain text, as .txt."""
    name = path.name.lower()
    suffixes = sorted((s for s in READERS if name.endswith(s)), key=len)
    return READERS[suffixes[-1]] if suffixes else read_text


def is_document_file(path: Path) -> bool:
    return any(path.name.lower().endswith(s) for s in READERS)


@reader(".txt")
def read_text(path: Path, field: str) -> Iterator[Piece]:
    """One document per file, in pieces that end at a line break (never inside a token)."""
    with (
        _warn_if_not_utf8(path),
        open(path, "rb") as raw,
        io.TextIOWrapper(raw, encoding="utf-8", errors="count_replaced") as handle,
    ):
        piece = handle.read(CHUNK_CHARS)
        while True:
            piece += handle.readline()
            following = handle.read(CHUNK_CHARS)
            yield piece, not following, raw.tell()
            if not following:
                return
            piece = following


@reader(".jsonl", ".jsonl.gz")
def read_jsonl(path: Path, field: str) -> Iterator[Piece]:
    """One document per line: the line's JSON object's `field`. Blank lines and null fields are skipped."""
    with _warn_if_not_utf8(path), open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
        for number, line in enumerate(io.TextIOWrapper(stream, encoding="utf-8", errors="count_replaced"), 1):
            if not line.strip():
                continue
            try:
                record = loads_json(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {number} is not JSON: {error.msg}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {number} is a JSON {type(record).__name__}, not an object")
            if field not in record:
                raise DataError(
                    f"{path} line {number} has no field {field!r} (it has {', '.join(map(str, record))}): "
                    "set data.text.field"
                )
            text = record[field]
            if text is not None:
                if not isinstance(text, str):
                    raise DataError(f"{path} line {number}: field {field!r} holds a {type(text).__name__}, not text")
                yield text, True, raw.tell()


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"Parquet and Arrow files need pyarrow: {install_hint('data')}") from None
    return pyarrow


def _text_column(schema, field: str, path: Path) -> int:
    """The index of the text column `field` in an Arrow schema, or a DataError naming the columns there are."""
    pa = _pyarrow()
    index = schema.get_field_index(field)
    if index < 0:
        raise DataError(f"{path} has no column {field!r} (it has {', '.join(schema.names)}): set data.text.field")
    kind = schema.field(index).type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise DataError(f"{path}: column {field!r} holds {kind}, not text: set data.text.field")
    return index


@reader(".parquet")
def read_parquet(path: Path, field: str) -> Iterator[Piece]:
    """One document per row, read ARROW_ROWS rows at a time (only the text column)."""
    pq = _pyarrow().parquet
    with pq.ParquetFile(path, memory_map=True) as parquet:
        _text_column(parquet.schema_arrow, field, path)
        size, rows, done = path.stat().st_size, max(parquet.metadata.num_rows, 1), 0
        for batch in parquet.iter_batches(batch_size=ARROW_ROWS, columns=[field]):
            done += batch.num_rows
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text, True, size * done // rows


@reader(".arrow")
def read_arrow(path: Path, field: str) -> Iterator[Piece]:
    """One document per row of an Arrow IPC file, memory-mapped and read record batch by record batch:
    the stream format that Hugging Face `datasets` writes, or the file format."""
    pa = _pyarrow()
    with pa.memory_map(str(path)) as source:
        try:
            batches = pa.ipc.open_stream(source)
            schema = batches.schema
        except pa.ArrowInvalid:  # not a stream: the IPC file format (random access)
            source.seek(0)
            ipc_file = pa.ipc.open_file(source)
            schema = ipc_file.schema
            batches = (ipc_file.get_batch(i) for i in range(ipc_file.num_record_batches))
        column = _text_column(schema, field, path)
        for batch in batches:
            for text in batch.column(column).to_pylist():
                if text is not None:
                    yield text, True, source.tell()


def corpus_files(path: str | None) -> tuple[list[Path], list[Path] | None]:
    """(training files, validation files) of a corpus path. The validation files are a DatasetDict's
    validation (else test) split; None when the corpus has no such split, and its last tokens are held out.

    - a file: itself;
    - a Hugging Face `save_to_disk` folder of one Dataset (state.json): its .arrow files, in order;
    - one of a DatasetDict (dataset_dict.json): validation = its `validation` split, else its `test`
      split; training = every other split (train, and any others; with both, test is left out);
    - any other folder: its files of a known suffix (READERS), recursively, sorted by path.
    """
    if not path:
        raise DataError("data.text.path is required for text data")
    root = Path(path)
    if root.is_file():
        return [root], None
    if not root.is_dir():
        raise DataError(f"corpus not found: {root}")
    if (root / "dataset_dict.json").is_file():
        return _dataset_dict(root)
    if (root / "state.json").is_file():
        return _saved_dataset(root), None
    files = sorted(p for p in root.rglob("*") if p.is_file() and is_document_file(p))
    if not files:
        raise DataError(f"no {', '.join('*' + s for s in READERS)} files under {root}")
    return files, None


def _read_json(path: Path) -> dict:
    try:
        return loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path}: {error}") from None


def _saved_dataset(folder: Path) -> list[Path]:
    """The .arrow files of a `Dataset.save_to_disk` folder, in the order its state.json lists them."""
    try:
        files = [folder / entry["filename"] for entry in _read_json(folder / "state.json")["_data_files"]]
    except (KeyError, TypeError):
        raise DataError(f"{folder}/state.json lists no _data_files: not a save_to_disk folder") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"the save_to_disk folder {folder} lacks {', '.join(missing) or 'its .arrow files'}")
    return files


def _dataset_dict(root: Path) -> tuple[list[Path], list[Path] | None]:
    splits = _read_json(root / "dataset_dict.json").get("splits", [])
    validation = next((s for s in ("validation", "test") if s in splits), None)
    training = [s for s in splits if s not in ("validation", "test")]
    if not training:
        raise DataError(f"the DatasetDict {root} has no split to train on (its splits: {', '.join(splits)})")
    train = [f for split in training for f in _saved_dataset(root / split)]
    return train, (_saved_dataset(root / validation) if validation else None)


READ_ERRORS = (OSError, EOFError, ValueError, zlib.error)  # a corrupt gzip, Arrow or Parquet file, ...


def documents(path: Path, field: str) -> Iterator[Piece]:
    """The pieces of a file's documents; a file that cannot be read is a DataError naming it."""
    try:
        yield from reader_for(path)(path, field)
    except DataError:
        raise
    except READ_ERRORS as error:
        raise DataError(f"cannot read {path}: {error}") from None
