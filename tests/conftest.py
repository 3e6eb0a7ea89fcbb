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
            model.post_sampler.weight.normal_(0, 0.5)
            model.encoder_readout.weight.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
