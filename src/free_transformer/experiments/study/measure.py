"""What the study measures of each trained run, on the held-out text: honest likelihoods (exact for a
baseline; prior cross-entropy, IWAE and ELBO for a Free Transformer) in bits per token and per byte, the
bits Z saves, the KL, whether Z collapsed or carries the tokens; and the run's validation curves.
Cached in RUN/study-measures.json, so a study that is run again measures only what is new."""

from __future__ import annotations

import json
from pathlib import Path

from ...analysis.measures import collapsed, copies_tokens, saving
from ...base.bounded import loads_json
from ...base.fileio import atomic_write_text
from ...data.tokenizer import get_tokenizer
from ...eval.likelihood import heldout_likelihood
from ...runs.checkpoint import load_model, resolve_checkpoint
from ...train.metrics import read_metrics

CACHE = "study-measures.json"


def measure_run(
    run_dir: Path, heldout: str, *, kappa_bits: float, samples: int, windows: int, device: str, seed: int = 0
) -> dict:
    """The run's held-out measures; kappa_bits: its config's (what the copying verdict weighs the KL against)."""
    checkpoint = resolve_checkpoint(run_dir)
    cache = run_dir / CACHE
    settings = {
        "checkpoint": checkpoint.name,
        "samples": samples,
        "windows": windows,
        "seed": seed,
        "heldout_chars": len(heldout),
    }
    if cache.is_file():
        cached = loads_json(cache.read_text())
        if cached.get("settings") == settings:
            return cached
    model, metadata = load_model(checkpoint, device)
    tokenizer = get_tokenizer(metadata.get("tokenizer", "byte"))
    like = heldout_likelihood(model, tokenizer, heldout, samples=samples, seed=seed, max_windows=windows)
    like.pop("per_window")
    free = model.config.is_free
    measures = {"settings": settings, "free": free, "params": model.num_params(), "likelihood": like}
    if free:
        saved = saving(like["prior_ce"]["bits_per_token"], like["posterior_ce"]["bits_per_token"])
        kl = like["kl"]["bits_per_token"]
        measures.update(
            {
                "bits_saved": saved,
                "kl_bits": kl,
                "kappa_bits": kappa_bits,
                "collapsed": collapsed(saved),
                "copying": copies_tokens(saved, kl, kappa_bits),
            }
        )
    atomic_write_text(cache, json.dumps(measures, indent=1))
    return measures


def curves(run_dir: Path) -> list[dict]:
    """The run's validation measures over training (step, cross-entropies, bits Z saves, KL)."""
    keep = ("step", "val_cross_entropy_bits", "val_prior_cross_entropy_bits", "latent_bits_saved", "val_kl_bits")
    return [
        {k: m[k] for k in keep if k in m}
        for m in read_metrics(run_dir / "metrics.jsonl")
        if "val_cross_entropy_bits" in m
    ]
