"""Printing one evaluation's results as a table, and writing them as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..base.fileio import atomic_write_text
from ..eval.catalog import all_tasks
from ..eval.task_metrics import measure_legend
from .comparison import sample_ks

SAMPLE_MEASURES = ("pass@k", "maj@k")  # what a generative task gives besides its value (eval.runner.sample_measures)


def _order(names) -> list[str]:
    known = [t for t in all_tasks() if t in names]
    return known + sorted(n for n in names if n not in known)


def _samples(task: dict) -> int:
    """The samples per prompt a generative task drew (0: not a generative task)."""
    return max((int(k) for k in task.get("pass@k", {})), default=0)


def _sample_rows(name: str, task: dict) -> list[tuple[str, str]]:
    """(pass@k or maj@k, table line) of the pass@k and maj@k of a task scored from several samples per prompt,
    k = 1, 2, 4, ... n, each with its bootstrap interval over documents."""
    n = _samples(task)
    rows = []
    for measure in [m for m in SAMPLE_MEASURES if m in task] if n > 1 else []:
        for k in [1, *sample_ks(n)]:
            m, label = task[measure][str(k)], measure.replace("k", str(k))
            interval = f"[{m['low']:.3f}, {m['high']:.3f}]"
            rows.append(
                (measure, f"{name:<16} {label:<20} {m['value']:>7.3f} {task['n']:>6} {'':>5} {'':>7}  {interval}")
            )
    return rows


def format_table(results: dict) -> str:
    lines = []
    latents = results.get("latents", {})
    tasks = results.get("tasks", {})
    generative = [t for t in tasks.values() if _samples(t)]
    lines.append(f"model: {results.get('checkpoint', '?')}  ({latents.get('latents', '')})")
    drawn = []  # what ran only: no multiple-choice estimator without a multiple-choice task
    if latents.get("mc_estimator") and len(generative) < len(tasks):
        drawn.append(f"multiple choice: {latents['mc_estimator']}")
    if generative:
        drawn.append(f"generations per prompt: {max(map(_samples, generative))}")
    if drawn:
        lines.append("; ".join(drawn))
    sampled = {name: _sample_rows(name, tasks[name]) for name in _order(tasks)}
    header = f"{'task':<16} {'measure':<20} {'value':>7} {'n':>6} {'shots':>5} {'secs':>7}"
    header += "  95% CI" if any(sampled.values()) else ""
    lines += [header, "-" * len(header)]
    for name, rows in sampled.items():
        r = tasks[name]
        lines.append(
            f"{name:<16} {r['metric']:<20} {r['value']:>7.3f} {r['n']:>6} {r['num_fewshot']:>5} "
            f"{r.get('seconds', 0):>7.1f}"
        )
        lines += [line for _, line in rows]
    if any(sampled.values()):  # what the rows of several samples mean
        shown = [m for name, rows in sampled.items() if rows for m in (tasks[name]["metric"], *(m for m, _ in rows))]
        lines += measure_legend(shown) + ["95% CI: a bootstrap over documents"]
    for name in _order(tasks):
        r, max_len = tasks[name], results.get("model_config", {}).get("max_seq_len", "?")
        if r.get("truncated_answers"):
            lines.append(
                f"note: {name}: {r['truncated_answers']} of {r['n']} documents have an answer longer than "
                f"the model's context ({max_len} tokens); its start was cut, so their choices may score alike"
            )
        if r.get("truncated_prompts"):
            lines.append(
                f"note: {name}: {r['truncated_prompts']} of {r['n']} prompts were longer than the "
                f"context ({max_len} tokens) and lost their start"
            )
    for name in _order(results.get("unavailable", {})):
        lines.append(f"{name:<16} unavailable: {results['unavailable'][name]}")
    like = results.get("likelihood")
    if like:
        lines.append("")
        lines.append(
            f"held-out text: {like['tokens']} tokens, {like['bytes']} bytes, {like['windows']} windows"
            + (f", K={like['samples']}" if like.get("samples") else "")
        )
        for measure in ("exact", "prior_ce", "elbo", "iwae", "posterior_ce", "kl"):
            if measure in like:
                m = like[measure]
                lines.append(
                    f"  {measure:<13} {m['bits_per_token']:.4f} bits/token  {m['bits_per_byte']:.4f} bits/byte"
                )
    return "\n".join(lines)


def write_json(results: dict, path: str | Path, exclusive: bool = False) -> Path:
    """Write whole (a temporary sibling, then a rename); exclusive: never replace an existing file (the
    temporary file is hard-linked into place, which fails if `path` exists: no check-then-write race)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not exclusive:
        atomic_write_text(path, json.dumps(results, indent=1))
        return path
    tmp = path.with_suffix(path.suffix + ".tmp")
    atomic_write_text(tmp, json.dumps(results, indent=1))
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path} already exists: it is kept; choose another --output") from None
    finally:
        tmp.unlink()
    return path
