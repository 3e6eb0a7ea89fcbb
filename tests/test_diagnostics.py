"""What every run reports about its latent: the validation measures of train/validation.py, their warnings,
the loggers they go to (TensorBoard, W&B offline), `inspect`, and the parameter-matched baseline."""

import math

import pytest
import torch
from conftest import TINY, run_losses, tiny_run_config

from free_transformer.analysis.measures import bits_saved, saving
from free_transformer.base.seeding import seed_of
from free_transformer.cli import main
from free_transformer.data import build_dataset
from free_transformer.model.config import named_config
from free_transformer.model.transformer import FreeTransformer
from free_transformer.train.metrics import read_metrics
from free_transformer.train.trainer import train
from free_transformer.train.validation import latent_warning, validate

LN2 = math.log(2.0)


def _model_and_data(*overrides):
    config = tiny_run_config("validation_batches=2", *overrides)
    torch.manual_seed(0)
    model = FreeTransformer(config.model)
    model.init_weights(post_sampler_std=1.0)  # a large R: the decoder's output depends on Z from the start
    return model, build_dataset(config.data, config.seed), config


def test_validation_measures_equal_a_hand_computation():
    model, dataset, config = _model_and_data()
    measures = validate(model, dataset, config, torch.device("cpu"))
    ce = kl = prior_ce = 0.0
    per_bit = torch.zeros(config.model.latent_units, dtype=torch.float64)
    with torch.no_grad():
        for index in range(2):
            batch = dataset.batch(index, config.batch_size, split="val")
            seed = seed_of(config.seed, "eval", "val", index, 0)
            out = model(batch[:, :-1], batch[:, 1:], generator=torch.Generator().manual_seed(seed))
            prior_seed = seed_of(config.seed, "eval", "prior", index, 0)
            prior = model(
                batch[:, :-1], batch[:, 1:], latents="prior", generator=torch.Generator().manual_seed(prior_seed)
            )
            ce, kl, prior_ce = (
                ce + out.cross_entropy_nats.item(),
                kl + out.kl_nats.item(),
                prior_ce + prior.cross_entropy_nats.item(),
            )
            p = torch.sigmoid(out.posterior.double())  # the KL of each bit to a fair coin, from its definition
            per_bit += (math.log(2) + p * p.log() + (1 - p) * (1 - p).log()).mean(dim=(0, 1))
    assert measures["val_cross_entropy_bits"] == pytest.approx(ce / 2 / LN2, rel=1e-6)
    assert measures["val_prior_cross_entropy_bits"] == pytest.approx(prior_ce / 2 / LN2, rel=1e-6)
    assert measures["latent_bits_saved"] == pytest.approx((prior_ce - ce) / 2 / LN2, rel=1e-5, abs=1e-7)
    assert measures["val_kl_bits_per_unit"] == pytest.approx(
        (per_bit / 2 / LN2).tolist(), rel=1e-5, abs=1e-7
    )  # float32 log terms
    assert sum(measures["val_kl_bits_per_unit"]) == pytest.approx(kl / 2 / LN2, rel=1e-5)  # bits add up to the KL
    assert measures["dead_units"] == sum(v < 0.01 for v in measures["val_kl_bits_per_unit"])
    assert measures["latent_bits_saved"] != 0.0  # Z reaches the output: prior and encoder Z differ


def test_a_kind_with_dependent_units_gets_no_per_unit_report(monkeypatch):
    """kl_per_unit means something only where the units are independent (LatentSpace.independent_units)."""
    from free_transformer.model.latent import BinaryMapper

    model, dataset, config = _model_and_data()
    monkeypatch.setattr(BinaryMapper, "independent_units", False)
    monkeypatch.setattr(BinaryMapper, "kl_per_unit", lambda self, posterior: pytest.fail("read per unit"))
    monkeypatch.setattr(BinaryMapper, "kl", lambda self, posterior: torch.zeros(posterior.shape[:-1]))
    measures = validate(model, dataset, config, torch.device("cpu"))
    assert "val_kl_bits_per_unit" not in measures and "dead_units" not in measures and "val_kl_bits" in measures


def test_bits_saved_per_token_is_the_prior_minus_the_encoder_cross_entropy_in_bits():
    """measures.saving is the one definition of the bits Z saves (validation's latent_bits_saved, the study's
    bits_saved, the demo's per-token bits_saved): the cross-entropy with prior Z minus with encoder Z, in
    bits; per token, each cross-entropy averaged over the draws of Z (seeds seed, seed + 1, ...)."""
    assert saving(3.5, 1.25) == 2.25
    model, dataset, config = _model_and_data()
    tokens = dataset.batch(0, config.batch_size, split="val")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ce = {}
    with torch.no_grad():
        for source in ("prior", "encoder"):
            draws = [
                model(inputs, latents=source, generator=torch.Generator().manual_seed(5 + k)).logits for k in range(3)
            ]
            ce[source] = (
                sum(-logits.double().log_softmax(-1).gather(-1, targets[..., None])[..., 0] for logits in draws)
                / 3
                / LN2
            )  # (B, T) bits
    saved = bits_saved(model, tokens, samples=3, seed=5)
    torch.testing.assert_close(saved, ce["prior"] - ce["encoder"], rtol=0, atol=1e-5)
    assert saved.abs().max() > 0.01  # Z reaches the output


def test_evaluation_leaves_the_rng_streams_and_a_baseline_alone():
    model, dataset, config = _model_and_data()
    state = torch.get_rng_state()
    first = validate(model, dataset, config, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)
    assert validate(model, dataset, config, torch.device("cpu")) == first  # the same batches and noise each time
    baseline, dataset, config = _model_and_data("model.latent_units=0")
    assert set(validate(baseline, dataset, config, torch.device("cpu"))) == {"val_cross_entropy_bits", "val_kl_bits"}


def test_training_losses_do_not_depend_on_evaluations(tmp_path):
    train(tiny_run_config("steps=4"), tmp_path / "plain")
    train(tiny_run_config("steps=4", "validate_every=1"), tmp_path / "evaluated")
    assert run_losses(tmp_path / "plain") == run_losses(tmp_path / "evaluated")
    assert "latent_bits_saved" in read_metrics(tmp_path / "evaluated" / "metrics.jsonl")[-1]


@pytest.mark.parametrize(
    "measures, kappa, settled, expected",
    [
        (dict(latent_bits_saved=0.002, val_kl_bits=0.3), 0.5, True, "Z is unused"),
        (dict(latent_bits_saved=0.002, val_kl_bits=0.3), 0.5, False, None),  # early in training: not news
        (dict(latent_bits_saved=0.2, val_kl_bits=0.45), 0.5, True, None),  # used, within its budget
        (dict(latent_bits_saved=2.5, val_kl_bits=3.9), 4.0, True, "Z carries the tokens"),
        (dict(latent_bits_saved=0.5, val_kl_bits=3.9), 4.0, True, None),  # spends its KL, saves little of it
        (dict(latent_bits_saved=2.5, val_kl_bits=2.0), 4.0, True, None),  # well under kappa
        (dict(val_cross_entropy_bits=3.0, val_kl_bits=0.0), 4.0, True, None),  # a baseline
    ],
)
def test_latent_warnings(measures, kappa, settled, expected):
    warning = latent_warning({"val_prior_cross_entropy_bits": 5.0, **measures}, kappa, settled=settled)
    assert (warning is None) if expected is None else warning.startswith(expected)


def test_a_run_warns_once_records_every_warning_and_inspect_summarises(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, "steps=8", "validate_every=2", "optim.warmup_steps=1"]) == 0
    err = capsys.readouterr().err
    evaluated = [m for m in read_metrics(out / "metrics.jsonl") if "val_cross_entropy_bits" in m]
    warned = [m["step"] for m in evaluated if "latent_warning" in m]
    assert warned == [4, 6, 8]  # after a quarter of training and the warm-up: a tiny model's Z is unused
    assert err.count("Z is unused") == 1
    assert main(["inspect", str(out)]) == 0
    summary = capsys.readouterr().out
    for expected in ("with prior Z", "KL per bit", "bits Z saves over training: 2:", "warnings at 3 of 4"):
        assert expected in summary
    assert main(["inspect", str(tmp_path / "nothing")]) == 2


def test_inspect_measures_what_z_does_for_a_run_that_logged_no_validation(tmp_path, capsys):
    """The demo's runs train with validate_every=0: inspect validates their newest checkpoint itself, with the
    numbers training would have logged there."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, "steps=4", "checkpoint_every=2", "keep_checkpoints=2"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "measured now on the newest checkpoint, step 4" in summary and "no validation measures" not in summary
    logged = tmp_path / "logged"  # the same run, validated at its last step by training itself
    assert main(["train", "--out", str(logged), *TINY, "steps=4", "checkpoint_every=2", "validate_every=4"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(logged)]) == 0
    expected = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("validation", "KL per bit"))]
    assert len(expected) == 2 and all(line in summary for line in expected)


def test_tensorboard_and_wandb_offline_get_every_measure(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(tiny_run_config("steps=2", "validate_every=2", "tensorboard=true", "wandb=true"), out)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert {"loss", "latent_bits_saved", "val_kl_bits_per_unit/0"} <= set(events.Tags()["scalars"])
    history = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(history) == 1 and history[0].stat().st_size > 0


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (
            (_ for _ in ()).throw(ImportError(name)) if name == "wandb" else real_import(name, *a, **k)
        ),
    )
    assert main(["train", "--out", str(tmp_path / "run"), *TINY, "steps=1", "wandb=true"]) == 2


def test_the_matched_baseline_has_the_encoders_parameters_and_flops(tmp_path):
    free = named_config("cpu-small", latent_units=8)
    matched = free.matched_baseline()
    assert (matched.latent_units, matched.n_layers) == (0, free.n_layers + 1)
    latent_only = free.dim * free.latent_units + free.latent_units + 2**free.latent_units * free.dim + 2 * free.dim
    assert matched.num_params() == free.num_params() - latent_only  # read-out, table, zeta, norm: all it lacks
    ratio = matched.training_flops_per_token(65) / free.training_flops_per_token(65)
    assert 0.98 < ratio < 1.0
    out = tmp_path / "matched"
    assert main(["train", "--out", str(out), *TINY, "steps=1", "--matched-baseline"]) == 0
    saved = __import__("yaml").safe_load((out / "config.yaml").read_text())["model"]
    debug = named_config("debug")
    assert (saved["latent_units"], saved["n_layers"]) == (0, debug.n_layers + 1)
    with pytest.raises(Exception, match="no latent"):
        debug.replace(latent_units=0).matched_baseline()


def _kl_split_by_enumeration(bit_logits):
    """The definitions, code by code: Q(z | S) as a product of bit probabilities, its batch mean, two KLs."""
    B, T, H = bit_logits.shape
    p = torch.sigmoid(bit_logits.double())
    kl, mismatch = 0.0, 0.0
    for t in range(T):
        mean_q = [0.0] * 2**H
        for b in range(B):
            for z in range(2**H):
                q = math.prod(float(p[b, t, h]) if z >> h & 1 else 1 - float(p[b, t, h]) for h in range(H))
                mean_q[z] += q / B
                kl += q * math.log2(q * 2**H) / (B * T)
        mismatch += sum(q * math.log2(q * 2**H) for q in mean_q) / T
    return kl - mismatch, mismatch


def test_kl_split_is_information_plus_prior_mismatch():
    from free_transformer.analysis.measures import kl_split as split_of
    from free_transformer.model.latent import BinaryMapper

    def kl_split(bit_logits, **options):
        return split_of(BinaryMapper(bit_logits.shape[-1], 1), bit_logits, **options)

    logits = torch.randn(5, 3, 3, generator=torch.Generator().manual_seed(0)) * 2
    information, mismatch = _kl_split_by_enumeration(logits)
    for max_entries in (2**22, 8):  # the batch in one slice, and one row per slice
        split = kl_split(logits, max_entries=max_entries)
        assert split["information"] == pytest.approx(information, rel=1e-9)
        assert split["prior_mismatch"] == pytest.approx(mismatch, rel=1e-9)
    # one code for every sequence: all mismatch, no information; codes that tell sequences apart: the reverse
    same = torch.full((4, 2, 3), 6.0)
    assert kl_split(same)["information"] == pytest.approx(0.0, abs=1e-9)
    assert kl_split(same)["prior_mismatch"] > 2.9
    apart = torch.tensor([[[20.0]], [[-20.0]]]).expand(2, 2, 1)  # one bit, opposite in two sequences
    assert kl_split(apart)["information"] == pytest.approx(1.0, abs=1e-6)
    assert kl_split(apart)["prior_mismatch"] == pytest.approx(0.0, abs=1e-6)
