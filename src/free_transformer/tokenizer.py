"""Tokenizers, all available offline. A checkpoint records the tokenizer's name so that generation
and evaluation decode with the one the model was trained with."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes: 256 ids, nothing to download, any text round-trips."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}
HF_PREFIX = "hf:"  # "hf:<directory>": a Hugging Face tokenizer saved in a local directory


def get_tokenizer(name: str) -> Tokenizer:
    if name.startswith(HF_PREFIX):
        from .hf.tokenizer import HFTokenizer  # needs the optional transformers package

        return HFTokenizer(name[len(HF_PREFIX) :])
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name]()
