"""Benchmarks scored on the live model during training (config section `eval`): every `eval.every` steps
and at the last step, one line appended to RUN/eval/curve.jsonl (eval/record.py, score_and_record: the same as `eval
--checkpoints`).

Training does not see it: every RNG stream (torch, CUDA, Python, NumPy) is saved before and restored
after, gradients are off, and the model goes back to train mode, so the losses are bit-identical to a
run without it. A step already in the record (scored before a resume) is not scored again, and a resume
from a due step that was not scored (a stop signal skips the evaluation) scores it first."""

from __future__ import annotations

import contextlib
import random
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data.tokenizer import get_tokenizer
from ..eval.record import CurveRecord, score_and_record
from .metrics import tokens_per_step


@contextlib.contextmanager
def training_untouched(model: torch.nn.Module, device: torch.device):
    """Run an evaluation of `model` without changing training's RNG streams or the model's mode."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        model.train()


class PeriodicEvaluation:
    def __init__(self, run):
        config = run.config
        self.settings = config.eval.settings()
        self.every, self.last_step = config.eval.every, config.steps
        self.model, self.device, self.run_dir = run.model, run.device, run.run_dir
        self.tokenizer = get_tokenizer(run.metadata["tokenizer"])
        self.tokens_per_step = tokens_per_step(config, run.dataset.sequence_length)
        self.record = CurveRecord(run.run_dir)

    def due(self, step: int) -> bool:
        return step > 0 and (step % self.every == 0 or step == self.last_step)

    def at(self, step: int) -> float:
        """Score the model after `step` steps if that is due and not yet in the record; the seconds spent
        (0 when nothing was done), which are not training time."""
        if not self.due(step) or self.record.scored(step, self.settings):
            return 0.0
        started = time.perf_counter()
        checkpoint = f"step_{step:08d}"
        with training_untouched(self.model, self.device):
            scores = score_and_record(
                self.record,
                self.model,
                self.tokenizer,
                self.settings,
                step=step,
                tokens=step * self.tokens_per_step,
                source="training",
                checkpoint=checkpoint if (self.run_dir / "checkpoints" / checkpoint).is_dir() else None,
            )
        tqdm.write(f"eval at step {step}: {scores}")
        return time.perf_counter() - started


def periodic_evaluation(run) -> PeriodicEvaluation | None:
    """The run's periodic evaluation, or None when its config's `eval.every` is 0."""
    return PeriodicEvaluation(run) if run.config.eval.every else None
