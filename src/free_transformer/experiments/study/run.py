"""Run a study: train every (seed, variant) side by side, measure each on the held-out text, report."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...base.errors import UserError
from ...data.corpora import is_named, read_heldout
from ..launch.launchers import Launcher
from .measure import curves, measure_run
from .presets import StudyPlan
from .report import write_report


def heldout_text(plan: StudyPlan, heldout: str | None) -> str:
    """The text the study scores: a file, or the named corpus's held-out documents (never trained on)."""
    if heldout is not None:
        return read_heldout(heldout)
    path = plan.train_config(plan.variants()[0], plan.seeds[0], threads=1).data.text.path
    if path is None:
        raise UserError("the study has no corpus: give data.text.path=FILE or corpus:NAME")
    if not is_named(path):
        if not Path(path).exists():
            raise UserError(f"the study's corpus {path} does not exist")
        raise UserError(f"the study's corpus {path} has no held-out documents of its own: give --heldout FILE")
    return read_heldout(path)


def run_study(plan: StudyPlan, *, launcher: Launcher, heldout: str | None = None) -> Path:
    """Train every run through `launcher`, then measure them and write the report (where the launcher says)."""
    started = time.time()  # wall-clock time: the report may be written on another machine
    text = heldout_text(plan, heldout)  # before hours of training: a missing held-out text fails now
    wall = plan.sweep.train(launcher)
    return launcher.finish(measure_and_report, plan, text, wall, started, device=plan.device)


def measure_and_report(plan: StudyPlan, text: str, wall: dict[str, float], started: float, *, device: str) -> Path:
    """Every run's held-out measures (cached in the run), then the report. wall: the training seconds of the
    runs trained by this invocation, by run directory."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core this process may use
    sweep = plan.sweep
    records = []
    for seed, variant in tqdm(sweep.runs(), desc="held-out likelihoods", dynamic_ncols=True):
        run_dir = sweep.run_dir(seed, variant)
        measures = measure_run(
            run_dir,
            text,
            kappa_bits=sweep.train_config(variant, seed).kappa_bits,
            samples=plan.preset.heldout_samples,
            windows=plan.preset.heldout_windows,
            device=device,
        )
        records.append(
            {
                "seed": seed,
                "slug": variant.slug,
                "trained_now": str(run_dir) in wall,
                "train_seconds": wall.get(str(run_dir), 0.0),
                "curves": curves(run_dir),
                **measures,
            }
        )
    return write_report(plan, records, time.time() - started)
