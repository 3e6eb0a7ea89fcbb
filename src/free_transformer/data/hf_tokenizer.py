"""A Hugging Face tokenizer from a local directory, behind our `Tokenizer` protocol (tokenizer.py).

A Llama converted with `free-transformer convert` records its tokenizer as "hf:<directory>" (the
Llama's own directory, which holds tokenizer.json or tokenizer.model);
`free_transformer.data.tokenizer.get_tokenizer` resolves such names with this class. Nothing is
downloaded: the directory must exist.
"""

from __future__ import annotations

import threading
from pathlib import Path

from transformers import AutoTokenizer

from .chat_template import ChatRenderer


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
        self._renderer: ChatRenderer | None = None  # made at the first chat_prompt, for this chat_template
        self._renderer_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode([int(i) for i in ids])
        assert isinstance(text, str)  # one sequence of ids: one text
        return text

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The messages through the tokenizer's chat template, ending with the assistant's turn opened, as
        transformers' apply_chat_template renders them, but bounded in time, memory and length (chat_template.py):
        a one-line ChatTemplateRefused (a ValueError: the template refused the messages, or they took it past a
        bound) or ChatTemplateFailed (the template's code failed) otherwise."""
        return self._chat_renderer().render(messages)

    def read_chat(self, body: bytes, reader: str) -> dict:
        """A chat request's `body` read, its messages rendered, in a render worker by the module `reader`
        (chat_template.ChatRenderer.read): its reply; a ChatTemplateRefused or ChatTemplateFailed as chat_prompt's."""
        return self._chat_renderer().read(body, reader)

    def _chat_renderer(self) -> ChatRenderer:
        """The renderer of the current chat_template (made again when it changes)."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer {self.name} has no chat template")
        with self._renderer_lock:
            if self._renderer is None or self._renderer.template != self.chat_template:
                variables = {name: _plain(value) for name, value in self._tokenizer.special_tokens_map.items()}
                self._renderer = ChatRenderer(self.chat_template, variables)
            return self._renderer


def _plain(value):
    """A special token (a string, an AddedToken or a list of them) as the text a template sees."""
    return [_plain(item) for item in value] if isinstance(value, list | tuple) else str(value)
