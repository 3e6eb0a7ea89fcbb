"""Conversions: our checkpoints <-> Hugging Face format, Llama -> our baseline (logit parity with the
transformers implementation), our baseline -> Llama, and a Free Transformer initialised from a Llama."""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from free_transformer import FreeTransformer, GenerationConfig, generate  # noqa: E402
from free_transformer.cli import main  # noqa: E402
from free_transformer.hf.conversion import (  # noqa: E402
    ConversionError,
    convert,
    detect_format,
    llama_model_config,
    load_llama,
    save_llama,
    with_fresh_latent_path,
)
from free_transformer.runs.checkpoint import load_model, save_checkpoint  # noqa: E402
from free_transformer.runs.migrations import split_state_dict  # noqa: E402


def tiny_llama(tmp_path, tie: bool, seed=0, **overrides) -> tuple[LlamaForCausalLM, str]:
    """A random LlamaForCausalLM (2 layers, hidden 32, 4 heads, 2 kv heads, vocab 64) saved to tmp_path."""
    values = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    llama = LlamaForCausalLM(LlamaConfig(**values)).eval()
    with torch.no_grad():  # larger than the default init, so that every weight matters in the logits
        for param in llama.parameters():
            param.normal_(0, 0.2)
    directory = tmp_path / f"llama-{'tied' if tie else 'untied'}"
    llama.save_pretrained(directory)
    return llama, str(directory)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_logits_equal_transformers(tmp_path, tie):
    llama, directory = tiny_llama(tmp_path, tie)
    config = json.loads((tmp_path / directory / "config.json").read_text())
    assert config["attention_bias"] is False and config["mlp_bias"] is False
    ours, _ = load_llama(directory)
    assert ours.config.latent_units == 0 and ours.config.tie_embeddings == tie and ours.config.rope_theta == 5000.0
    tokens = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        expected = llama(tokens).logits
        got = ours(tokens).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # float32; measured max |diff| = 0
        # float64: limited by transformers' LlamaRMSNorm, which normalises in float32
        torch.testing.assert_close(ours.double()(tokens).logits, llama.double()(tokens).logits, rtol=0, atol=1e-5)
    # greedy decoding with the KV cache, ours vs transformers' generate
    prompts = tokens[:, :6]
    ours_tokens = generate(ours.float(), prompts, GenerationConfig(max_new_tokens=10, temperature=0)).tokens
    hf_tokens = llama.float().generate(prompts, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert hf_tokens[:, 6:].tolist() == ours_tokens


@pytest.mark.parametrize("tie", [False, True])
def test_baseline_to_llama_loads_in_transformers(tmp_path, tie):
    model = tiny_model(dtype=torch.float32, latent_units=0, tie_embeddings=tie)
    save_llama(model, tmp_path / "llama")
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama", local_files_only=True).eval()
    assert llama.config.tie_word_embeddings == tie
    tokens = torch.randint(0, 50, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)
    back, _ = load_llama(tmp_path / "llama", max_seq_len=model.config.max_seq_len)
    assert back.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_checkpoint_hf_checkpoint_round_trip(tmp_path):
    model = tiny_model(dtype=torch.float32, latent_units=4, latent_layer=1)
    save_checkpoint(tmp_path / "run", 7, model, {"tokenizer": "byte"})
    assert detect_format(tmp_path / "run") == "checkpoint"
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert detect_format(tmp_path / "hf") == "hf"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tokenizer_name"] == "byte"
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to", "checkpoint", "--step", "7"]) == 0
    back, meta = load_model(tmp_path / "back")
    assert back.config == model.config and meta["tokenizer"] == "byte" and meta["step"] == 7
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    tokens, latents = torch.randint(0, 50, (2, 12)), torch.randint(0, 16, (2, 12))
    assert torch.equal(back(tokens, latents=latents).logits, model(tokens, latents=latents).logits)


def test_free_transformer_from_llama(tmp_path):
    llama, directory = tiny_llama(tmp_path, tie=False)
    run = tmp_path / "run"
    assert main(["convert", directory, str(run), "--to", "checkpoint", "--latent-units", "4", "--seed", "3"]) == 0
    model, meta = load_model(run / "checkpoints" / "step_00000000")
    assert model.config.latent_units == 4 and model.config.injection_layer == 1
    assert meta["converted_from"]["format"] == "llama" and meta["token_ids"] == {"bos_token_id": 1, "eos_token_id": 2}
    llama_weights = llama.state_dict()
    decoder = {name for name in model.state_dict() if name.startswith(("embed_tokens", "layers", "norm", "lm_head"))}
    separate = split_state_dict({name: model.state_dict()[name] for name in decoder}, model.config)
    for name, tensor in separate.items():  # q/k/v and gate/up: Llama's matrices, stacked into ours
        key = name if name == "lm_head.weight" else f"model.{name}"
        assert torch.equal(tensor, llama_weights[key]), name
    assert {name if name == "lm_head.weight" else f"model.{name}" for name in separate} == set(llama_weights)
    torch.manual_seed(3)
    fresh = FreeTransformer(model.config)  # the latent path is exactly a fresh init with the given seed
    latent = set(model.state_dict()) - decoder
    assert latent == {n for n in fresh.state_dict() if n.startswith("latent.")}
    for name in latent:
        assert torch.equal(model.state_dict()[name], fresh.state_dict()[name]), name
    model.train()  # and it trains: loss with the KL term, gradients reach the encoder
    tokens = torch.randint(0, 64, (2, 16))
    out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=0.0)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.latent.readout.weight.grad.abs().sum() > 0


def test_unsupported_llama_features_are_refused():
    base = dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    assert llama_model_config(base).n_kv_heads == 2
    for change, message in [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 16}, "head_dim"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling 'llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope scaling 'yarn'"),
        ({"model_type": "mistral"}, "model_type 'llama'"),
    ]:
        with pytest.raises(ConversionError, match=message):
            llama_model_config({**base, **change})
    # transformers 4.x layout: rope_theta at the top level
    assert llama_model_config({**base, "rope_theta": 5e5, "rope_scaling": None}).rope_theta == 5e5


def test_conversion_errors(tmp_path, capsys):
    with pytest.raises(ConversionError, match="not a directory"):
        detect_format(tmp_path / "missing")
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ConversionError, match="unsupported model_type 'gpt2'"):
        detect_format(tmp_path / "gpt2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="no config.json"):
        detect_format(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                vocab_size=64,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
            )
        )
    )
    with pytest.raises(ConversionError, match="no model.safetensors"):
        load_llama(tmp_path / "noweights")
    free = tiny_model(dtype=torch.float32, latent_units=4)
    save_checkpoint(tmp_path / "free", 0, free, {})
    with pytest.raises(ConversionError, match="only a baseline"):
        convert(tmp_path / "free", tmp_path / "out", "llama")
    with pytest.raises(ConversionError, match="already has a latent path"):
        convert(tmp_path / "free", tmp_path / "out", "checkpoint", latent_units=4, step=1)
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out"), "--to", "hf"]) == 2
    assert "not a directory" in capsys.readouterr().err
    baseline = with_fresh_latent_path(tiny_model(latent_units=0), 2)
    assert baseline.config.latent_units == 2


def test_llama_tokenizer_travels_with_the_conversion(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from free_transformer.data.tokenizer import get_tokenizer as tokenizer_from_name

    _, directory = tiny_llama(tmp_path, tie=True)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(directory)
    assert main(["convert", directory, str(tmp_path / "run"), "--to", "checkpoint"]) == 0
    _, meta = load_model(tmp_path / "run")
    tokenizer = tokenizer_from_name(meta["tokenizer"])
    assert meta["tokenizer"].startswith("hf:") and tokenizer.encode("hello world") == [1, 2]
    assert tokenizer.decode([2, 1]) == "world hello" and tokenizer_from_name("byte").vocab_size == 256
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True).encode("world") == [2]


def test_an_export_written_before_the_latent_path_module_loads():
    """tests/data/legacy-hf was written by 0.1's `convert tests/data/legacy-run OUT --to hf`."""
    from transformers import AutoModelForCausalLM

    data = Path(__file__).parent / "data"
    ours, _ = load_model(data / "legacy-run")
    hf_model = AutoModelForCausalLM.from_pretrained(data / "legacy-hf", local_files_only=True)
    loaded = hf_model.model.state_dict()
    assert loaded.keys() == ours.state_dict().keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in ours.state_dict().items())


CONFIG_DAMAGE = {  # what a config.json that does not describe its weights did to `convert`; {n}: its layers
    "sizes that do not match the weights": (
        lambda c: json.dumps({**c, "vocab_size": 512}),
        "embed_tokens.weight is [256, {d}] in the weights, [512, {d}] by the config",
    ),
    "a layer more than the weights": (
        lambda c: json.dumps({**c, "num_hidden_layers": c["num_hidden_layers"] + 1}),
        "the weights lack layers.{n}.",
    ),  # it used to be a random layer, silently
    "a layer less than the weights": (
        lambda c: json.dumps({**c, "num_hidden_layers": c["num_hidden_layers"] - 1}),
        "the weights hold layers.{n_1}.",
    ),
    "a duplicate key": (lambda c: json.dumps(c)[:-1] + ', "hidden_size": 64}', "duplicate key 'hidden_size'"),
    "a list": (lambda c: json.dumps([c]), "it must hold a JSON object, not a list"),
    "RoPE tables of 4 TiB": (
        lambda c: json.dumps({**c, "max_position_embeddings": 2**40}),
        "does not fit in this machine's memory",
    ),
}


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGE))
@pytest.mark.parametrize("source", ["hf", "llama"])
def test_a_config_json_is_checked_against_its_weights_before_it_is_used(tmp_path, capsys, source, damage):
    """An HF or Llama config.json whose sizes do not match the weights was a RuntimeError traceback
    from transformers (or, one layer more, a silently random layer); one with a duplicate key was read
    silently, one that is a list an AttributeError. Each is one line naming the file, before any model
    is built; an older export (other tensor names) still converts."""
    if source == "hf":
        save_checkpoint(tmp_path / "run", 0, tiny_model(dtype=torch.float32, latent_bits=0, vocab_size=256), {})
        assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
        directory = tmp_path / "hf"
    else:
        _, directory = tiny_llama(tmp_path, tie=False, vocab_size=256)
    config_file = Path(directory) / "config.json"
    config = json.loads(config_file.read_text())
    rewrite, message = CONFIG_DAMAGE[damage]
    config_file.write_text(rewrite(config))
    capsys.readouterr()
    assert main(["convert", str(directory), str(tmp_path / "out"), "--to", "checkpoint"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and str(config_file) in error, error
    d, n = config["hidden_size"], config["num_hidden_layers"]
    assert message.format(d=d, n=n, n_1=n - 1) in error, error
    assert not (tmp_path / "out").exists()
    if source == "hf" and damage == "a list":
        legacy = Path(__file__).parent / "data" / "legacy-hf"
        assert main(["convert", str(legacy), str(tmp_path / "legacy"), "--to", "checkpoint"]) == 0
