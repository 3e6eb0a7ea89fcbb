"""A Hugging Face tokenizer from a local directory, behind our `Tokenizer` protocol (tokenizer.py).

A Llama converted with `free-transformer convert` records its tokenizer as "hf:<directory>" (the
Llama's own directory, which holds tokenizer.json or tokenizer.model);
`free_transformer.data.tokenizer.get_tokenizer` resolves such names with this class. Nothing is
downloaded: the directory must exist.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError  # transformers renders chat templates with jinja2
from transformers import AutoTokenizer


class HFTokenizer:
    """`name` is what runs record (tokenizer.py's "hf:<directory>"); it imports nothing of ours, so
    that tokenizer.py, below it, is the only one of the two that names the other."""

    def __init__(self, directory: str | Path, name: str):
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"tokenizer directory {directory} does not exist")
        self._tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.name = name
        self.vocab_size = len(self._tokenizer)
        self.document_separator = self.encode("\n")  # what the text dataset writes between documents
        self.chat_template = self._tokenizer.chat_template  # None when the directory ships none

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode([int(i) for i in ids])
        assert isinstance(text, str)  # one sequence of ids: one text
        return text

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The messages through the tokenizer's chat template, ending with the assistant's turn opened."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer {self.name} has no chat template")
        try:
            prompt = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as error:  # a template may refuse a conversation (roles that do not alternate, ...)
            raise ValueError(f"the chat template refused these messages: {error}") from None
        assert isinstance(prompt, str)  # tokenize=False: the text
        return prompt
