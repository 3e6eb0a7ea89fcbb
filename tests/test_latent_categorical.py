"""What is specific to the categorical latent kind (model.latent.kind=categorical): its Gumbel-max draws,
its straight-through Gumbel-softmax gradient at its temperature, bit_linear's R as its K = 2 case, and its
settings (model.latent.categorical.*) wherever settings appear. What every kind satisfies is
tests/test_latent_contract.py's."""

import json

import pytest
import torch

from free_transformer import ModelConfig
from free_transformer.cli import main
from free_transformer.model.config import LatentConfig
from free_transformer.model.latent import BitLinear, CategoricalLatent, CategoricalSettings
from free_transformer.model.latent.draws import bits_to_index, rand_rows

H, D = 3, 5


def _space(classes=4, temperature=1.0):
    torch.manual_seed(0)
    return CategoricalLatent(H, D, CategoricalSettings(classes, temperature)).double()


def test_at_two_classes_opposite_embeddings_give_bit_linears_r():
    """E[h, 1] = W_h and E[h, 0] = -W_h: R = sum_h E[h, z_h] = W s with s_h = 2 z_h - 1."""
    bit_linear, categorical = BitLinear(H, D).double(), _space(classes=2)
    with torch.no_grad():
        table = categorical.weight.view(H, 2, D)
        table[:, 1], table[:, 0] = bit_linear.weight.T, -bit_linear.weight.T
    z = categorical.prior((4, 6), torch.Generator().manual_seed(1))  # (4, 6, H) in {0, 1}
    torch.testing.assert_close(categorical.embed(z), bit_linear.embed(bits_to_index(z.bool())), rtol=1e-12, atol=1e-12)
    posterior = torch.randn(4, 6, 2 * H, dtype=torch.float64)
    r, value = categorical.sample(posterior, torch.Generator().manual_seed(2))
    torch.testing.assert_close(r, bit_linear.embed(bits_to_index(value.bool())), rtol=1e-12, atol=1e-12)


def test_the_sample_is_a_gumbel_max_draw_of_each_groups_softmax():
    space = _space()
    logits = torch.tensor([2.0, 0.0, -1.0, 0.5], dtype=torch.float64).repeat(H)  # (H * K,)
    _, z = space.sample(logits.expand(40000, -1), torch.Generator().manual_seed(0))  # (N, H)
    frequencies = torch.nn.functional.one_hot(z, 4).double().mean(0)  # (H, K)
    torch.testing.assert_close(frequencies, torch.softmax(logits.view(H, 4), -1), atol=0.01, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_the_gradient_is_the_straight_through_gumbel_softmax(temperature):
    """R's value is the sampled embeddings; its gradient that of the soft sample softmax((l + g) / tau) @ E."""
    space = _space(temperature=temperature)
    posterior = torch.randn(2, 5, 4 * H, dtype=torch.float64, requires_grad=True)
    r, z = space.sample(posterior, torch.Generator().manual_seed(3))
    torch.testing.assert_close(r, space.embed(z), rtol=1e-12, atol=1e-12)
    grad_r = torch.randn_like(r)
    grad, grad_table = torch.autograd.grad((r * grad_r).sum(), (posterior, space.weight))

    reference = posterior.detach().clone().requires_grad_()
    gumbel = -torch.log(-torch.log(rand_rows((2, 5, H, 4), torch.Generator().manual_seed(3)).double()))
    soft = torch.softmax((reference.view(2, 5, H, 4) + gumbel) / temperature, -1)  # (2, 5, H, K)
    assert torch.equal(soft.argmax(-1), z)  # the same Gumbel noise
    (expected,) = torch.autograd.grad((soft.flatten(-2) @ space.weight.detach() * grad_r).sum(), reference)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    hard = torch.nn.functional.one_hot(z + torch.arange(H) * 4, 4 * H).double().sum(-2)  # (2, 5, H * K)
    torch.testing.assert_close(grad_table, hard.flatten(0, 1).T @ grad_r.flatten(0, 1), rtol=1e-12, atol=1e-12)


def test_the_settings_size_the_read_out_and_the_table():
    config = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=48,
        max_seq_len=16,
        latent_units=3,
        latent={"kind": "categorical", "categorical": {"classes": 5}},
    )
    assert config.latent == LatentConfig("categorical", settings=CategoricalSettings(classes=5))
    from free_transformer import FreeTransformer

    model = FreeTransformer(config)
    assert model.latent.readout.out_features == 15 and model.latent.mapper.weight.shape == (15, 32)
    assert model.num_params() == config.num_params()


def test_the_config_holds_the_chosen_kinds_settings_only():
    """model.latent.<kind> is read for the chosen kind alone; changing the kind drops the one it replaces."""
    from free_transformer.base.checks import ConfigError
    from free_transformer.train.config import apply_overrides, load_train_config

    config = load_train_config(None, ["model.latent.kind=categorical", "model.latent.categorical.classes=3"])
    assert config.to_dict()["model"]["latent"] == {
        "kind": "categorical",
        "encoder_layers": 1,
        "policy": False,
        "categorical": {"classes": 3, "temperature": 1.0},
    }
    assert apply_overrides(config, ["model.latent.categorical.temperature=0.5"]).model.latent.settings == (
        CategoricalSettings(3, 0.5)
    )
    gaussian = apply_overrides(config, ["model.latent.kind=gaussian"]).model.latent
    assert gaussian == LatentConfig("gaussian") and gaussian.section() is None
    with pytest.raises(ConfigError, match=r"unknown setting model.latent.categorical: .* model.latent.kind=gaussian"):
        load_train_config(None, ["model.latent.kind=gaussian", "model.latent.categorical.classes=3"])
    with pytest.raises(ConfigError, match="model.latent.gaussian: kind gaussian has no settings"):
        load_train_config(None, ["model.latent.kind=gaussian", "model.latent.gaussian.classes=3"])
    defaults = LatentConfig("categorical")  # the kind's defaults, filled in when the config is checked
    assert defaults.settings is None and defaults.section() == CategoricalSettings()
    assert ModelConfig(latent=defaults).check_latent_kind().latent.settings == CategoricalSettings()


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "model.latent.categorical.classes=1",
            "error: model.latent.categorical.classes must be an integer >= 2, got 1",
        ),
        (
            "model.latent.categorical.temperature=0",
            "error: model.latent.categorical.temperature must be a finite number > 0, got 0.0",
        ),
        (
            "model.latent.categorical.clases=3",
            "error: unknown setting model.latent.categorical.clases: did you mean model.latent.categorical.classes?",
        ),
    ],
)
def test_a_bad_setting_is_one_line(tmp_path, capsys, override, line):
    assert main(["train", "--out", str(tmp_path / "run"), "model.latent.kind=categorical", override]) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_train_help_lists_the_settings_of_the_chosen_kind_with_their_docstrings(capsys):
    with pytest.raises(SystemExit):
        main(["train", "model.latent.kind=categorical", "--help"])
    text = capsys.readouterr().out
    builtin = {"binary_mapper", "bit_linear", "categorical", "gaussian"}  # others if a test registered more
    kind_line = next(line for line in text.splitlines() if line.startswith("  model.latent.kind=categorical  ("))
    assert builtin <= set(kind_line.partition("(")[2].rstrip(")").split(" | "))  # the registry's names, as choices
    assert "  model.latent.categorical.classes=4  (int)\n      K, the classes of each of the H groups" in text
    assert "  model.latent.categorical.temperature=1.0  (float)\n      The Gumbel-softmax temperature" in text
    registered = next(line for line in text.splitlines() if line.startswith("latent kinds registered: "))
    assert builtin <= set(registered.partition(": ")[2].split(", "))
    with pytest.raises(SystemExit):
        main(["train", "--help"])  # the default kind, binary_mapper, has no settings of its own
    text = capsys.readouterr().out
    assert "model.latent.categorical" not in text and "model.latent.kind=NAME --help" in text


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("categorical")
    assert (
        main(
            [
                "train",
                "--out",
                str(root / "run"),
                "model.size=debug",
                "model.vocab_size=256",
                "model.max_seq_len=72",
                "model.latent.kind=categorical",
                "model.latent.categorical.classes=3",
                "model.latent.categorical.temperature=0.5",
                "data.kind=letters",
                "steps=4",
                "batch_size=4",
                "validate_every=4",
                "validation_batches=1",
                "optim.warmup_steps=1",
                "progress=false",
                "kappa_bits=0.5",
            ]
        )
        == 0
    )
    return root / "run"


def test_the_settings_are_saved_with_the_run_and_in_the_hf_config(run, tmp_path):
    import yaml

    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]["latent"]
    assert saved["kind"] == "categorical" and saved["categorical"] == {"classes": 3, "temperature": 0.5}
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["latent_kind"] == "categorical" and hf["latent_settings"] == {"classes": 3, "temperature": 0.5}
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--to", "checkpoint"]) == 0
    from free_transformer.runs.checkpoint import load_model

    back, _ = load_model(tmp_path / "back")
    assert back.config.latent.settings == CategoricalSettings(3, 0.5)


def test_inspect_names_the_groups(run, capsys):
    assert main(["inspect", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "H = 4 groups (categorical)" in shown and "KL per group (bits/token)" in shown


@pytest.mark.parametrize("choice", ["encoder", "prior", "shared"])
def test_the_generate_command_samples_under_each_named_choice(run, choice, capsys):
    assert (
        main(
            [
                "generate",
                str(run),
                "--prompt",
                "K>",
                "-n",
                "2",
                "--max-new-tokens",
                "4",
                "--latents",
                choice,
                "--format",
                "jsonl",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(line["latents"] == choice for line in lines)
