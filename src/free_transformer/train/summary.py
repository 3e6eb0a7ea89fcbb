"""A run at a glance, from its config.yaml and metrics.jsonl: training and validation losses and, for a
Free Transformer, what Z does (the bits it saves, its KL against kappa, the bits that carry nothing,
warnings). A run that logged no validation (validate_every=0, as the demo's runs) is validated now, at
its newest checkpoint. What `free-transformer inspect RUN` prints."""

from __future__ import annotations

from pathlib import Path

import torch

from ..analysis.measures import DEAD_UNIT_KL
from ..base.errors import UserError
from ..data import build_dataset
from ..model.latent import latent_kind
from ..runs.checkpoint import checkpoint_dirs, load_model, read_checkpoint_config
from .config import load_train_config
from .metrics import read_metrics
from .validation import latent_warning, settled, validate


def summarize_run(run_dir: str | Path, history: int = 8) -> str:
    """The summary as text; `history` evaluations of the bits Z saves are listed (evenly spread)."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"{run_dir} is neither a training run (no config.yaml) nor a checkpointed rl run")
    config = load_train_config(config_path)  # a malformed file is one line (ConfigError)
    metrics_path = run_dir / "metrics.jsonl"
    try:
        return _summary(run_dir, config, read_metrics(metrics_path), history)
    except (KeyError, TypeError, ValueError, IndexError) as error:  # a line without a key, of another type
        raise UserError(
            f"{metrics_path} holds a line this package did not write ({type(error).__name__}: "
            f"{error}): move the file aside to summarize the run without it"
        ) from None


def _summary(run_dir: Path, config, metrics: list, history: int) -> str:
    model, free = config.model, config.model.is_free
    space = latent_kind(model.latent.kind)
    kind = (
        f"Free Transformer, H = {space.count(model.latent_units)} ({model.latent.kind}), kappa "
        f"{config.kappa_bits:g} bits"
        if free
        else "baseline decoder (no latent)"
    )
    kept = checkpoint_dirs(run_dir)
    lines = [
        f"run {run_dir}: {kind}; {model.n_layers} blocks of width {model.dim}",
        f"steps: {metrics[-1]['step'] if metrics else 0} logged of {config.steps}; checkpoints: "
        + (", ".join(d.name for d in kept) if kept else "none"),
    ]
    if not metrics:
        return "\n".join(lines + ["nothing logged yet"])
    last = metrics[-1]
    lines.append(
        f"training (step {last['step']}): cross-entropy {last['cross_entropy_bits']:.4f} bits/token"
        + (f", KL {last['kl_bits']:.4f} (kappa {last['kappa_bits']:g})" if free else "")
    )
    evaluated = [m for m in metrics if "val_cross_entropy_bits" in m]
    if not evaluated and kept:
        evaluated = [validate_checkpoint(kept[-1], config)]
        lines.append(
            f"no validation logged (validate_every=0): measured now on the newest checkpoint, step "
            f"{evaluated[0]['step']}"
        )
    if not evaluated:
        return "\n".join(lines + ["no validation measures: train with validate_every=N to see what Z does"])
    val = evaluated[-1]
    if not free:
        return "\n".join(
            lines + [f"validation (step {val['step']}): cross-entropy {val['val_cross_entropy_bits']:.4f}"]
        )
    lines.append(
        f"validation (step {val['step']}): cross-entropy {val['val_cross_entropy_bits']:.4f} with the "
        f"encoder's Z, {val['val_prior_cross_entropy_bits']:.4f} with prior Z (as generated); "
        f"Z saves {val['latent_bits_saved']:.4f} bits/token for a KL of {val['val_kl_bits']:.4f}"
    )
    if "val_kl_bits_per_unit" in val:  # units of their own (independent_units)
        per_unit = val["val_kl_bits_per_unit"]
        dead = [str(h) for h, value in enumerate(per_unit) if value < DEAD_UNIT_KL]
        lines.append(
            f"KL per {space.unit} (bits/token): "
            + " ".join(f"{value:.3f}" for value in per_unit)
            + (f"; carrying nothing (< {DEAD_UNIT_KL}): {space.unit} {', '.join(dead)}" if dead else "")
        )
    shown = evaluated[:: max(1, len(evaluated) // history)][-history:]
    lines.append(
        "bits Z saves over training: " + ", ".join(f"{m['step']}: {m['latent_bits_saved']:.3f}" for m in shown)
    )
    warnings = [m for m in evaluated if "latent_warning" in m]
    if warnings:
        lines.append(
            f"warnings at {len(warnings)} of {len(evaluated)} evaluations (steps {warnings[0]['step']}"
            f"-{warnings[-1]['step']}); latest: {warnings[-1]['latent_warning']}"
        )
    return "\n".join(lines)


def validate_checkpoint(checkpoint: Path, config) -> dict:
    """The validation measures training would have logged at `checkpoint`'s step (train/validation.py), on the
    CPU, with the warning they call for."""
    model, _ = load_model(checkpoint, "cpu")
    step = int(read_checkpoint_config(checkpoint)["step"])
    measures = {"step": step, **validate(model, build_dataset(config.data, config.seed), config, torch.device("cpu"))}
    warning = latent_warning(measures, config.kappa_bits, settled=settled(config, step))
    return {**measures, "latent_warning": warning} if warning else measures
