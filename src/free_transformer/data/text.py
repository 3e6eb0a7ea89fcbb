"""The `text` kind: documents in files of any format readers.py reads, or a named corpus (corpora.py),
tokenized once into a memory-mapped cache (tokenizing.py); batches are random windows of the tokens.

Validation: a named corpus's held-out documents, or a DatasetDict's validation (else test) split, so no
validation window overlaps a training document; otherwise the last `val_fraction` of the tokens."""

from __future__ import annotations

from pathlib import Path

from .config import TextConfig
from .corpora import is_named, named_corpus
from .datasets import Split, TokenWindows, check_sequence_length, register_data_kind
from .readers import corpus_files
from .tokenizer import get_tokenizer
from .tokenizing import default_cache_dir, tokenize_files


def corpus_splits(path: str | None) -> tuple[list[Path], list[Path] | None]:
    """(training files, validation files or None) of data.text.path: a named corpus or a path (readers.py)."""
    return named_corpus(path).files() if is_named(path) else corpus_files(path)


@register_data_kind("text")
def build_text(config: TextConfig, seed: int) -> TokenWindows:
    tokenizer = get_tokenizer(config.tokenizer)
    train_files, val_files = corpus_splits(config.path)
    seq_len = check_sequence_length("data.text.seq_len", config.seq_len)
    assert config.path is not None  # corpus_splits refused a missing path
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()

    def tokenize(files):
        return tokenize_files(files, tokenizer, cache_dir, config.field, config.workers)

    if val_files is not None:
        splits = {"train": Split([tokenize(train_files)]), "val": Split([tokenize(val_files)])}
    else:
        tokens = tokenize(train_files)
        split_at = int(len(tokens) * (1 - config.val_fraction))
        splits = {"train": Split([tokens[:split_at]]), "val": Split([tokens[split_at:]])}
    return TokenWindows(
        splits,
        seq_len,
        seed,
        config.tokenizer,
        config.path,
        val_required=val_files is not None or config.val_fraction > 0,
    )
