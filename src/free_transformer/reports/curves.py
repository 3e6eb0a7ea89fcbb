"""A run's scores during training, read from its record (RUN/eval/curve.jsonl): the evaluations under one
set of settings, step by step, the final one, and the average over the last third of the iterations
(the paper's Table 3, "to mitigate the irregularity of the performance increase during training").

The last third of a curve whose last scored step is N holds the evaluations at steps s with 3 s >= 2 N.
Its average is taken document by document (each document's score averaged over those evaluations),
then aggregated as the task's measure is: for a mean or a macro average this equals the mean of the
evaluations' values, and the per-document averages are what `compare` bootstraps."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import UserError
from ..eval import task_metrics
from ..eval.likelihood import total_of
from ..eval.record import RECORD_NAME, read_record, record_path

# settings of the latent draws: a baseline ignores them, and compare states them under the table
LATENT_SETTINGS = ("latents", "latent_samples", "generation_samples", "seed", "heldout_samples")
MEASURES = ("exact", "prior_ce", "elbo", "iwae", "posterior_ce", "kl")  # held-out likelihood measures


class CurveError(UserError, ValueError):
    """A record that cannot give the curve asked for (unknown settings, no token counts)."""


@dataclass
class Curve:
    label: str
    run_dir: Path
    entries: list[dict]  # one evaluation per scored step, under settings_key, by step
    settings_key: str
    others: dict[str, list[dict]]  # the record's evaluations under other settings, by key

    @property
    def settings(self) -> dict:
        return self.entries[-1]["settings"]

    def final(self) -> dict:
        """The last evaluation, shaped as an eval results file."""
        return {**self.entries[-1], "label": self.label}

    def last_third(self) -> list[dict]:
        last = self.entries[-1]["step"]
        return [e for e in self.entries if 3 * e["step"] >= 2 * last]

    def last_third_average(self) -> dict:
        """The last third's average, shaped as an eval results file (per_doc: averaged scores)."""
        entries = self.last_third()
        result = {
            "label": self.label,
            "steps": [e["step"] for e in entries],
            "latents": entries[-1]["latents"],
            "unavailable": entries[-1]["unavailable"],
            "tasks": {},
        }
        for name in entries[-1]["tasks"]:
            if all(name in e["tasks"] for e in entries):
                result["tasks"][name] = _average_task([e["tasks"][name] for e in entries])
        likelihoods = [e["likelihood"] for e in entries if e.get("likelihood")]
        if len(likelihoods) == len(entries) and len({len(like["per_window"]) for like in likelihoods}) == 1:
            result["likelihood"] = _average_likelihood(likelihoods)
        return result

    def x(self, entry: dict, axis: str) -> float:
        """Where an evaluation sits on the x axis: its step, or the tokens seen."""
        if axis == "step":
            return entry["step"]
        if entry.get("tokens") is None:
            raise CurveError(
                f"{self.label}: the evaluation at step {entry['step']} has no token count (the run's "
                "config.yaml could not be read when it was scored): draw against steps"
            )
        return entry["tokens"]


def _average_task(results: list[dict]) -> dict:
    """One task's results at several steps -> their average, document by document."""
    by_id = [{d["id"]: d["score"] for d in r["per_doc"]} for r in results]
    per_doc = [
        {"id": d["id"], "group": d.get("group"), "score": statistics.fmean(s[d["id"]] for s in by_id)}
        for d in results[-1]["per_doc"]
        if all(d["id"] in s for s in by_id)
    ]
    value = task_metrics.aggregate([d["score"] for d in per_doc], [d["group"] for d in per_doc])
    return {
        **{k: v for k, v in results[-1].items() if k != "per_doc"},
        "value": value,
        "n": len(per_doc),
        "per_doc": per_doc,
    }


def _average_likelihood(likelihoods: list[dict]) -> dict:
    """Held-out likelihoods of the same windows at several steps -> their average, window by window."""
    last = likelihoods[-1]
    measures = [m for m in MEASURES if all(m in like for like in likelihoods)]
    per_window = [
        {
            "tokens": w["tokens"],
            "bytes": w["bytes"],
            **{m: statistics.fmean(like["per_window"][i][m] for like in likelihoods) for m in measures},
        }
        for i, w in enumerate(last["per_window"])
    ]
    result = {k: v for k, v in last.items() if k not in MEASURES}
    for m in measures:
        result[m] = total_of(per_window, m)
    result["per_window"] = per_window
    return result


def has_curve(path: str | Path) -> bool:
    """A run directory with a record, or a record file."""
    path = Path(path)
    return record_path(path).is_file() or (path.is_file() and path.name == RECORD_NAME)


def load_curve(path: str | Path, settings_key: str | None = None) -> Curve:
    """The curve of a run directory (or of its curve.jsonl) under `settings_key`; by default under the
    settings with the most scored steps (of those, the newest evaluation's). The record's evaluations
    under other settings are kept apart."""
    path = Path(path)
    record = path if path.is_file() else record_path(path)
    run_dir = record.parent.parent
    entries = read_record(record)
    if not entries:
        raise CurveError(f"{record} holds no evaluation")
    by_key: dict[str, dict[int, dict]] = {}
    for entry in entries:  # the first evaluation of a step is kept (two writers may have raced)
        by_key.setdefault(entry["settings_key"], {}).setdefault(entry["step"], entry)
    newest = [e["settings_key"] for e in entries]
    key = settings_key or max(by_key, key=lambda k: (len(by_key[k]), len(newest) - newest[::-1].index(k)))
    if key not in by_key:
        raise CurveError(f"{record} has no evaluation under settings {key}; it has {', '.join(by_key)}")
    chosen = [by_key[key][step] for step in sorted(by_key[key])]
    others = {k: list(v.values()) for k, v in by_key.items() if k != key}
    return Curve(run_dir.name, run_dir, chosen, key, others)


def settings_difference(a: dict, b: dict, ignore: tuple[str, ...] = ()) -> str:
    """'limit 3 vs 2, tasks [...] vs [...]': the fields (but `ignore`) in which settings a differ from b."""
    return ", ".join(
        f"{k} {a.get(k)} vs {b.get(k)}" for k in sorted((set(a) | set(b)) - set(ignore)) if a.get(k) != b.get(k)
    )
