"""Run a study: train every (seed, variant) side by side, measure each on the held-out text, report."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...data.corpora import is_named, read_heldout
from ...errors import UserError
from .measure import curves, measure_run
from .presets import StudyPlan
from ..pool import threads_per_run
from .report import write_report


def heldout_text(plan: StudyPlan, heldout: str | None) -> str:
    """The text the study scores: a file, or the named corpus's held-out documents (never trained on)."""
    if heldout is not None:
        return read_heldout(heldout)
    data = plan.train_config(plan.variants()[0], plan.seeds[0], threads=1).data
    if not is_named(data.text.path) and not Path(data.text.path).exists():
        raise UserError(f"the study's corpus {data.text.path} does not exist")
    if not is_named(data.text.path):
        raise UserError(f"the study's corpus {data.text.path} has no held-out documents of its own: give --heldout FILE")
    return read_heldout(data.text.path)


def run_study(plan: StudyPlan, *, workers: int, heldout: str | None = None) -> Path:
    started = time.perf_counter()
    text = heldout_text(plan, heldout)  # before hours of training: a missing held-out text fails now
    sweep = plan.sweep
    wall = sweep.train(workers)
    torch.set_num_threads(max(1, workers * threads_per_run(workers)))
    records = []
    for seed, variant in tqdm(sweep.runs(), desc="held-out likelihoods", dynamic_ncols=True):
        run_dir = sweep.run_dir(seed, variant)
        measures = measure_run(run_dir, text, kappa_bits=sweep.train_config(variant, seed).kappa_bits,
                               samples=plan.preset.heldout_samples,
                               windows=plan.preset.heldout_windows, device=plan.device)
        records.append({"seed": seed, "slug": variant.slug, "trained_now": str(run_dir) in wall,
                        "train_seconds": wall.get(str(run_dir), 0.0),
                        "curves": curves(run_dir), **measures})
    return write_report(plan, records, time.perf_counter() - started)
