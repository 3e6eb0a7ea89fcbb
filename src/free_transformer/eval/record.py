"""A run's evaluation record, RUN/eval/curve.jsonl: one JSON line per (step, settings) scored, written by
the periodic evaluation inside training and by `free-transformer eval RUN --checkpoints ...`.

    {"step": 200, "tokens": 52000, "source": "training" | "checkpoint", "checkpoint": "step_00000200" | null,
     "settings_key": "3f2a9c01d4", "settings": {...EvalSettings...}, "seconds": 12.5,
     "tasks": {name: {"metric", "value", "n", "paper_name", "category", "per_doc": [{"id", "group", "score"}]}},
     "unavailable": {...}, "latents": {...}, "likelihood": {...}}

Lines are only ever appended: a (step, settings) already in the record is not scored again, and a line
cut short by a killed process is skipped when read (the next append starts on a fresh line)."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from ..base.bounded import loads_json
from ..base.errors import UserError
from ..base.fileio import open_no_follow, refuse_links
from .runner import score
from .settings import EvalSettings

RECORD_NAME = "curve.jsonl"
TASK_FIELDS = ("metric", "value", "n", "num_fewshot", "paper_name", "category", "source")


def record_path(run_dir: str | Path) -> Path:
    return refuse_links(Path(run_dir) / "eval" / RECORD_NAME, run_dir)


def read_record(path: str | Path) -> list[dict]:
    """The record's entries in the order written; unreadable lines (a killed writer's) are skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = loads_json(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and "step" in entry and "settings_key" in entry:
            entries.append(entry)
    return entries


class CurveRecord:
    """Appending to one run's record; `scored` says whether a step was already scored under settings."""

    def __init__(self, run_dir: str | Path):
        self.path = record_path(run_dir)
        self.done = {(e["step"], e["settings_key"]) for e in read_record(self.path)}

    def scored(self, step: int, settings: EvalSettings) -> bool:
        return (step, settings.key) in self.done

    def append(self, entry: dict) -> None:
        """Append `entry` unless its (step, settings) is in the record by then: the file is locked and
        read again first, so that two writers (two `eval --checkpoints`, or one beside a training run's
        periodic evaluation) never record a step twice."""
        line = (json.dumps(entry) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = open_no_follow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
                self.done |= {(e["step"], e["settings_key"]) for e in read_record(self.path)}
                if (entry["step"], entry["settings_key"]) in self.done:
                    return
                if os.fstat(fd).st_size and not _ends_with_newline(self.path):
                    line = b"\n" + line  # after a line cut short by a killed writer
                while line:
                    line = line[os.write(fd, line) :]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as error:
            raise UserError(
                f"cannot append to {self.path} ({error}): make room, then run again; what is scored already is kept"
            ) from None
        self.done.add((entry["step"], entry["settings_key"]))


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


def make_entry(
    results: dict,
    settings: EvalSettings,
    *,
    step: int,
    tokens: int | None,
    source: str,
    checkpoint: str | None,
    seconds: float,
) -> dict:
    """A record line from `runner.score`'s results: per-document scores only (what the bootstrap and
    the averages need), not the log-probabilities or generations of a single evaluation's JSON."""
    tasks = {}
    for name, result in results["tasks"].items():
        tasks[name] = {key: result[key] for key in TASK_FIELDS if key in result}
        tasks[name]["per_doc"] = [
            {"id": d["id"], "group": d.get("group"), "score": d["score"]} for d in result["per_doc"]
        ]
    entry = {
        "step": step,
        "tokens": tokens,
        "source": source,
        "checkpoint": checkpoint,
        "settings_key": settings.key,
        "settings": settings.to_dict(),
        "seconds": round(seconds, 1),
        "tasks": tasks,
        "unavailable": results["unavailable"],
        "latents": results["latents"],
    }
    if "likelihood" in results:
        entry["likelihood"] = results["likelihood"]
    return entry


def score_and_record(
    record: CurveRecord,
    model,
    tokenizer,
    settings: EvalSettings,
    *,
    step: int,
    tokens: int | None,
    source: str,
    checkpoint: str | None,
    progress: bool = False,
) -> str | None:
    """Score `model` (the weights after `step` steps) under `settings` and append the line to the record,
    unless that step is scored under these settings already; the scores as one line of text, or None
    when skipped. What the periodic evaluation inside training and `eval --checkpoints` both do."""
    if record.scored(step, settings):
        return None
    started = time.perf_counter()
    results = score(model, tokenizer, settings, progress=progress)
    seconds = time.perf_counter() - started
    record.append(
        make_entry(results, settings, step=step, tokens=tokens, source=source, checkpoint=checkpoint, seconds=seconds)
    )
    scores = ", ".join(f"{name} {r['value']:.3f}" for name, r in results["tasks"].items())
    return f"{scores or 'held-out likelihood'} ({seconds:.0f} s)"
