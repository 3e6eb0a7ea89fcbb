import pytest
import torch

from free_transformer import FreeTransformer, ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=50, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=40,
                  latent_bits=4)
    values.update(overrides)
    return ModelConfig(**values)


def tiny_model(seed=0, dtype=torch.float64, **overrides) -> FreeTransformer:
    torch.manual_seed(seed)
    model = FreeTransformer(tiny_config(**overrides)).to(dtype)
    with torch.no_grad():  # non-trivial latent path: larger table, biased encoder bits
        if model.config.is_free:
            model.latent.mapper.weight.normal_(0, 0.5)
            model.latent.readout.weight.normal_(0, 0.5)
    return model.eval()


def tiny_checkpoint(root, name: str, latent_bits: int, **overrides):
    """A byte-tokenizer run directory with one checkpoint of a small random model (vocab 256)."""
    from free_transformer.checkpoint import save_checkpoint

    torch.manual_seed(0)
    values = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64,
                  latent_bits=latent_bits)
    values.update(overrides)
    save_checkpoint(root / name, 1, FreeTransformer(ModelConfig(**values)), {"tokenizer": "byte"})
    return root / name


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def fake_corpus(tmp_path, monkeypatch, texts: dict[str, str], heldout: tuple[str, ...]):
    """Register corpus:fake, a NamedCorpus whose files are `texts` inside an importable package."""
    from free_transformer.data.corpora import CORPORA, NamedCorpus

    folder = tmp_path / "site" / "fakecorpusdata" / "texts"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    for name, text in texts.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    corpus = NamedCorpus(name="fake", module="fakecorpusdata", folder="texts", pattern="*_m.txt", heldout=heldout,
                         install="pip install fake", about="a test corpus")
    monkeypatch.setitem(CORPORA, "fake", corpus)
    return corpus
