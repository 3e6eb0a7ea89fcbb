"""Run a study: train every (seed, variant) side by side, measure each on the held-out text, report."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..data.corpora import is_named, read_heldout
from ..errors import UserError
from ..train.pool import threads_per_run, train_runs
from .measure import curves, measure_run
from .plan import StudyPlan
from .report import write_report


def heldout_text(plan: StudyPlan, heldout: str | None) -> str:
    """The text the study scores: a file, or the named corpus's held-out documents (never trained on)."""
    if heldout is not None:
        return read_heldout(heldout)
    data = plan.train_config(plan.variants()[0], plan.seeds[0], threads=1).data
    if not is_named(data.text.path):
        raise UserError(f"the study's corpus {data.text.path} has no held-out documents of its own: give --heldout FILE")
    return read_heldout(data.text.path)


def run_study(plan: StudyPlan, *, workers: int, heldout: str | None = None) -> Path:
    started = time.perf_counter()
    text = heldout_text(plan, heldout)  # before hours of training: a missing held-out text fails now
    threads = threads_per_run(workers)
    runs = [(seed, variant) for seed in plan.seeds for variant in plan.variants()]
    jobs = [(plan.train_config(variant, seed, threads), plan.run_dir(seed, variant)) for seed, variant in runs]
    wall = train_runs(jobs, workers, desc=f"training {len(jobs)} models")
    torch.set_num_threads(max(1, workers * threads))
    records = []
    for seed, variant in tqdm(runs, desc="held-out likelihoods", dynamic_ncols=True):
        run_dir = plan.run_dir(seed, variant)
        measures = measure_run(run_dir, text, samples=plan.preset.heldout_samples,
                               windows=plan.preset.heldout_windows, device=plan.device)
        records.append({"seed": seed, "slug": variant.slug, "trained_now": str(run_dir) in wall,
                        "train_seconds": wall.get(str(run_dir), 0.0),
                        "curves": curves(run_dir), **measures})
    return write_report(plan, records, time.perf_counter() - started)
