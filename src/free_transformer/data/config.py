"""The data section of a run's config: `kind` picks a dataset, and each kind reads its own sub-section
(`data.kind=text` reads `data.text.*`, `data.coinflip.length`, ...). A new kind is a new section here
and one `register_data_kind` in its module (datasets.py), not more flat fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TypeVar

from ..base.checks import ConfigError, check_range


@dataclass
class LettersConfig:
    """The paper's synthetic task (data/synthetic.py) has no options."""


@dataclass
class CoinflipConfig:
    length: int = 64
    """number of coin values X_t per sequence."""
    epsilon: float = 0.1
    """probability that each X_t differs from the hidden coin Z."""

    def __post_init__(self):
        check_range("data.coinflip.length", self.length, 1)
        check_range("data.coinflip.epsilon", self.epsilon, 0, 1, high_closed=True)


@dataclass
class TextConfig:
    path: str | None = None
    """a file; a folder (recursively, its .txt, .jsonl, .jsonl.gz, .parquet and .arrow files); a Hugging Face
    save_to_disk folder (a DatasetDict's validation, else test, split is the validation split); or
    corpus:NAME, a named corpus (corpus:shakespeare, corpus:python-stdlib; see data/corpora.py)."""
    field: str = "text"
    """.jsonl, .parquet, .arrow: the key or column that holds each document's text."""
    tokenizer: str = "byte"
    """tokenizer name: byte, gpt2 (GPT-2's BPE, offline; needs the text extra) or hf:<directory>."""
    seq_len: int | None = None
    """tokens per training sequence (model input length); none: the model's max_seq_len."""
    val_fraction: float = 0.01
    """share of the corpus (its last tokens) held out for validation; a corpus with its own held-out
    documents (a named corpus, a DatasetDict's validation split) holds those out instead."""
    workers: int = 0
    """processes that tokenize the corpus the first time (0: min(CPU count, 8)); the tokens do not depend on it."""
    cache_dir: str | None = None
    """where the tokenized corpus is cached (default: $XDG_CACHE_HOME or ~/.cache, then
    free-transformer/tokens/; never beside the corpus, whose folder may be read-only)."""

    def __post_init__(self):
        if self.seq_len is not None:
            check_range("data.text.seq_len", self.seq_len, 1)
        check_range("data.text.val_fraction", self.val_fraction, 0, 1)


@dataclass
class TokensConfig:
    path: str | None = None
    """pre-tokenized shards in llm.c's format (`free-transformer tokenize` writes them): a glob such as
    /data/fineweb10B/fineweb_*.bin, a folder (its *.bin files) or one file. Shards whose name has the
    word val (valid, validation) are the validation split, as in llm.c."""
    tokenizer: str = "gpt2"
    """the tokenizer the shards were written with (the vocabulary, and how samples are decoded)."""
    seq_len: int | None = None
    """tokens per training sequence (model input length); none: the model's max_seq_len."""
    val_fraction: float = 0.01
    """without validation shards: share of the tokens (the last ones) held out for validation."""

    def __post_init__(self):
        if self.seq_len is not None:
            check_range("data.tokens.seq_len", self.seq_len, 1)
        check_range("data.tokens.val_fraction", self.val_fraction, 0, 1)


@dataclass
class DataConfig:
    kind: str = "letters"
    """letters: the paper's synthetic task; coinflip: the Motivation section's example; text: documents
    (files of any supported format, or a named corpus); tokens: pre-tokenized shards."""
    letters: LettersConfig = field(default_factory=LettersConfig)
    coinflip: CoinflipConfig = field(default_factory=CoinflipConfig)
    text: TextConfig = field(default_factory=TextConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)

    def __post_init__(self):
        if self.kind not in data_kinds():
            raise ConfigError(f"data.kind: {self.kind!r} is not one of {', '.join(data_kinds())}")

    def section(self):
        """The options of the chosen kind (data.<kind>.*)."""
        return getattr(self, self.kind)

    def fitted_to(self, max_seq_len: int) -> DataConfig:
        """This config with the model's `max_seq_len` as the seq_len of the text and token sections that name
        none, so that the data a command defaults to fits the model it trains (and a printed config names
        the length)."""
        return dataclasses.replace(
            self, text=_with_seq_len(self.text, max_seq_len), tokens=_with_seq_len(self.tokens, max_seq_len)
        )


Section = TypeVar("Section", TextConfig, TokensConfig)


def _with_seq_len(section: Section, seq_len: int) -> Section:
    """`section` with `seq_len` where it names none."""
    return section if section.seq_len is not None else dataclasses.replace(section, seq_len=seq_len)


def data_kinds() -> list[str]:
    """The kinds a config can name: one section of DataConfig each."""
    return [f.name for f in dataclasses.fields(DataConfig) if f.name != "kind"]
